"""The EAGLE family's row layout: which (anchor, depth) rows a forward computes, and who may attend to whom.

Row (a, d) drafts the token at sequence position a + 2 + d, at rotary position a + d. Depth 0 is a real row: it
reads the verifier's features at position a and the embedding of token a + 1. Depth d > 0 is a row of anchor a's
draft chain: in P-EAGLE it reads the learned mask hidden state and the mask token (all depths in one forward); in
EAGLE-3 it reads the previous depth's output and token a + 1 + d (training-time test, one depth per step). Both
share this mask, which is also what speculators builds (its P-EAGLE mask and EAGLE-3's diagonal TTT extension).
"""

from __future__ import annotations

import torch


def attention_allowed(anchors: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, R] anchors/depths/valid -> [B, R, R] bool: query row may attend to key row.

    A row sees every real row at or before its anchor (the real context) and the earlier rows of its own chain;
    never another chain. Padding rows see only themselves so softmax stays finite.
    """
    return attention_allowed_to(anchors, depths, valid, anchors, depths, valid)


def attention_allowed_to(q_anchors: torch.Tensor, q_depths: torch.Tensor, q_valid: torch.Tensor,
                         k_anchors: torch.Tensor, k_depths: torch.Tensor, k_valid: torch.Tensor) -> torch.Tensor:
    """`attention_allowed` between query rows [B, Q] and key rows [B, K] whose last Q entries are the queries
    themselves (rows computed earlier come first, as in a KV cache) -> [B, Q, K] bool."""
    a_q, a_k = q_anchors[:, :, None], k_anchors[:, None, :]
    d_q, d_k = q_depths[:, :, None], k_depths[:, None, :]
    real_context = (d_k == 0) & (a_k <= a_q)
    own_chain = (d_k > 0) & (a_k == a_q) & (d_k <= d_q)
    allowed = (real_context | own_chain) & q_valid[:, :, None] & k_valid[:, None, :]
    queries, keys = q_anchors.shape[1], k_anchors.shape[1]
    itself = torch.zeros(queries, keys, dtype=torch.bool, device=q_anchors.device)
    itself[:, keys - queries:] = torch.eye(queries, dtype=torch.bool, device=q_anchors.device)
    return allowed | (itself & ~q_valid[:, :, None])


def sample_training_rows(
    loss_mask: torch.Tensor, num_speculative_tokens: int, keep_decay: float, generator: torch.Generator | None = None,
    max_anchors: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows for one sequence of length T with draft-block sparsification.

    loss_mask: [T] (1 on assistant tokens). Returns anchors [R], depths [R], has_target [R] where has_target marks
    rows whose drafted token exists and is an assistant token. Every real row is kept (it is context for all
    later rows); chain depth d of an anchor is kept with probability keep_decay per level, nested so a kept row
    always has its whole chain above it, and only while its target is trainable. With max_anchors, only that
    many randomly chosen anchors carry a loss (and chains): sequence-length sparsification.
    """
    length = int(loss_mask.shape[0])
    num_real = max(length - 1, 0)
    real_anchor = torch.arange(num_real)
    target_pos = real_anchor + 2
    real_target = torch.zeros(num_real, dtype=torch.bool)
    in_range = target_pos < length
    real_target[in_range] = loss_mask[target_pos[in_range]].bool()
    if max_anchors is not None and int(real_target.sum()) > max_anchors:
        candidates = real_target.nonzero().squeeze(1)
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:max_anchors]]
        real_target = torch.zeros_like(real_target)
        real_target[chosen] = True

    anchors, depths, targets = [real_anchor], [torch.zeros(num_real, dtype=torch.long)], [real_target]
    alive = real_target.clone()
    for depth in range(1, num_speculative_tokens):
        target_pos = real_anchor + 2 + depth
        trainable = torch.zeros(num_real, dtype=torch.bool)
        ok = target_pos < length
        trainable[ok] = loss_mask[target_pos[ok]].bool()
        keep = torch.rand(num_real, generator=generator) < keep_decay
        alive = alive & keep & trainable
        if not alive.any():
            break
        kept = real_anchor[alive]
        anchors.append(kept)
        depths.append(torch.full_like(kept, depth))
        targets.append(torch.ones_like(kept, dtype=torch.bool))
    return torch.cat(anchors), torch.cat(depths), torch.cat(targets)


def inference_rows(context_length: int, num_speculative_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to draft num_speculative_tokens tokens after a context whose last real row is anchor context_length - 1:
    (anchors, depths), each [context_length + num_speculative_tokens - 1] int64 on the CPU: every context position
    at depth 0, then the last one's chain at depths 1..K-1."""
    last = context_length - 1
    anchors = torch.cat([torch.arange(context_length), torch.full((num_speculative_tokens - 1,), last)])
    depths = torch.cat([torch.zeros(context_length, dtype=torch.long), torch.arange(1, num_speculative_tokens)])
    return anchors, depths
