"""P-EAGLE's options: EAGLE-3's family options plus the parallel rows' mask token and depth sparsification."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Self

from pipeline.drafters.eagle3.config import EagleFamilyConfig


@dataclass
class PEagleConfig(EagleFamilyConfig):
    name: str = "peagle"
    # Token whose embedding fills the parallel rows. null -> the verifier's unk/pad/eos token.
    mask_token_id: Optional[int] = None
    # Draft-block sparsification (P-EAGLE): chain depth d is kept for a fraction depth_keep_decay**d of anchors.
    depth_keep_decay: float = 0.8

    def depth_keep_decay_in_training(self) -> float:
        return self.depth_keep_decay

    def deterministic(self) -> Self:
        return replace(super().deterministic(), depth_keep_decay=1.0)

    def validate(self) -> None:
        from pipeline.errors import require

        super().validate()
        require(0.0 < self.depth_keep_decay <= 1.0, "drafter.depth_keep_decay: must be in (0, 1]")
