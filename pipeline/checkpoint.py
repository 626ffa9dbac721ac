"""Training checkpoints: the drafter's spec and trainable weights (the verifier's frozen tensors are not copied)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from pipeline.drafters.base import DrafterBase
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError, read_json
from pipeline.integrity import verify

SPEC_FILE, WEIGHTS_FILE, STATE_FILE = "spec.json", "drafter.safetensors", "train_state.json"


def save_checkpoint(folder: Path, model: Any, state: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SPEC_FILE).write_text(json.dumps(model.spec.to_dict(), indent=1))
    save_file({k: v.contiguous() for k, v in model.trainable_state_dict().items()}, str(folder / WEIGHTS_FILE))
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_trainable_weights(model: Any, folder: Path) -> None:
    """Put a checkpoint's trained tensors into `model` (frozen verifier tensors are not in checkpoints; a trained
    embedding is). Raises PipelineError naming what is missing or unexpected."""
    missing, unexpected = model.load_state_dict(load_file(str(Path(folder) / WEIGHTS_FILE)), strict=False)
    missing = [k for k in missing if k not in model.frozen_names()]
    if missing or unexpected:
        raise PipelineError(f"checkpoint: '{folder}' does not match {model.spec.algorithm}: missing {missing}, "
                            f"unexpected {unexpected}")


def load_checkpoint(folder: Path, verified: bool = True) -> tuple[DrafterBase, dict[str, Any]]:
    """(model with trained weights, train state); refuses a folder that is not a complete checkpoint, or (verified)
    whose files are not those its integrity records list (pipeline/integrity.py). verified=False only for a folder
    this process has just written and not sealed yet (val.tau at a checkpoint)."""
    from pipeline.drafters.build import build_drafter

    folder = Path(folder)
    if verified:
        verify(folder)
    for name in (SPEC_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise PipelineError(f"checkpoint: '{folder}' has no {name}")
    spec = DrafterSpec.from_dict(read_json(folder / SPEC_FILE, "checkpoint"))
    model = build_drafter(spec)
    load_trainable_weights(model, folder)
    state = read_json(folder / STATE_FILE, "checkpoint") if (folder / STATE_FILE).is_file() else {}
    return model.eval(), state
