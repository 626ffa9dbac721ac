"""P-EAGLE: the EAGLE-3 drafter that predicts K tokens in one forward.

Parallel rows (depth > 0) read a learned ``mask_hidden`` in place of verifier features and the mask token in
place of a real one, so all K drafts come from a single forward. Training keeps chain depth d for
depth_keep_decay**d of the anchors (draft-block sparsification) so near positions dominate the loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.drafters.chains import inference_rows
from pipeline.drafters.eagle_family import EagleFamilyDrafter
from pipeline.drafters.peagle.config import PEagleConfig
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError


class PEagleDrafter(EagleFamilyDrafter):
    algorithm = "peagle"
    config_class = PEagleConfig
    speculators_architecture = "PEagleSpeculator"

    @classmethod
    def vllm_method(cls) -> dict[str, Any]:
        """vLLM runs P-EAGLE as an EAGLE-3 model drafting all positions in parallel."""
        return {"method": "eagle3", "parallel_drafting": True}

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        return {**super().export_fields(spec), "mask_token_id": spec.mask_token_id}

    def check_exportable(self) -> None:
        if "mask_hidden" not in self.state_dict():
            raise PipelineError("export: a P-EAGLE checkpoint needs mask_hidden (vLLM refuses to load without it)")

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__(spec)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(spec.aux_layer_ids) * spec.hidden_size) * init_std)
        self.init_linear_weights(init_std)

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H] verifier features at positions 0..T-1
        next_ids: torch.Tensor,  # [B, T] token at position t + 1, paired with features at t
        anchors: torch.Tensor,  # [B, R]
        depths: torch.Tensor,  # [B, R]
        valid: torch.Tensor,  # [B, R] bool
    ) -> torch.Tensor:
        """Final normed hidden state per row: [B, R, H]; ``lm_head`` turns rows into draft logits."""
        real = (depths == 0)[..., None]
        embeds, features = self.real_row_inputs(aux_hidden, next_ids, anchors)
        features = torch.where(real, features, self.mask_hidden.to(features.dtype))  # [B, R, A*H]
        mask_embed = self.embed_tokens.weight[self.spec.mask_token_id].to(features.dtype)
        embeds = torch.where(real, embeds.to(features.dtype), mask_embed)
        x = torch.cat([embeds, self.fuse(features)], dim=-1)  # [B, R, 2H]
        return self.norm(self.run_layers(x, anchors, depths, valid))

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Greedy drafts for one sequence: aux_hidden [1, T, A*H], next_ids [1, T] -> [K] target ids."""
        self.check_draft_count(num_speculative_tokens)
        anchors, depths = inference_rows(aux_hidden.shape[1], num_speculative_tokens)
        anchors, depths = anchors[None].to(aux_hidden.device), depths[None].to(aux_hidden.device)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        hidden = self.forward(aux_hidden, next_ids, anchors, depths, valid)[0, -num_speculative_tokens:]  # [K, H]
        return self.to_target_ids(self.lm_head(hidden).argmax(dim=-1))
