"""The training engine of one worker: DeepSpeed ZeRO when enabled, else plain torch with gradients averaged over the
workers; its optimizers, learning-rate schedule, autocast dtype and checkpointed state. No Ray here."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pipeline.checkpoint import load_trainable_weights
from pipeline.config.schema import DeepSpeedConfig, TrainingConfig
from pipeline.errors import PipelineError
from pipeline.training import dist
from pipeline.training.optim import (
    deepspeed_grad_clip,
    deepspeed_muon,
    lr_factor,
    optimizer_split,
    torch_optimizers,
)
from pipeline.training.resume import (
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    OPTIMIZER_FILE,
    UNIVERSAL_TAG,
    ResumePoint,
    check_same_optimizer_split,
    convert_to_universal,
    needs_universal,
)


def deepspeed_config(ds: DeepSpeedConfig, training: TrainingConfig, micro_batch: int,
                     load_universal: bool = False) -> dict:
    """The DeepSpeed JSON config of a run (deepspeed.extra merged over it verbatim)."""
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": training.grad_accum_steps,
        "gradient_clipping": deepspeed_grad_clip(training),
        "zero_optimization": {"stage": ds.zero_stage},
        "bf16": {"enabled": ds.bf16},
        # AdamW is a torch optimizer handed to DeepSpeed (Engine): DeepSpeed calls that untested.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if ds.offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if ds.offload_params:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if training.optimizer == "muon" and ds.zero_stage == 3:
        # ZeRO-3 refuses Muon with reduce-scatter (each rank must hold whole gradients to orthogonalise a matrix)
        config["zero_optimization"]["reduce_scatter"] = False
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    config.update(ds.extra or {})
    return config


def offloads_optimizer(config: dict) -> bool:
    """Whether the DeepSpeed config moves the optimizer off the accelerator (to host memory or NVMe), as DeepSpeed
    reads it: then its CPU Adam must run the AdamW half."""
    offload = config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device") in ("cpu", "nvme")


class Engine:
    """DeepSpeed engine when enabled, else plain torch (single worker or DDP-free averaging of grads)."""

    def __init__(self, model: torch.nn.Module, training: TrainingConfig, ds: DeepSpeedConfig, micro_batch: int,
                 load_universal: bool = False):
        factor = lr_factor(training.lr_schedule, training.warmup_steps, training.max_steps, training.min_lr_ratio)
        self.uses_deepspeed = ds.enabled
        # Recorded in every checkpoint's state: the split its optimizer state belongs to (resume.py).
        self.optimizer_split = optimizer_split(model, training)
        if self.uses_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
            config = deepspeed_config(ds, training, micro_batch, load_universal)
            if training.optimizer == "muon":  # DeepSpeed's ZeRO-aware Muon, split by our rule (deepspeed_muon)
                client = deepspeed_muon(model, training, offloads_optimizer(config))
            else:  # a torch AdamW handed to DeepSpeed: no op compilation on CPU, the same math on every backend
                (client,) = torch_optimizers(model, training)
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=client, config=config,
                lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor))
            self.module = self.engine.module
        else:  # DeepSpeed places the model itself
            self.module = model.to(dist.device())
            self.optimizers = torch_optimizers(self.module, training)
            self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]
            self.params = [p for p in self.module.parameters() if p.requires_grad]
            self.clip, self.accum = training.grad_clip, training.grad_accum_steps

    def save_state(self, folder: Path) -> None:
        """Optimizer, scheduler (and, with DeepSpeed, weights) into `folder`; every rank calls it."""
        if self.uses_deepspeed:
            self.engine.save_checkpoint(str(folder / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        elif dist.is_rank_zero():
            torch.save({"optimizers": [o.state_dict() for o in self.optimizers],
                        "schedulers": [s.state_dict() for s in self.schedulers]}, folder / OPTIMIZER_FILE)

    def full_weights(self):
        """Context in which the module holds whole tensors: ZeRO-3 partitions them over the ranks, so every rank
        enters it (a collective gather); other stages already hold whole weights."""
        if self.zero_stage() != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def load_state(self, point: ResumePoint, scratch: Path) -> None:
        """Weights (plain engine; DeepSpeed loads its own), optimizer and schedule of `point`. Raises
        PipelineError when its optimizer state belongs to another parameter split than this run's."""
        if point.uses_deepspeed != self.uses_deepspeed:
            raise RuntimeError(f"checkpoint {point.folder} was written with deepspeed.enabled={point.uses_deepspeed}")
        check_same_optimizer_split(point, self.optimizer_split)
        if self.uses_deepspeed:
            if needs_universal(point, dist.world_size(), self.zero_stage()):
                self.engine.load_checkpoint(str(convert_to_universal(point, scratch)), tag=UNIVERSAL_TAG)
            else:
                self.engine.load_checkpoint(str(point.deepspeed_dir), tag=DEEPSPEED_TAG)
            return
        load_trainable_weights(self.module, point.folder)
        state = torch.load(point.folder / OPTIMIZER_FILE, weights_only=True)
        saved = state.get("optimizers", [state.get("optimizer")])  # one AdamW before training.optimizer
        if len(saved) != len(self.optimizers):
            raise PipelineError(f"training.optimizer: checkpoint '{point.folder}' holds {len(saved)} optimizer "
                                f"states, this run's training.optimizer has {len(self.optimizers)}")
        for optimizer, optimizer_state in zip(self.optimizers, saved):
            try:
                optimizer.load_state_dict(optimizer_state)
            except ValueError as error:  # torch's check of the group sizes: a split the checkpoint did not record
                raise PipelineError(f"training.optimizer: checkpoint '{point.folder}' holds optimizer state for "
                                    f"another parameter split ({error})") from None
        for scheduler, scheduler_state in zip(self.schedulers, state.get("schedulers", [state.get("scheduler")])):
            scheduler.load_state_dict(scheduler_state)

    def backward_and_step(self, loss: torch.Tensor, boundary: bool = True) -> None:
        """Backward one micro-batch's mean loss; step the optimizer at the last micro-batch of a step (`boundary`).
        DeepSpeed counts the micro-batches (gradient_accumulation_steps) and scales the loss itself; without it the
        loss is scaled here and the gradients add up until the boundary."""
        if self.uses_deepspeed:
            self.engine.backward(loss)
            self.engine.step()
            return
        (loss / self.accum).backward()
        if not boundary:
            return
        for param in self.params:  # average gradients across workers
            if param.grad is not None:
                dist.all_reduce_sum(param.grad).div_(dist.world_size())
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage()) if self.uses_deepspeed else -1

    def lr(self) -> float:
        """The current learning rate of the last parameter group: AdamW's (with Muon, the non-matrix half's)."""
        groups = self.optimizer.param_groups if self.uses_deepspeed else self.optimizers[-1].param_groups
        return float(groups[-1]["lr"])
