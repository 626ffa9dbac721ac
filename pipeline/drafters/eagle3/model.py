"""EAGLE-3: one decoder layer over [token embedding ; fused verifier features], drafting one token per step.

Depth d > 0 reads the drafter's own pre-norm output at depth d - 1 (no ``fc``: it is already H wide) and the
token a + 1 + d. Training runs the same K sequential steps (training-time test) with the ground-truth tokens, as
speculators does; at inference the tokens are the drafter's own greedy picks.
"""

from __future__ import annotations

import torch

from pipeline.drafters.chains import inference_rows
from pipeline.drafters.common import DrafterSpec
from pipeline.drafters.eagle_family import EagleFamilyDrafter


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


def rows_needed(depths: torch.Tensor, valid: torch.Tensor, step: int) -> int:
    """How many leading rows hold every valid row of depth <= step (all rows if none is valid)."""
    needed = ((depths <= step) & valid).nonzero()
    return int(needed[:, 1].max()) + 1 if needed.numel() else depths.shape[1]


class Eagle3Drafter(EagleFamilyDrafter):
    algorithm = "eagle3"
    sparsifies_depth = False
    extra_keys = ("norm_before_fc", "norm_output")

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__(spec)
        self.norm_output = bool(spec.extra.get("norm_output"))
        self.init_linear_weights(init_std)

    def _rows_input(self, aux_hidden, next_ids, anchors, depths, chain_hidden):
        """[B, R, 2H]: real rows get fc(features), chain rows the previous depth's output; both their token."""
        embeds, features = self.real_row_inputs(aux_hidden, next_ids, anchors + depths)
        real = (depths == 0)[..., None]
        fused = self.fuse(features)
        fused = fused if chain_hidden is None else torch.where(real, fused, chain_hidden)
        return torch.cat([embeds.to(fused.dtype), fused], dim=-1)

    def forward(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, anchors: torch.Tensor,
                depths: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Training-time test over all rows: normed hidden [B, R, H].

        Step s computes correct outputs for every row of depth <= s (a row sees only rows of lower or equal depth),
        so after step s the depth-(s+1) rows can take their parents' outputs as input. A row's output never changes
        after its own step, so step s keeps only its depth-s rows and runs only the leading rows up to the last one
        of depth <= s (rows come ordered by depth; deeper rows inside that span are masked out as keys).
        """
        parents = parent_rows(anchors, depths, valid)
        outputs, chain_hidden = None, None
        for step in range(int(depths.max()) + 1):
            span = rows_needed(depths, valid, step)
            rows = (anchors[:, :span], depths[:, :span], valid[:, :span])
            chain = None if chain_hidden is None else chain_hidden[:, :span]
            out = self.run_layers(self._rows_input(aux_hidden, next_ids, rows[0], rows[1], chain), *rows)
            out = torch.nn.functional.pad(out, (0, 0, 0, anchors.shape[1] - span))  # [B, R, H]
            outputs = out if outputs is None else torch.where((depths == step)[..., None], out, outputs)
            chain_hidden = torch.gather(self.chained(outputs), 1, parents[..., None].expand_as(outputs))
        return self.norm(outputs)

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        """What the next depth reads of a row's output [.., H]: pre-norm, or post-norm with norm_output (vLLM's
        `aux_output`)."""
        return self.norm(out) if self.norm_output else out

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Greedy drafts for one sequence, one forward per token: [num_drafts] target ids."""
        context = aux_hidden.shape[1]
        tokens = next_ids
        drafts = []
        chain_hidden = torch.zeros(1, context, self.spec.hidden_size, dtype=aux_hidden.dtype, device=aux_hidden.device)
        for depth in range(num_drafts):
            anchors, depths = (t[None].to(aux_hidden.device) for t in inference_rows(context, depth + 1))
            valid = torch.ones_like(anchors, dtype=torch.bool)
            out = self.run_layers(self._rows_input(aux_hidden, tokens, anchors, depths, chain_hidden),
                                  anchors, depths, valid)  # [1, T + depth, H]
            draft_id = self.lm_head(self.norm(out[:, -1])).argmax(dim=-1)  # [1]
            target_id = self.to_target_ids(draft_id)
            drafts.append(target_id)
            tokens = torch.cat([tokens, target_id[None]], dim=1)  # row (last, depth + 1) reads this token
            chain_hidden = torch.cat([chain_hidden, self.chained(out[:, -1:])], dim=1)
        return torch.cat(drafts)
