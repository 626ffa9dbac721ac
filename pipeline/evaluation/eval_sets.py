"""The prompt sets an evaluation decodes: the prompt set's held-out split plus named eval sets (`datasets`).

A named set never hands back a prompt the drafter trained on: rows whose user turns (data.prompts.prompt_key) a
conversation of the training split has are left out before its first `prompts_per_set` are taken (HumanEval is
both a training and an eval source), whatever their system prompt or assistant turns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from pipeline.data.chat import prompt_messages
from pipeline.data.prompts import check_file_unchanged, load_prompts, prompt_key
from pipeline.errors import PipelineError, first_line

if TYPE_CHECKING:
    from pipeline.config.schema import EvaluationConfig

log = logging.getLogger(__name__)

HELD_OUT = "held_out"


def trained_prompts(train) -> set[str]:
    """The prompt keys of the training split's rows ({sample_id, messages}), which no named eval set hands back."""
    return {prompt_key(row["messages"]) for row in train}


def eval_sets(eval_cfg: EvaluationConfig, held_out, trained: set[str], writer=None,
              fit: Optional[Callable[[str, list], list]] = None,
              file_sha256: Optional[dict[str, str]] = None) -> dict[str, list[list[dict]]]:
    """{set name: conversations (prompt messages only)}, in the order `eval_cfg.datasets` names them. `trained`:
    the training split's prompt keys (trained_prompts). file_sha256: {set name: the digest its local file had when
    the evaluation key was made} (StagePaths.eval_set_sha256); a file that no longer has it is refused.

    writer: the verifier's PromptWriter, for sets of the verifier's own prompts (code, math, chat). fit(name,
    conversations): the ones that fit the context they are decoded in (None: all), applied before a named set is
    cut to evaluation.prompts_per_set, so that long prompts leave room for others."""
    sets: dict[str, list[list[dict]]] = {}
    for name in eval_cfg.datasets:
        rows = list(held_out) if name == HELD_OUT else _named_set(name, eval_cfg, trained, writer,
                                                                  (file_sha256 or {}).get(name))
        conversations = [prompt_messages(row["messages"]) for row in rows]
        if fit is not None:
            conversations = fit(name, conversations)
        sets[name] = conversations if name == HELD_OUT else conversations[: eval_cfg.prompts_per_set]
        if not sets[name]:
            raise PipelineError(f"evaluation.datasets: the eval set '{name}' has no prompts")
    return sets


def set_config(name: str, eval_cfg: EvaluationConfig) -> Any:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.config.registration import config_error_line
    from pipeline.config.schema import EvalSetConfig

    try:
        return OmegaConf.merge(OmegaConf.structured(EvalSetConfig), eval_cfg.sets[name])
    except OmegaConfBaseException as error:
        if getattr(error, "full_key", None):  # the bad key inside the set
            raise PipelineError(f"evaluation.sets.{name}.{config_error_line(error)}") from error
        raise PipelineError(f"evaluation.sets.{name}: {first_line(error)}") from error
    except ValueError as error:  # not a mapping at all
        raise PipelineError(f"evaluation.sets.{name}: must be a mapping of EvalSetConfig's fields "
                            f"({{source: ..., path: ...}}), got {eval_cfg.sets[name]!r}") from error


def _named_set(name: str, eval_cfg: EvaluationConfig, trained: set[str], writer,
               expected_sha256: Optional[str]) -> list[dict]:
    prompts = read_named_set(name, eval_cfg, writer)
    check_file_unchanged(eval_cfg.sets[name].get("path"), expected_sha256, f"evaluation.sets.{name}.path")
    unseen = [row for row in prompts if prompt_key(row["messages"]) not in trained]
    if len(unseen) < len(prompts):
        log.info("evaluate: %s: left out %d prompts the drafter trained on", name, len(prompts) - len(unseen))
    return unseen


def read_named_set(name: str, eval_cfg: EvaluationConfig, writer=None):
    """Every usable conversation of the eval set `name` (a datasets.Dataset, as load_prompts gives). Raises
    PipelineError naming the set's own fields (evaluation.sets.<name>.path, ...)."""
    definition = set_config(name, eval_cfg)
    try:
        return load_prompts(definition, writer)
    except PipelineError as error:  # the reader names data's fields: here they are the set's own
        message = str(error)
        field = f"evaluation.sets.{name}"
        raise PipelineError(f"{field}.{message[len('data.'):]}" if message.startswith("data.")
                            else f"{field}: {message.removeprefix('data: ')}") from error
    except Exception as error:  # the hub raises connection errors of many types when offline
        raise PipelineError(f"evaluation.sets.{name}: cannot load {definition.path or name} "
                            f"({type(error).__name__}: {first_line(error)[:200]})") from error
