"""DFlash's options: the `drafter=dflash` schema, which DSpark's extends."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from pipeline.config.schema import DistillTarget, DrafterConfig


class PositionWeighting(StrEnum):
    decay = "decay"
    dpace = "dpace"


@dataclass
class DFlashConfig(DrafterConfig):
    name: str = "dflash"
    # Token whose embedding fills a block's mask positions. null -> the verifier's unk/pad/eos token.
    mask_token_id: Optional[int] = None
    # Attention inside a block is bidirectional (the DFlash paper, arXiv:2602.06036); true makes it causal.
    causal_block: bool = False
    # Loss weight of draft j is exp(-j / loss_decay_gamma) (position_weighting "decay").
    loss_decay_gamma: float = 7.0
    # "dpace" weighs each draft by what the block's expected accepted length gains from it, read from each row's
    # exp(-KL) to its target: the greedy-match probability itself with distill_target "argmax" (speculators'
    # D-PACE, its DFlash default), a stand-in for it with "distribution"; smoothed by dpace_alpha.
    position_weighting: PositionWeighting = PositionWeighting.dpace
    dpace_alpha: float = 0.5
    # What a draft learns from the verifier: its next-token "distribution" (soft cross-entropy) or its greedy token
    # ("argmax": cross-entropy on it, speculators' `ce`, its DFlash default).
    distill_target: DistillTarget = DistillTarget.distribution

    def validate(self) -> None:
        from pipeline.errors import require

        super().validate()
        require(self.loss_decay_gamma > 0, "drafter.loss_decay_gamma: must be > 0")
        require(0.0 <= self.dpace_alpha < 1.0, "drafter.dpace_alpha: must be in [0, 1)")
        # Each weighting reads its own knob: one set for the other weighting is refused rather than ignored (it would
        # still change the run's key, and train again to the same drafter).
        if self.position_weighting == PositionWeighting.dpace:
            require(self.loss_decay_gamma == DFlashConfig.loss_decay_gamma,
                    "drafter.loss_decay_gamma: read only with position_weighting=decay (dpace weighs each draft by "
                    "its share of the expected accepted length)")
        else:
            require(self.dpace_alpha == DFlashConfig.dpace_alpha,
                    "drafter.dpace_alpha: read only with position_weighting=dpace (D-PACE's smoothing; dflash's alone)")
