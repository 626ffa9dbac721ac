"""DFlash: block diffusion drafting. Math only.

The verifier's features from several layers are fused (``fc``, ``hidden_norm``) into one context state per
position and injected into every drafter layer's keys and values, placed before the block's own. A block
[anchor token ; B - 1 mask tokens] is denoised in one forward; slot k (k >= 1) drafts token p + k. Layers are
Qwen3-style (q_norm / k_norm) whatever the verifier, which is the layout speculators and vLLM load.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.base import DrafterBase
from pipeline.drafters.dflash.blocks import acceptance_weights, block_attention_allowed, position_decay, sample_anchors
from pipeline.drafters.dflash.config import DFlashConfig
from pipeline.drafters.layers import additive_mask
from pipeline.drafters.spec import DrafterSpec
from pipeline.losses.distill import distill_hidden_rows, on_model_device, pad_stack

QWEN3_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act",
              "bos_token_id", "eos_token_id", "pad_token_id")


def qwen3():
    """transformers' Qwen3 modeling module, imported on first use: importing it costs seconds that every training
    worker would pay for any drafter."""
    from transformers.models.qwen3 import modeling_qwen3

    return modeling_qwen3


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block], k_norm on both, RoPE at their positions."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = qwen3().Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = qwen3().Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.view(*x.shape[:2], count, self.head_dim)

    def forward(self, block: torch.Tensor, context: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        """block [B, S, H] (every block slot, S = N*bs) attends to [context ; block]: context [B, T, H] (the
        fused verifier features), rotary (cos, sin) each [B, T + S, head_dim], mask [B, 1, S, T + S] additive float
        (layers.additive_mask). Returns [B, S, H] in block's dtype; shapes that disagree raise RuntimeError."""
        cos, sin = rotary  # [B, T + S, hd]: context positions, then block positions
        slots = block.shape[1]
        q = self.q_norm(self._heads(self.q_proj(block), self.num_heads)).transpose(1, 2)
        keys_in = torch.cat([context, block], dim=1)
        k = self.k_norm(self._heads(self.k_proj(keys_in), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(keys_in), self.num_kv_heads).transpose(1, 2)
        q, _ = qwen3().apply_rotary_pos_emb(q, q, cos[:, -slots:], sin[:, -slots:])
        k, _ = qwen3().apply_rotary_pos_emb(k, k, cos, sin)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nH, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:2], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = qwen3().Qwen3MLP(config)
        self.input_layernorm = qwen3().Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = qwen3().Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, rotary, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rotary, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(DrafterBase):
    algorithm = "dflash"
    config_class = DFlashConfig
    # Slot k drafts token p + k + this: DFlash's slot 0 is the known anchor token; DSpark samples from it too.
    sample_from_anchor = False
    extra_keys: tuple[str, ...] = ("causal_block",)
    speculators_architecture = "DFlashDraftModel"
    # speculators' DFlash/DSpark loaders always copy the verifier's embedding; vLLM shares the target's.
    not_exported = ("embed_tokens.weight",)
    # speculators saves a full-vocabulary block drafter without its LM head (frozen: the verifier's own); loading
    # such a checkpoint keeps the head build_drafter took from the verifier, as vLLM shares the target's head when a
    # drafter checkpoint has none (llm_base_proposer._maybe_share_lm_head).
    verifier_head_when_absent = ("lm_head.weight",)
    runs_on_vllm_cpu = True
    # Whether logit_bias corrects the head's logits (DSpark's Markov bias, whose confidence head then trains on each
    # row's acceptance 1 - TV).
    biases_logits = False

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        return {
            "aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "block_size": cls.block_size_for(spec.num_speculative_tokens, cls.sample_from_anchor),
            "mask_token_id": spec.mask_token_id,
            "sample_from_anchor": cls.sample_from_anchor,
            # vLLM reads this flag as "the block is bidirectional" for every layer (speculators only for
            # sliding-window layers; its full-attention layers are always bidirectional): the block's true shape.
            "sliding_window_non_causal": not spec.extra.get("causal_block", False),
        }

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        return {"causal_block": not config.get("sliding_window_non_causal", True)}

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__(spec)
        config = spec.layer_config()
        hidden = spec.hidden_size
        self.block_size = self.block_size_for(spec.num_speculative_tokens, self.sample_from_anchor)
        self.first_draft_slot = 0 if self.sample_from_anchor else 1  # DFlash's slot 0 is the known anchor
        self.causal_block = bool(spec.extra.get("causal_block", False))
        self.fc = nn.Linear(len(spec.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = qwen3().Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(config) for _ in range(spec.num_layers))
        self.norm = qwen3().Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = qwen3().Qwen3RotaryEmbedding(config)
        self.init_linear_weights(init_std)

    def make_layer(self, config) -> nn.Module:
        """One drafter layer (DFlash2 wraps its sublayers in convolutions); self.block_size is set."""
        return DFlashDecoderLayer(config)

    @staticmethod
    def block_size_for(num_speculative_tokens: int, sample_from_anchor: bool) -> int:
        return num_speculative_tokens if sample_from_anchor else num_speculative_tokens + 1

    @staticmethod
    def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
        """Five layers spread from the second to the third-from-last (the DFlash paper, arXiv:2602.06036, fuses
        several, evenly spaced)."""
        n = num_verifier_layers
        first, last = min(1, n), max(n - 3, 1)
        count = min(5, last - first + 1)
        return sorted({round(first + i * (last - first) / max(count - 1, 1)) for i in range(count)})

    @staticmethod
    def adapt_layer_config(verifier_layer_config: dict[str, Any]) -> dict[str, Any]:
        """The verifier's sizes in a Qwen3 layer config: the only DFlash layer layout vLLM implements."""
        values = {k: verifier_layer_config[k] for k in QWEN3_KEYS if k in verifier_layer_config}
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        return {"model_type": "qwen3", **values, "attention_bias": False, "tie_word_embeddings": False}

    def context_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The fused context state of each position: aux [.., A*H] (the A aux layers' features concatenated, in the
        drafter's parameter dtype) -> hidden_norm(fc(aux)) [.., H], same dtype and device. A last dim other than A*H
        raises RuntimeError (torch's shape mismatch)."""
        return self.hidden_norm(self.fc(aux_hidden))

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor) -> torch.Tensor:
        """Denoise N blocks per row in one forward: normed hidden [B, N*bs, H] of every block slot, block-major
        (slots of anchor n at n*bs .. n*bs + bs - 1), in aux_hidden's dtype, on its device.

        aux_hidden: [B, T, A*H] float, the context's fused-layer features at positions 0..T-1 (the drafter's
        parameter dtype: fc and the layers run in it). input_ids: [B, >= max anchor + 1] int64 target ids (the
        anchor token is read at each anchor position). anchors: [B, N] int64 positions, each block starting at its
        anchor; anchor_valid: [B, N] bool (False = padding, never attended to). bs = self.block_size. Shapes that do
        not agree raise RuntimeError; an anchor >= input_ids.shape[1] raises RuntimeError (gather out of range)."""
        batch, context_length = aux_hidden.shape[:2]
        bs = self.block_size
        anchor_tokens = torch.gather(input_ids, 1, anchors)  # [B, N]
        tokens = torch.full((batch, anchors.shape[1], bs), self.spec.mask_token_id, dtype=torch.long,
                            device=input_ids.device)
        tokens[:, :, 0] = anchor_tokens
        x = self.embed_tokens(tokens.flatten(1)).to(aux_hidden.dtype)  # [B, N*bs, H]
        context = self.context_states(aux_hidden)
        block_positions = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).flatten(1)
        positions = torch.cat([torch.arange(context_length, device=anchors.device).expand(batch, -1),
                               block_positions], dim=1)
        rotary = self.rotary_emb(x, positions)
        allowed = block_attention_allowed(context_length, anchors, anchor_valid, bs, self.causal_block)
        mask = additive_mask(allowed, x.dtype)
        for layer in self.layers:
            x = layer(x, context, rotary, mask)
        return self.norm(x)

    def logit_bias(self, previous_tokens: torch.Tensor) -> torch.Tensor | None:
        """[.., Vd] correction of the head's logits from the previous tokens [..] (int64 target ids; DSpark's Markov
        bias, in the drafter's dtype); DFlash has none and returns None. Raises nothing here."""
        return None

    def correct_logits(self, logits: torch.Tensor, previous_tokens: torch.Tensor) -> torch.Tensor:
        """logits [.., Vd] (draft vocabulary) plus logit_bias(previous_tokens [..], int64 target ids), the bias cast
        to logits' dtype; the same tensor, unchanged, for a drafter without a bias (DFlash). Shapes that do not
        broadcast raise RuntimeError."""
        bias = self.logit_bias(previous_tokens)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the slots that draft: hidden [.., bs, H] -> [.., K, Vd] in the LM head's dtype
        (K = spec.num_speculative_tokens: DFlash skips slot 0, the known anchor; DSpark drafts from every slot).
        Uncorrected: correct_logits adds DSpark's Markov bias. A last dim other than H raises RuntimeError."""
        return self.lm_head(hidden[..., self.first_draft_slot:, :])

    def block_after_context(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Normed hidden [bs, H] of the one block that follows the context, in aux_hidden's dtype and device.

        aux_hidden: [1, T, A*H] float, features of positions 0..T-1 (the drafter's parameter dtype); next_ids:
        [1, T] int64, next_ids[0, t] = token t + 1 (so its last entry is token T, the block's anchor). A batch of
        one only; other shapes raise RuntimeError."""
        input_ids = torch.cat([next_ids[:, :1], next_ids], dim=1)  # token t at index t (index 0 unused)
        anchors = torch.tensor([[aux_hidden.shape[1]]], device=aux_hidden.device)
        return self.forward(aux_hidden, input_ids, anchors, torch.ones_like(anchors, dtype=torch.bool))[0]

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Greedy drafts for one sequence in one forward: [min(num_speculative_tokens, K)] int64 target ids (the
        verifier's vocabulary; d2t applied), on the drafter's device. aux_hidden [1, T, A*H] and next_ids [1, T] as
        block_after_context takes them; K = spec.num_speculative_tokens caps the count (ValueError below 1). No
        gradient."""
        self.check_draft_count(num_speculative_tokens)
        hidden = self.block_after_context(aux_hidden, next_ids)
        return self.to_target_ids(self.draft_logits(hidden).argmax(dim=-1))[:num_speculative_tokens]

    def training_loss(self, samples: list[dict[str, torch.Tensor]], options: DrafterConfig,
                      generator: torch.Generator | None = None, count_matches: bool = True):
        """DFlash always counts matches (its loss computes the verifier's full-vocabulary logits anyway)."""
        return block_loss(self, samples, self.own_options(options, DFlashConfig), generator)[:3]


def _row_weights(options: DFlashConfig, block_of_row: torch.Tensor, draft_of_row: torch.Tensor, num_blocks: int,
                 num_speculative_tokens: int):
    """Loss weight per row: exp(-j / loss_decay_gamma) of its draft index j ("decay"), or D-PACE's acceptance
    weights computed from each row's KL to its target, which distill_hidden_rows passes ("dpace",
    `acceptance_weights`)."""
    if options.position_weighting == "dpace":
        return functools.partial(acceptance_weights, block_of_row=block_of_row, draft_of_row=draft_of_row,
                                 num_blocks=num_blocks, num_speculative_tokens=num_speculative_tokens,
                                 alpha=options.dpace_alpha)
    decay = position_decay(num_speculative_tokens, options.loss_decay_gamma)
    return decay.to(draft_of_row.device)[draft_of_row]


def block_loss(model: DFlashDrafter, samples: list[dict[str, torch.Tensor]], options: DFlashConfig,
               generator: torch.Generator | None = None):
    """Distillation over at most options.max_anchors random anchor blocks per sample, each draft's row weighted by
    options.position_weighting (D-PACE or exp(-j / loss_decay_gamma): _row_weights).

    Returns (loss, correct [K], total [K], extras) where extras carries what DSpark's and DFlash2's heads need:
    each trained row's hidden state [M, H], previous token, weight, acceptance, draft index j and the verifier's
    greedy token.
    """
    num_speculative_tokens, bs = model.spec.num_speculative_tokens, model.block_size
    anchor_lists = [sample_anchors(s["loss_mask"], 1, options.max_anchors, generator) for s in samples]
    if all(a.numel() == 0 for a in anchor_lists):
        zero = torch.stack([p.sum() for p in model.parameters() if p.requires_grad]).sum() * 0.0
        zeros = torch.zeros(num_speculative_tokens, dtype=torch.long, device=zero.device)
        return zero, zeros, zeros.clone(), None
    anchors = pad_stack([a if a.numel() else torch.zeros(1, dtype=torch.long) for a in anchor_lists], 0)  # [B, N]
    anchor_valid = pad_stack([torch.ones(max(a.numel(), 1), dtype=torch.bool) & (a.numel() > 0)
                              for a in anchor_lists], False)
    aux = pad_stack([s["aux"].float() for s in samples], 0.0)
    input_ids = pad_stack([s["input_ids"] for s in samples], 0)
    loss_mask = pad_stack([s["loss_mask"] for s in samples], 0)
    last = pad_stack([s["last"].float() for s in samples], 0.0)
    anchors, anchor_valid, aux, input_ids, loss_mask, last = on_model_device(
        model, anchors, anchor_valid, aux, input_ids, loss_mask, last)
    hidden = model(aux, input_ids, anchors, anchor_valid)  # [B, N*bs, H]
    hidden = hidden.view(*anchors.shape, bs, -1)[:, :, model.first_draft_slot:]  # [B, N, K, H]: drafting slots

    # [B, N, K]: draft j of block p is p + 1 + j
    target_pos = anchors[:, :, None] + 1 + torch.arange(num_speculative_tokens, device=anchors.device)
    length = input_ids.shape[1]
    inside = target_pos < length
    trainable = anchor_valid[:, :, None] & inside & torch.gather(
        loss_mask, 1, target_pos.clamp(max=length - 1).flatten(1)).view_as(target_pos).bool()
    b, n, j = trainable.nonzero(as_tuple=True)
    before = target_pos[b, n, j] - 1  # the position before each drafted token
    previous = input_ids[b, before]  # its token (teacher forcing)
    # Overlapping blocks draft the same positions: each verifier position's logits are computed once.
    unique_pos, teacher_rows = torch.unique(b * length + before, return_inverse=True)  # [U], [M]
    with torch.no_grad():
        teacher = model.teacher_logits(last.reshape(-1, last.shape[-1])[unique_pos])  # [U, V]: the verifier's view
    rows = hidden[b, n, j]  # [M, H]
    weights = _row_weights(options, b * anchors.shape[1] + n, j, anchors.numel(), num_speculative_tokens)
    # The head's [M, Vd] logits are computed blockwise, never held (DSpark's Markov bias is one [U, Vd] input: the
    # rows of a position share its previous token).
    loss, correct, total, acceptance = distill_hidden_rows(
        model, rows, teacher, j, weights, teacher_rows, bias=model.logit_bias(input_ids.reshape(-1)[unique_pos]),
        with_acceptance=model.biases_logits, target=options.distill_target)
    return loss, correct, total, {"hidden": rows, "previous": previous, "weights": weights, "acceptance": acceptance,
                                  "draft_index": j, "teacher_argmax": teacher.argmax(dim=-1)[teacher_rows]}
