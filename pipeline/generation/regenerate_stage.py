"""Stage 2, regenerate: the verifier answers every user turn of the training prompts (self-distillation), or
`generation.responses=keep` tokenizes the source's own answers; rows gain input_ids and a per-turn loss_mask."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets

from pipeline.context import Context, load_saved_dataset
from pipeline.data.chat import tokenize_conversation, tokenizer_fingerprint
from pipeline.data.store import projected_store_bytes
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_folder
from pipeline.generation.batching import pack_by_token_budget
from pipeline.generation.common import (
    REGENERATION_INFO,
    capture_layer_ids,
    check_each_once,
    load_tokenizer,
    progress,
    refuse_over_budget,
    stream_batches,
    verifier_config,
    vllm_options,
)
from pipeline.generation.parts import read_parts, remove_stale_parts
from pipeline.generation.regenerate import Limits, keep_conversation
from pipeline.generation.workers import RegenerateWorker

if TYPE_CHECKING:
    from pipeline.config.schema import GenerationConfig

log = logging.getLogger(__name__)


def _limits(gen_cfg: GenerationConfig) -> Limits:
    return Limits(max_new_tokens=int(gen_cfg.max_new_tokens), max_length=int(gen_cfg.max_length),
                  overlength=str(gen_cfg.overlength))


def _regeneration_items(rows: list[dict], tokenizer: Any, gen_cfg: GenerationConfig) -> tuple[list[dict], list[int]]:
    """Token-budget batches; a sample's cost is its first prompt plus every answer it will get, capped."""
    lengths = []
    for row in rows:
        first_turn = row["messages"][: next(i for i, m in enumerate(row["messages"]) if m["role"] == "user") + 1]
        prompt, _ = tokenize_conversation(tokenizer, first_turn, add_generation_prompt=True)
        turns = sum(1 for m in row["messages"] if m["role"] == "user")
        lengths.append(min(len(prompt) + turns * gen_cfg.max_new_tokens, gen_cfg.max_length))
    batches = pack_by_token_budget(lengths, gen_cfg.max_batch_tokens, gen_cfg.batch_size)
    return [{"rows_json": json.dumps([rows[i] for i in batch])} for batch in batches], lengths


def _regenerate_missing(ctx: Context, rows: list[dict], tokenizer: Any, parts_dir: Path) -> None:
    from pipeline.cluster import ensure_ray

    gen = ctx.cfg.generation
    items, lengths = _regeneration_items(rows, tokenizer, gen)
    config = verifier_config(ctx)
    layers = len(capture_layer_ids(ctx, int(config.num_hidden_layers)))
    refuse_over_budget(projected_store_bytes(sum(lengths), layers, int(config.hidden_size),
                                              ctx.cfg.verifier.save_dtype, gen.compression),
                        "regenerate (upper bound)", gen)
    ensure_ray(ctx.cfg.cluster)
    kwargs = dict(backend=gen.backend, verifier_path=ctx.verifier_path, compute_dtype=ctx.cfg.verifier.compute_dtype,
                  threads=gen.torch_threads, limits=vars(_limits(gen)),
                  sampling={"temperature": float(gen.temperature), "top_p": float(gen.top_p), "seed": int(gen.seed)},
                  parts_dir=str(parts_dir), vllm_options=vllm_options(gen))
    started, tokens = time.time(), 0
    with progress(len(rows), "regenerate") as bar:
        for summary in stream_batches(items, RegenerateWorker, kwargs, gen):
            bar.update(int(summary["samples"]))
            tokens += int(summary["response_tokens"])
    elapsed = time.time() - started
    ctx.log_metrics({"regenerate.response_tokens_per_s": tokens / max(elapsed, 1e-9),
                     "regenerate.seconds": elapsed})


def _kept_rows(rows: list[dict], tokenizer: Any, gen_cfg: GenerationConfig) -> list[dict]:
    """`generation.responses=keep`: the source's own answers, tokenized in the driver (no verifier needed)."""
    results = []
    for row in rows:
        result = keep_conversation(row["messages"], tokenizer, _limits(gen_cfg))
        results.append({"sample_id": row["sample_id"], "messages_json": json.dumps(result["messages"]),
                        "input_ids": result["input_ids"], "loss_mask": result["loss_mask"],
                        "skip_reason": result["skip_reason"], "truncated": result["truncated"]})
    return results


# A count inside a skip reason (a prompt's tokens, a turn number), not a setting's value (after '='): reasons
# that differ only in their counts are one kind of skip.
_COUNT_IN_REASON = re.compile(r"(?<![=\w.])\d+(?![\w.])")


def summarize_reasons(reasons: Counter) -> dict[str, int]:
    """{reason: samples} with reasons that differ only in their counts merged into one line, each count shown as
    the range it spans: 'prompt of 20035-20410 tokens (turn 1) leaves no room within generation.max_length=8192'
    once for 300 long prompts, not 300 warnings."""
    kinds: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    totals: Counter = Counter()
    for reason, count in reasons.items():
        kind = tuple(_COUNT_IN_REASON.split(reason))
        kinds.setdefault(kind, []).append(tuple(int(n) for n in _COUNT_IN_REASON.findall(reason)))
        totals[kind] += count
    summaries = {}
    for kind, counts in kinds.items():
        spans = [f"{low}" if low == high else f"{low}-{high}"
                 for low, high in zip(map(min, zip(*counts)), map(max, zip(*counts)))]
        summaries["".join(part + span for part, span in zip(kind, [*spans, ""]))] = totals[kind]
    return summaries


def _report_outcomes(ctx: Context, results: list[dict]) -> list[dict]:
    """Log skips grouped by reason and truncations; return the kept samples."""
    reasons = Counter(r["skip_reason"] for r in results if r["skip_reason"])
    for summary, count in summarize_reasons(reasons).items():
        log.warning("regenerate: skipped %d samples: %s", count, summary)
    kept = [r for r in results if not r["skip_reason"]]
    truncated = sum(1 for r in kept if r["truncated"])
    if truncated:
        log.warning("regenerate: truncated %d samples to generation.max_length=%d", truncated,
                    ctx.cfg.generation.max_length)
    if not kept:
        raise PipelineError("regenerate: every sample was skipped (see the warnings); check generation.max_length")
    ctx.log_metrics({"regenerate.samples": len(kept), "regenerate.skipped": sum(reasons.values()),
                     "regenerate.truncated": truncated,
                     "regenerate.response_tokens": sum(sum(r["loss_mask"]) for r in kept)})
    return kept


def _save_regenerated(folder: Path, kept: list[dict], info: dict) -> datasets.Dataset:
    regenerated = datasets.Dataset.from_list([
        {"sample_id": r["sample_id"], "messages": json.loads(r["messages_json"]),
         "input_ids": [int(t) for t in r["input_ids"]], "loss_mask": [int(m) for m in r["loss_mask"]]}
        for r in kept
    ])
    with atomic_folder(folder) as staging:
        regenerated.save_to_disk(str(staging))
        (staging / REGENERATION_INFO).write_text(json.dumps(info, indent=1))
    return regenerated


def run_regenerate(ctx: Context, train_prompts: datasets.Dataset) -> datasets.Dataset:
    """Self-distillation: the verifier answers every user turn; rows gain input_ids and a per-turn loss_mask."""
    folder, parts_dir = ctx.paths.regenerated, ctx.paths.regenerated_parts
    # lineage on the stage's run, made or reused, as prompts.key and store.key are on theirs
    ctx.set_tags({"regenerated.key": ctx.paths.regenerated_key, "regenerated.path": str(folder)})
    if folder.is_dir():
        regenerated = load_saved_dataset(folder, "regenerate")
        log.info("regenerate: reusing %d samples from %s", len(regenerated), folder)
        ctx.set_tags({"regenerated.reused": True})
        return regenerated
    tokenizer = load_tokenizer(ctx)
    gen = ctx.cfg.generation
    rows = [{"sample_id": r["sample_id"], "messages": r["messages"]} for r in train_prompts]
    if gen.responses == "keep":
        results = _kept_rows(rows, tokenizer, gen)
    else:
        remove_stale_parts(parts_dir)
        done = set(read_parts(parts_dir)["sample_id"])
        todo = [r for r in rows if r["sample_id"] not in done]
        log.info("regenerate: %d samples already in finished parts, %d to generate", len(done), len(todo))
        if todo:
            _regenerate_missing(ctx, todo, tokenizer, parts_dir)
        results = read_parts(parts_dir).to_dict("records")
        check_each_once([r["sample_id"] for r in results], {r["sample_id"] for r in rows}, "regenerate")
    kept = _report_outcomes(ctx, results)
    info = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "backend": gen.backend,
            "responses": gen.responses, "temperature": gen.temperature, "skipped": len(results) - len(kept)}
    regenerated = _save_regenerated(folder, kept, info)
    if parts_dir.is_dir():
        shutil.rmtree(parts_dir)  # the saved dataset now holds every part's rows
    return regenerated
