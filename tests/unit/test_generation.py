"""Generation without a model: token-budget batching, turn-by-turn regeneration, length limits, fp8 storage."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.data.store import (
    iter_samples,
    projected_store_bytes,
    verify_store,
    write_manifest,
    write_shard,
)
from pipeline.errors import PipelineError
from pipeline.generation.batching import pack_by_token_budget
from pipeline.generation.regenerate import Limits, keep_conversation, regenerate_conversations


def test_token_budget_batches_cover_every_sample_once_within_budget():
    lengths = [5, 300, 40, 41, 7, 120, 120, 900, 3]
    batches = pack_by_token_budget(lengths, max_tokens=256, max_rows=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 3
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 256
    assert [7] in batches and [1] in batches  # longer than the budget: alone


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def stops(tokenizer):
    return (tokenizer.eos_token_id,)


def scripted_verifier(tokenizer, answers):
    """A stand-in for the verifier: answers the n-th call's prompts with fixed texts, recording what it saw."""
    calls = []

    def generate(prompts, budgets):
        calls.append((prompts, budgets))
        text = answers[len(calls) - 1]
        return [(tokenizer.encode(text) + [tokenizer.eos_token_id])[:budget] for budget in budgets]

    return generate, calls


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "SOURCE ANSWER"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "SOURCE ANSWER"}]


def test_every_user_turn_is_answered_by_the_verifier_with_its_own_history(tokenizer):
    generate, calls = scripted_verifier(tokenizer, ["Hello friend", "See you"])
    [row] = regenerate_conversations([CHAT], tokenizer, generate, Limits(64, 512, "truncate"), stops(tokenizer))
    assert row["skip_reason"] == "" and not row["truncated"]
    assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == ["Hello friend", "See you"]
    # the second question was asked after the verifier's first answer, never after the source's
    second_prompt = tokenizer.decode(calls[1][0][0])
    assert "Hello friend" in second_prompt and "SOURCE" not in second_prompt
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "Hello friend" in trained and "See you" in trained and "Bye" not in trained
    assert row["input_ids"][-1] == tokenizer.eos_token_id and row["loss_mask"][-1] == 1
    # the last answer's ids are exactly what was generated (no re-tokenization)
    assert row["input_ids"][-len(tokenizer.encode("See you")) - 1:] == tokenizer.encode("See you") + [
        tokenizer.eos_token_id]


def test_a_turn_that_does_not_fit_is_truncated_or_dropped(tokenizer):
    long_chat = CHAT[:3] + [{"role": "user", "content": "word " * 400}]
    generate, _ = scripted_verifier(tokenizer, ["Hello friend", "unused"])
    [kept] = regenerate_conversations([long_chat], tokenizer, generate, Limits(16, 128, "truncate"), stops(tokenizer))
    assert kept["truncated"] and kept["skip_reason"] == ""
    assert [m["content"] for m in kept["messages"] if m["role"] == "assistant"] == ["Hello friend"]
    generate, _ = scripted_verifier(tokenizer, ["Hello friend", "unused"])
    [dropped] = regenerate_conversations([long_chat], tokenizer, generate, Limits(16, 128, "drop"), stops(tokenizer))
    assert "generation.max_length=128" in dropped["skip_reason"] and dropped["input_ids"] == []


def test_a_first_prompt_that_does_not_fit_is_skipped_with_a_reason(tokenizer):
    generate, calls = scripted_verifier(tokenizer, ["x"])
    rows = regenerate_conversations([[{"role": "user", "content": "word " * 400}]], tokenizer, generate,
                                    Limits(16, 64, "truncate"), stops(tokenizer))
    assert "leaves no room" in rows[0]["skip_reason"] and calls == []


def test_keep_mode_trains_on_source_answers_and_skips_chats_without_one(tokenizer):
    kept = keep_conversation(CHAT, tokenizer, Limits(16, 512, "truncate"))
    assert "SOURCE ANSWER" in tokenizer.decode([t for t, m in zip(kept["input_ids"], kept["loss_mask"]) if m])
    assert "no assistant turn" in keep_conversation(CHAT[:2], tokenizer, Limits(16, 512, "drop"))["skip_reason"]


def sample(sample_id, length, layers, hidden=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {"sample_id": sample_id, "input_ids": torch.arange(length), "loss_mask": torch.ones(length),
            "hidden": {i: torch.randn(length, hidden, generator=generator) * (i + 1) for i in layers}}


@pytest.mark.parametrize("compression, dtype, tolerance", [("none", "bfloat16", 0.01), ("fp8", "bfloat16", 0.05)])
def test_store_bytes_match_the_projection_and_readers_see_the_states(tmp_path, compression, dtype, tolerance):
    layers = [1, 3]
    samples = [sample(f"s{i}", 40 + i, layers, seed=i) for i in range(3)]
    entry = write_shard(tmp_path, samples, layers, torch.bfloat16, compression)
    manifest = write_manifest(tmp_path, [entry], {"layer_ids": layers, "dtype": dtype, "compression": compression})
    projected = projected_store_bytes(manifest["num_tokens"], len(layers), 32, dtype, compression)
    assert projected <= manifest["bytes"] <= projected + 2048  # + the safetensors header
    assert 0 < entry["relative_error"] < tolerance
    read = {s["sample_id"]: s for s in iter_samples(tmp_path, verify_store(tmp_path), [1], 3)}
    original = samples[2]["hidden"][3]
    error = (read["s2"]["last"].float() - original).norm() / original.norm()
    assert error < tolerance


def test_fp8_takes_about_half_the_bytes_of_bf16(tmp_path):
    layers = [1, 2, 3, 4]
    samples = [sample("s", 256, layers, hidden=256)]
    plain = write_shard(tmp_path / "bf16", samples, layers, torch.bfloat16, "none")
    packed = write_shard(tmp_path / "fp8", samples, layers, torch.bfloat16, "fp8")
    ratio = (tmp_path / "fp8" / packed["file"]).stat().st_size / (tmp_path / "bf16" / plain["file"]).stat().st_size
    assert 0.45 < ratio < 0.56


def test_verify_refuses_a_manifest_listing_a_sample_twice(tmp_path):
    layers = [1]
    first = write_shard(tmp_path, [sample("a", 4, layers), sample("b", 4, layers)], layers, torch.bfloat16)
    second = write_shard(tmp_path, [sample("b", 4, layers)], layers, torch.bfloat16)
    write_manifest(tmp_path, [first, second], {"layer_ids": layers})
    with pytest.raises(PipelineError, match="sample b is in both"):
        verify_store(tmp_path)


def test_a_single_worker_cpu_engine_runs_in_process_and_a_gpu_or_tensor_parallel_one_keeps_vllms_defaults(
        monkeypatch):
    from pipeline.generation import vllm_backend

    # set, then deleted: monkeypatch records it, so the variable the function sets is undone after the test
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "unset")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_backend.in_process_engine_on_cpu(2) == {}
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert vllm_backend.in_process_engine_on_cpu(1) == {"distributed_executor_backend": "uni"}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a user's own choice stays
    vllm_backend.in_process_engine_on_cpu(1)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_backend.in_process_engine_on_cpu(1) == {}


@pytest.mark.vllm
def test_the_capturing_engine_refuses_a_process_whose_vllm_settings_are_already_fixed_in_process(monkeypatch):
    """The capture's file lock deadlocks an in-process engine; once vLLM has cached an in-process setting (an
    engine ran here), capture must fail with a reason instead of waiting forever."""
    import vllm.envs

    from pipeline.generation.vllm_backend import _engine_in_its_own_process

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.enable_envs_cache()
    try:
        with pytest.raises(RuntimeError, match="in its own process"):
            _engine_in_its_own_process()
    finally:
        vllm.envs.disable_envs_cache()
    _engine_in_its_own_process()  # nothing cached: it sets the engine apart and goes on
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_skips_that_differ_only_in_their_counts_are_one_warning_with_the_range():
    """300 prompts too long for generation.max_length were 300 warnings, one per token count."""
    from collections import Counter

    from pipeline.generation.regenerate_stage import summarize_reasons

    room = "leaves no room within generation.max_length=8192"
    reasons = Counter({f"prompt of 20035 tokens (turn 1) {room}": 1, f"prompt of 20410 tokens (turn 2) {room}": 2,
                       f"prompt of 20100 tokens (turn 1) {room}": 1,
                       "the answer to turn 3 does not fit in generation.max_length=4096": 1,
                       "the answer to turn 3 does not fit in generation.max_length=8192": 1,
                       "no assistant turn to train on (generation.responses=keep)": 4})
    assert summarize_reasons(reasons) == {
        f"prompt of 20035-20410 tokens (turn 1-2) {room}": 4,
        # a setting's value is no count: two settings stay two lines
        "the answer to turn 3 does not fit in generation.max_length=4096": 1,
        "the answer to turn 3 does not fit in generation.max_length=8192": 1,
        "no assistant turn to train on (generation.responses=keep)": 4}


def test_a_stop_signal_a_finalizer_dropped_while_batches_streamed_stops_the_stage_at_the_next_batch(monkeypatch):
    """SIGTERM during capture landed in a finalizer, was dropped, and every batch was captured before the job exited
    0: the recorded signal stops the stream before it hands on another batch."""
    from types import SimpleNamespace

    import ray

    from pipeline import cluster
    from pipeline.errors import Terminated
    from pipeline.generation.common import stream_batches

    class Mapped:
        def iter_rows(self):
            yield {"batch": 1}
            monkeypatch.setattr(cluster, "_sigterm_received", True)  # the handler ran; its exception was dropped
            yield {"batch": 2}
            yield {"batch": 3}

    monkeypatch.setattr(ray.data, "from_items",
                        lambda items, **kwargs: SimpleNamespace(map_batches=lambda *a, **k: Mapped()))
    gen = SimpleNamespace(num_actors=1, cpus_per_actor=1, tensor_parallel_size=1, use_gpu=False)
    handed_on = []
    with pytest.raises(Terminated):
        for row in stream_batches([{}], object, {}, gen):
            handed_on.append(row)
    assert handed_on == [{"batch": 1}]
