"""Distillation losses and acceptance counts. Pure tensor functions."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from pipeline.config.schema import DistillTarget
from pipeline.losses.blockwise import RowWeights


def soft_cross_entropy(student_logits: torch.Tensor, teacher_probs: torch.Tensor,
                       weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(Weighted) mean over rows of CE(teacher, student) = KL(teacher || student) + teacher entropy.

    student_logits [N, Vd], teacher_probs [N, Vd] (rows sum to 1), weights [N] or None."""
    per_row = -(teacher_probs * F.log_softmax(student_logits.float(), dim=-1)).sum(dim=-1)
    if weights is None:
        return per_row.mean()
    return (per_row * weights).sum() / weights.sum().clamp_min(1e-12)


DISTILL_TARGETS = tuple(target.value for target in DistillTarget)


def teacher_targets(teacher_draft_logits: torch.Tensor, target: str = "distribution") -> torch.Tensor:
    """[U, Vd] target rows from the verifier's draft-vocabulary logits [U, Vd]: its softmax ("distribution",
    speculators' `kl_div`) or a one-hot on its argmax ("argmax", speculators' `ce`). Raises ValueError for another
    target (the schema's DistillTarget admits only these two)."""
    if target not in DISTILL_TARGETS:
        raise ValueError(f"distill target: '{target}' is not one of {DISTILL_TARGETS}")
    if target == "argmax":
        return F.one_hot(teacher_draft_logits.argmax(dim=-1), teacher_draft_logits.shape[-1]).float()
    return F.softmax(teacher_draft_logits.float(), dim=-1)


def per_depth_counts(match: torch.Tensor, depths: torch.Tensor,
                     num_speculative_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct [K], total [K]) greedy-match counts per draft depth; raw counts, to be reduced then divided."""
    match = match.long()
    correct = torch.zeros(num_speculative_tokens, dtype=torch.long, device=match.device).index_add_(0, depths, match)
    total = torch.zeros(num_speculative_tokens, dtype=torch.long, device=match.device).index_add_(
        0, depths, torch.ones_like(match))
    return correct, total


def distill_rows(model: Any, student_logits: torch.Tensor, teacher_full: torch.Tensor, depths: torch.Tensor,
                 weights: Optional[torch.Tensor] = None, teacher_rows: Optional[torch.Tensor] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss and per-depth greedy matches of draft-vocabulary logits [N, Vd] against the verifier's logits.

    teacher_full: [U, V] verifier logits; teacher_rows: [N] index of each student row's teacher row (None: U = N,
    row i's own). Several rows often share one verifier position (the chains of nearby anchors), so callers pass
    each position once and its softmax is computed once. With a pruned vocabulary the target is the verifier's
    distribution renormalised over the draft vocabulary, but a match still needs the verifier's full-vocabulary
    argmax: a token outside the draft vocabulary is a miss, exactly as in serving.
    """
    teacher_probs = F.softmax(model.to_draft_vocab(teacher_full).float(), dim=-1)  # [U, Vd]
    teacher_argmax = teacher_full.argmax(dim=-1)  # [U]
    if teacher_rows is not None:
        teacher_probs, teacher_argmax = teacher_probs[teacher_rows], teacher_argmax[teacher_rows]
    loss = soft_cross_entropy(student_logits, teacher_probs, weights)
    drafted = model.to_target_ids(student_logits.detach().argmax(dim=-1))
    correct, total = per_depth_counts(drafted == teacher_argmax, depths, model.spec.num_speculative_tokens)
    return loss, correct, total


def distill_hidden_rows(model: Any, hidden: torch.Tensor, teacher_full: torch.Tensor, depths: torch.Tensor,
                        weights: RowWeights = None, teacher_rows: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, with_acceptance: bool = False,
                        target: str = "distribution",
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`distill_rows` from the drafter's hidden rows [N, H] instead of their logits: the frozen head's logits
    (+ an optional trainable logit bias [U, Vd], one per teacher row) are computed, scored and dropped a block of
    rows at a time (pipeline.losses.blockwise), never held as [N, Vd]. With target "distribution", the same loss,
    gradients and counts as `distill_rows(model, model.lm_head(hidden) + bias[teacher_rows], ...)`. Returns
    (scalar loss, correct [K], total [K], acceptance): the greedy-match counts per draft depth (depths [N] int64,
    each row's 0-based draft index; K = spec.num_speculative_tokens), and each row's 1 - TV(student, teacher over
    the draft vocabulary) [N] when `with_acceptance`, else None. teacher_full [U, V] verifier logits,
    teacher_rows [N] index into U (None: U = N). Raises ValueError for an unknown target, a head weight that requires
    grad, or callable weights together with a bias (pipeline.losses.blockwise).

    target: "distribution" distils the verifier's next-token distribution (soft cross-entropy, KL up to a
    constant); "argmax" its greedy token (cross-entropy on the argmax over the draft vocabulary: speculators'
    `ce` loss, its DFlash default). weights: [N], or a function of the rows' KL(target || drafter) [N] (each row's
    loss less its target's entropy, so the loss itself for the one-hot argmax target) that returns them
    (pipeline.losses.blockwise); exp(-KL) is then the drafter's probability of the greedy token for "argmax", and
    stands for it with the distribution target."""
    teacher_probs = teacher_targets(model.to_draft_vocab(teacher_full), target)  # [U, Vd]
    teacher_argmax = teacher_full.argmax(dim=-1)  # [U]
    if teacher_rows is not None:
        teacher_argmax = teacher_argmax[teacher_rows]
    if callable(weights):
        weights = _of_kl(weights, target_entropy(teacher_probs), teacher_rows)
    loss, drafted, acceptance = model.lm_head(hidden, teacher_probs, teacher_rows, weights, bias=bias,
                                              with_acceptance=with_acceptance)
    correct, total = per_depth_counts(model.to_target_ids(drafted) == teacher_argmax, depths,
                                      model.spec.num_speculative_tokens)
    return loss, correct, total, acceptance


def target_entropy(target_probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each target row [U, Vd] -> [U]; exactly 0 for a one-hot row."""
    return -torch.special.xlogy(target_probs, target_probs).sum(dim=-1)


def _of_kl(weights_of_kl: Callable[[torch.Tensor], torch.Tensor], entropy: torch.Tensor,
           teacher_rows: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Row weights from the rows' soft cross-entropies [N]: their KL to the target (cross-entropy less the target's
    entropy; clamped at 0 against rounding) is what `weights_of_kl` reads."""
    row_entropy = entropy if teacher_rows is None else entropy[teacher_rows]

    def weights_of_losses(losses: torch.Tensor) -> torch.Tensor:
        return weights_of_kl((losses - row_entropy.to(losses.dtype)).clamp_min(0.0))
    return weights_of_losses


def on_model_device(model: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The row/anchor index math runs on the CPU (its seeded generator lives there); the model may be on a GPU."""
    device = next(model.parameters()).device
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def pad_stack(tensors: list[torch.Tensor], fill: int | float | bool) -> torch.Tensor:
    """Tensors [L_i, ...] of one dtype -> [B, max L_i, ...], each padded at the end with `fill`. Raises ValueError
    for an empty list."""
    if not tensors:
        raise ValueError("pad_stack: no tensors to stack")
    longest = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), longest, *tensors[0].shape[1:]), fill, dtype=tensors[0].dtype)
    for i, tensor in enumerate(tensors):
        out[i, : tensor.shape[0]] = tensor
    return out
