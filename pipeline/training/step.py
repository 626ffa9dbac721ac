"""One P-EAGLE training step's math: rows, forward, loss, per-depth counts. Knows nothing of Ray or DeepSpeed."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.drafters.peagle.data import sample_training_rows
from pipeline.losses.distill import per_depth_counts, soft_cross_entropy


def _pad_stack(tensors: list[torch.Tensor], fill: int | float | bool) -> torch.Tensor:
    longest = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), longest, *tensors[0].shape[1:]), fill, dtype=tensors[0].dtype)
    for i, tensor in enumerate(tensors):
        out[i, : tensor.shape[0]] = tensor
    return out


def peagle_loss(
    model: Any, samples: list[dict[str, torch.Tensor]], keep_decay: float, generator: torch.Generator | None = None,
    max_anchors: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples hold aux [T, A*H], last [T, H] (post-norm final hidden), input_ids [T], loss_mask [T].

    Returns (loss, correct [K], total [K]) where K = the drafter's num_speculative_tokens.
    """
    num_depths = model.spec.num_speculative_tokens
    rows = [sample_training_rows(s["loss_mask"], num_depths, keep_decay, generator, max_anchors) for s in samples]
    anchors = _pad_stack([r[0] for r in rows], 0)  # [B, R]
    depths = _pad_stack([r[1] for r in rows], 0)  # [B, R]
    has_target = _pad_stack([r[2] for r in rows], False)  # [B, R]
    valid = _pad_stack([torch.ones_like(r[0], dtype=torch.bool) for r in rows], False)  # [B, R]
    aux = _pad_stack([s["aux"].float() for s in samples], 0.0)  # [B, T, A*H]
    next_ids = _pad_stack([torch.cat([s["input_ids"][1:], s["input_ids"][:1] * 0]) for s in samples], 0)  # [B, T]
    hidden = model(aux, next_ids, anchors, depths, valid)  # [B, R, H]

    batch_index, row_index = has_target.nonzero(as_tuple=True)  # rows that draft an assistant token
    if batch_index.numel() == 0:
        zero = hidden.sum() * 0.0
        return zero, torch.zeros(num_depths, dtype=torch.long), torch.zeros(num_depths, dtype=torch.long)
    row_anchor, row_depth = anchors[batch_index, row_index], depths[batch_index, row_index]
    teacher_pos = row_anchor + 1 + row_depth  # the verifier position whose next-token distribution we match
    last = _pad_stack([s["last"].float() for s in samples], 0.0)  # [B, T, H]
    with torch.no_grad():
        teacher_logits = model.lm_head(last[batch_index, teacher_pos])  # [N, V]
    student_logits = model.lm_head(hidden[batch_index, row_index])  # [N, V]
    loss = soft_cross_entropy(student_logits, teacher_logits)
    correct, total = per_depth_counts(student_logits.detach(), teacher_logits, row_depth, num_depths)
    return loss, correct, total
