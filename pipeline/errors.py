"""The exception types the jobs turn into a one-line error and a non-zero exit."""

import json
import re
from pathlib import Path
from typing import Any, Sequence


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the job (`ray job stop`, a pod's shutdown, `kill`): raised in the main thread and handled as
    Ctrl-C is (cluster.stop_cleanly_on_signals), so locks, MLflow runs and a local Ray are closed, but reported as
    what it was."""


class PipelineError(Exception):
    """Bad input or state the user can fix; the message names the field or file."""


def require(condition: bool, message: str) -> None:
    """Raises PipelineError(message) unless condition holds; message starts with the field it names."""
    if not condition:
        raise PipelineError(message)


def read_json(path: Path | str, field: str) -> Any:
    """The JSON in a file the pipeline wrote or was given; one that cannot be read or parsed (truncated, not UTF-8,
    nested past Python's recursion limit) is a PipelineError naming `field` and the file, not a traceback."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise PipelineError(f"{field}: '{path}' is not readable JSON ({reason})") from None


def read_json_object(path: Path | str, field: str, what: str, required: Sequence[str], remedy: str,
                     schema: Any = None) -> dict:
    """read_json for a file that holds one JSON object with the `required` keys (`what` names it, e.g. "a finished
    evaluation report"); `schema`, a pydantic model class, then checks the kinds of the figures readers use, nested
    ones included (true/false are no numbers, text no number). One that is not an object, lacks a key or holds
    another kind of value is a PipelineError naming `field`, the file, the first faulty key path and `remedy`."""
    found = read_json(path, field)
    if not isinstance(found, dict):
        raise PipelineError(f"{field}: '{path}' holds {type(found).__name__}, not {what}; {remedy}")
    missing = [key for key in required if key not in found]
    if missing:
        raise PipelineError(f"{field}: '{path}' is not {what} (no {', '.join(missing)}); {remedy}")
    if schema is not None:
        from pydantic import ValidationError

        try:
            schema.model_validate(found)
        except ValidationError as error:
            raise PipelineError(f"{field}: '{path}' is not {what} ({_first_problem(error)}); {remedy}") from None
    return found


def required_fields(schema: Any) -> tuple[str, ...]:
    """The fields a pydantic model class requires, in its order: what read_json_object's `required` names for it."""
    return tuple(name for name, info in schema.model_fields.items() if info.is_required())


_PROBLEMS = {"float_type": "not a number", "int_type": "not a whole number", "int_from_float": "not a whole number",
             "missing": "missing", "dict_type": "not an object", "model_type": "not an object",
             "list_type": "not a list", "string_type": "not text", "bool_type": "not true or false"}


def _first_problem(error: Any) -> str:
    """`key.path problem` for the first of a pydantic ValidationError's errors, in plain words where known."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where} {_PROBLEMS.get(first['type'], first['msg'].lower())}"


def first_line(error: BaseException) -> str:
    """The first line of an error's message ("" for an empty one): libraries' messages often go on for paragraphs."""
    return (str(error).strip().splitlines() or [""])[0]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): (?P<message>.+)$")


def remote_cause(error: BaseException) -> str:
    """The first exception raised in a Ray worker, as `Type: message`, out of the error Ray hands the driver.

    Ray Data wraps an actor's exception in RayTaskError(UserCodeException), whose own message is Ray's retry advice;
    the actor's exception survives only as the first `Type: message` line of the traceback text Ray carries along
    (exception objects are not always picklable back). Falls back to the error's own last line."""
    text = _ANSI.sub("", str(error))
    for line in text.splitlines():
        found = _RAISED.match(line.strip())
        if found and not found["type"].startswith("ray."):
            kind = found["type"].rsplit(".", 1)[-1]
            return found["message"] if kind == PipelineError.__name__ else f"{kind}: {found['message']}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else repr(error)
