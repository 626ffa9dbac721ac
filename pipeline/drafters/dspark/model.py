"""DSpark: the DFlash backbone plus two light heads. Math only.

- A Markov correction head: a low-rank logit bias from the previous token, W2 · W1[prev], applied sequentially
  at decoding time (each draft conditions on the one before it) and with the true previous token in training.
- A confidence head trained to predict the chance a draft is accepted, target 1 - TV(draft, verifier). It is used:
  decoding keeps drafts only while the product of their confidences stays above ``confidence_threshold``, so
  drafts unlikely to be accepted never reach the verifier.

As in speculators' DSpark, every block slot drafts (sample_from_anchor): slot k of the block at p drafts p + k + 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.dflash.model import DFlashDrafter, block_loss
from pipeline.drafters.dspark.config import DSparkConfig
from pipeline.drafters.spec import DrafterSpec


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov bias: the token before a slot -> a bias on that slot's draft-vocabulary logits
    (rank `rank`, zero at initialisation, so training starts from plain DFlash)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)  # starts as plain DFlash

    def forward(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        """previous_tokens [...] int64 verifier ids -> logit bias [..., draft_vocab_size]."""
        return self.markov_w2(self.markov_w1(previous_tokens))


class ConfidenceHead(nn.Module):
    """DSpark's acceptance predictor: a slot's features -> the logit of P(its draft is accepted)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., width] -> logits [...] of P(accepted) (apply sigmoid for the probability)."""
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    algorithm = "dspark"
    config_class = DSparkConfig
    sample_from_anchor = True
    extra_keys: tuple[str, ...] = ("causal_block", "markov_rank")
    biases_logits = True
    speculators_architecture = "DSparkDraftModel"
    runs_on_vllm_cpu = False  # vLLM runs DSpark on its GPU model runner only
    vocabulary_matrices = (*DFlashDrafter.vocabulary_matrices, "markov_w1", "markov_w2")  # the Markov bias [V, rank]

    @classmethod
    def export_fields(cls, spec: DrafterSpec) -> dict[str, Any]:
        fields = {**super().export_fields(spec), "markov_rank": int(spec.extra["markov_rank"]),
                  "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
        if "confidence_threshold" in spec.extra:  # ours: the evaluated truncation threshold (others ignore it)
            fields["confidence_threshold"] = float(spec.extra["confidence_threshold"])
        return fields

    @classmethod
    def extra_from_export(cls, config: dict[str, Any]) -> dict[str, Any]:
        extra = {**super().extra_from_export(config), "markov_rank": int(config["markov_rank"])}
        if "confidence_threshold" in config:
            extra["confidence_threshold"] = float(config["confidence_threshold"])
        return extra

    def __init__(self, spec: DrafterSpec, init_std: float = 0.02):
        super().__init__(spec, init_std)
        rank = int(spec.extra["markov_rank"])  # an extra_key: every spec of a DSpark carries it
        self.markov_head = MarkovHead(spec.vocab_size, spec.draft_vocab_size, rank)
        self.confidence_head = ConfidenceHead(spec.hidden_size + rank)
        self.confidence_threshold = float(spec.extra.get("confidence_threshold", 0.0))

    def decoding_options(self) -> dict[str, Any]:
        """{"confidence_threshold": float}: the threshold `draft` truncates with (0.0 = every draft is sent)."""
        return {"confidence_threshold": self.confidence_threshold}

    def set_decoding_options(self, confidence_threshold: float | None = None, **others: Any) -> None:
        """Truncate with `confidence_threshold` from now on (a probability in [0, 1], DSparkConfig checks it; 0 sends
        all K drafts; None keeps the current one). Another option name raises TypeError."""
        super().set_decoding_options(**others)
        if confidence_threshold is not None:
            self.confidence_threshold = float(confidence_threshold)

    def logit_bias(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        """The Markov bias W2 · W1[prev]: previous_tokens [..] int64 target ids in [0, V) -> [.., Vd] in the heads'
        dtype, on their device. An id outside [0, V) raises IndexError (on CUDA, a device-side assert)."""
        return self.markov_head(previous_tokens)

    def confidence_logits(self, hidden: torch.Tensor, previous_tokens: torch.Tensor) -> torch.Tensor:
        """Logit of P(draft accepted) per drafting row: hidden [.., H] (a slot's normed hidden state, in the
        drafter's dtype) with previous_tokens [..] (int64 target ids in [0, V), the token before the draft) -> [..]
        in hidden's dtype; sigmoid gives the confidence. Shapes that do not agree raise RuntimeError; an id outside
        [0, V) raises IndexError."""
        features = torch.cat([hidden, self.markov_head.markov_w1(previous_tokens).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)

    @torch.no_grad()
    def draft_with_confidence(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int):
        """(all K drafts as target ids, their confidences): base logits in one forward, then the Markov bias and
        the confidence one draft at a time, each conditioned on the draft before it.

        aux_hidden: [1, T, A*H] float (the drafter's dtype), next_ids: [1, T] int64 (next_ids[0, t] = token t + 1),
        as block_after_context takes them. Returns drafts [K'] int64 target ids and confidences [K'] in (0, 1), in
        the drafter's dtype, both on its device, K' = min(num_speculative_tokens, spec.num_speculative_tokens).
        Nothing is truncated here (`draft` does). Other shapes raise RuntimeError, a count below 1 ValueError. No
        gradient."""
        self.check_draft_count(num_speculative_tokens)
        hidden = self.block_after_context(aux_hidden, next_ids)
        base = self.draft_logits(hidden)[:num_speculative_tokens]  # [K, Vd]
        previous = next_ids[0, -1]
        drafts, confidences = [], []
        for k in range(base.shape[0]):
            confidences.append(torch.sigmoid(self.confidence_logits(hidden[k], previous)))
            previous = self.to_target_ids(self.correct_logits(base[k], previous).argmax())
            drafts.append(previous)
        return torch.stack(drafts), torch.stack(confidences)

    @torch.no_grad()
    def draft(self, aux_hidden: torch.Tensor, next_ids: torch.Tensor, num_speculative_tokens: int) -> torch.Tensor:
        """The leading drafts worth sending: [n] int64 target ids, 1 <= n <= K' (draft_with_confidence's K'), the
        longest prefix whose confidence product stays >= self.confidence_threshold (keep_count), at least one.
        Inputs and errors as draft_with_confidence. No gradient."""
        drafts, confidences = self.draft_with_confidence(aux_hidden, next_ids, num_speculative_tokens)
        return drafts[: keep_count(confidences, self.confidence_threshold)]

    def training_loss(self, samples: list[dict[str, torch.Tensor]], options: DrafterConfig,
                      generator: torch.Generator | None = None, count_matches: bool = True):
        own = self.own_options(options, DSparkConfig)
        loss, correct, total, extras = block_loss(self, samples, own, generator)
        if extras is None:
            return loss, correct, total
        # the confidence head learns each draft's acceptance probability, 1 - TV(draft, verifier), computed with
        # the loss (no gradient)
        logits = self.confidence_logits(extras["hidden"], extras["previous"]).float()
        per_row = F.binary_cross_entropy_with_logits(logits, extras["acceptance"], reduction="none")
        weights = extras["weights"]
        confidence_loss = (per_row * weights).sum() / weights.sum()
        return loss + own.confidence_loss_weight * confidence_loss, correct, total


def keep_count(confidences: torch.Tensor, threshold: float) -> int:
    """How many leading drafts to send: while the chance that all of them are accepted (the product of their
    confidences) stays at or above the threshold; always at least one."""
    survival = torch.cumprod(confidences.float(), dim=0)
    return max(1, int((survival >= threshold).sum()))
