"""P-EAGLE's options: EAGLE-3's family options plus the parallel rows' mask token, and depth sparsification on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.drafters.eagle3.config import EagleFamilyConfig


@dataclass
class PEagleConfig(EagleFamilyConfig):
    name: str = "peagle"
    # Token whose embedding fills the parallel rows. null -> the verifier's unk/pad/eos token.
    mask_token_id: Optional[int] = None
    # P-EAGLE trains sparsified by default: chain depth d is kept for a fraction depth_keep_decay**d of anchors.
    depth_keep_decay: float = 0.8
