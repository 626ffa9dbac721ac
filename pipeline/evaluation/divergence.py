"""Judge where vLLM's greedy output leaves the reference decoder's: numerics at a near-tie, or a fault.

At temperature 0 the reference decoder's output equals `verifier.generate`'s, so vLLM's speculative output should
equal it too. Another kernel (a batched verify step, vLLM's attention, another GEMM blocking) rounds differently,
and where the verifier's top two logits lie within a few rounding steps of the dtype in use, that is enough to flip
the argmax: that divergence is numerics. Anywhere else, vLLM chose a token the verifier ranks clearly lower, which is
a lossless bug (a wrong draft accepted) and nothing may be promoted on it.

A rounding step is the spacing of the dtype's floats at the magnitude of the winning logit (bf16: 2**-7 times the
power of two at or below it, so 0.125 for logits in [16, 32)); `near_tie_steps` of them is the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class Divergence:
    """One request whose vLLM output differs from the reference's.

    position: index into the generated tokens of the first difference. reference_token / vllm_token: the tokens
    there (None where that side's output had already ended). margin: the verifier's logit of the reference token
    minus vLLM's token's, at that position (logit units; None when a side ended). tolerance: near_tie_steps rounding
    steps of the dtype at the reference logit's magnitude."""

    request: int
    position: int
    reference_token: Optional[int]
    vllm_token: Optional[int]
    margin: Optional[float]
    tolerance: Optional[float]
    near_tie: bool

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where a and b differ, len of the shorter when one is a prefix of the other,
    None when they are equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def rounding_step(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing of `dtype`'s floats at |magnitude| (its unit in the last place), for floating dtypes."""
    info = torch.finfo(dtype)
    magnitude = max(abs(magnitude), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def near_tie_tolerance(dtype: torch.dtype, winning_logit: float, near_tie_steps: float) -> float:
    """The largest logit margin (logit units) that is still numerics: near_tie_steps rounding steps of `dtype` at the
    winning logit's magnitude. A token that far or less below the winner may have been flipped by rounding."""
    return near_tie_steps * rounding_step(dtype, winning_logit)


@torch.no_grad()
def next_token_logits(verifier, prefix: Sequence[int]) -> torch.Tensor:
    """The verifier's logits [vocab] (float32) for the token after `prefix` (token ids, prompt + generated)."""
    device = next(verifier.parameters()).device
    ids = torch.tensor([list(prefix)], dtype=torch.long, device=device)
    return verifier(input_ids=ids).logits[0, -1].float().cpu()


def judge(verifier, dtype: torch.dtype, requests: list[dict], vllm_tokens: list[list[int]],
          near_tie_steps: float) -> list[Divergence]:
    """Every request whose vLLM tokens differ from the reference's (`requests[i]["tokens"]`, generated ids after
    `requests[i]["prompt_ids"]`), judged at its first difference. One verifier forward per diverging request.

    A side that ended where the other went on is never a near-tie: both stop at the same end-of-sequence token and
    length, so a different length is a fault, not rounding."""
    found = []
    for index, (request, theirs) in enumerate(zip(requests, vllm_tokens)):
        ours = request["tokens"]
        position = first_difference(ours, theirs)
        if position is None:
            continue
        if position >= len(ours) or position >= len(theirs):
            found.append(Divergence(index, position, ours[position] if position < len(ours) else None,
                                    theirs[position] if position < len(theirs) else None, None, None, False))
            continue
        logits = next_token_logits(verifier, list(request["prompt_ids"]) + list(ours[:position]))
        reference_logit = float(logits[ours[position]])
        margin = reference_logit - float(logits[theirs[position]])
        tolerance = near_tie_tolerance(dtype, reference_logit, near_tie_steps)
        found.append(Divergence(index, position, ours[position], theirs[position], margin, tolerance,
                                margin <= tolerance))
    return found


def fault_reason(divergences: list[Divergence]) -> Optional[str]:
    """One line naming the first divergence that is not a near-tie, or None when every one is."""
    faults = [d for d in divergences if not d.near_tie]
    if not faults:
        return None
    first = faults[0]
    if first.margin is None:
        where = (f"request {first.request}: one output ended at token {first.position} where the other went on "
                 f"(reference token {first.reference_token}, vLLM token {first.vllm_token})")
    else:
        where = (f"request {first.request}, token {first.position}: vLLM chose {first.vllm_token} where the "
                 f"verifier's logit margin to the reference's {first.reference_token} is {first.margin:.4g}, over "
                 f"the near-tie tolerance {first.tolerance:.3g}")
    return f"{len(faults)} of vLLM's greedy outputs leave the reference's away from a near-tie; first: {where}"
