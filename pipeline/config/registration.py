"""Registers the schema in Hydra's ConfigStore and composes configs outside of ``@hydra.main`` (tests, tools)."""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException, ConfigCompositionException
from omegaconf import DictConfig

from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SCHEMA_GROUP = "drafter_schema"  # the drafters' schema nodes (register_configs): extended by conf/drafter/*.yaml


def register_configs() -> None:
    """conf/config.yaml lists `base_config` first, so every group file is merged into (and checked against) it;
    each drafter's schema is `drafter_schema/<name>`, which its conf/drafter/<name>.yaml extends. The schemas sit in
    a group of their own so that `drafter=` offers only the drafters, never a bare schema."""
    from pipeline.drafters import DRAFTERS

    store = ConfigStore.instance()
    store.store(name="base_config", node=PipelineConfig)
    for name, drafter in DRAFTERS.items():
        store.store(group=SCHEMA_GROUP, name=name, node=drafter.config_class)


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
        except ValueError as error:
            if not raised_by_hydra(error):
                raise
            raise ConfigError(config_error_line(error, overrides or [])) from error


def _eval_set_field_line(key: str, first: str) -> str:
    """The eval set presets are plain mappings holding only the fields they set (schema._eval_set_presets): a field
    of EvalSetConfig they leave out is added with `+`, anything else is not a field."""
    import dataclasses

    from pipeline.config.schema import EvalSetConfig, SyntheticConfig

    fields = {f.name for schema in (EvalSetConfig, SyntheticConfig) for f in dataclasses.fields(schema)}
    if key.rsplit(".", 1)[-1] in fields:
        return f"{key}: {first}; the preset does not set it: add it with +{key}=..."
    return f"{key}: not a field of EvalSetConfig ({first})"


def _group_set_to_null(overrides: Sequence[str]) -> Optional[str]:
    """The first config group an override sets to null (`drafter=null`, `+scale=null`), or None."""
    for override in overrides:
        matched = re.fullmatch(r"\+{0,2}([\w/]+)=null", override.strip())
        if matched and (CONF_DIR / matched[1]).is_dir():
            return matched[1]
    return None


def _group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def raised_by_hydra(error: BaseException) -> bool:
    """Whether Hydra itself raised this while composing (e.g. the ValueError of a `drafter=null` override), rather
    than the job it went on to run: such an error is bad input, reported in one line."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}hydra{os.sep}" in frames[-1].filename


def config_error_line(error: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for an error Hydra or OmegaConf raised while composing: the config key it is about, then what is
    wrong (OmegaConf's own message), e.g. "training.max_steps: Value 'abc' of type 'str' could not be converted to
    Integer"; a group option that does not exist lists the ones that do; a group set to null (found among the
    command's overrides) names the group."""
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
        options = [option for option in listed if re.fullmatch(r"[\w.-]+", option)]  # not the search path's lines
        group, option = missing.groups()
        return f"{group}: '{option}' is not one of {options}"
    if isinstance(cause, OmegaConfBaseException) and key:
        choice = re.fullmatch(r"Invalid value '(.*)', expected one of \[(.*)\]", first)  # a schema Enum's choices
        if choice:
            return f"{key}: '{choice[1]}' is not one of [{choice[2]}]"
        if str(key).startswith("evaluation.sets.") and "is not in struct" in first:
            return _eval_set_field_line(str(key), first)
        return f"{key}: {first}"
    if isinstance(error, ValueError) and not isinstance(cause, OmegaConfBaseException):
        nulled = _group_set_to_null(overrides)
        if nulled:
            return f"{nulled}: a config group cannot be null; choose one of {_group_options(nulled)}"
    if isinstance(error, OverrideParseException):  # the override's syntax: name the override, not the grammar docs
        return f"override '{error.override}': {first}"
    return " ".join(lines)
