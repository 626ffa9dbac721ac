"""Decoder layers shared by the drafters, built from the verifier family's transformers classes (Llama or Qwen3
attention, MLP, RMSNorm, rotary embedding). Math only: no Ray, DeepSpeed or MLflow here."""

from __future__ import annotations

import torch
from torch import nn


def _model_parts(model_type: str):
    if model_type == "llama":
        from transformers.models.llama import modeling_llama as llama

        return llama.LlamaAttention, llama.LlamaMLP, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding
    if model_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as qwen3

        return qwen3.Qwen3Attention, qwen3.Qwen3MLP, qwen3.Qwen3RMSNorm, qwen3.Qwen3RotaryEmbedding
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

    def forward(self, x: torch.Tensor, position_embeddings, attention_mask: torch.Tensor, cache=None) -> torch.Tensor:
        """x [B, Q, 2H] (first layer) or [B, Q, H]; attention_mask [B, 1, Q, K] additive; cache: a transformers
        Cache holding the keys and values of earlier rows (K - Q of them), extended with these rows', or None."""
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
            hidden_states=attn_in, position_embeddings=position_embeddings, attention_mask=attention_mask,
            past_key_values=cache,
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
