"""DSpark's options: DFlash's plus the Markov logit bias and the confidence head."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.schema import decoding_setting
from pipeline.drafters.dflash.config import DFlashConfig, PositionWeighting


@dataclass
class DSparkConfig(DFlashConfig):
    name: str = "dspark"
    # Fixed position decay: the Markov bias takes its gradient from fixed weights (validate).
    position_weighting: PositionWeighting = PositionWeighting.decay
    # Rank of the Markov (previous-token) logit bias: speculators' CLI default, 1.01-1.03 of rank 64 in tau
    # (benchmarks/results/versus_speculators.json).
    markov_rank: int = 256
    # Weight of the confidence head's loss (the head truncates the block at decoding time, confidence_threshold).
    confidence_loss_weight: float = 1.0
    # Decoding sends drafts while the product of their confidences stays >= this (0 = send all K). 0 by default:
    # vLLM 0.32 serves DSpark without one (its speculators config reads no threshold), and the evaluation measures
    # what vLLM serves. It decodes and never trains: another value is another evaluation and export (whose
    # config.json records it), and another training only where val.tau picks the final checkpoint.
    confidence_threshold: float = decoding_setting(0.0)

    def validate(self) -> None:
        """D-PACE is DFlash's: DSpark's Markov bias takes its gradient from fixed position weights."""
        from pipeline.errors import require

        # First: DFlash's checks would otherwise judge a dpace knob as if dpace were this drafter's.
        require(self.position_weighting == "decay", "drafter.position_weighting: 'dpace' is dflash's, not dspark's")
        super().validate()
        require(self.markov_rank >= 1, "drafter.markov_rank: must be >= 1")
        require(self.confidence_loss_weight >= 0, "drafter.confidence_loss_weight: must be >= 0")
        require(0.0 <= self.confidence_threshold <= 1.0, "drafter.confidence_threshold: must be in [0, 1]")
