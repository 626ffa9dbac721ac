"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Pure torch.

A draft token x drawn from the drafter's distribution q is accepted with probability min(1, p(x) / q(x)), p being
the verifier's distribution at that position; at the first rejection the token is resampled from
normalize(max(p - q, 0)). If every draft is accepted, a bonus token comes from the verifier's next distribution.
The emitted tokens are then distributed exactly as the verifier's own samples.

Our drafters propose their argmax, as vLLM's EAGLE-style proposers do: q is then one-hot on x, the acceptance
probability is p(x), and the residual is p with x removed, renormalised.
"""

from __future__ import annotations

from typing import Optional

import torch


def verifier_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The verifier's sampling distribution softmax(logits / temperature) over the last dim.

    logits: [..., V] (any float dtype, any device); returns float32 probabilities of the same shape and device,
    each row summing to 1. temperature: > 0; greedy decoding (temperature 0) takes the argmax and never calls this.
    Raises ValueError for a temperature that is not > 0 (0, negative or NaN), which would divide by zero or flip
    the distribution.
    """
    if not temperature > 0:
        raise ValueError(f"verifier_probs: temperature must be > 0 (0 is greedy: take the argmax), got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def one_hot_probs(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """q for greedy drafts: [len(tokens), vocab_size] float32 on the CPU, 1.0 at each row's token, 0 elsewhere.
    tokens: ids in [0, vocab_size); one >= vocab_size raises IndexError (a negative one counts from the end, as
    torch indexing does)."""
    q = torch.zeros(len(tokens), vocab_size)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


def rejection_sample(p: torch.Tensor, drafts: list[int], q: Optional[torch.Tensor],
                     generator: torch.Generator) -> tuple[int, int]:
    """(accepted drafts in [0, len(drafts)], the token emitted after them).

    p: [len(drafts) + 1, V] verifier probabilities at each draft position and one past the last;
    q: [len(drafts), V] drafter probabilities of the drafts (None = one-hot, i.e. greedy drafts). Any float dtype
    and device: both are compared in float64 on the CPU. drafts: token ids in [0, V). generator: a CPU
    torch.Generator, the only source of randomness (a seeded one makes the result reproducible).
    """
    p = p.double().cpu()
    q = one_hot_probs(drafts, p.shape[-1]).double() if q is None else q.double().cpu()
    for k, token in enumerate(drafts):
        accept_probability = min(1.0, float(p[k, token] / q[k, token])) if q[k, token] > 0 else 0.0
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < accept_probability:
            continue
        residual = (p[k] - q[k]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection cannot happen then; keep p to stay defined
            residual = p[k]
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    bonus = p[len(drafts)]
    return len(drafts), int(torch.multinomial(bonus / bonus.sum(), 1, generator=generator))
