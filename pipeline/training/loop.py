"""The per-worker training loop (Ray Train's train_loop_per_worker): the store's data stream, the steps, the metrics
and the checkpoints it reports. Rank and world size come from `pipeline.training.dist` only; the engine (DeepSpeed
or torch) is pipeline/training/engine.py."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import SPEC_FILE, STATE_FILE, WEIGHTS_FILE, save_checkpoint
from pipeline.config.schema import TrainingConfig
from pipeline.data.store import load_manifest, read_samples, sample_locations
from pipeline.drafters.build import build_drafter
from pipeline.drafters.spec import DrafterSpec
from pipeline.errors import PipelineError
from pipeline.integrity import seal
from pipeline.metrics import expected_tau
from pipeline.tracking import client_for, log_metric_batch
from pipeline.training import dist
from pipeline.training.engine import Engine
from pipeline.training.feed import plan_row, stream_micro_batches, with_loss_positions
from pipeline.training.order import GlobalOrder
from pipeline.training.precision import resolve_autocast
from pipeline.training.resume import (
    checkpoint_step,
    is_complete_checkpoint,
    micro_batch_for,
    needs_universal,
    read_resume_point,
)
from pipeline.training.validation import split_validation, validate, validation_share
from pipeline.training.worker_config import ValTauSettings, WorkerConfig


def step_seed(seed: int, step: int, rank: int) -> int:
    """The drafter's sampling (anchors, depths) at a step depends only on (seed, step, rank): resumes replay it."""
    return (seed * 1_000_003 + step * 1009 + rank) % (2**63)


class StoreData:
    """Where the store's samples lie (no hidden states): the order is planned on these, Ray Data reads them."""

    def __init__(self, store_dir: Path, spec: DrafterSpec, last_layer_id: int, training: TrainingConfig):
        self.store_dir, self.aux_layer_ids, self.last_layer_id = store_dir, list(spec.aux_layer_ids), last_layer_id
        # The driver verified every shard's hash before starting the workers: reading the store again here
        # would cost each worker a full pass over it.
        manifest = load_manifest(store_dir)
        if manifest is None:
            raise PipelineError(f"train: the store at {store_dir} has no manifest; run the generate stage")
        locations = sample_locations(store_dir, manifest)
        self.train, held_out = split_validation(locations, training.val_samples, training.seed)
        self.held_out = self.read(held_out)  # a few samples, validated at every checkpoint: kept in memory

    def read(self, locations: list[dict]) -> list[dict]:
        return read_samples(self.store_dir, locations, self.aux_layer_ids, self.last_layer_id)

    def lengths(self) -> list[int]:
        return [w["end"] - w["start"] for w in self.train]

    def stream(self, order: GlobalOrder, start: int, training: TrainingConfig, rank: int, world: int):
        """This worker's micro-batches from optimizer step start + 1 to the end of the run, in order."""
        accum = training.grad_accum_steps
        plan = [plan_row(step, micro, [self.train[i] for i in order.micro_batch(step - 1, micro, accum, rank, world)])
                for step in range(start + 1, training.max_steps + 1) for micro in range(accum)]
        if not plan:
            return iter(())
        return stream_micro_batches(plan, str(self.store_dir), self.aux_layer_ids, self.last_layer_id,
                                    training.prefetch_micro_batches)


class MetricsSink:
    """Rank 0 logs to the job's MLflow run (no active run needed inside a Ray worker)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None):
        self.client = None
        if tracking_uri and run_id and dist.is_rank_zero():
            self.client, self.run_id = client_for(tracking_uri), run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is not None and metrics:
            log_metric_batch(self.client, self.run_id, metrics, step)

    def tag(self, key: str, value: str) -> None:
        if self.client is not None:
            self.client.set_tag(self.run_id, key, value)

    def checkpoint(self, folder: Path, step: int) -> None:
        """The drafter's spec, weights and train state of a checkpoint as the run's artifacts `checkpoints/step-N`
        (the optimizer state stays in Ray's storage: it is only for resuming)."""
        if self.client is not None:
            for name in (SPEC_FILE, WEIGHTS_FILE, STATE_FILE):
                self.client.log_artifact(self.run_id, str(folder / name), f"checkpoints/step-{step}")


@dataclass
class _Window:
    """What this rank's micro-batches add up to since the last logged step (the logged metrics cover them)."""

    loss: float = 0.0  # sum of the micro-batch losses
    correct: torch.Tensor | None = None  # [K] teacher-forced greedy matches per draft position
    total: torch.Tensor | None = None  # [K]
    tokens: int = 0  # loss-masked tokens
    sequences: int = 0
    micro_batches: int = 0
    start: float = field(default_factory=time.time)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, total: torch.Tensor, batch: list[dict]) -> None:
        self.loss += float(loss.detach().float())
        self.correct = correct.cpu() if self.correct is None else self.correct + correct.cpu()
        self.total = total.cpu() if self.total is None else self.total + total.cpu()
        self.tokens += sum(int(sample["loss_mask"].sum()) for sample in batch)
        self.sequences += len(batch)
        self.micro_batches += 1

    def metrics(self, lr: float) -> dict[str, float]:
        """train.* over every rank's window (a collective: every rank calls it on the same steps)."""
        if self.correct is None or self.total is None:
            raise RuntimeError("train: a step is logged before any micro-batch of it ran")
        k = self.correct.shape[0]
        reduced = dist.all_reduce_sum(torch.cat([
            torch.tensor([self.loss / self.micro_batches], dtype=torch.float64), self.correct.double(),
            self.total.double(), torch.tensor([float(self.tokens), float(self.sequences)], dtype=torch.float64)]))
        correct, total = reduced[1:1 + k], reduced[1 + k:1 + 2 * k]
        accuracy = [(c / t).item() if t > 0 else 0.0 for c, t in zip(correct, total)]
        elapsed = time.time() - self.start
        metrics = {"train.loss": reduced[0].item() / dist.world_size(), "train.lr": lr,
                   "train.tokens_per_s": reduced[-2].item() / max(elapsed, 1e-9),
                   "train.proxy_tau": expected_tau(accuracy),
                   "train.sequences_per_micro_batch": reduced[-1].item() / (self.micro_batches * dist.world_size())}
        metrics.update({f"train.accuracy_pos{i + 1}": a for i, a in enumerate(accuracy)})
        return metrics


def _report_checkpoint(metrics: dict, engine: Engine, state: dict, sink: MetricsSink, val_tau: "ValTau") -> dict:
    """Write the checkpoint, measure val.tau on it when asked, log the step's metrics and report the checkpoint;
    returns the metrics as reported. Every rank reports: each adds its own DeepSpeed files and rank 0 the drafter's
    spec, weights and train state; Ray Train gathers all ranks' files into one checkpoint folder and ranks it by
    `metrics`.

    Steps without a checkpoint report nothing to Ray Train (MetricsSink logs their metrics): Ray Train 2 holds one
    unconsumed report per worker and its controller takes one per poll (every 2 s by default), so a report per
    step would cap training at one step per poll."""
    import ray.train

    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state(Path(tmp))
        with engine.full_weights():
            if dist.is_rank_zero():
                save_checkpoint(Path(tmp), engine.module, state)
        metrics = {**metrics, **val_tau.measure(Path(tmp))}
        seal(Path(tmp), dist.rank(), dist.world_size())  # each rank its own files: Ray Train merges the folders
        sink.log(metrics, state["step"])
        sink.checkpoint(Path(tmp), state["step"])
        ray.train.report({**metrics, "step": state["step"]}, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    return metrics


class ValTau:
    """val.tau at every checkpoint when training.val_tau_samples > 0 (pipeline/training/val_tau.py): rank 0 decodes,
    every rank receives the figures (so each reports the same metrics), rank 0 keeps them for proxy_agreement."""

    def __init__(self, settings: ValTauSettings | None, held_out: list[dict]):
        self.enabled = settings is not None
        self.probe: Any = None  # AcceptanceProbe, on rank 0
        self.points: list[dict[str, float]] = []
        if settings and dist.is_rank_zero():
            from pipeline.training.val_tau import AcceptanceProbe, prompt_of

            prompts = [prompt_of(sample) for sample in held_out[: settings.samples]]
            self.probe = AcceptanceProbe(settings.verifier_path, settings.compute_dtype, prompts,
                                         settings.num_speculative_tokens, settings.max_new_tokens,
                                         settings.batch_size, settings.decoding)

    def measure(self, checkpoint: Path) -> dict[str, float]:
        if not self.enabled:
            return {}
        from pipeline.training.val_tau import METRICS

        values = torch.zeros(len(METRICS), dtype=torch.float64)
        if self.probe is not None:
            measured = self.probe.measure(checkpoint)
            values = torch.tensor([measured[name] for name in METRICS], dtype=torch.float64)
        return dict(zip(METRICS, dist.all_reduce_sum(values).tolist()))

    def remember(self, step: int, metrics: dict) -> None:
        if self.probe is not None and "val.proxy_tau" in metrics:
            self.points.append({"step": step, "val.proxy_tau": metrics["val.proxy_tau"],
                                "val.tau": metrics["val.tau"]})

    def agreement(self) -> dict[str, float]:
        """How well val.proxy_tau ranked this run's checkpoints (since its last resume), for rank 0's sink."""
        from pipeline.training.val_tau import proxy_agreement

        return proxy_agreement(self.points) if self.points else {}


def _checkpoint_folder(config: WorkerConfig):
    """The checkpoint to resume from: the one the driver chose (`resume_from`: the config's own latest complete one
    on a rerun, or training.resume_from), unless Ray Train hands a later complete one (its latest registered, to
    workers it restarted after a failure). A context manager giving a folder, or None to start at step 0."""
    import ray.train

    chosen = Path(config.resume_from) if config.resume_from else None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return contextlib.nullcontext(chosen)
    return _later_complete(checkpoint, chosen)


@contextlib.contextmanager
def _later_complete(checkpoint, chosen: Path | None):
    """Ray's checkpoint, or `chosen` where Ray's is older or incomplete: a rerun restores Ray's snapshot of the
    earlier job, whose latest registered checkpoint lags the newest on disk (a checkpoint is registered only once
    the next one is reported) and may be one a crash truncated, which every worker would fail on for ever."""
    with checkpoint.as_directory() as folder:
        given = Path(folder)
        if chosen is not None and checkpoint_step(given, default=-1) <= checkpoint_step(chosen):
            yield chosen  # the driver checked it already; no rank hashes the folder again
        else:
            yield given if is_complete_checkpoint(given) else chosen


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Ray Train's per-worker function; loop_config is WorkerConfig.as_loop_config()."""
    config: WorkerConfig = loop_config["worker"]
    training, ds = config.training, config.deepspeed
    torch.set_num_threads(training.torch_threads_per_worker)
    torch.manual_seed(training.seed)  # identical initial weights on every rank (DeepSpeed broadcasts rank 0's)
    os.environ.setdefault("DS_ACCELERATOR", dist.device().type)
    spec = DrafterSpec.from_dict(config.spec)
    data = StoreData(Path(config.store_dir), spec, config.last_layer_id, training)
    accum, world = training.grad_accum_steps, dist.world_size()
    model = build_drafter(spec).train()
    with _checkpoint_folder(config) as folder, tempfile.TemporaryDirectory() as scratch:
        # The driver already refused a resume_from of another drafter or data order (check_same_data_order).
        point = read_resume_point(Path(folder) if folder else None, spec)
        global_batch = point.global_batch if point else training.micro_batch_size * accum * world
        micro = micro_batch_for(global_batch, accum, world)
        zero_stage = ds.zero_stage if ds.enabled else -1
        engine = Engine(model, training, ds, micro,
                        load_universal=bool(point and needs_universal(point, world, zero_stage)))
        if point:
            engine.load_state(point, Path(scratch))
    order = GlobalOrder(data.lengths(), global_batch, training.seed, training.max_tokens_per_micro_batch)
    sink = MetricsSink(config.tracking_uri, config.run_id)
    start = point.step if point else 0
    if point:
        sink.log({"train.resumed_from_step": point.step, "train.resumed_from_world_size": point.world_size},
                 point.step)
    _train_steps(config, engine, data.stream(order, start, training, dist.rank(), world), order, start, micro, sink,
                 validation_share(data.held_out, dist.rank(), world) if data.held_out else [],
                 ValTau(config.val_tau, data.held_out))


def _train_steps(config: WorkerConfig, engine: Engine, feed, order: GlobalOrder, start: int, micro: int,
                 sink: MetricsSink, held_out_share: list[tuple[dict, bool]], val_tau: ValTau) -> None:
    training = config.training
    accum, world, rank = training.grad_accum_steps, dist.world_size(), dist.rank()
    generator = torch.Generator()
    device_type = dist.device().type
    autocast = resolve_autocast(training.autocast_dtype, device_type)
    sink.tag("train.autocast", str(autocast).replace("torch.", "") if autocast else "float32")
    progress = _progress(training.max_steps, start)
    window = _Window()
    for step in range(start + 1, training.max_steps + 1):
        generator.manual_seed(step_seed(training.seed, step, rank))
        last = step == training.max_steps
        with_checkpoint = step % training.checkpoint_every == 0 or last
        logs = step % training.log_every == 0 or with_checkpoint
        # Greedy-match counts need the verifier's full-vocabulary argmax: a pruned drafter computes them only on
        # the steps that log them (train.accuracy_pos*, train.proxy_tau are then those steps' micro-batches).
        for micro_index in range(accum):
            fed = next(feed)
            if (fed["step"], fed["micro"]) != (step, micro_index):  # the stream must be the planned order
                raise RuntimeError(f"data stream out of order: got step {fed['step']} micro {fed['micro']}, "
                                   f"expected step {step} micro {micro_index}")
            batch = with_loss_positions(fed["samples"], training.loss_positions)
            with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
                loss, correct, total = engine.module.training_loss(batch, config.drafter, generator,
                                                                       count_matches=logs)
            engine.backward_and_step(loss, boundary=micro_index == accum - 1)
            window.add(loss, correct, total, batch)
        progress.update(1)
        if not logs:
            continue
        # Every rank reaches this on the same steps: the reductions and checkpoint reports stay in lockstep.
        metrics = window.metrics(engine.lr())
        epoch = order.epoch(step - 1)
        metrics.update({"train.epoch": epoch, "train.world_size": world, "train.zero_stage": engine.zero_stage(),
                        "train.micro_batch_size": micro})
        if with_checkpoint and held_out_share:  # every checkpoint carries the score that ranks it
            metrics.update(validate(engine.module, held_out_share, config.drafter,
                                    torch.autocast(device_type, dtype=autocast) if autocast else None))
        state = {"step": step, "epoch": epoch, "micro_batches_seen": step * order.global_batch,
                 "global_batch": order.global_batch, "world_size": world, "zero_stage": engine.zero_stage(),
                 "deepspeed": engine.uses_deepspeed, "token_budget": order.token_budget,
                 "val_samples": training.val_samples, "optimizer_split": engine.optimizer_split}
        if with_checkpoint:
            metrics = _report_checkpoint(metrics, engine, state, sink, val_tau)
            val_tau.remember(step, metrics)
        else:
            sink.log(metrics, step)
        progress.set_postfix(loss=f"{metrics['train.loss']:.3f}", tau=f"{metrics['train.proxy_tau']:.2f}")
        window = _Window()
    progress.close()
    sink.log(val_tau.agreement(), training.max_steps)


def _progress(total: int, start: int):
    from pipeline.logs import progress_bar

    # A Ray worker's output reaches the driver line by line: whole lines, not redraws glued to the next log line.
    return progress_bar(total, "train", initial=start, disable=not dist.is_rank_zero())
