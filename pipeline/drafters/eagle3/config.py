"""EAGLE-3's options (and those every EAGLE-family drafter shares): the `drafter=eagle3` schema."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Self

from pipeline.config.schema import DistillTarget, DrafterConfig


@dataclass
class EagleFamilyConfig(DrafterConfig):
    """What EAGLE-3 and P-EAGLE both read."""

    # The decoder layer's residual is the normed fused features (speculators', vLLM's and our default); false keeps
    # the un-normed ones, as the original EAGLE-3 code does. The block drafters have no such choice.
    norm_before_residual: bool = True
    # One RMSNorm over the concatenated aux hidden states before `fc` (speculators' and vLLM's `norm_before_fc`,
    # weight `input_norm`): the verifier's layers differ in scale by orders of magnitude.
    norm_before_fc: bool = False
    # Train the token embedding too (speculators' `embed_requires_grad`, on by default in its P-EAGLE); the export
    # carries it and vLLM serves it. DFlash and DSpark exports take the verifier's embedding instead.
    embed_requires_grad: bool = False
    # Draft-block sparsification (P-EAGLE's, speculators' down_sample_ratio): chain depth d trains on a fraction
    # depth_keep_decay**d of the anchors, nested, so the first drafts weigh more in the loss and a step has fewer
    # rows. 1.0 keeps every depth of every anchor (EAGLE-3's training-time test as speculators runs it).
    depth_keep_decay: float = 1.0
    # The draft LM head scores the 8192 most frequent response tokens of the store (d2t/t2d in the export), as
    # conf/drafter/{eagle3,peagle}.yaml say: the vocabulary-sized logits dominate a training step.
    draft_vocab_size: Optional[int] = 8192
    # Greedy verification accepts a draft when it is the verifier's argmax: "argmax" trains on that token alone
    # (speculators' `ce`), "distribution" on the verifier's whole next-token distribution (its `kl_div`, the default).
    distill_target: DistillTarget = DistillTarget.distribution

    def deterministic(self) -> Self:
        return replace(super().deterministic(), depth_keep_decay=1.0)

    def validate(self) -> None:
        from pipeline.errors import require

        super().validate()
        require(0.0 < self.depth_keep_decay <= 1.0, "drafter.depth_keep_decay: must be in (0, 1]")


@dataclass
class Eagle3Config(EagleFamilyConfig):
    name: str = "eagle3"
    # Each training-time-test step reads the previous step's post-norm output instead of its pre-norm one
    # (speculators' and vLLM's `norm_output`; vLLM's P-EAGLE ignores it, so P-EAGLE has no such option).
    norm_output: bool = False
