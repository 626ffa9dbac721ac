"""Stage 3, capture: the verifier's hidden states of every regenerated sample into the store (safetensors shards and
a manifest); samples already in a complete shard are never recomputed."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from pipeline.context import Context
from pipeline.data.chat import chat_template_hash, tokenizer_fingerprint
from pipeline.data.store import (
    entries_still_current,
    load_manifest,
    projected_store_bytes,
    remove_stale_temporaries,
    scan_shards,
    write_manifest,
)
from pipeline.errors import PipelineError, read_json_object
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
from pipeline.generation.workers import CaptureWorker

if TYPE_CHECKING:
    from pipeline.config.schema import GenerationConfig

log = logging.getLogger(__name__)


def _check_regenerated_tokenizer(ctx: Context, fingerprint: str) -> None:
    info_path = ctx.paths.regenerated / REGENERATION_INFO
    if not info_path.is_file():
        return
    info = read_json_object(info_path, "capture", "the regeneration's record", (),
                            "delete the regenerated set and regenerate")
    made_with = info.get("tokenizer_fingerprint")
    if made_with and made_with != fingerprint:
        raise PipelineError(
            f"capture: the regenerated set {ctx.paths.regenerated} was tokenized with a different tokenizer "
            f"({made_with}) than verifier '{ctx.cfg.verifier.name}' ({fingerprint}); delete it and regenerate")


def _check_store_compatible(previous: dict | None, wanted: dict, store: Path) -> None:
    if not previous:
        return
    for key in ("layer_ids", "compression", "dtype", "tokenizer_fingerprint"):
        if key in previous and previous[key] != wanted[key]:
            raise PipelineError(f"store: '{store}' holds {key}={previous[key]}, this run needs {wanted[key]}")


def _capture_items(todo: list[dict], gen_cfg: GenerationConfig) -> list[dict]:
    batches = pack_by_token_budget([len(r["input_ids"]) for r in todo],
                                   gen_cfg.capture_max_batch_tokens or gen_cfg.max_batch_tokens,
                                   gen_cfg.capture_batch_size or gen_cfg.batch_size)
    return [{"rows_json": json.dumps([todo[i] for i in batch])} for batch in batches]


def _capture_missing(ctx: Context, todo: list[dict], layer_ids: list[int], store: Path) -> dict:
    """Capture `todo` into new shards; returns throughput figures."""
    from pipeline.cluster import ensure_ray

    ensure_ray(ctx.cfg.cluster)
    gen = ctx.cfg.generation
    kwargs = dict(backend=gen.capture_backend or gen.backend, verifier_path=ctx.verifier_path,
                  compute_dtype=ctx.cfg.verifier.compute_dtype, threads=gen.torch_threads, layer_ids=layer_ids,
                  store_dir=str(store), store_dtype=ctx.cfg.verifier.save_dtype, compression=gen.compression,
                  vllm_options=vllm_options(gen, capture=True))
    started, forward, write, tokens = time.time(), 0.0, 0.0, 0
    with progress(len(todo), "capture") as bar:
        for summary in stream_batches(_capture_items(todo, gen), CaptureWorker, kwargs, gen):
            entry = json.loads(summary["entry_json"])
            bar.update(len(entry["sample_ids"]))
            forward += float(summary["forward_seconds"])
            write += float(summary["write_seconds"])
            tokens += entry["num_tokens"]
    return {"capture.seconds": time.time() - started, "capture.tokens_per_s": tokens / max(time.time() - started, 1e-9),
            "capture.forward_seconds": forward, "capture.write_seconds": write}


def run_capture(ctx: Context, regenerated: datasets.Dataset) -> dict:
    """Write the hidden-state store; samples already in a complete shard are never recomputed."""
    store = ctx.paths.store
    config = verifier_config(ctx)
    num_layers, hidden_size = int(config.num_hidden_layers), int(config.hidden_size)
    gen = ctx.cfg.generation
    tokenizer = load_tokenizer(ctx)
    fingerprint = tokenizer_fingerprint(tokenizer)
    _check_regenerated_tokenizer(ctx, fingerprint)
    layer_ids = capture_layer_ids(ctx, num_layers)
    wanted = {"layer_ids": layer_ids, "compression": gen.compression, "dtype": ctx.cfg.verifier.save_dtype,
              "tokenizer_fingerprint": fingerprint}
    previous = load_manifest(store)
    _check_store_compatible(previous, wanted, store)
    stale = remove_stale_temporaries(store)
    if stale:
        log.warning("capture: removed %d half-written shards left by an interrupted run", stale)
    stored = scan_shards(store, entries_still_current(store, previous))
    done = {sid for shard in stored for sid in shard["sample_ids"]}
    todo = [{"sample_id": r["sample_id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            for r in regenerated if r["sample_id"] not in done]
    total_tokens = sum(len(r["input_ids"]) for r in regenerated)
    projected = projected_store_bytes(total_tokens, len(layer_ids), hidden_size, ctx.cfg.verifier.save_dtype,
                                      gen.compression)
    refuse_over_budget(projected, "capture", gen)
    store.mkdir(parents=True, exist_ok=True)
    log.info("capture: %d samples already stored, %d to capture into %s", len(done), len(todo), store)
    throughput = _capture_missing(ctx, todo, layer_ids, store) if todo else {}
    # those just checked keep their entries; a shard captured now is read, even one with an old shard's name
    shards = scan_shards(store, {s["file"]: s for s in stored})
    check_each_once([sid for shard in shards for sid in shard["sample_ids"]],
                     {r["sample_id"] for r in regenerated}, "store")
    manifest = write_manifest(store, shards, {
        **wanted,
        "hidden_size": hidden_size,
        "num_verifier_layers": num_layers,
        "verifier": {"name": ctx.cfg.verifier.name, "path": ctx.verifier_path,
                     "revision": getattr(config, "_commit_hash", None)},
        "chat_template_hash": chat_template_hash(tokenizer),
        "regenerated_key": ctx.paths.regenerated_key,
        "projected_bytes": projected,
    })
    _log_capture(ctx, manifest, throughput, len(todo), len(done))
    return manifest


def _log_capture(ctx: Context, manifest: dict, throughput: dict, new: int, reused: int) -> None:
    tokens = max(manifest["num_tokens"], 1)
    errors = [s["relative_error"] for s in manifest["shards"] if s.get("relative_error") is not None]
    metrics = {
        "capture.new_samples": new, "capture.reused_samples": reused,
        "capture.num_tokens": manifest["num_tokens"], "capture.bytes": manifest["bytes"],
        "capture.bytes_per_token": manifest["bytes"] / tokens,
        "capture.projected_bytes": manifest["projected_bytes"],
        "capture.actual_over_projected": manifest["bytes"] / max(manifest["projected_bytes"], 1),
        **throughput,
    }
    if errors:
        metrics["capture.max_relative_error"] = max(errors)
    ctx.log_metrics(metrics)
    ctx.log_artifact(ctx.paths.store / "manifest.json", "store")
    ctx.set_tags({"store.key": ctx.paths.store_key, "store.path": str(ctx.paths.store),
                  "store.compression": manifest["compression"]})
