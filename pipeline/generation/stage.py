"""Stages 2 and 3: regenerate responses with the verifier, then capture its hidden states into the store.

Both run as Ray Data pipelines with one verifier per actor (`generation.num_actors`, `generation.use_gpu`): the
driver packs samples into token-budget batches, actors write each finished batch straight to disk (a Parquet part
or a safetensors shard, written then renamed), and the driver streams their one-row summaries into a progress bar.
A killed run keeps every finished batch; the rerun does only what no finished file holds. Scaling out is a config
change, not a code change.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import datasets

from pipeline.context import Context
from pipeline.data.chat import chat_template_hash, tokenize_conversation, tokenizer_fingerprint
from pipeline.data.store import (
    load_manifest,
    projected_store_bytes,
    remove_stale_temporaries,
    scan_shards,
    write_manifest,
)
from pipeline.errors import PipelineError, remote_cause
from pipeline.families import load_verifier_config
from pipeline.fsutil import atomic_folder
from pipeline.generation.batching import pack_by_token_budget
from pipeline.generation.parts import read_parts, remove_stale_parts
from pipeline.generation.regenerate import Limits, keep_conversation
from pipeline.generation.workers import CaptureWorker, RegenerateWorker

log = logging.getLogger(__name__)

GIB = 1024**3
REGENERATION_INFO = "regeneration.json"


# ---------------------------------------------------------------- shared plumbing


def _stream_batches(items: list[dict], worker_cls: type, kwargs: dict, gen_cfg: Any) -> Iterator[dict]:
    """Run `worker_cls` over every item (one token-budget batch each) on an actor pool; yield summaries as they
    finish."""
    import ray

    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    mapped = dataset.map_batches(
        worker_cls,
        fn_constructor_kwargs=kwargs,
        batch_size=1,
        batch_format="pandas",
        compute=ray.data.ActorPoolStrategy(size=gen_cfg.num_actors),
        num_cpus=gen_cfg.cpus_per_actor,
        num_gpus=gen_cfg.tensor_parallel_size if gen_cfg.use_gpu else 0,
    )
    try:
        yield from mapped.iter_rows()
    except Exception as error:  # Ray wraps the actor's exception; finished batches are already safe on disk
        raise PipelineError(f"{worker_cls.__name__}: a verifier actor failed: {remote_cause(error)}; "
                            "finished batches are kept, rerun to continue") from error


def _progress(total: int, description: str):
    from pipeline.logs import progress_bar

    return progress_bar(total, description, unit="sample")


def _vllm_options(gen_cfg: Any, capture: bool = False) -> dict:
    """The vLLM engine's settings. Capture prefills a whole sample and asks for one token (vLLM returns hidden
    states only for a request that runs), so a sample of exactly generation.max_length tokens needs a context one
    longer: with max_model_len = max_length vLLM refused the samples regeneration had truncated to that length."""
    max_model_len = int(gen_cfg.max_length) + (1 if capture else 0)
    return {"max_model_len": max_model_len, "gpu_memory_utilization": float(gen_cfg.gpu_memory_utilization),
            "kv_cache_gb": gen_cfg.kv_cache_gb,
            "tensor_parallel_size": int(gen_cfg.tensor_parallel_size)}


def _load_tokenizer(ctx: Context):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ctx.verifier_path)
    vocab_size = int(load_verifier_config(ctx.verifier_path).vocab_size)
    if len(tokenizer) > vocab_size:
        raise PipelineError(f"verifier.path: its tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                            f"has {vocab_size}: the tokenizer does not belong to this verifier")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _refuse_over_budget(projected_bytes: int, what: str, gen_cfg: Any) -> None:
    log.info("%s: projected store size %.3f GiB (generation.max_store_gb=%s)", what, projected_bytes / GIB,
             gen_cfg.max_store_gb)
    if projected_bytes > gen_cfg.max_store_gb * GIB:
        raise PipelineError(
            f"generation.max_store_gb: the store would take {projected_bytes / GIB:.2f} GiB, over the limit of "
            f"{gen_cfg.max_store_gb} GiB (samples x tokens x layers x hidden x bytes); raise the limit, use "
            f"generation.compression=fp8, or capture fewer samples")


# ---------------------------------------------------------------- regeneration


def _limits(gen_cfg: Any) -> Limits:
    return Limits(max_new_tokens=int(gen_cfg.max_new_tokens), max_length=int(gen_cfg.max_length),
                  overlength=str(gen_cfg.overlength))


def _regeneration_items(rows: list[dict], tokenizer: Any, gen_cfg: Any) -> tuple[list[dict], list[int]]:
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
    config = _verifier_config(ctx)
    layers = len(capture_layer_ids(ctx, int(config.num_hidden_layers)))
    _refuse_over_budget(projected_store_bytes(sum(lengths), layers, int(config.hidden_size),
                                              ctx.cfg.verifier.save_dtype, gen.compression),
                        "regenerate (upper bound)", gen)
    ensure_ray(ctx.cfg.cluster)
    kwargs = dict(backend=gen.backend, verifier_path=ctx.verifier_path, compute_dtype=ctx.cfg.verifier.compute_dtype,
                  threads=gen.torch_threads, limits=vars(_limits(gen)),
                  sampling={"temperature": float(gen.temperature), "top_p": float(gen.top_p), "seed": int(gen.seed)},
                  parts_dir=str(parts_dir), vllm_options=_vllm_options(gen))
    started, tokens = time.time(), 0
    with _progress(len(rows), "regenerate") as bar:
        for summary in _stream_batches(items, RegenerateWorker, kwargs, gen):
            bar.update(int(summary["samples"]))
            tokens += int(summary["response_tokens"])
    elapsed = time.time() - started
    ctx.log_metrics({"regenerate.response_tokens_per_s": tokens / max(elapsed, 1e-9),
                     "regenerate.seconds": elapsed})


def _kept_rows(rows: list[dict], tokenizer: Any, gen_cfg: Any) -> list[dict]:
    """`generation.responses=keep`: the source's own answers, tokenized in the driver (no verifier needed)."""
    results = []
    for row in rows:
        result = keep_conversation(row["messages"], tokenizer, _limits(gen_cfg))
        results.append({"sample_id": row["sample_id"], "messages_json": json.dumps(result["messages"]),
                        "input_ids": result["input_ids"], "loss_mask": result["loss_mask"],
                        "skip_reason": result["skip_reason"], "truncated": result["truncated"]})
    return results


def _report_outcomes(ctx: Context, results: list[dict]) -> list[dict]:
    """Log skips grouped by reason and truncations; return the kept samples."""
    reasons = Counter(r["skip_reason"] for r in results if r["skip_reason"])
    for reason, count in reasons.items():
        log.warning("regenerate: skipped %d samples: %s", count, reason)
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


def _check_each_once(sample_ids: list[str], expected: set[str], what: str) -> None:
    duplicated = [sid for sid, count in Counter(sample_ids).items() if count > 1]
    if duplicated:
        raise PipelineError(f"{what}: samples {duplicated[:3]} were written twice")
    missing = expected - set(sample_ids)
    if missing:
        raise PipelineError(f"{what}: {len(missing)} samples are missing, e.g. {sorted(missing)[:3]}")


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
    if folder.is_dir():
        regenerated = datasets.load_from_disk(str(folder))
        log.info("regenerate: reusing %d samples from %s", len(regenerated), folder)
        ctx.set_tags({"regenerated.reused": True})
        return regenerated
    tokenizer = _load_tokenizer(ctx)
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
        _check_each_once([r["sample_id"] for r in results], {r["sample_id"] for r in rows}, "regenerate")
    kept = _report_outcomes(ctx, results)
    info = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "backend": gen.backend,
            "responses": gen.responses, "temperature": gen.temperature, "skipped": len(results) - len(kept)}
    regenerated = _save_regenerated(folder, kept, info)
    if parts_dir.is_dir():
        shutil.rmtree(parts_dir)  # the saved dataset now holds every part's rows
    return regenerated


# ---------------------------------------------------------------- capture


def _verifier_config(ctx: Context):
    return load_verifier_config(ctx.verifier_path)


def capture_layer_ids(ctx: Context, num_verifier_layers: int) -> list[int]:
    """Every layer any drafter reads by default (or the configured aux layers), plus the last layer, whose
    post-norm state gives the training targets."""
    from pipeline.drafters.build import store_layer_ids

    return store_layer_ids(ctx.cfg.drafter.aux_layer_ids, num_verifier_layers)


def _check_regenerated_tokenizer(ctx: Context, fingerprint: str) -> None:
    info_path = ctx.paths.regenerated / REGENERATION_INFO
    if not info_path.is_file():
        return
    made_with = json.loads(info_path.read_text()).get("tokenizer_fingerprint")
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


def _capture_items(todo: list[dict], gen_cfg: Any) -> list[dict]:
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
                  vllm_options=_vllm_options(gen, capture=True))
    started, forward, write, tokens = time.time(), 0.0, 0.0, 0
    with _progress(len(todo), "capture") as bar:
        for summary in _stream_batches(_capture_items(todo, gen), CaptureWorker, kwargs, gen):
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
    config = _verifier_config(ctx)
    num_layers, hidden_size = int(config.num_hidden_layers), int(config.hidden_size)
    gen = ctx.cfg.generation
    tokenizer = _load_tokenizer(ctx)
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
    known = {s["file"]: s for s in (previous or {}).get("shards", [])}
    done = {sid for shard in scan_shards(store, known) for sid in shard["sample_ids"]}
    todo = [{"sample_id": r["sample_id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
            for r in regenerated if r["sample_id"] not in done]
    total_tokens = sum(len(r["input_ids"]) for r in regenerated)
    projected = projected_store_bytes(total_tokens, len(layer_ids), hidden_size, ctx.cfg.verifier.save_dtype,
                                      gen.compression)
    _refuse_over_budget(projected, "capture", gen)
    store.mkdir(parents=True, exist_ok=True)
    log.info("capture: %d samples already stored, %d to capture into %s", len(done), len(todo), store)
    throughput = _capture_missing(ctx, todo, layer_ids, store) if todo else {}
    shards = scan_shards(store, known)
    _check_each_once([sid for shard in shards for sid in shard["sample_ids"]],
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
