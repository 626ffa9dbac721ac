"""Registers the schema in Hydra's ConfigStore and composes configs outside of ``@hydra.main`` (tests, tools)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException, ConfigCompositionException
from omegaconf import DictConfig

from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """conf/config.yaml lists `base_config` first, so every group file is merged into (and checked against) it;
    each drafter's schema is `drafter/<name>_schema`, which its conf/drafter/<name>.yaml extends."""
    from pipeline.drafters import DRAFTERS

    store = ConfigStore.instance()
    store.store(name="base_config", node=PipelineConfig)
    for name, drafter in DRAFTERS.items():
        store.store(group="drafter", name=f"{name}_schema", node=drafter.config_class)


class ConfigError(PipelineError, ConfigCompositionException):
    """A config Hydra cannot compose, as the one line config_error_line makes: bad input (a PipelineError) that is
    also the composition error Hydra raises, whose original is its __cause__."""


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> DictConfig:
    """Compose the Hydra config like a job would, for tests and tools. Raises ConfigError naming the key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return hydra_compose(config_name=config_name, overrides=list(overrides or []))
        except CompactHydraException as error:
            raise ConfigError(config_error_line(error)) from error


SCHEMA_SUFFIX = "_schema"  # a drafter's schema node (register_configs): composed by its conf file, not chosen


def config_error_line(error: BaseException) -> str:
    """One line for an error Hydra or OmegaConf raised while composing: the config key it is about, then what is
    wrong (OmegaConf's own message), e.g. "training.max_steps: Value 'abc' of type 'str' could not be converted to
    Integer"; a group option that does not exist lists the ones that do."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    key = getattr(cause, "full_key", None)
    message = str(getattr(cause, "msg", None) or cause)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", first)
    listed_from = next((i + 1 for i, line in enumerate(lines) if line.startswith("Available options")), None)
    if isinstance(error, MissingConfigException) and missing and listed_from is not None:
        listed = lines[listed_from:]
        options = [option for option in listed if re.fullmatch(r"[\w.-]+", option)  # not the search path's lines
                   and not option.endswith(SCHEMA_SUFFIX)]
        group, option = missing.groups()
        return f"{group}: '{option}' is not one of {options}"
    if isinstance(cause, OmegaConfBaseException) and key:
        choice = re.fullmatch(r"Invalid value '(.*)', expected one of \[(.*)\]", first)  # a schema Enum's choices
        return f"{key}: '{choice[1]}' is not one of [{choice[2]}]" if choice else f"{key}: {first}"
    if isinstance(error, OverrideParseException):  # the override's syntax: name the override, not the grammar docs
        return f"override '{error.override}': {first}"
    return " ".join(lines)
