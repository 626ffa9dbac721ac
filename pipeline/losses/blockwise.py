"""The draft LM head's distillation loss, a block of rows at a time (a fused linear + soft cross-entropy).

A drafter's head is the verifier's frozen LM head (its draft-vocabulary rows), so the only gradient it passes back
is the one to the hidden states: d loss / d hidden = (softmax(logits) - teacher) * w @ W. The forward computes that
gradient and the greedy picks block by block, so the [N, Vd] student logits, their log-softmax and their gradient
are never held whole (at Vd = 49,152 a batch's logits alone are hundreds of MB, and each pass over them is memory
bound). The technique is the fused linear cross-entropy of Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989),
here with soft targets. Math only.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

# Per-row loss weights [N], or a function of the rows' losses [N] returning them (None: equal weights).
RowWeights = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], None]

BLOCK_ROWS = 64  # rows of logits alive at once: [64, Vd] fp32 is 12.6 MB at Vd = 49,152


class _BlockwiseSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_probs, teacher_rows, row_weights, block_rows, bias, with_acceptance):
        """hidden [N, H]; weight [Vd, H] (frozen); teacher_probs [U, Vd] (rows sum to 1); teacher_rows [N] index
        into U; row_weights [N] (sum to 1), or a function of the rows' losses [N] (no gradient) giving them, applied
        once every row is scored (a row's gradient to its hidden state is linear in its weight; bias must then be
        None, its gradient mixes rows); bias [U, Vd] (added to the logits of each teacher row's rows) or None.
        Returns (sum_i w_i CE(p_i, softmax(hidden_i W^T + bias_i)) [], argmax [N], 1 - TV(student, teacher) [N],
        empty unless with_acceptance)."""
        count = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_bias = torch.zeros_like(bias) if bias is not None else None
        drafted = torch.empty(count, dtype=torch.long, device=hidden.device)
        acceptance = torch.empty(count if with_acceptance else 0, dtype=torch.float32, device=hidden.device)
        weights_from_losses = callable(row_weights)
        losses = torch.empty(count if weights_from_losses else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, count, block_rows):
            rows = slice(start, min(start + block_rows, count))
            logits = (hidden[rows] @ weight.t()).float()  # [b, Vd]
            teacher = teacher_rows[rows]  # [b]
            if bias is not None:
                logits += bias[teacher].float()
            target = teacher_probs[teacher]  # [b, Vd]
            drafted[rows] = logits.argmax(dim=-1)
            # CE(p, q) = logsumexp(logits) - <p, logits> for p summing to 1
            per_row = torch.logsumexp(logits, dim=-1) - torch.linalg.vecdot(target, logits)
            if weights_from_losses:  # weighted once every row is scored, below
                losses[rows] = per_row
            else:
                loss += (per_row * row_weights[rows]).sum()
            grad_logits = torch.softmax(logits, dim=-1).sub_(target)  # [b, Vd]: q - p
            if with_acceptance:
                acceptance[rows] = 1.0 - 0.5 * grad_logits.abs().sum(dim=-1)
            if not weights_from_losses:
                grad_logits.mul_(row_weights[rows][:, None])
            grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_bias is not None:  # rows that share a teacher row share its bias
                grad_bias.index_add_(0, teacher, grad_logits.to(grad_bias.dtype))
        if weights_from_losses:
            final_weights = row_weights(losses).to(losses.dtype)  # [N]
            loss = (losses * final_weights).sum()
            grad_hidden.mul_(final_weights[:, None].to(grad_hidden.dtype))
        ctx.save_for_backward(grad_hidden, grad_bias)
        ctx.mark_non_differentiable(drafted, acceptance)
        return loss, drafted, acceptance

    @staticmethod
    def backward(ctx, grad_loss, _grad_drafted, _grad_acceptance):
        grad_hidden, grad_bias = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return (grad_hidden * scale, None, None, None, None, None,
                grad_bias * scale if grad_bias is not None else None, None)


class DraftHead(nn.Linear):
    """The drafter's (frozen) LM head. Called with hidden states alone it is a plain linear layer; called with a
    teacher it returns the distillation loss, greedy picks and acceptance blockwise (`blockwise_soft_cross_entropy`).
    Both go through the module's call, so ZeRO-3 gathers the partitioned weight for either."""

    def forward(self, hidden: torch.Tensor, teacher_probs: torch.Tensor | None = None,
                teacher_rows: torch.Tensor | None = None, row_weights: RowWeights = None,
                bias: torch.Tensor | None = None, with_acceptance: bool = False):
        if teacher_probs is None:
            return F.linear(hidden, self.weight)
        return blockwise_soft_cross_entropy(hidden, self.weight, teacher_probs, teacher_rows, row_weights,
                                            bias=bias, with_acceptance=with_acceptance)


def blockwise_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, teacher_probs: torch.Tensor,
                                 teacher_rows: torch.Tensor | None = None, row_weights: RowWeights = None,
                                 block_rows: int = BLOCK_ROWS, bias: torch.Tensor | None = None,
                                 with_acceptance: bool = False,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss [], argmax [N], acceptance [N] or None) of the student logits hidden @ weight^T (+ bias) against
    teacher probabilities.

    hidden [N, H]; weight [Vd, H], which gets no gradient (the verifier's frozen head); teacher_probs [U, Vd];
    teacher_rows [N] (row i's teacher row; None: U = N, its own); row_weights [N], None (equal), or a function of
    the rows' losses [N] (no gradient) returning [N] (D-PACE: pipeline.drafters.dflash.blocks); bias [U, Vd] or None, a
    logit bias per teacher row that does get its gradient (DSpark's Markov head: rows drafting the same position
    share its previous token). The loss is the (weighted) mean over rows of CE(teacher, student), the same value as
    `soft_cross_entropy` on the materialised logits; argmax is each row's greedy draft-vocabulary id;
    with_acceptance also gives 1 - TV(student, teacher) per row (no gradient), the acceptance probability of a
    sampled draft (Leviathan et al. 2023). Raises ValueError for a head weight that requires grad, or for weights
    from the losses together with a bias."""
    if weight.requires_grad:
        raise ValueError("blockwise_soft_cross_entropy: the head weight must be frozen (it gets no gradient)")
    count = hidden.shape[0]
    rows = teacher_rows if teacher_rows is not None else torch.arange(count, device=hidden.device)
    weights: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
    if callable(row_weights):
        if bias is not None:
            raise ValueError("blockwise_soft_cross_entropy: row weights computed from the losses cannot train a bias")
        weight_of_losses = row_weights

        def normalised_weights(losses: torch.Tensor) -> torch.Tensor:
            return _normalised(weight_of_losses(losses))
        weights = normalised_weights
    elif row_weights is None:
        weights = torch.full((count,), 1.0 / max(count, 1), device=hidden.device)
    else:
        weights = _normalised(row_weights)
    loss, drafted, acceptance = _BlockwiseSoftCrossEntropy.apply(
        hidden, weight, teacher_probs.float(), rows, weights, block_rows, bias, with_acceptance)
    return loss, drafted, acceptance if with_acceptance else None


def _normalised(row_weights: torch.Tensor) -> torch.Tensor:
    return row_weights.float() / row_weights.float().sum().clamp_min(1e-12)
