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
