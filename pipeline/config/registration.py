"""Registers the schema in Hydra's ConfigStore and composes configs outside of ``@hydra.main`` (tests, tools)."""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence, cast

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException, ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

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


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> PipelineConfig:
    """Compose the Hydra config like a job would, for tests and tools. Raises ConfigError naming the key. The result
    is a DictConfig typed by the schema, read as the PipelineConfig it duck-types (pipeline/context.py)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
        except (CompactHydraException, ValueError) as error:
            if not is_composition_error(error):
                raise
            raise ConfigError(config_error_line(error, overrides or [])) from error
    check_boolean_overrides(cfg, overrides or [])
    return cast(PipelineConfig, cfg)


def check_boolean_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """OmegaConf reads any integer given to a boolean field as a boolean (`deepspeed.enabled=2`, or `=02`, composes
    as true); only true/false (and the words and 0/1 OmegaConf documents) are taken. Raises ConfigError naming the
    key for a number other than 0 or 1 (written as a number or a string) given to a boolean field."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.nodes import BooleanNode

    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_delete() or override.is_sweep_override():
            continue
        number = _as_number(override.value())
        if number is None or number in (0, 1):
            continue
        key = override.key_or_group
        parent, _, leaf = key.rpartition(".")
        container = OmegaConf.select(cfg, parent) if parent else cfg
        node = container._get_node(leaf) if isinstance(container, DictConfig) and leaf in container else None
        if isinstance(node, BooleanNode):
            written = override.value()
            shown = repr(written) if isinstance(written, str) else written
            raise ConfigError(f"{key}: must be true or false, got {shown}")


def _as_number(value: Any) -> float | None:
    """An override's value as the number OmegaConf would read it as (it converts the string '02' or ' 2' to 2 before
    it tests for non-zero), or None for a boolean or a non-numeric value."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _eval_set_field_line(key: str, first: str) -> str:
    """A key under evaluation.sets.<name> that the set's mapping does not hold. The presets are plain mappings with
    only the fields they set (schema._eval_set_presets): a field of EvalSetConfig (or of its `synthetic` part) they
    leave out is added with `+`; a set that is not defined at all is added whole."""
    import dataclasses

    from pipeline.config.schema import EvalSetConfig, SyntheticConfig

    parts = key.split(".")[2:]  # <name>, then the path inside the set
    if len(parts) == 1:  # evaluation.sets.<name> itself is missing
        return (f"{key}: evaluation.sets has no set '{parts[0]}'; define it whole with "
                f"+evaluation.sets.{parts[0]}={{source: ..., path: ...}}")
    schema: Any = EvalSetConfig
    for depth, part in enumerate(parts[1:], start=1):
        if schema is None:
            return f"{key}: evaluation.sets.{'.'.join(parts[:depth])} is a value, not a mapping ({first})"
        if part not in {f.name for f in dataclasses.fields(schema)}:
            return f"{key}: not a field of {schema.__name__} ({first})"
        schema = SyntheticConfig if schema is EvalSetConfig and part == "synthetic" else None
    return f"{key}: {first}; the set does not set it: add it with +{key}=..."


def _group_set_to_null(overrides: Sequence[str]) -> Optional[str]:
    """The first config group an override sets to null (`drafter=null`, `+scale=null`), or None."""
    for override in overrides:
        matched = re.fullmatch(r"\+{0,2}([\w/]+)=null", override.strip())
        if matched and (CONF_DIR / matched[1]).is_dir():
            return matched[1]
    return None


def _optional_group(group: str) -> bool:
    """Whether conf/config.yaml's defaults list leaves the group out unless chosen (`- experiment: null`)."""
    return re.search(rf"^\s*- {re.escape(group)}: null\s*$", (CONF_DIR / "config.yaml").read_text(), re.M) is not None


def _group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def is_composition_error(error: BaseException) -> bool:
    """Whether Hydra raised this while composing the config (bad input, reported in one line), not the job it went
    on to run: a CompactHydraException, or another error (the ValueError of a `drafter=null` override) raised inside
    Hydra's own package before Hydra started the job (its run_job frame)."""
    import hydra
    from hydra.errors import CompactHydraException

    if isinstance(error, CompactHydraException):
        return True
    hydra_dir = str(Path(hydra.__file__).resolve().parent) + os.sep
    frames = traceback.extract_tb(error.__traceback__)
    def in_hydra(frame: traceback.FrameSummary) -> bool:
        return str(Path(frame.filename).resolve()).startswith(hydra_dir)

    if any(frame.name == "run_job" and in_hydra(frame) for frame in frames):
        return False  # raised by the job, or by a Hydra helper the job called
    return bool(frames) and in_hydra(frames[-1])


def _override_below_a_value(key: str, overrides: Sequence[str]) -> Optional[str]:
    """The key of the command's first override that names a field below `key` (`key.<field>=...`), if any."""
    for override in overrides:
        name = override.partition("=")[0].lstrip("+~")
        if name.startswith(f"{key}."):
            return name
    return None


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
        below = _override_below_a_value(str(key), overrides)
        if below and "dict" in first:  # `training.max_steps.x=1`: OmegaConf's own words are about a dict
            return f"{key}: is a single value, not a group of fields: '{below}' names no option (set {key}=...)"
        choice = re.fullmatch(r"Invalid value '(.*)', expected one of \[(.*)\]", first)  # a schema Enum's choices
        if choice:
            return f"{key}: '{choice[1]}' is not one of [{choice[2]}]"
        if str(key).startswith("evaluation.sets.") and "is not in struct" in first:
            return _eval_set_field_line(str(key), first)
        return f"{key}: {first}"
    if isinstance(error, ValueError) and not isinstance(cause, OmegaConfBaseException):
        nulled = _group_set_to_null(overrides)
        if nulled and _optional_group(nulled):
            return f"{nulled}: an optional group is left out by leaving out its override, not set to null"
        if nulled:
            return f"{nulled}: a config group cannot be set to null; choose one of {_group_options(nulled)}"
    if isinstance(error, OverrideParseException):  # the override's syntax: name the override, not the grammar docs
        return f"override '{error.override}': {first}"
    return " ".join(lines)
