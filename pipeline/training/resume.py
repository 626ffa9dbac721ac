"""Where a run starts: fresh, or from a checkpoint. After a worker failure Ray Train hands the run's latest
checkpoint to the restarted workers; when the same config is started again (after a crash or a stop) the driver
finds that config's latest complete checkpoint in Ray's storage; `training.resume_from` names any other one.

A checkpoint holds the drafter's spec and weights (rank 0), the train state (step, samples seen, global batch,
world size, ZeRO stage) and the full optimizer state: DeepSpeed's own per-rank files under `deepspeed/`, or
`optimizer.pt` without DeepSpeed. On another world size or ZeRO stage, DeepSpeed's `ds_to_universal` turns the
per-rank files into its universal (world-size-free) checkpoint, which the new engine loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.checkpoint import SPEC_FILE, STATE_FILE
from pipeline.config.schema import TrainingConfig
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError, read_json
from pipeline.integrity import is_intact, verify

DEEPSPEED_DIR, DEEPSPEED_TAG, UNIVERSAL_TAG = "deepspeed", "state", "state_universal"
OPTIMIZER_FILE = "optimizer.pt"


def drafter_identity(spec: dict) -> dict:
    """What must match for a checkpoint to continue a run: the same drafter shape on the same verifier."""
    layer = spec["transformer_layer_config"]
    return {"algorithm": spec["algorithm"], "verifier": spec["verifier_name"],
            "verifier hidden_size": layer.get("hidden_size"), "verifier vocab_size": layer.get("vocab_size"),
            "verifier layers": layer.get("num_hidden_layers"), "aux_layer_ids": spec["aux_layer_ids"],
            "num_layers": spec["num_layers"], "num_speculative_tokens": spec["num_speculative_tokens"],
            "draft vocabulary": spec.get("draft_token_ids")}


@dataclass
class ResumePoint:
    folder: Path
    step: int
    global_batch: int
    world_size: int
    zero_stage: int
    uses_deepspeed: bool
    token_budget: Optional[int] = None  # None: a checkpoint from before these were recorded
    val_samples: Optional[int] = None
    # {"muon": names, "adamw": names} its optimizer state holds (optim.optimizer_split); None: not recorded
    optimizer_split: Optional[dict[str, list[str]]] = None

    @property
    def deepspeed_dir(self) -> Path:
        return self.folder / DEEPSPEED_DIR


def _difference(key: str, saved, ours) -> str:
    """How the checkpoint's value differs from this run's, readably: a draft vocabulary of the same size names the
    first token id that differs rather than showing 'N tokens' twice."""
    if key != "draft vocabulary" or not saved or not ours:
        return f"{key} {saved!r}, this run has {ours!r}"
    if len(saved) != len(ours):
        return f"a draft vocabulary of {len(saved)} tokens, this run has {len(ours)}"
    index = next(i for i, (a, b) in enumerate(zip(saved, ours)) if a != b)
    return (f"another draft vocabulary of the same {len(saved)} tokens (entry {index}: token {saved[index]}, this "
            f"run has {ours[index]}; the drafter.draft_vocab_size tokens are counted on the store)")


def check_same_drafter(saved: dict, spec: DrafterSpec, folder: Path) -> None:
    try:
        theirs = drafter_identity(saved)
    except (KeyError, TypeError, AttributeError):  # valid JSON, but not what save_checkpoint writes
        raise PipelineError(f"training.resume_from: '{folder / SPEC_FILE}' is not a drafter spec (no algorithm, "
                            "verifier and layer config)") from None
    ours = drafter_identity(spec.to_dict())
    for key, value in ours.items():
        if theirs[key] != value:
            raise PipelineError(f"training.resume_from: checkpoint '{folder}' has "
                                f"{_difference(key, theirs[key], value)}; it cannot be resumed here")


def read_resume_point(folder: Optional[Path], spec: DrafterSpec) -> Optional[ResumePoint]:
    """The resume point of a checkpoint folder (None for a fresh run); refuses another drafter's checkpoint."""
    if folder is None:
        return None
    folder = Path(folder)
    for name in (SPEC_FILE, STATE_FILE):
        if not (folder / name).is_file():
            raise PipelineError(f"training.resume_from: '{folder}' has no {name} (not a training checkpoint)")
    check_same_drafter(read_json(folder / SPEC_FILE, "training.resume_from"), spec, folder)  # JSON: safe first
    state = read_json(folder / STATE_FILE, "training.resume_from")
    if not isinstance(state, dict) or "global_batch" not in state:
        raise PipelineError(f"training.resume_from: '{folder}' holds weights only (no optimizer state to resume)")
    verify(folder, "training.resume_from")  # before DeepSpeed unpickles a single file of it
    return ResumePoint(folder=folder, step=int(state["step"]), global_batch=int(state["global_batch"]),
                       world_size=int(state["world_size"]), zero_stage=int(state["zero_stage"]),
                       uses_deepspeed=bool(state["deepspeed"]), token_budget=state.get("token_budget"),
                       val_samples=state.get("val_samples"), optimizer_split=state.get("optimizer_split"))


def check_same_data_order(point: ResumePoint, training: TrainingConfig) -> None:
    """The packing and the held-out samples are part of the data order a resume continues."""
    for key, saved in (("max_tokens_per_micro_batch", point.token_budget), ("val_samples", point.val_samples)):
        ours = getattr(training, key)
        if saved is not None and int(ours) != int(saved):
            raise PipelineError(f"training.{key}: checkpoint '{point.folder}' was trained with {saved}, this run "
                                f"has {ours}; a resume must keep the data order")


def check_optimizer_carries_over(point: ResumePoint, training: TrainingConfig, num_workers: int,
                                 zero_stage: int) -> None:
    """A Muon run's DeepSpeed checkpoint resumes only on the worker count and ZeRO stage that wrote it: another
    layout goes through DeepSpeed's universal checkpoint (ds_to_universal), which carries Adam's moments and no
    Muon momentum, and fails on it. zero_stage is this run's (-1 without DeepSpeed, which load_state refuses)."""
    if training.optimizer == "muon" and zero_stage >= 0 and needs_universal(point, num_workers, zero_stage):
        raise PipelineError(
            f"training.num_workers: checkpoint '{point.folder}' was trained with Muon on {point.world_size} workers "
            f"at ZeRO stage {point.zero_stage}; DeepSpeed's universal checkpoint cannot carry Muon's momentum to "
            f"{num_workers} workers at stage {zero_stage}: resume with the same training.num_workers and "
            "deepspeed.zero_stage")


def check_same_optimizer_split(point: ResumePoint, split: dict[str, list[str]]) -> None:
    """A checkpoint's optimizer state fits only the split that wrote it: which trainable tensors Muon holds and
    which AdamW (`split`, this run's: optim.optimizer_split). Another split (another training.optimizer, another
    trainable set such as drafter.embed_requires_grad, or a checkpoint from before the split changed) would fail
    inside torch or DeepSpeed with a size mismatch, or load moments into the wrong tensors; it is refused here
    naming the tensors that differ. A checkpoint that records no split (written before it was recorded) passes."""
    saved = point.optimizer_split
    if saved is None or saved == split:
        return
    moved = [f"{name} ({_half(saved, name)} there, {_half(split, name)} here)"
             for name in dict.fromkeys([*saved["muon"], *saved["adamw"], *split["muon"], *split["adamw"]])
             if _half(saved, name) != _half(split, name)]
    shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
    raise PipelineError(f"training.optimizer: checkpoint '{point.folder}' holds optimizer state for another "
                        f"parameter split: {shown or 'the same tensors in another order'}; its optimizer state "
                        "cannot be resumed by this run")


def _half(split: dict[str, list[str]], name: str) -> str:
    return "Muon" if name in split["muon"] else "AdamW" if name in split["adamw"] else "not trained"


def is_complete_checkpoint(folder: Path) -> bool:
    """Every file a resume reads is there, whole (a run killed while Ray gathered the ranks' files leaves a partial
    one; a crash can truncate a file): the integrity records of every rank hold."""
    if not is_intact(folder):
        return False
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not (folder / SPEC_FILE).is_file() or "global_batch" not in state:
        return False
    if not state["deepspeed"]:
        return (folder / OPTIMIZER_FILE).is_file()
    ranks = list((folder / DEEPSPEED_DIR / DEEPSPEED_TAG).glob("*optim_states.pt"))
    return len(ranks) == int(state["world_size"])


def checkpoint_step(folder: Path, default: Optional[int] = None) -> int:
    """The step a checkpoint folder was saved at (its train_state.json). `default` for one whose state cannot be
    read; without a default that raises PipelineError naming the file."""
    try:
        return int(read_json(folder / STATE_FILE, "train")["step"])
    except (PipelineError, KeyError, TypeError, ValueError):
        if default is None:
            raise PipelineError(f"train: '{folder / STATE_FILE}' holds no step") from None
        return default


def latest_complete_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint of the highest step under a Ray Train run folder that a resume can read, if any."""
    best, best_step = None, -1
    for folder in run_dir.glob("checkpoint_*") if run_dir.is_dir() else []:
        if is_complete_checkpoint(folder):
            step = checkpoint_step(folder)
            if step > best_step:
                best, best_step = folder, step
    return best


def needs_universal(point: ResumePoint, world_size: int, zero_stage: int) -> bool:
    return point.uses_deepspeed and (point.world_size != world_size or point.zero_stage != zero_stage)


def convert_to_universal(point: ResumePoint, into: Path) -> Path:
    """DeepSpeed's own converter: per-rank ZeRO files -> a universal checkpoint under `into/UNIVERSAL_TAG`."""
    output = into / UNIVERSAL_TAG
    if not output.is_dir():
        result = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             str(point.deepspeed_dir / DEEPSPEED_TAG), "--output_folder", str(output), "--inject_missing_state",
             "--num_extract_workers", "1", "--num_merge_workers", "1"],
            capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed on {point.deepspeed_dir}: {result.stderr[-2000:]}")
    return into


def micro_batch_for(global_batch: int, accum: int, world_size: int) -> int:
    per_worker, remainder = divmod(global_batch, accum * world_size)
    if remainder or per_worker < 1:
        raise PipelineError(f"training.num_workers: the checkpoint's global batch of {global_batch} sequences does "
                            f"not split over {world_size} workers x {accum} accumulation steps")
    return per_worker
