"""Layers shared by the EAGLE-family drafters. Math only: no Ray, DeepSpeed or MLflow here.

Parameter names follow the speculators checkpoint layout (``fc``, ``layers.N.self_attn.q_proj``, ``norm``,
``lm_head``, ...), so a state dict exports without renaming.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch import nn


@dataclass
class DrafterSpec:
    """Everything needed to build a drafter: the verifier's shapes plus the drafter's own choices."""

    algorithm: str
    verifier_name: str
    verifier_path: str
    transformer_layer_config: dict[str, Any]  # the verifier's HF config (model_type llama / qwen3)
    aux_layer_ids: list[int]
    num_speculative_tokens: int
    mask_token_id: int
    num_layers: int = 1
    norm_before_residual: bool = True
    draft_vocab_size: Optional[int] = None  # null: the verifier's full vocabulary
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.transformer_layer_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.transformer_layer_config["vocab_size"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DrafterSpec":
        return cls(**values)

    def layer_config(self):
        """The verifier's HF config narrowed to the drafter's layers, with an explicit attention mask path."""
        from transformers import AutoConfig

        values = copy.deepcopy(self.transformer_layer_config)
        model_type = values.pop("model_type")
        config = AutoConfig.for_model(model_type, **values)
        config.num_hidden_layers = self.num_layers
        config._attn_implementation = "sdpa"
        return config


def _model_parts(model_type: str):
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as m

        return m.LlamaAttention, m.LlamaMLP, m.LlamaRMSNorm, m.LlamaRotaryEmbedding
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as m

        return m.Qwen3Attention, m.Qwen3MLP, m.Qwen3RMSNorm, m.Qwen3RotaryEmbedding
    raise ValueError(f"drafter: verifier model_type '{model_type}' is not supported (llama, qwen3)")


class EagleDecoderLayer(nn.Module):
    """A verifier-style decoder layer; the first one reads [embedding ; fused hidden] (2H wide) like EAGLE-3."""

    def __init__(self, config, layer_idx: int, norm_before_residual: bool):
        super().__init__()
        attention_cls, mlp_cls, norm_cls, _ = _model_parts(config.model_type)
        hidden = config.hidden_size
        self.is_first = layer_idx == 0
        self.norm_before_residual = norm_before_residual
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp = mlp_cls(config)
        self.input_layernorm = norm_cls(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(hidden, eps=config.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = norm_cls(hidden, eps=config.rms_norm_eps)
            head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
            bias = getattr(config, "attention_bias", False)
            self.self_attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias=bias)
            self.self_attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)
            self.self_attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)

    def forward(self, x: torch.Tensor, position_embeddings, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            embeds, hidden = x.chunk(2, dim=-1)  # [B, R, H] each
            residual = hidden
            hidden = self.hidden_norm(hidden)
            if self.norm_before_residual:
                residual = hidden
            attn_in = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # [B, R, 2H]
        else:
            residual = x
            attn_in = self.input_layernorm(x)
        attn_out, _ = self.self_attn(
            hidden_states=attn_in, position_embeddings=position_embeddings, attention_mask=attention_mask
        )
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool (True = may attend) -> [B, 1, Q, K] additive float mask for SDPA/eager attention."""
    zeros = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zeros, blocked).unsqueeze(1)


def build_rotary(config):
    _, _, _, rotary_cls = _model_parts(config.model_type)
    return rotary_cls(config)


def build_norm(config, size: int):
    _, _, norm_cls, _ = _model_parts(config.model_type)
    return norm_cls(size, eps=config.rms_norm_eps)
