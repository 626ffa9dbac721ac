"""Where the verifier comes from, and the errors for a verifier that is not there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.errors import PipelineError
from pipeline.generation.verifier import resolve_verifier_path


def verifier_cfg(**overrides):
    values = dict(name="v", path=None, gguf_package=None, gguf_file=None, cache_dir="/tmp", save_dtype="bfloat16")
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

    import pipeline.generation.verifier as verifier

    conversions = []

    def slow_conversion(gguf_path, out_dir, dtype):
        conversions.append(out_dir)
        time.sleep(0.5)  # long enough that the other thread asks while this one converts
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(verifier, "_save_gguf_as_hf", slow_conversion)
    monkeypatch.setattr(verifier, "_packaged_file", lambda package, filename: tmp_path / filename)
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
