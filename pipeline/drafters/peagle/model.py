"""P-EAGLE: the EAGLE-3 drafter that predicts K tokens in one forward.

The verifier's features from several layers are fused by ``fc`` into one hidden state per position and paired
with the embedding of the next token; parallel positions use a learned ``mask_hidden`` and the mask token.
The embedding and LM head are the verifier's, frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.drafters.common import DrafterSpec, EagleDecoderLayer, additive_mask, build_norm, build_rotary
from pipeline.drafters.peagle.data import attention_allowed, inference_rows


class PEagleDrafter(nn.Module):
    algorithm = "peagle"

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__()
        self.spec = spec
        config = spec.layer_config()
        hidden, num_aux = spec.hidden_size, len(spec.aux_layer_ids)
        self.embed_tokens = nn.Embedding(spec.vocab_size, hidden)
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            EagleDecoderLayer(config, i, spec.norm_before_residual) for i in range(spec.num_layers)
        )
        self.norm = build_norm(config, hidden)
        self.lm_head = nn.Linear(hidden, spec.draft_vocab_size or spec.vocab_size, bias=False)
        self.rotary_emb = build_rotary(config)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, num_aux * hidden) * init_std)
        self._init_weights(init_std)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def load_verifier_tensors(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            self.lm_head.weight.copy_(lm_head_weight)

    def forward(
        self,
        aux_hidden: torch.Tensor,  # [B, T, A*H] verifier features at positions 0..T-1
        next_ids: torch.Tensor,  # [B, T] token at position t + 1, paired with features at t
        anchors: torch.Tensor,  # [B, R]
        depths: torch.Tensor,  # [B, R]
        valid: torch.Tensor,  # [B, R] bool
    ) -> torch.Tensor:
        """Final normed hidden state per row: [B, R, H]; ``lm_head`` turns rows into draft logits."""
        real = depths == 0
        index = anchors.clamp(0, aux_hidden.shape[1] - 1)
        features = torch.gather(aux_hidden, 1, index[..., None].expand(-1, -1, aux_hidden.shape[-1]))
        features = torch.where(real[..., None], features, self.mask_hidden.to(features.dtype))  # [B, R, A*H]
        tokens = torch.where(real, torch.gather(next_ids, 1, index), torch.full_like(index, self.spec.mask_token_id))
        x = torch.cat([self.embed_tokens(tokens).to(features.dtype), self.fc(features)], dim=-1)  # [B, R, 2H]
        positions = anchors + depths
        position_embeddings = self.rotary_emb(x, positions)
        mask = additive_mask(attention_allowed(anchors, depths, valid), x.dtype)
        for layer in self.layers:
            x = layer(x, position_embeddings, mask)
        return self.norm(x)

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Greedy drafts for one sequence: aux_hidden [1, T, A*H], next_ids [1, T] -> [num_drafts] token ids."""
        anchors, depths = inference_rows(aux_hidden.shape[1], num_drafts)
        anchors, depths = anchors[None].to(aux_hidden.device), depths[None].to(aux_hidden.device)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        hidden = self.forward(aux_hidden, next_ids, anchors, depths, valid)[0, -num_drafts:]  # [K, H]
        return self.lm_head(hidden).argmax(dim=-1)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        frozen = {"embed_tokens.weight", "lm_head.weight"}
        return {k: v.detach().cpu() for k, v in self.state_dict().items() if k not in frozen}
