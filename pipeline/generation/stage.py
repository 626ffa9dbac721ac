"""Stages 2 and 3: regenerate responses with the verifier, then capture its hidden states into the store.

Both run as Ray Data pipelines with one verifier per actor; scaling out is `generation.num_actors` (and
`generation.use_gpu` on GPU nodes), not a code change.
"""

from __future__ import annotations

import json
import logging
import time

import datasets

from pipeline.context import Context, save_dataset_atomic
from pipeline.data.chat import chat_template_hash
from pipeline.data.store import load_manifest, scan_shards, write_manifest
from pipeline.errors import PipelineError
from pipeline.generation.hf_backend import HiddenStateCapturer, ResponseGenerator

log = logging.getLogger(__name__)


def _map_with_verifier_actors(rows: list[dict], actor_cls, constructor_kwargs: dict, batch_size: int, gen_cfg):
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    dataset = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // batch_size))
    mapped = dataset.map_batches(
        actor_cls,
        fn_constructor_kwargs=constructor_kwargs,
        batch_size=batch_size,
        batch_format="pandas",
        compute=ray.data.ActorPoolStrategy(size=gen_cfg.num_actors),
        num_cpus=gen_cfg.cpus_per_actor,
        num_gpus=1 if gen_cfg.use_gpu else 0,
    )
    return mapped.take_all()


def run_regenerate(ctx: Context, train_prompts: datasets.Dataset) -> datasets.Dataset:
    """Greedy self-distillation: the verifier rewrites every assistant turn; rows gain input_ids and loss_mask."""
    folder = ctx.paths.regenerated
    if folder.is_dir():
        regenerated = datasets.load_from_disk(str(folder))
        log.info("regenerate: reusing %d samples from %s", len(regenerated), folder)
        ctx.set_tags({"regenerated.reused": True})
        return regenerated
    from pipeline.cluster import ensure_ray

    verifier_path = ctx.verifier_path  # fail on a bad verifier before starting Ray
    ensure_ray(ctx.cfg.cluster)
    gen = ctx.cfg.generation
    rows = [{"sample_id": r["sample_id"], "messages_json": json.dumps(r["messages"])} for r in train_prompts]
    started = time.time()
    results = _map_with_verifier_actors(
        rows, ResponseGenerator,
        dict(verifier_path=verifier_path, compute_dtype=ctx.cfg.verifier.compute_dtype,
             max_new_tokens=gen.max_new_tokens, max_length=gen.max_length, threads=gen.torch_threads),
        gen.batch_size, gen,
    )
    skipped = [r for r in results if r["skip_reason"]]
    kept = [
        {"sample_id": r["sample_id"], "messages": json.loads(r["messages_json"]),
         "input_ids": [int(t) for t in r["input_ids"]], "loss_mask": [int(m) for m in r["loss_mask"]]}
        for r in results if not r["skip_reason"]
    ]
    for row in skipped:
        log.warning("regenerate: skipped %s: %s", row["sample_id"], row["skip_reason"])
    if not kept:
        raise PipelineError("regenerate: every prompt was skipped (see the warnings); raise generation.max_length")
    elapsed = time.time() - started
    response_tokens = sum(sum(r["loss_mask"]) for r in kept)
    ctx.log_metrics({"regenerate.samples": len(kept), "regenerate.skipped": len(skipped),
                     "regenerate.response_tokens": response_tokens,
                     "regenerate.tokens_per_s": response_tokens / max(elapsed, 1e-9)})
    regenerated = datasets.Dataset.from_list(kept)
    save_dataset_atomic(regenerated, folder)
    return regenerated


def capture_layer_ids(ctx: Context, num_verifier_layers: int) -> list[int]:
    """Every layer any drafter reads by default (or the configured aux layers), plus the last layer, whose
    post-norm state gives the training targets."""
    from pipeline.drafters.build import store_layer_ids

    return store_layer_ids(ctx.cfg.drafter.aux_layer_ids, num_verifier_layers)


def run_capture(ctx: Context, regenerated: datasets.Dataset) -> dict:
    """Write the hidden-state store; samples already in a complete shard are never recomputed."""
    from transformers import AutoConfig, AutoTokenizer

    store = ctx.paths.store
    store.mkdir(parents=True, exist_ok=True)
    verifier_config = AutoConfig.from_pretrained(ctx.verifier_path)
    num_layers = int(verifier_config.num_hidden_layers)
    layer_ids = capture_layer_ids(ctx, num_layers)
    previous = load_manifest(store)
    if previous and previous["layer_ids"] != layer_ids:
        raise PipelineError(f"store: '{store}' holds layers {previous['layer_ids']}, this run needs {layer_ids}")
    known = {s["file"]: s for s in (previous or {}).get("shards", [])}
    done = {sid for shard in scan_shards(store, known) for sid in shard["sample_ids"]}
    todo = [
        {"sample_id": r["sample_id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}
        for r in regenerated if r["sample_id"] not in done
    ]
    log.info("capture: %d samples already stored, %d to capture into %s", len(done), len(todo), store)
    started = time.time()
    if todo:
        from pipeline.cluster import ensure_ray

        ensure_ray(ctx.cfg.cluster)
        gen = ctx.cfg.generation
        _map_with_verifier_actors(
            todo, HiddenStateCapturer,
            dict(verifier_path=ctx.verifier_path, compute_dtype=ctx.cfg.verifier.compute_dtype,
                 layer_ids=layer_ids, store_dir=str(store), store_dtype=ctx.cfg.verifier.save_dtype,
                 threads=gen.torch_threads),
            gen.samples_per_shard, gen,
        )
    shards = scan_shards(store, known)
    _check_each_sample_once(shards, {r["sample_id"] for r in regenerated})
    tokenizer = AutoTokenizer.from_pretrained(ctx.verifier_path)
    manifest = write_manifest(store, shards, {
        "layer_ids": layer_ids,
        "dtype": ctx.cfg.verifier.save_dtype,
        "hidden_size": int(verifier_config.hidden_size),
        "num_verifier_layers": num_layers,
        "verifier": {"name": ctx.cfg.verifier.name, "path": ctx.verifier_path,
                     "revision": getattr(verifier_config, "_commit_hash", None)},
        "chat_template_hash": chat_template_hash(tokenizer),
        "regenerated_key": ctx.paths.regenerated_key,
    })
    elapsed = time.time() - started
    ctx.log_metrics({"capture.new_samples": len(todo), "capture.reused_samples": len(done),
                     "capture.num_tokens": manifest["num_tokens"], "capture.bytes": manifest["bytes"],
                     "capture.bytes_per_token": manifest["bytes"] / max(manifest["num_tokens"], 1),
                     "capture.seconds": elapsed})
    ctx.log_artifact(store / "manifest.json", "store")
    ctx.set_tags({"store.key": ctx.paths.store_key, "store.path": str(store)})
    return manifest


def _check_each_sample_once(shards: list[dict], expected: set[str]) -> None:
    seen: dict[str, str] = {}
    for shard in shards:
        for sample_id in shard["sample_ids"]:
            if sample_id in seen:
                raise PipelineError(f"store: sample {sample_id} is in both {seen[sample_id]} and {shard['file']}")
            seen[sample_id] = shard["file"]
    missing = expected - set(seen)
    if missing:
        raise PipelineError(f"store: {len(missing)} samples were not captured, e.g. {sorted(missing)[:3]}")
