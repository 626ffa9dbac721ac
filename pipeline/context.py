"""What every stage receives: the config, its stage folders, the tracker, and the resolved verifier."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, cast

from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError, first_line
from pipeline.fsutil import atomic_folder
from pipeline.paths import StagePaths
from pipeline.tracking import Tracker


@dataclass
class Context:
    # The composed config: a DictConfig typed by the schema at run time, read as the schema's dataclasses (the duck
    # typing OmegaConf documents for structured configs), so mypy checks every field a stage reads.
    cfg: PipelineConfig
    paths: StagePaths
    tracker: Optional[Tracker] = None

    @classmethod
    def create(cls, cfg: PipelineConfig, track: bool = True) -> "Context":
        return cls(cfg=cast(PipelineConfig, cfg), paths=StagePaths(cfg), tracker=Tracker(cfg) if track else None)

    @functools.cached_property
    def verifier_path(self) -> str:
        from pipeline.verifier import resolve_verifier_path

        return resolve_verifier_path(self.cfg.verifier)

    def prompt_writer(self):
        """The verifier as the writer of the `synthetic` and `general` prompt sources (PromptWriter)."""
        from pipeline.data.synthesize import PromptWriter

        return PromptWriter(path=self.verifier_path, identity=self.paths.verifier_identity,
                            compute_dtype=self.cfg.verifier.compute_dtype,
                            cache_root=self.paths.root / "synthetic", cluster=self.cfg.cluster)

    def tracking(self, what: str) -> Tracker:
        """The tracker, for a step that cannot run untracked (`what` names it). Raises PipelineError when this
        context was created with track=False."""
        if self.tracker is None:
            raise PipelineError(f"{what}: needs MLflow tracking (this job runs untracked)")
        return self.tracker

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        if self.tracker:
            self.tracker.log_metrics(metrics, step=step)

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        if self.tracker:
            self.tracker.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict) -> None:
        if self.tracker:
            self.tracker.set_tags(tags)


def load_saved_dataset(folder: Path, field: str):
    """datasets.load_from_disk of a folder a stage saved (save_dataset_atomic); a damaged one (a truncated arrow
    file, a missing state file) is a PipelineError naming `field` and the folder: delete it and the stage redoes it."""
    import datasets

    try:
        return datasets.load_from_disk(str(folder))
    except Exception as error:  # pyarrow, datasets and OS errors alike: any of them means the folder is damaged
        reason = f"{type(error).__name__}: {first_line(error)}"
        raise PipelineError(f"{field}: the saved dataset '{folder}' cannot be read ({reason}); delete it to redo "
                            "the stage") from None


def save_dataset_atomic(dataset, target: Path) -> None:
    """save_to_disk into a temporary sibling, then rename: readers never see half a dataset."""
    with atomic_folder(target) as staging:
        dataset.save_to_disk(str(staging))
