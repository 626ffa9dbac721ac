"""What the driver hands each Ray Train worker: typed, so the loop reads `training.max_steps`, never a dict key that a
typo or a schema change turns into a KeyError (or a silent default) minutes into a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.config.schema import DeepSpeedConfig, DrafterConfig, TrainingConfig


@dataclass(frozen=True)
class ValTauSettings:
    """What rank 0 needs to measure val.tau at each checkpoint (training.val_tau_samples > 0): the lossless
    reference decoder on the prompts of `samples` held-out samples, greedy, K = num_speculative_tokens."""

    samples: int
    max_new_tokens: int
    verifier_path: str
    compute_dtype: str
    num_speculative_tokens: int
    batch_size: int
    # the drafter's decoding options (pipeline.paths.decoding_options: DSpark's confidence_threshold)
    decoding: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerConfig:
    """One training run as every worker sees it. `drafter` is the drafter's own schema (a DrafterConfig subclass);
    `spec` is DrafterSpec.to_dict()."""

    spec: dict[str, Any]
    store_dir: str
    last_layer_id: int
    drafter: DrafterConfig
    training: TrainingConfig
    deepspeed: DeepSpeedConfig
    tracking_uri: Optional[str] = None
    run_id: Optional[str] = None
    val_tau: Optional[ValTauSettings] = None
    resume_from: Optional[str] = None  # the checkpoint the driver chose (its own latest, or training.resume_from)

    def as_loop_config(self) -> dict[str, Any]:
        """Ray Train's train_loop_config (a dict) holding this config."""
        return {"worker": self}
