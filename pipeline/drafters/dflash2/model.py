"""DFlash2: the DFlash block drafter with grouped dynamic convolutions and a low-rank candidate selector. Math only.

Every layer wraps its attention and its MLP in a grouped causal convolution inside each draft block: the sublayer's
input is convolved over the slot and the slots before it in the same block, and so is its output, with per-token
kernels (a base kernel plus a delta projected from the sublayer's normed input; channels share a kernel in groups).
Both start as the identity, so an untrained DFlash2 is a DFlash. After the unary head (the verifier's LM head over
the block's hidden states), a selector reranks its top-k candidates at each slot by a bilinear score of the
predecessor token, the slot's hidden state and the candidate: score(c) = unary(c) + <P[prev] * W h, S[c]>. Drafting
walks the block greedily, each slot's predecessor the draft before it (the anchor token for the first).

Source: speculators 0.9 `dflash2` (DFlash2DraftModel; config keys conv_kernel_size, conv_group_size,
selector_rank, selector_top_k) and vLLM's qwen3_dflash2 runtime, which reads the same weights by the same names.
Shapes: B batch, N blocks, bs block slots, H hidden, G = H / group_size kernel groups, C = selector_top_k, V vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.dflash.model import DFlashDecoderLayer, DFlashDrafter, block_loss
from pipeline.drafters.dflash2.config import DFlash2Config
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError

CONV_KEYS = ("conv_kernel_size", "conv_group_size")
SELECTOR_KEYS = ("selector_rank", "selector_top_k")
TOP_K_CHUNK_ROWS = 256  # unary top-k over the full vocabulary, this many rows at a time


def grouped_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [.., S, H] with S a whole number of blocks of block_size slots; delta [.., S, kernel, G] (each slot's own
    kernel offsets); base [kernel, H]. Slot s of a block gets sum over taps t <= s of
    x[s - t] * (base[t] + delta[s, t] per group); earlier blocks never leak in. Returns [.., S, H]."""
    kernel, groups, hidden = base.shape[0], delta.shape[-1], x.shape[-1]
    blocks = x.reshape(*x.shape[:-2], -1, block_size, groups, hidden // groups)  # [.., N, bs, G, H/G]
    delta = delta.reshape(*delta.shape[:-3], -1, block_size, kernel, groups)  # [.., N, bs, kernel, G]
    out = torch.zeros_like(blocks)
    for tap in range(kernel):
        shifted = F.pad(blocks[..., : block_size - tap, :, :], (0, 0, 0, 0, tap, 0))  # slot s reads slot s - tap
        coefficient = base[tap].to(x.dtype).view(groups, -1) + delta[..., tap, :, None]
        out = out + shifted * coefficient
    return out.reshape(x.shape)


class GroupedDynamicConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer, both driven by one projection of its input."""

    def __init__(self, hidden_size: int, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise PipelineError(f"drafter.conv_group_size: {group_size} does not divide the verifier's hidden size "
                                f"{hidden_size}")
        if kernel_size > block_size:
            raise PipelineError(f"drafter.conv_kernel_size: {kernel_size} exceeds the block size {block_size}")
        self.block_size, self.kernel_size, self.num_groups = block_size, kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output, taps, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        """Tap 0 passes the slot through and nothing else contributes: the layer computes DFlash's."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved for the sublayer, the output-side kernel offsets [.., S, kernel, G])."""
        deltas = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return grouped_causal_conv(x, deltas[..., 0, :, :], self.base_kernel[0], self.block_size), deltas[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_causal_conv(x, delta, self.base_kernel[1], self.block_size)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config, block_size: int, kernel_size: int, group_size: int):
        super().__init__(config)
        self.attention_conv = GroupedDynamicConv(config.hidden_size, block_size, kernel_size, group_size)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, block_size, kernel_size, group_size)

    def forward(self, x, context, rotary, mask):
        h, output_delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, rotary, mask), output_delta)
        h, output_delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), output_delta)


class CandidateSelector(nn.Module):
    """The bilinear transition score <P[predecessor] * W h, S[candidate]> over the full vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float):
        super().__init__()
        if top_k > vocab_size:
            raise PipelineError(f"drafter.selector_top_k: {top_k} exceeds the verifier's vocabulary ({vocab_size})")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def transition_scores(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                          candidate_ids: torch.Tensor) -> torch.Tensor:
        """hidden [.., H], predecessor_ids [..], candidate_ids [.., C] -> [.., C]."""
        context = self.predecessor_codebook[predecessor_ids.long()] * self.hidden_projection(hidden)  # [.., R]
        successors = self.successor_codebook[candidate_ids.long()]  # [.., C, R]
        return (context.unsqueeze(-2) * successors).sum(dim=-1)


class DFlash2Drafter(DFlashDrafter):
    algorithm = "dflash2"
    config_class = DFlash2Config
    extra_keys: tuple[str, ...] = ("causal_block", *CONV_KEYS, *SELECTOR_KEYS)
    speculators_architecture = "DFlash2DraftModel"
    runs_on_vllm_cpu = False  # vLLM's DFlash2 runtime (its Triton selector walk) runs on its GPU model runner
    # the selector's [V, rank] codebooks train with AdamW, as speculators' Muon split leaves its codebooks
    vocabulary_matrices = (*DFlashDrafter.vocabulary_matrices, "predecessor_codebook", "successor_codebook")

    @classmethod
    def vllm_method(cls) -> dict[str, Any]:
        """vLLM runs DFlash2 on its DFlash runtime (speculators' `dflash2` maps to method `dflash`)."""
        return {"method": "dflash"}

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        return {**super().export_fields(spec), **{key: int(spec.extra[key]) for key in CONV_KEYS + SELECTOR_KEYS}}

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        return {**super().extra_from_export(config), **{key: int(config[key]) for key in CONV_KEYS + SELECTOR_KEYS}}

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        if spec.draft_vocab_size != spec.vocab_size:
            raise ValueError("dflash2: needs the verifier's full vocabulary (drafter.draft_vocab_size null)")
        super().__init__(spec, init_std)
        for module in self.modules():  # identity convolutions: the projections' random init would perturb DFlash
            if isinstance(module, GroupedDynamicConv):
                module.reset_to_identity()
        self.candidate_selector = CandidateSelector(spec.vocab_size, spec.hidden_size, int(spec.extra["selector_rank"]),
                                                    int(spec.extra["selector_top_k"]), init_std)
        nn.init.normal_(self.candidate_selector.hidden_projection.weight, std=init_std)

    def make_layer(self, config) -> nn.Module:
        return DFlash2DecoderLayer(config, self.block_size, int(self.spec.extra["conv_kernel_size"]),
                                   int(self.spec.extra["conv_group_size"]))

    def candidate_scores(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                         candidate_ids: torch.Tensor) -> torch.Tensor:
        """The selector's score of each candidate: its unary logit plus the transition score. hidden [M, H],
        predecessor_ids [M], candidate_ids [M, C] -> [M, C]."""
        unary = torch.einsum("mh,mch->mc", hidden, self.lm_head.weight[candidate_ids].to(hidden.dtype))
        return unary + self.candidate_selector.transition_scores(hidden, predecessor_ids, candidate_ids)

    @torch.no_grad()
    def unary_top_k(self, hidden: torch.Tensor) -> torch.Tensor:
        """The unary head's top-k token ids [M, C] of hidden [M, H] (the full-vocabulary logits a chunk at a time)."""
        return torch.cat([self.lm_head(chunk).topk(self.candidate_selector.top_k, dim=-1).indices
                          for chunk in hidden.split(TOP_K_CHUNK_ROWS)])

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """Greedy drafts for one sequence: [min(num_speculative_tokens, K)] int64 verifier token ids (DFlash2 keeps
        the full vocabulary, so no d2t), on the drafter's device. aux_hidden [1, T, A*H] and next_ids [1, T] as
        block_after_context takes them; each slot re-ranks its unary head's top-k candidates by the low-rank
        selector given the token drafted before it (speculators 0.9's DFlash2 decoding). ValueError for a count
        below 1. No gradient."""
        self.check_draft_count(num_speculative_tokens)
        hidden = self.block_after_context(aux_hidden, next_ids)[self.first_draft_slot:][:num_speculative_tokens]
        candidates = self.unary_top_k(hidden)  # [K, C]
        previous = next_ids[0, -1:]  # the anchor token precedes the first draft
        drafts = []
        for slot in range(hidden.shape[0]):
            scores = self.candidate_scores(hidden[slot: slot + 1], previous, candidates[slot: slot + 1])
            previous = candidates[slot: slot + 1].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            drafts.append(previous)
        return torch.cat(drafts)

    def training_loss(self, samples: list[dict[str, torch.Tensor]], options: DrafterConfig,
                      generator: torch.Generator | None = None, count_matches: bool = True):
        """DFlash's unary distillation + selector_loss_alpha x the selector's cross-entropy over the unary top-k
        (the verifier's greedy token put in the last candidate's place when the top-k misses it, as speculators
        trains it), teacher-forced on the true previous token. correct/total count the selector's choice."""
        own = self.own_options(options, DFlash2Config)
        loss, _, total, extras = block_loss(self, samples, own, generator)
        if extras is None:
            return loss, torch.zeros_like(total), total
        hidden, target, slot = extras["hidden"], extras["teacher_argmax"], extras["draft_index"]
        candidates, target_position = training_candidates(self.unary_top_k(hidden.detach()), target)
        scores = self.candidate_scores(hidden, extras["previous"], candidates).float()
        weights = extras["weights"]  # the rows' fixed position decay (DFlash2Config refuses "dpace")
        per_row = F.cross_entropy(scores, target_position, reduction="none")
        selector_loss = (per_row * weights).sum() / weights.sum()
        chosen = candidates.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        correct = torch.zeros_like(total).index_add_(0, slot, (chosen == target).long())
        return loss + own.selector_loss_alpha * selector_loss, correct, total


def training_candidates(candidates: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """candidates [M, C] (unary top-k), target [M] -> (candidates with the target in the last place where they miss
    it, the target's index in them [M])."""
    matches = candidates == target[:, None]
    present = matches.any(dim=-1)
    last = candidates.shape[-1] - 1
    candidates = candidates.clone()
    candidates[:, last] = torch.where(present, candidates[:, last], target)
    return candidates, torch.where(present, matches.long().argmax(dim=-1), torch.full_like(target, last))
