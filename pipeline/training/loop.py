"""The per-worker training loop. Rank and world size come from `pipeline.training.dist` only."""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from pipeline.data.store import iter_samples, verify_store
from pipeline.drafters.build import build_drafter
from pipeline.drafters.common import DrafterSpec
from pipeline.evaluation.metrics import expected_tau
from pipeline.training import dist
from pipeline.training.checkpoint import save_checkpoint
from pipeline.tracking import log_metric_batch

AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device_type: str) -> bool:
    """Whether this device computes bf16 in hardware (emulated bf16 matmuls are far slower than fp32)."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # AVX512-BF16 or AMX
    except (AttributeError, RuntimeError):
        return False


def resolve_autocast(name: str | None, device_type: str) -> torch.dtype | None:
    """training.autocast_dtype -> the dtype to autocast to (None = fp32); `auto` asks the hardware."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device_type) else None
    return AUTOCAST.get(name or "")


def deepspeed_config(ds: dict, training: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": training["micro_batch_size"],
        "gradient_accumulation_steps": training["grad_accum_steps"],
        "gradient_clipping": training["grad_clip"],
        "zero_optimization": {"stage": ds["zero_stage"]},
        "bf16": {"enabled": bool(ds["bf16"])},
        # We hand DeepSpeed a torch optimizer: no op compilation on CPU and the same math on every backend.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if ds.get("offload_optimizer"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config.update(ds.get("extra") or {})
    return config


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def batches(samples: list[dict], size: int, seed: int) -> Iterator[tuple[int, list[dict]]]:
    """Endless (epoch, micro-batch) stream, reshuffled each epoch with a seeded generator."""
    epoch = 0
    while True:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(0, len(order), size):
            yield epoch, [samples[i] for i in order[start:start + size]]
        epoch += 1


class Engine:
    """DeepSpeed engine when enabled, else plain torch (single worker or DDP-free averaging of grads)."""

    def __init__(self, model: torch.nn.Module, training: dict, ds: dict):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=training["lr"], weight_decay=training["weight_decay"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(training["warmup_steps"], training["max_steps"]))
        self.uses_deepspeed = bool(ds["enabled"])
        if self.uses_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(ds, training))
            self.module = self.engine.module
        else:
            self.module, self.optimizer, self.scheduler = model, optimizer, scheduler
            self.params, self.clip = params, training["grad_clip"]

    def backward_and_step(self, loss: torch.Tensor) -> None:
        if self.uses_deepspeed:
            self.engine.backward(loss)
            self.engine.step()
            return
        loss.backward()
        for param in self.params:  # average gradients across workers
            if param.grad is not None:
                dist.all_reduce_sum(param.grad).div_(dist.world_size())
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage()) if self.uses_deepspeed else -1

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def _my_samples(store_dir: Path, spec: DrafterSpec, last_layer_id: int) -> list[dict]:
    manifest = verify_store(store_dir)
    everything = list(iter_samples(store_dir, manifest, spec.aux_layer_ids, last_layer_id))
    mine = everything[dist.rank()::dist.world_size()]
    if not mine:
        raise RuntimeError(f"worker {dist.rank()} got no samples: the store has {len(everything)} for "
                           f"{dist.world_size()} workers")
    return mine


class MetricsSink:
    """Rank 0 logs to the job's MLflow run (no active run needed inside a Ray worker)."""

    def __init__(self, tracking_uri: str | None, run_id: str | None):
        self.client = None
        if tracking_uri and run_id and dist.is_rank_zero():
            import mlflow

            self.client, self.run_id = mlflow.MlflowClient(tracking_uri), run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.client is not None:
            log_metric_batch(self.client, self.run_id, metrics, step)

    def tag(self, key: str, value: str) -> None:
        if self.client is not None:
            self.client.set_tag(self.run_id, key, value)


def _step_metrics(loss_sum: torch.Tensor, correct: torch.Tensor, total: torch.Tensor, tokens: torch.Tensor,
                  elapsed: float, lr: float) -> dict[str, float]:
    reduced = dist.all_reduce_sum(torch.cat([loss_sum.reshape(1), correct.double(), total.double(),
                                             tokens.double().reshape(1)]))
    k = correct.shape[0]
    loss = reduced[0].item() / dist.world_size()
    correct, total, tokens = reduced[1:1 + k], reduced[1 + k:1 + 2 * k], reduced[-1].item()
    accuracy = [(c / t).item() if t > 0 else 0.0 for c, t in zip(correct, total)]
    metrics = {"train.loss": loss, "train.lr": lr, "train.tokens_per_s": tokens / max(elapsed, 1e-9),
               "train.proxy_tau": expected_tau(accuracy)}
    metrics.update({f"train.acc_pos{i + 1}": a for i, a in enumerate(accuracy)})
    return metrics


def _report(metrics: dict, model: torch.nn.Module, state: dict, with_checkpoint: bool) -> None:
    import ray.train

    if not with_checkpoint:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if dist.is_rank_zero():
            save_checkpoint(Path(tmp), model, state)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    training, ds = config["training"], config["deepspeed"]
    torch.set_num_threads(training["torch_threads_per_worker"])
    torch.manual_seed(training["seed"] + dist.rank())
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    spec = DrafterSpec.from_dict(config["spec"])
    samples = _my_samples(Path(config["store_dir"]), spec, config["last_layer_id"])
    model = build_drafter(spec).train()
    engine = Engine(model, training, ds)
    sink = MetricsSink(config.get("tracking_uri"), config.get("run_id"))
    generator = torch.Generator().manual_seed(training["seed"] * 1000 + dist.rank())
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = resolve_autocast(training.get("autocast_dtype"), device_type)
    sink.tag("train.autocast", str(autocast).replace("torch.", "") if autocast else "float32")
    stream = batches(samples, training["micro_batch_size"], training["seed"] + dist.rank())
    progress = _progress(training["max_steps"])
    window_start = time.time()
    loss_sum, correct_sum, total_sum, tokens, window_steps = torch.zeros(()), 0, 0, torch.zeros(()), 0
    for step in range(1, training["max_steps"] + 1):
        for _ in range(training["grad_accum_steps"]):
            epoch, batch = next(stream)
            with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
                loss, correct, total = engine.module.training_loss(batch, config["drafter"], generator)
            engine.backward_and_step(loss / (1 if engine.uses_deepspeed else training["grad_accum_steps"]))
            loss_sum += loss.detach().float()
            correct_sum, total_sum = correct_sum + correct, total_sum + total
            tokens += sum(int(s["loss_mask"].sum()) for s in batch)
            window_steps += 1
        progress.update(1)
        last = step == training["max_steps"]
        with_checkpoint = step % training["checkpoint_every"] == 0 or last
        if not (step % training["log_every"] == 0 or with_checkpoint):
            continue
        # Every rank reaches this on the same steps: the reductions and ray.train.report stay in lockstep.
        metrics = _step_metrics(loss_sum / window_steps, correct_sum, total_sum, tokens,
                                time.time() - window_start, engine.lr())
        metrics.update({"train.epoch": epoch, "train.world_size": dist.world_size(),
                        "train.zero_stage": engine.zero_stage()})
        sink.log(metrics, step)
        progress.set_postfix(loss=f"{metrics['train.loss']:.3f}", tau=f"{metrics['train.proxy_tau']:.2f}")
        _report({**metrics, "step": step}, engine.module, {"step": step, "epoch": epoch}, with_checkpoint)
        loss_sum, correct_sum, total_sum, tokens, window_steps = torch.zeros(()), 0, 0, torch.zeros(()), 0
        window_start = time.time()
    progress.close()


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", disable=not dist.is_rank_zero(), mininterval=5)
