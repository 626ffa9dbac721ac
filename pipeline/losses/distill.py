"""Distillation losses and acceptance counts. Pure tensor functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of CE(teacher softmax, student) = KL(teacher || student) + teacher entropy. [N, V] each."""
    teacher = F.softmax(teacher_logits.float(), dim=-1)
    return -(teacher * F.log_softmax(student_logits.float(), dim=-1)).sum(dim=-1).mean()


def per_depth_counts(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, depths: torch.Tensor, num_depths: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct [K], total [K]) greedy-match counts per draft depth; raw counts, to be reduced then divided."""
    match = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).long()
    correct = torch.zeros(num_depths, dtype=torch.long, device=match.device).index_add_(0, depths, match)
    total = torch.zeros(num_depths, dtype=torch.long, device=match.device).index_add_(0, depths, torch.ones_like(match))
    return correct, total
