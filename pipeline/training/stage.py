"""Stage 4: train the drafter with Ray Train's TorchTrainer (+ DeepSpeed ZeRO) on the hidden-state store."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from omegaconf import OmegaConf

from pipeline.checkpoint import SPEC_FILE, STATE_FILE, WEIGHTS_FILE
from pipeline.config.schema import DeepSpeedConfig, DrafterConfig, TrainingConfig
from pipeline.context import Context
from pipeline.data.chat import tokenizer_fingerprint
from pipeline.data.store import iter_trained_tokens, verify_store
from pipeline.drafters.build import default_mask_token_id, make_spec
from pipeline.drafters.vocab import most_frequent_tokens
from pipeline.errors import PipelineError, read_json, remote_cause
from pipeline.families import load_verifier_config
from pipeline.fsutil import copy_folder_atomic
from pipeline.integrity import verify
from pipeline.paths import StagePaths, decoding_options
from pipeline.training.loop import train_loop_per_worker
from pipeline.training.optim import planned_optimizer_split
from pipeline.training.resume import (
    check_optimizer_carries_over,
    check_same_data_order,
    check_same_optimizer_split,
    latest_complete_checkpoint,
    read_resume_point,
)
from pipeline.training.worker_config import ValTauSettings, WorkerConfig
from pipeline.verifier import verifier_stop_token_ids

log = logging.getLogger(__name__)


def _check_store_matches_verifier(ctx: Context, manifest: dict, verifier_config, tokenizer) -> None:
    """A store captured from another verifier or tokenizer would train a drafter on the wrong states or ids."""
    recorded = manifest.get("tokenizer_fingerprint")
    if recorded and recorded != tokenizer_fingerprint(tokenizer):
        raise PipelineError(f"train: the store {ctx.paths.store} was tokenized by a different tokenizer than "
                            f"verifier '{ctx.cfg.verifier.name}' ({ctx.verifier_path}); recapture it")
    if manifest.get("hidden_size") not in (None, int(verifier_config.hidden_size)):
        raise PipelineError(f"train: the store {ctx.paths.store} holds hidden size {manifest['hidden_size']}, "
                            f"verifier '{ctx.cfg.verifier.name}' has {verifier_config.hidden_size}")
    # The drafter reads the last layer's states under this number, so a store without it cannot train one.
    layers = manifest.get("num_verifier_layers")
    if layers is None:
        raise PipelineError(f"store: manifest '{ctx.paths.store / 'manifest.json'}': 'num_verifier_layers' is "
                            "missing; recapture the store with jobs/generate.py")
    if layers != int(verifier_config.num_hidden_layers):
        raise PipelineError(f"train: the store {ctx.paths.store} was captured from {layers} verifier layers, "
                            f"verifier '{ctx.cfg.verifier.name}' has {verifier_config.num_hidden_layers}")


def _spec(ctx: Context, manifest: dict):
    from transformers import AutoTokenizer

    verifier_config = load_verifier_config(ctx.verifier_path)
    tokenizer = AutoTokenizer.from_pretrained(ctx.verifier_path)
    _check_store_matches_verifier(ctx, manifest, verifier_config, tokenizer)
    spec = make_spec(ctx.cfg.drafter, verifier_config, ctx.cfg.verifier.name, ctx.verifier_path,
                     default_mask_token_id(tokenizer))
    missing = [i for i in spec.aux_layer_ids if i not in manifest["layer_ids"]]
    if missing:
        raise PipelineError(f"drafter.aux_layer_ids: layers {missing} are not in the store ({manifest['layer_ids']})")
    size = ctx.cfg.drafter.draft_vocab_size
    if size and size >= spec.vocab_size:  # a small verifier's whole vocabulary already fits: nothing to prune
        log.info("train: drafter.draft_vocab_size=%d covers the verifier's %d tokens: full vocabulary", size,
                 spec.vocab_size)
    elif size:
        keep = list(verifier_stop_token_ids(ctx.verifier_path, tokenizer))  # every end of turn stays draftable
        spec.draft_token_ids = most_frequent_tokens(iter_trained_tokens(ctx.paths.store, manifest), spec.vocab_size,
                                                    int(size), keep)
    return spec


def _worker_env(use_gpu: bool) -> dict:
    keep = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "MLFLOW_DISABLE_TELEMETRY", "OMP_NUM_THREADS",
            "TORCH_COMPILE_DISABLE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if not use_gpu:
        # DeepSpeed's Muon update is a torch.compile'd function: on 2 CPU cores inductor spent about 30 s of the
        # first step compiling it (measured on a two-matrix model), for a Newton-Schulz step of milliseconds eagerly.
        env.setdefault("TORCH_COMPILE_DISABLE", "1")
    return env


def run(ctx: Context, run_id: str | None = None) -> Path:
    """Train (or reuse a finished run of the same config) and return the final checkpoint folder."""
    final = ctx.paths.final_checkpoint
    damaged: PipelineError | None = None
    if final.is_dir():
        try:
            verify(final)
            log.info("train: reusing the finished checkpoint %s", final)
            return _recorded(ctx, final, reused=True)
        except PipelineError as problem:  # a truncated or changed file: never picked again, made again
            damaged = problem
    store = ctx.paths.store
    if not (store / "manifest.json").is_file():
        raise PipelineError(f"train: no hidden-state store (manifest.json) at {store}; "
                            "run jobs/generate.py with this config first")
    manifest = verify_store(store)
    spec = _spec(ctx, manifest)
    cfg = ctx.cfg
    check_samples_to_train(manifest["num_samples"], cfg.training.val_samples, cfg.training.num_workers)
    if damaged is not None:  # only once the store can train it again; kept aside, since a user's files may be in it
        _set_aside(final, damaged)
    training, deepspeed, drafter = (OmegaConf.to_object(group) for group in (cfg.training, cfg.deepspeed, cfg.drafter))
    assert isinstance(training, TrainingConfig) and isinstance(deepspeed, DeepSpeedConfig)  # the schema's groups
    assert isinstance(drafter, DrafterConfig)  # its own schema (validate's _validate_drafter)
    worker = WorkerConfig(
        spec=spec.to_dict(), store_dir=str(store), last_layer_id=manifest["num_verifier_layers"],
        drafter=drafter, training=training, deepspeed=deepspeed,
        tracking_uri=ctx.tracker.uri if ctx.tracker else None, run_id=run_id, val_tau=_val_tau_settings(ctx))
    resume_from, own = _resume_from(ctx)
    if resume_from:  # refuse another drafter's checkpoint, or another data order, before starting workers
        point = read_resume_point(resume_from, spec)
        assert point is not None  # a folder always has one
        check_same_data_order(point, training)
        check_optimizer_carries_over(point, training, training.num_workers,
                                     deepspeed.zero_stage if deepspeed.enabled else -1)
        check_same_optimizer_split(point, planned_optimizer_split(spec, training))
        if not own:
            check_steps_left(point.step, cfg.training.max_steps, resume_from)
        if point.step >= cfg.training.max_steps:  # nothing left to train: the final folder was lost or refused
            log.warning("train: %s already holds step %d of %d; it becomes the final checkpoint (the choice by %s "
                        "among the run's checkpoints is not made again)", resume_from, point.step,
                        cfg.training.max_steps, cfg.training.select_best_by)
            copy_folder_atomic(resume_from, final)
            ctx.log_metrics({"train.resumed_from_step": point.step})  # as a worker logs a resume: the lineage
            return _recorded(ctx, final)
        log.info("train: resuming from %s", resume_from)
        worker = dataclasses.replace(worker, resume_from=str(resume_from))
    result = _fit(ctx, worker)
    if result.error:
        raise PipelineError(f"train: the Ray Train run failed: {remote_cause(result.error)}")
    if result.checkpoint is None:
        raise PipelineError("train: the run finished without reporting a checkpoint")
    check_run_finished(result.metrics, cfg.training.max_steps)
    select_by = str(cfg.training.select_best_by)
    chosen, score = _final_checkpoint(result, select_by if cfg.training.val_samples > 0 else None)
    with chosen.as_directory() as folder:
        copy_folder_atomic(Path(folder), final)
    state = read_json(final / STATE_FILE, "train")
    log.info("train: finished; the final checkpoint is step %s%s: %s", state.get("step"),
             f" (best {select_by} {score:.4f})" if score is not None else "", final)
    if score is not None:
        ctx.log_metrics({"train.best_step": state["step"], f"train.best_{select_by.replace('.', '_')}": score})
    return _recorded(ctx, final)


def check_samples_to_train(num_samples: int, val_samples: int, num_workers: int) -> None:
    """Every worker needs a sample of the store's `num_samples` that training.val_samples does not hold out.
    Raises PipelineError naming the setting that asks for too many."""
    trainable = num_samples - val_samples
    if trainable < 1:
        raise PipelineError(f"training.val_samples: {val_samples} held out of a store of {num_samples} samples "
                            "leaves none to train on")
    if trainable < num_workers:
        raise PipelineError(f"training.num_workers: {num_workers} workers but the store has only {trainable} "
                            f"samples to train on ({num_samples} less training.val_samples={val_samples} held out)")


def _recorded(ctx: Context, final: Path, reused: bool = False) -> Path:
    """Record the final checkpoint on this job's train run, however it was made: tags train.checkpoint, train.key
    and train.reused, and (unless reused: the run that made it holds them) its files as the `checkpoint` artifact.
    Returns `final`."""
    if not reused:
        for name in (SPEC_FILE, WEIGHTS_FILE, STATE_FILE):  # the optimizer state stays in final/ for resume_from
            ctx.log_artifact(final / name, "checkpoint")
    ctx.set_tags({"train.checkpoint": str(final), "train.key": ctx.paths.train_key, "train.reused": reused})
    return final


def _set_aside(final: Path, problem: PipelineError) -> Path:
    """Rename a final checkpoint that fails its integrity check to a sibling `final.damaged-<UTC time>`, so the run
    makes it again without deleting anything (it may hold a user's own files). Returns the new folder."""
    aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    try:
        final.rename(aside)
    except OSError as error:
        raise PipelineError(f"train: the finished checkpoint {final} fails its integrity check ({problem}) and "
                            f"cannot be moved aside to make it again ({error.strerror or error})") from None
    log.warning("train: the finished checkpoint fails its integrity check (%s); moved to %s and made again",
                problem, aside)
    return aside


def _val_tau_settings(ctx: Context) -> ValTauSettings | None:
    """What rank 0 needs to measure val.tau at each checkpoint (training.val_tau_samples > 0), else None."""
    training, evaluation = ctx.cfg.training, ctx.cfg.evaluation
    if training.val_tau_samples <= 0:
        return None
    return ValTauSettings(samples=training.val_tau_samples, max_new_tokens=training.val_tau_max_new_tokens,
                          verifier_path=str(ctx.verifier_path), compute_dtype=ctx.cfg.verifier.compute_dtype,
                          num_speculative_tokens=evaluation.num_speculative_tokens,
                          batch_size=evaluation.batch_size, decoding=decoding_options(ctx.cfg.drafter))


def _final_checkpoint(result, select_by: str | None):
    """(checkpoint, its `select_by` metric): the best validated checkpoint Ray Train kept, else the last one."""
    if select_by is None:
        return result.checkpoint, None
    from pipeline.training.val_tau import ranking

    scored = [(metrics, checkpoint) for checkpoint, metrics in result.best_checkpoints or [] if select_by in metrics]
    if not scored:
        return result.checkpoint, None
    metrics, checkpoint = max(scored, key=lambda pair: ranking(pair[0], select_by))
    return checkpoint, metrics[select_by]


def _run_name(paths: StagePaths) -> str:
    return f"train-{paths.train_key}"


def own_latest_checkpoint(cfg, paths: StagePaths) -> Path | None:
    """The latest complete checkpoint this config's own Ray Train run left under cluster.storage_path (a rerun
    after a crash continues it), or None."""
    storage = Path(cfg.cluster.storage_path).expanduser().resolve()
    return latest_complete_checkpoint(storage / _run_name(paths))


def check_run_finished(last_metrics: dict | None, max_steps: int) -> None:
    """A run whose last report (the metrics of Ray Train's Result) is short of max_steps was stopped, not finished:
    Ray Train's Ctrl-C abort ends the fit without an error, and its latest checkpoint must not become the final
    one. Raises PipelineError."""
    last_step = (last_metrics or {}).get("step")
    if isinstance(last_step, int) and last_step < max_steps:
        raise PipelineError(f"train: the Ray Train run stopped at step {last_step} of training.max_steps={max_steps} "
                            "(interrupted); rerun the same command to resume it")


def check_steps_left(step: int, max_steps: int, resume_from: Path) -> None:
    """A given training.resume_from must leave steps to train: a run no longer than its starting point would be
    that checkpoint under another run's key, its later schedule never run. Raises PipelineError."""
    if step >= max_steps:
        raise PipelineError(f"training.max_steps: {max_steps} leaves nothing to train after step {step}, which "
                            f"training.resume_from '{resume_from}' already holds")


def _resume_from(ctx: Context) -> tuple[Path | None, bool]:
    """(this config's own latest checkpoint (a rerun after a crash continues it), True), else
    (training.resume_from or None, False)."""
    own = own_latest_checkpoint(ctx.cfg, ctx.paths)
    if own is not None:
        return own, True
    given = ctx.cfg.training.resume_from
    return (Path(given).expanduser().resolve() if given else None), False


def _checkpoint_config(training):
    """Keep the last `keep_checkpoints`; with validation, the best by `select_best_by` (Ray Train keeps the latest
    one too, which a resume continues)."""
    from ray.train import CheckpointConfig

    if training.val_samples > 0:
        return CheckpointConfig(num_to_keep=training.keep_checkpoints,
                                checkpoint_score_attribute=str(training.select_best_by),  # a metric name for Ray
                                checkpoint_score_order="max")
    return CheckpointConfig(num_to_keep=training.keep_checkpoints)


def _fit(ctx: Context, worker: WorkerConfig):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from pipeline.cluster import ensure_ray

    ensure_ray(ctx.cfg.cluster)
    cfg = ctx.cfg
    use_gpu = bool(cfg.cluster.use_gpu)
    storage = Path(cfg.cluster.storage_path).expanduser().resolve()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=worker.as_loop_config(),
        scaling_config=ScalingConfig(num_workers=cfg.training.num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=_run_name(ctx.paths), storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=cfg.training.max_failures),
                             checkpoint_config=_checkpoint_config(cfg.training),
                             # Ray Train v2's RunConfig (the default); the stubs show v1's, which has no such field
                             worker_runtime_env={"env_vars": _worker_env(use_gpu)}),  # type: ignore[call-arg]
    )
    with _interrupt_handler_kept():
        return trainer.fit()


@contextlib.contextmanager
def _interrupt_handler_kept() -> Iterator[None]:
    """Put back the process's SIGINT handler after Ray Train's fit: the trainer installs its own and leaves it, so
    Ctrl-C in a later stage only logged "Gracefully aborting the training run", and its third exited 0 from a
    failed job. Ray's SystemExit(0 or 1) out of the fit becomes KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread only
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    except SystemExit as stop:
        # How Ray ends the driver's wait on a stopped fit: its Ctrl-C handler exits 0 (the third Ctrl-C, or an
        # abort that failed), and once the first Ctrl-C aborted the run, ray.get raises SystemExit(1). Either is a
        # stopped job, not a success or a crash with no line (run_guarded tells a SIGTERM from a Ctrl-C); any other
        # exit passes as it is.
        if stop.code in (0, 1, None):
            raise KeyboardInterrupt from stop
        raise
    finally:
        if handler is not None:  # None: installed outside Python, which getsignal cannot hand back
            signal.signal(signal.SIGINT, handler)
