"""EAGLE-3: one decoder layer over [token embedding ; fused verifier features], drafting one token per step.

Depth d > 0 reads the drafter's own pre-norm output at depth d - 1 (no ``fc``: it is already H wide) and the
token a + 1 + d. Training runs the same K sequential steps (training-time test) with the ground-truth tokens, as
speculators does; at inference the tokens are the drafter's own greedy picks.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.drafters.eagle3.config import Eagle3Config
from pipeline.drafters.eagle_family import EagleFamilyDrafter
from pipeline.drafters.spec import DrafterSpec


def parent_rows(anchors: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, R] index of row (anchor, depth - 1) for each row (itself for depth 0 and padding rows)."""
    batch, rows = anchors.shape
    span = int(anchors.max()) + 1
    device = anchors.device
    table = torch.zeros(batch, int(depths.max()) + 1, span, dtype=torch.long, device=device)
    row_ids = torch.arange(rows, device=device).expand(batch, rows)
    batch_ids = torch.arange(batch, device=device)[:, None].expand(batch, rows)
    table[batch_ids[valid], depths[valid], anchors[valid]] = row_ids[valid]
    parents = table[batch_ids, (depths - 1).clamp_min(0), anchors]
    return torch.where((depths > 0) & valid, parents, row_ids)


def rows_at_depth(depths: torch.Tensor, valid: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B, Q], present [B, Q]): each sequence's rows of this depth, in row order, padded to the longest with
    index R (one past the last row) and present False."""
    batch, rows = depths.shape
    chosen = (depths == depth) & valid  # [B, R]
    count = int(chosen.sum(dim=1).max())
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :count]  # chosen rows first, in order
    present = torch.gather(chosen, 1, order)
    return torch.where(present, order, torch.full_like(order, rows)), present


class Eagle3Drafter(EagleFamilyDrafter):
    algorithm = "eagle3"
    config_class = Eagle3Config
    extra_keys: tuple[str, ...] = ("norm_before_fc", "norm_output", "embed_requires_grad")
    speculators_architecture = "Eagle3Speculator"
    drafts_past_trained_k = True  # autoregressive: each further draft is one more step of the trained layer

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        return {**super().extra_from_export(config), "norm_output": bool(config.get("norm_output", False))}

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__(spec)
        self.norm_output = bool(spec.extra.get("norm_output"))
        self.init_linear_weights(init_std)

    def _rows_input(self, aux_hidden, next_ids, anchors, depths, chain_hidden):
        """[B, Q, 2H] for rows of one depth: depth 0 reads fc(features), a deeper one its parent's output
        (`chain_hidden`); both their token."""
        embeds, features = self.real_row_inputs(aux_hidden, next_ids, anchors + depths)
        hidden = self.fuse(features) if chain_hidden is None else chain_hidden
        return torch.cat([embeds.to(hidden.dtype), hidden], dim=-1)

    def forward(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, anchors: torch.Tensor,
                depths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Training-time test over all rows: normed hidden [B, R, H].

        Step s runs the depth-s rows alone: each reads its parent's (anchor, s - 1) output and attends to the keys
        and values of the rows run before it (a transformers DynamicCache, as incremental decoding keeps them) and
        to its own step's, so every row is computed once; the attention mask is `attention_allowed`'s.

        aux_hidden [B, T, A*H] (the A aux layers' features, the drafter's parameter dtype), next_ids [B, T] int64
        (the token after each position), anchors / depths [B, R] int64 (row r drafts the token anchors + depths + 1
        from depth `depths` of its chain), valid [B, R] bool (False = padding). Raises ValueError when there is no
        row (depths empty); shapes that disagree raise RuntimeError.
        """
        from transformers import DynamicCache

        parents = parent_rows(anchors, depths, valid)
        batch, rows = anchors.shape
        outputs = None  # [B, R + 1, H]: each row's pre-norm output, row R a sink for padding
        keys: list[tuple[torch.Tensor, ...]] = []
        cache = DynamicCache()
        for step in range(int(depths.max()) + 1):
            index, present = rows_at_depth(depths, valid, step)
            clamped = index.clamp(max=rows - 1)
            step_rows = (torch.gather(anchors, 1, clamped), torch.full_like(index, step), present)
            chain = None
            if outputs is not None:
                parent_out = torch.gather(outputs, 1, torch.gather(parents, 1, clamped)[..., None].expand(
                    -1, -1, outputs.shape[-1]))
                chain = self.chained(parent_out)
            keys.append(step_rows)
            all_keys = tuple(torch.cat(parts, dim=1) for parts in zip(*keys))
            out = self.run_layers_cached(self._rows_input(aux_hidden, next_ids, *step_rows[:2], chain), step_rows,
                                         all_keys, cache)  # [B, Q, H]
            if outputs is None:
                outputs = out.new_zeros(batch, rows + 1, out.shape[-1])
            outputs = outputs.scatter(1, index[..., None].expand_as(out), out)
        if outputs is None:
            raise ValueError("eagle3: no row to run (depths is empty)")
        return self.norm(outputs[:, :rows])

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        """What the next depth reads of a row's output [.., H]: pre-norm, or post-norm with norm_output (vLLM's
        `aux_output`)."""
        return self.norm(out) if self.norm_output else out

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Greedy drafts for one sequence, one forward per token: [num_speculative_tokens] int64 verifier ids (d2t
        applied), on the drafter's device. aux_hidden [1, T, A*H] and next_ids [1, T] as forward takes them. The
        context's rows run once; each draft's row attends to them through the cache, as in training. ValueError for
        a count below 1. No gradient."""
        from transformers import DynamicCache

        self.check_draft_count(num_speculative_tokens)
        context = aux_hidden.shape[1]
        device = aux_hidden.device
        cache = DynamicCache()
        rows = (torch.arange(context, device=device)[None], torch.zeros(1, context, dtype=torch.long, device=device),
                torch.ones(1, context, dtype=torch.bool, device=device))
        keys: tuple[torch.Tensor, ...] = rows
        out = self.run_layers_cached(self._rows_input(aux_hidden, next_ids, *rows[:2], None), rows, keys, cache)
        tokens, drafts = next_ids, []
        for depth in range(num_speculative_tokens):
            last = out[:, -1:]  # [1, 1, H]: the row that drafts this token
            draft_id = self.lm_head(self.norm(last[:, 0])).argmax(dim=-1)  # [1]
            drafts.append(self.to_target_ids(draft_id))
            if depth + 1 == num_speculative_tokens:
                break
            tokens = torch.cat([tokens, drafts[-1][None]], dim=1)  # row (last, depth + 1) reads this token
            rows = (torch.full((1, 1), context - 1, device=device), torch.full((1, 1), depth + 1, device=device),
                    torch.ones(1, 1, dtype=torch.bool, device=device))
            keys = tuple(torch.cat(pair, dim=1) for pair in zip(keys, rows))
            out = self.run_layers_cached(self._rows_input(aux_hidden, tokens, *rows[:2], self.chained(last)), rows,
                                         keys, cache)
        return torch.cat(drafts)
