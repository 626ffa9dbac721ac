"""Draft-vocabulary pruning in vLLM's and speculators' convention. Math only.

A pruned drafter scores only N of the verifier's V tokens. "Target" is the verifier, as the names d2t (draft to
target) and t2d say in EAGLE, speculators and vLLM. The checkpoint carries two tensors:
``d2t`` [N] int64 offsets (target id = draft id + d2t[draft id]) and ``t2d`` [V] bool (True where a target token
is in the draft vocabulary). Draft ids are the kept target ids in ascending order, so the LM head's rows are the
verifier's rows selected by ``t2d``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from pipeline.errors import PipelineError


def most_frequent_tokens(token_streams: Iterable[torch.Tensor], vocab_size: int, size: int,
                         always_keep: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent target ids (ties -> lower id), plus `always_keep`, in ascending order."""
    if not 0 < size <= vocab_size:
        raise PipelineError(f"drafter.draft_vocab_size: {size} must be in 1..{vocab_size} (the verifier's vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for tokens in token_streams:
        counts += torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size)[:vocab_size].double()
    keep = sorted(set(int(i) for i in always_keep))
    counts[keep] = float("inf")
    # Stable sort on -count keeps lower ids first among equal counts, so the choice is deterministic.
    order = torch.sort(-counts, stable=True).indices[:size]
    return sorted(order.tolist())


def d2t_offsets(draft_token_ids: list[int]) -> torch.Tensor:
    """The checkpoint's ``d2t``: [N] int64 on the CPU, d2t[i] = draft_token_ids[i] - i, so that target id = draft id
    + d2t[draft id] (vLLM's and speculators' convention).

    draft_token_ids: the N kept target ids, ascending (most_frequent_tokens' order; draft id i is the i-th). Nothing
    is checked here: ids out of order give a map ids_from_d2t later refuses (PipelineError). Raises nothing."""
    ids = torch.tensor(draft_token_ids, dtype=torch.long)
    return ids - torch.arange(len(draft_token_ids), dtype=torch.long)


def t2d_mask(draft_token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The checkpoint's ``t2d``: [vocab_size] bool on the CPU, True at each target id in the draft vocabulary.

    draft_token_ids: the N kept target ids (order does not matter here), each in [0, vocab_size); vocab_size: V, the
    verifier's vocabulary. An id >= vocab_size raises IndexError (a negative one counts from the end, as torch
    indexing does)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(draft_token_ids, dtype=torch.long)] = True
    return mask


def ids_from_d2t(d2t: torch.Tensor) -> list[int]:
    """Inverse of d2t_offsets; refuses a map that is not strictly increasing (a corrupt or foreign d2t)."""
    ids = d2t.long() + torch.arange(d2t.shape[0], dtype=torch.long)
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise PipelineError("checkpoint: d2t does not map draft ids to increasing target ids")
    return ids.tolist()
