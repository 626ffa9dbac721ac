"""DFlash's block layout: which anchors a training step denoises, who may attend to whom, and the loss weights.

A block anchored at position p holds [token p ; mask tokens] at rotary positions p .. p + B - 1 and sees the
verifier's features of positions < p (the context the verifier has processed when token p is its newest
output). Inside a block attention is bidirectional, as in the DFlash paper (arXiv:2602.06036; causal as an
option). Math only.
"""

from __future__ import annotations

import math

import torch


def sample_anchors(loss_mask: torch.Tensor, first_target_offset: int, max_anchors: int | None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted random anchors of one sequence (sequence-length sparsification): [N] int64 positions p >= 1 whose
    first drafted token p + first_target_offset lies inside the sequence and carries the loss (loss_mask [T] is 1
    there: an assistant token, or any token under training.loss_positions=all), at most max_anchors of them (None:
    all), drawn with `generator`."""
    length = int(loss_mask.shape[0])
    positions = torch.arange(1, max(length - first_target_offset, 1))
    positions = positions[loss_mask[positions + first_target_offset].bool()] if positions.numel() else positions
    if max_anchors is not None and positions.numel() > max_anchors:
        positions = positions[torch.randperm(positions.numel(), generator=generator)[:max_anchors]]
    return positions.sort().values


def block_attention_allowed(context_length: int, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                            block_size: int, causal: bool) -> torch.Tensor:
    """[B, N*bs, T + N*bs] bool: block query -> (context keys, then every block's keys).

    A query of the block anchored at p sees context positions < p and its own block (bidirectionally, or
    slots <= its own when causal); padded blocks see only their own slot so softmax stays finite.
    """
    batch, num_blocks = anchors.shape
    slots = num_blocks * block_size
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, N*bs]
    context = torch.arange(context_length, device=device)[None, None, :] < query_anchor[:, :, None]  # [B, N*bs, T]
    block_of = torch.arange(slots, device=device) // block_size
    slot_of = torch.arange(slots, device=device) % block_size
    same_block = block_of[:, None] == block_of[None, :]
    if causal:
        same_block = same_block & (slot_of[None, :] <= slot_of[:, None])
    valid = anchor_valid.repeat_interleave(block_size, dim=1)  # [B, N*bs]
    context = context & valid[:, :, None]
    within = same_block[None] & valid[:, :, None] & valid[:, None, :]
    within = within | (torch.eye(slots, dtype=torch.bool, device=device)[None] & ~valid[:, :, None])
    return torch.cat([context, within], dim=-1)


def position_decay(num_speculative_tokens: int, gamma: float) -> torch.Tensor:
    """DFlash's loss weight per draft index j (0 = nearest): exp(-j / gamma), so near positions dominate."""
    return torch.tensor([math.exp(-j / gamma) for j in range(num_speculative_tokens)])


def acceptance_weights(row_losses: torch.Tensor, block_of_row: torch.Tensor, draft_of_row: torch.Tensor,
                       num_blocks: int, num_speculative_tokens: int, alpha: float) -> torch.Tensor:
    """D-PACE loss weights (speculators' `per_position_loss_weight=dpace`): each draft weighs what the block's
    expected accepted length gains from it.

    With q_j = exp(-KL_j) the drafter's probability of the verifier's greedy token at draft j, smoothed to
    s_j = (1 - alpha) q_j + alpha, the block accepts past draft i with probability prod_{k<=i} s_k, and draft j's
    weight is the sum of those products over i >= j: the derivative of the expected accepted length with respect to
    log s_j. For the argmax target (`drafter.distill_target=argmax`, speculators' D-PACE) KL_j is the row's
    cross-entropy and q_j exactly that probability; for the distribution target exp(-KL(verifier || drafter))
    stands for it (1 where the drafter matches the verifier). Drafts with no row (outside the answer) count as
    s = 1 and get no weight. No gradient flows through the weights.

    row_losses [M] (each row's KL to its target, as pipeline.losses.distill.distill_hidden_rows passes it),
    block_of_row [M] in [0, num_blocks), draft_of_row [M] in [0, K) -> weights [M]."""
    with torch.no_grad():
        smooth = torch.ones(num_blocks, num_speculative_tokens, device=row_losses.device)
        present = torch.zeros(num_blocks, num_speculative_tokens, device=row_losses.device)
        smooth[block_of_row, draft_of_row] = (1.0 - alpha) * torch.exp(-row_losses.float()) + alpha
        present[block_of_row, draft_of_row] = 1.0
        reach = torch.cumprod(smooth, dim=-1) * present  # [blocks, K]: P(accepted through draft i)
        weights = reach.flip(-1).cumsum(-1).flip(-1) * present  # sum over i >= j
        return weights[block_of_row, draft_of_row]
