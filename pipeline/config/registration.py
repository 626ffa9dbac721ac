"""Registers the schema in Hydra's ConfigStore and composes configs outside of ``@hydra.main`` (tests, tools)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from pipeline.config.schema import PipelineConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """conf/config.yaml lists `base_config` first, so every group file is merged into (and checked against) it;
    each drafter's schema is `drafter/<name>_schema`, which its conf/drafter/<name>.yaml extends."""
    from pipeline.drafters import DRAFTERS

    store = ConfigStore.instance()
    store.store(name="base_config", node=PipelineConfig)
    for name, drafter in DRAFTERS.items():
        store.store(group="drafter", name=f"{name}_schema", node=drafter.config_class)


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> DictConfig:
    """Compose the Hydra config like a job would, for tests and tools."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
