"""The drafter a measurement decodes with: a checkpoint's, as the exported speculator holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pipeline.drafters.base import DrafterBase


def decoding_drafter(checkpoint: Path, confidence_threshold: Optional[float] = None,
                     verified: bool = True) -> DrafterBase:
    """The drafter of a checkpoint folder as vLLM will serve it: weights rounded in place to the export dtype
    (bf16, pipeline.export.speculators_format); DSpark's block truncation set to `confidence_threshold` (a decoding
    setting, not a weight). Raises PipelineError for a folder that is not a complete checkpoint (verified: or not
    the files its integrity records list)."""
    from pipeline.checkpoint import load_checkpoint
    from pipeline.export.speculators_format import round_to_export_dtype

    drafter = round_to_export_dtype(load_checkpoint(checkpoint, verified)[0])
    drafter.set_decoding_options(confidence_threshold=confidence_threshold)
    return drafter
