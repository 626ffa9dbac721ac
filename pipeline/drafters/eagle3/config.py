"""EAGLE-3's options (and those every EAGLE-family drafter shares): the `drafter=eagle3` schema."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.schema import DrafterConfig


@dataclass
class EagleFamilyConfig(DrafterConfig):
    """What EAGLE-3 and P-EAGLE both read."""

    # One RMSNorm over the concatenated aux hidden states before `fc` (speculators' and vLLM's `norm_before_fc`,
    # weight `input_norm`): the verifier's layers differ in scale by orders of magnitude.
    norm_before_fc: bool = False
    # Train the token embedding too (speculators' `embed_requires_grad`, on by default in its P-EAGLE); the export
    # carries it and vLLM serves it. DFlash and DSpark exports take the verifier's embedding instead.
    embed_requires_grad: bool = False

    def depth_keep_decay_in_training(self) -> float:
        """Chain depth d trains on a fraction decay**d of the anchors: 1.0 (every depth of every anchor) unless
        the drafter sparsifies depth (P-EAGLE's depth_keep_decay)."""
        return 1.0


@dataclass
class Eagle3Config(EagleFamilyConfig):
    name: str = "eagle3"
    # Each training-time-test step reads the previous step's post-norm output instead of its pre-norm one
    # (speculators' and vLLM's `norm_output`; vLLM's P-EAGLE ignores it, so P-EAGLE has no such option).
    norm_output: bool = False
