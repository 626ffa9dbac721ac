"""Distillation losses and acceptance counts. Pure tensor functions."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                       weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(Weighted) mean over rows of CE(teacher softmax, student) = KL(teacher || student) + teacher entropy."""
    teacher = F.softmax(teacher_logits.float(), dim=-1)
    per_row = -(teacher * F.log_softmax(student_logits.float(), dim=-1)).sum(dim=-1)
    if weights is None:
        return per_row.mean()
    return (per_row * weights).sum() / weights.sum().clamp_min(1e-12)


def per_depth_counts(match: torch.Tensor, depths: torch.Tensor, num_depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct [K], total [K]) greedy-match counts per draft depth; raw counts, to be reduced then divided."""
    match = match.long()
    correct = torch.zeros(num_depths, dtype=torch.long, device=match.device).index_add_(0, depths, match)
    total = torch.zeros(num_depths, dtype=torch.long, device=match.device).index_add_(0, depths, torch.ones_like(match))
    return correct, total


def distill_rows(model: Any, student_logits: torch.Tensor, teacher_full: torch.Tensor, depths: torch.Tensor,
                 weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss and per-depth greedy matches of draft-vocabulary logits [N, Vd] against the verifier's [N, V].

    With a pruned vocabulary the target is the verifier's distribution renormalised over the draft vocabulary,
    but a match still needs the verifier's full-vocabulary argmax: a token outside the draft vocabulary is a miss,
    exactly as in serving.
    """
    loss = soft_cross_entropy(student_logits, model.to_draft_vocab(teacher_full), weights)
    drafted = model.to_target_ids(student_logits.detach().argmax(dim=-1))
    correct, total = per_depth_counts(drafted == teacher_full.argmax(dim=-1), depths,
                                      model.spec.num_speculative_tokens)
    return loss, correct, total


def on_model_device(model: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The row/anchor index math runs on the CPU (its seeded generator lives there); the model may be on a GPU."""
    device = next(model.parameters()).device
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def pad_stack(tensors: list[torch.Tensor], fill: int | float | bool) -> torch.Tensor:
    longest = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), longest, *tensors[0].shape[1:]), fill, dtype=tensors[0].dtype)
    for i, tensor in enumerate(tensors):
        out[i, : tensor.shape[0]] = tensor
    return out
