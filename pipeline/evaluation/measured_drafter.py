"""The drafter a measurement decodes with: a checkpoint's, as the exported speculator holds it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from pipeline.drafters.base import DrafterBase


def decoding_drafter(checkpoint: Path, decoding: Optional[Mapping[str, Any]] = None,
                     verified: bool = True) -> DrafterBase:
    """The drafter of a checkpoint folder as vLLM will serve it: weights rounded in place to the export dtype
    (bf16, pipeline.export.speculators_format), decoding with `decoding` (the drafter schema's decoding options,
    pipeline.paths.decoding_options: DSpark's confidence_threshold; settings, not weights). Raises PipelineError
    for a folder that is not a complete checkpoint (verified: or not the files its integrity records list),
    TypeError for a decoding option the drafter does not have."""
    from pipeline.checkpoint import load_checkpoint
    from pipeline.export.speculators_format import round_to_export_dtype

    drafter = round_to_export_dtype(load_checkpoint(checkpoint, verified)[0])
    drafter.set_decoding_options(**(decoding or {}))
    return drafter
