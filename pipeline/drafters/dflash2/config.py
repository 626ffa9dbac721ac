"""DFlash2's options: DFlash's plus the grouped convolutions around each layer's attention and MLP and the
candidate selector; the model keys are speculators 0.9's (and vLLM's) `dflash2` config keys."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.drafters.dflash.config import DFlashConfig, PositionWeighting


@dataclass
class DFlash2Config(DFlashConfig):
    name: str = "dflash2"
    # Fixed position decay: our DFlash2 weighs its selector loss by it (speculators' DFlash2 also offers D-PACE;
    # not built here, validate refuses it).
    position_weighting: PositionWeighting = PositionWeighting.decay
    # Causal taps of each grouped dynamic convolution inside a draft block (at most the block size).
    conv_kernel_size: int = 2
    # Hidden channels that share one token-conditioned kernel (the verifier's hidden size must be a multiple).
    conv_group_size: int = 16
    # Rank of the selector's predecessor/successor codebooks ([V, rank] each, over the full vocabulary).
    selector_rank: int = 256
    # Candidates of the unary head that the selector reranks, at training and at decoding.
    selector_top_k: int = 16
    # Weight of the selector's cross-entropy beside the unary distillation loss (speculators' name and default).
    selector_loss_alpha: float = 1.0

    def validate(self) -> None:
        """The selector's codebooks index the verifier's vocabulary, as speculators and vLLM require; its loss
        weighs rows by the fixed position decay."""
        from pipeline.errors import require

        # First: DFlash's checks would otherwise judge a dpace knob as if dpace were this drafter's.
        require(self.position_weighting == "decay",
                "drafter.position_weighting: dflash2 trains with the fixed decay; 'dpace' is built for dflash only")
        super().validate()
        require(self.draft_vocab_size is None,
                "drafter.draft_vocab_size: DFlash2 needs the verifier's full vocabulary (null)")
        require(1 <= self.conv_kernel_size <= self.num_speculative_tokens + 1,
                "drafter.conv_kernel_size: must be in [1, num_speculative_tokens + 1] (the block size)")
        require(self.conv_group_size >= 1, "drafter.conv_group_size: must be >= 1")
        require(self.selector_rank >= 1, "drafter.selector_rank: must be >= 1")
        require(self.selector_top_k >= 1, "drafter.selector_top_k: must be >= 1")
        require(self.selector_loss_alpha >= 0, "drafter.selector_loss_alpha: must be >= 0")
