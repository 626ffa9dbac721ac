"""One prompt row -> one conversation `[{role, content: str}]`, or a one-line PipelineError naming where and which
field is wrong.

Row layouts accepted (the first present wins):
- `messages` (data.messages_field): OpenAI chat messages. `content` is a string or a list of text parts
  (`{"type": "text", "text": ...}`), joined with newlines as vLLM's chat parser joins them. An assistant turn that
  only calls tools (`tool_calls`, no text) and a tool result turn (`role: tool`) are dropped and counted: the
  verifier answers the user turns again, and a drafter trained on an empty answer learns nothing.
- `conversations`: ShareGPT turns `{from: human|gpt|system, value}`.
- `data`: UltraChat's alternating user / assistant strings.
- `prompt` (data.prompt_field): a string, or a list of strings (MT-Bench turns: the first one).

What is malformed (a wrong type, a missing key) is refused with its place; what is well formed but unusable (a
non-text part, an unknown role, no user turn) is skipped by the caller with a counted reason (`SkipRow`).
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from pipeline.errors import PipelineError, first_line

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
TOOL_ROLES = ("tool", "function", "ipython")  # OpenAI's tool and legacy function results, Llama 3's ipython


def is_blank(text: str) -> bool:
    """Nothing to read: only white space and invisible format characters (Unicode category Cf: zero-width spaces
    and joiners, BOMs, direction marks), which str.strip() keeps."""
    return all(character.isspace() or unicodedata.category(character) == "Cf" for character in text)


class SkipRow(Exception):
    """A well-formed row this pipeline cannot train on; the message is the counted reason."""


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for each non-blank line of a JSONL file; a line that is not UTF-8, not JSON or not an object
    is refused by its number."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"data.path: line {number} of '{path}'"
            try:  # a byte-order mark before the first line, as some editors save UTF-8, is not part of the row
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise PipelineError(f"{where} is not valid UTF-8 ({error.reason} at byte {error.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise PipelineError(f"{where} is not JSON ({error.msg} at column {error.colno})") from None
            except RecursionError:
                raise PipelineError(f"{where} is JSON nested too deeply to read") from None
            except ValueError as error:  # e.g. an integer past Python's digit limit
                raise PipelineError(f"{where} is JSON Python cannot read ({first_line(error)[:120]})") from None
            if not isinstance(row, dict):
                raise PipelineError(f"{where} is a JSON {_kind(row)}, not an object with a prompt or messages")
            _check_encodable(row, where)
            yield where, row


def _check_encodable(row: dict, where: str) -> None:
    """A \\ud800-style escape decodes to a lone UTF-16 surrogate, which no tokenizer, hash or Parquet file takes:
    refused by its line like bytes that are not UTF-8."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise PipelineError(f"{where} holds a lone UTF-16 surrogate escape ({error.object[error.start:error.end]!a}), "
                            "not text") from None


def _text_parts(parts: list, field: str, where: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        name = f"{field}[{index}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise PipelineError(f"{where}: '{name}' must be a text part object, got {_kind(part)}")
        if part.get("type", "text") != "text":
            raise SkipRow(f"a '{part.get('type')}' content part (only text is used)")
        if not isinstance(part.get("text"), str):
            raise PipelineError(f"{where}: '{name}.text' must be a string, got {_kind(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def _content(message: dict, field: str, where: str) -> str:
    content = message["content"]
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_parts(content, f"{field}.content", where)
    raise PipelineError(f"{where}: '{field}.content' must be a string or a list of text parts, got {_kind(content)}")


def _openai_messages(value: Any, field: str, where: str, dropped: Counter) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise PipelineError(f"{where}: '{field}' must be a list of {{role, content}} messages, got {_kind(value)}")
    messages = []
    for index, message in enumerate(value):
        name = f"{field}[{index}]"
        if not isinstance(message, dict):
            raise PipelineError(f"{where}: '{name}' must be an object with role and content, got {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise PipelineError(f"{where}: '{name}.role' must be a string, got {_kind(role)}")
        if role in TOOL_ROLES:
            dropped["tool result turn"] += 1
            continue
        calls_tools = role == "assistant" and bool(message.get("tool_calls") or message.get("function_call"))
        if "content" not in message and not calls_tools:
            raise PipelineError(f"{where}: '{name}' has no 'content'")
        text = _content(message, name, where) if "content" in message else ""
        if calls_tools and is_blank(text):
            dropped["assistant turn with only tool calls"] += 1
            continue
        messages.append({"role": role, "content": text})
    return messages


def _sharegpt_messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise PipelineError(f"{where}: 'conversations' must be a list of {{from, value}} turns, got {_kind(value)}")
    messages = []
    for index, turn in enumerate(value):
        name = f"conversations[{index}]"
        if not isinstance(turn, dict):
            raise PipelineError(f"{where}: '{name}' must be an object with from and value, got {_kind(turn)}")
        text = turn.get("value")
        if not isinstance(text, (str, type(None))):
            raise PipelineError(f"{where}: '{name}.value' must be a string, got {_kind(text)}")
        speaker = str(turn.get("from", "")).lower()
        messages.append({"role": SHAREGPT_ROLES.get(speaker, speaker), "content": text or ""})
    return messages


def _ultrachat_messages(value: list, where: str) -> list[dict[str, str]]:
    for index, text in enumerate(value):
        if not isinstance(text, (str, type(None))):
            raise PipelineError(f"{where}: 'data[{index}]' must be a string, got {_kind(text)}")
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": text or ""}
            for index, text in enumerate(value)]


def _prompt_message(value: Any, field: str, where: str) -> list[dict[str, str]]:
    # A list of turns (MT-Bench): the first one; later turns need the model's own earlier answers.
    prompt = value[0] if isinstance(value, list) and value else value
    if not isinstance(prompt, str):
        raise PipelineError(f"{where}: '{field}' must be a string or a list of strings, got "
                            f"{_kind(value if not isinstance(value, list) else prompt)}")
    return [{"role": "user", "content": prompt}]


def row_messages(row: dict, messages_field: str, prompt_field: str, where: str,
                 dropped: Counter) -> list[dict[str, str]]:
    """The conversation a row holds; `dropped` counts the turns left out (tool calls and results).

    Raises PipelineError (malformed: names `where` and the field) or SkipRow (well formed, unusable)."""
    if row.get(messages_field) is not None:
        return _openai_messages(row[messages_field], messages_field, where, dropped)
    if row.get("conversations") is not None:
        return _sharegpt_messages(row["conversations"], where)
    if isinstance(row.get("data"), list) and row["data"] and isinstance(row["data"][0], str):
        return _ultrachat_messages(row["data"], where)
    if row.get(prompt_field) is not None:
        return _prompt_message(row[prompt_field], prompt_field, where)
    raise SkipRow(f"no '{messages_field}', 'conversations', 'data' or '{prompt_field}' field with a value (absent "
                  "or null)")
