"""What EAGLE-3 and P-EAGLE share: fused verifier features, one or more decoder layers over (anchor, depth) rows,
and the chain loss. Math only.

The verifier's features from several layers are fused by ``fc`` into one hidden state per position and paired
with the embedding of the next token; parameter names follow the speculators checkpoint layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.base import DrafterBase, soft_cap
from pipeline.drafters.chains import attention_allowed, attention_allowed_to, sample_training_rows
from pipeline.drafters.eagle3.config import EagleFamilyConfig
from pipeline.drafters.layers import EagleDecoderLayer, additive_mask, build_norm, build_rotary
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError
from pipeline.losses.distill import distill_hidden_rows, on_model_device, pad_stack, teacher_targets


class EagleFamilyDrafter(DrafterBase):
    extra_keys: tuple[str, ...] = ("norm_before_fc", "embed_requires_grad")
    aux_layers_key = "eagle_aux_hidden_state_layer_ids"
    runs_on_vllm_cpu = True

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        return {
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            # vLLM assumes True when absent, speculators False: always write it.
            "norm_before_residual": spec.norm_before_residual,
            "norm_before_fc": bool(spec.extra.get("norm_before_fc", False)),
            "fc_norm": False,
            # vLLM's P-EAGLE drafts without chaining hidden states, so only EAGLE-3 has a norm_output.
            "norm_output": bool(spec.extra.get("norm_output", False)),
            # speculators' own key: whether training moved the embedding this checkpoint carries.
            "embed_requires_grad": bool(spec.extra.get("embed_requires_grad", False)),
        }

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("fc_norm"):
            raise PipelineError("checkpoint config.json: fc_norm (one RMSNorm per aux layer) is not supported; "
                                "norm_before_fc is")
        return {"norm_before_fc": bool(config.get("norm_before_fc", False)),
                "embed_requires_grad": bool(config.get("embed_requires_grad", False))}

    def __init__(self, spec: DrafterSpec):
        super().__init__(spec)
        config = spec.layer_config()
        hidden, num_aux = spec.hidden_size, len(spec.aux_layer_ids)
        # speculators' and vLLM's norm_before_fc: one RMSNorm over the concatenated [A*H] features before fc.
        self.input_norm = build_norm(config, num_aux * hidden) if spec.extra.get("norm_before_fc") else None
        self.fc = nn.Linear(num_aux * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            EagleDecoderLayer(config, i, spec.norm_before_residual) for i in range(spec.num_layers)
        )
        self.norm = build_norm(config, hidden)
        self.rotary_emb = build_rotary(config)

    @staticmethod
    def default_aux_layer_ids(num_verifier_layers: int) -> list[int]:
        """EAGLE-3's default: an early, a middle and a late layer (id i = hidden state after i layers).

        [2, n//2, n-3] collides on verifiers of under 7 layers; speculators and vLLM need distinct ids, so those
        get [1, n//2, n-1].
        """
        n = num_verifier_layers
        ids = [2, n // 2, n - 3]
        return ids if len(set(ids)) == 3 and ids[0] < ids[1] else [1, n // 2, n - 1]

    def real_row_inputs(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, anchors: torch.Tensor):
        """(token embedding, fused verifier features) of each row's anchor position: [B, R, H] each."""
        index = anchors.clamp(0, aux_hidden.shape[1] - 1)
        features = torch.gather(aux_hidden, 1, index[..., None].expand(-1, -1, aux_hidden.shape[-1]))
        # Tokens are indexed by their own length: at inference `next_ids` runs past the features by the drafts
        # made so far (row T-1+d must read draft d, not the last verified token that a feature clamp gives).
        tokens = torch.gather(next_ids, 1, anchors.clamp(0, next_ids.shape[1] - 1))
        return self.embed_tokens(tokens), features

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Verifier features [.., A*H] -> the drafter's hidden [.., H] (fc, after input_norm when it exists)."""
        return self.fc(features if self.input_norm is None else self.input_norm(features))

    def run_layers(self, x: torch.Tensor, anchors: torch.Tensor, depths: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
        """Decoder layers over rows [B, R, 2H] -> pre-norm hidden [B, R, H]."""
        position_embeddings = self.rotary_emb(x, anchors + depths)
        mask = additive_mask(attention_allowed(anchors, depths, valid), x.dtype)
        for layer in self.layers:
            x = layer(x, position_embeddings, mask)
        return x

    def run_layers_cached(self, x: torch.Tensor, rows: tuple[torch.Tensor, ...], keys: tuple[torch.Tensor, ...],
                          cache) -> torch.Tensor:
        """Decoder layers over new rows [B, Q, 2H] -> pre-norm hidden [B, Q, H], attending to the keys and values of
        the rows run before (`cache`, a transformers Cache that this call extends) and to their own.

        rows: (anchors, depths, valid) [B, Q] of the new rows; keys: the same [B, K] for every row the cache will
        hold after this call, the new rows last."""
        anchors, depths, _ = rows
        position_embeddings = self.rotary_emb(x, anchors + depths)
        mask = additive_mask(attention_allowed_to(*rows, *keys), x.dtype)
        for layer in self.layers:
            x = layer(x, position_embeddings, mask, cache)
        return x

    def training_loss(self, samples: list[dict[str, torch.Tensor]], options: DrafterConfig,
                      generator: torch.Generator | None = None, count_matches: bool = True):
        return chain_loss(self, samples, self.own_options(options, EagleFamilyConfig), generator, count_matches)


def chain_loss(model: EagleFamilyDrafter, samples: list[dict[str, torch.Tensor]], options: EagleFamilyConfig,
               generator: torch.Generator | None = None, count_matches: bool = True,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples hold aux [T, A*H], last [T, H] (post-norm final hidden), input_ids [T], loss_mask [T]. Chain depth d
    trains on a fraction options.depth_keep_decay**d of at most options.max_anchors anchors.

    Returns (loss, correct [K], total [K]) where K = the drafter's num_speculative_tokens.
    """
    num_speculative_tokens = model.spec.num_speculative_tokens
    keep_decay = options.depth_keep_decay
    rows = [sample_training_rows(s["loss_mask"], num_speculative_tokens, keep_decay, generator, options.max_anchors)
            for s in samples]
    anchors = pad_stack([r[0] for r in rows], 0)  # [B, R]
    depths = pad_stack([r[1] for r in rows], 0)  # [B, R]
    has_target = pad_stack([r[2] for r in rows], False)  # [B, R]
    valid = pad_stack([torch.ones_like(r[0], dtype=torch.bool) for r in rows], False)  # [B, R]
    aux = pad_stack([s["aux"].float() for s in samples], 0.0)  # [B, T, A*H]
    next_ids = pad_stack([torch.cat([s["input_ids"][1:], s["input_ids"][:1] * 0]) for s in samples], 0)  # [B, T]
    last = pad_stack([s["last"].float() for s in samples], 0.0)  # [B, T, H]
    anchors, depths, has_target, valid, aux, next_ids, last = on_model_device(
        model, anchors, depths, has_target, valid, aux, next_ids, last)
    hidden = model(aux, next_ids, anchors, depths, valid)  # [B, R, H]

    batch_index, row_index = has_target.nonzero(as_tuple=True)  # rows that draft an assistant token
    if batch_index.numel() == 0:
        zeros = torch.zeros(num_speculative_tokens, dtype=torch.long, device=hidden.device)
        return hidden.sum() * 0.0, zeros, zeros.clone()
    row_anchor, row_depth = anchors[batch_index, row_index], depths[batch_index, row_index]
    teacher_pos = row_anchor + 1 + row_depth  # the verifier position whose next-token distribution we match
    # Chains of nearby anchors end on the same positions: each verifier position's logits are computed once.
    flat_pos = batch_index * last.shape[1] + teacher_pos  # [N]
    unique_pos, teacher_rows = torch.unique(flat_pos, return_inverse=True)  # [U], [N]
    teacher_hidden = last.reshape(-1, last.shape[-1])[unique_pos]  # [U, H]
    student_hidden = hidden[batch_index, row_index]  # [N, H]; the head's [N, Vd] logits are computed blockwise
    target = str(options.distill_target)
    if model.draft_ids is not None and not count_matches:
        return draft_vocab_loss(model, student_hidden, teacher_hidden, teacher_rows, target)
    with torch.no_grad():
        teacher = model.teacher_logits(teacher_hidden)  # [U, V]
    return distill_hidden_rows(model, student_hidden, teacher, row_depth, teacher_rows=teacher_rows,
                               target=target)[:3]


def draft_vocab_loss(model: EagleFamilyDrafter, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                     teacher_rows: torch.Tensor, target: str = "distribution",
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distillation loss of a pruned drafter without the greedy-match counts (returned as zeros [K]).

    The target is the verifier's distribution renormalised over the draft vocabulary, whose logits are the frozen
    LM head's rows (the verifier's rows of the draft tokens): [U, Vd] instead of the verifier's [U, V]. Only the
    counts need the full vocabulary's argmax, so steps that log no metrics skip it (training_loss(count_matches=False)).
    student_hidden [N, H] the drafter's rows, teacher_hidden [U, H] post-norm verifier states, teacher_rows [N] ->
    index into U. target: as in distill_hidden_rows ("argmax": one-hot on the greedy draft-vocabulary token).
    """
    with torch.no_grad():
        teacher_logits = soft_cap(model.lm_head(teacher_hidden).float(), model.spec.verifier_logit_softcap)
        teacher_probs = teacher_targets(teacher_logits, target)  # [U, Vd]
    loss, _, _ = model.lm_head(student_hidden, teacher_probs, teacher_rows)
    zeros = torch.zeros(model.spec.num_speculative_tokens, dtype=torch.long, device=student_hidden.device)
    return loss, zeros, zeros.clone()
