"""The optimizer and learning-rate schedule of a training run (training.optimizer, training.lr_schedule).

- `adamw`: AdamW over every trainable tensor.
- `muon`: Muon (momentum orthogonalised by Newton-Schulz; Jordan et al. 2024, "Muon: an optimizer for hidden layers
  in neural networks") over the weight matrices, AdamW over the rest; speculators' default recipe splits a drafter
  this way. Both engines split the drafter by one rule (`is_muon_matrix`: the 2-D matrices with both sides > 1
  that are not vocabulary matrices, speculators' rule): under DeepSpeed its ZeRO-aware `MuonWithAuxAdam` runs as
  a client optimizer given that split, without it `torch.optim.Muon` and `torch.optim.AdamW`. Both scale muon_lr
  per matrix by sqrt(max(1, rows / cols)), Muon's original rule.

The schedule is a multiplier of each group's peak learning rate, by optimizer step: linear warmup over
`warmup_steps`, then cosine or linear down to `min_lr_ratio` at `max_steps`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from pipeline.config.schema import LrSchedule, TrainingConfig
from pipeline.drafters.base import DrafterBase
from pipeline.drafters.spec import DrafterSpec

LR_SCHEDULES = tuple(schedule.value for schedule in LrSchedule)


def lr_factor(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """step (0-based, optimizer steps) -> multiplier of the peak learning rate."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"training.lr_schedule: '{schedule}' is not one of {LR_SCHEDULES}")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        fall = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * fall

    return factor


def is_muon_matrix(name: str, param: torch.Tensor, vocabulary_matrices: tuple[str, ...]) -> bool:
    """A tensor Muon updates (with or without DeepSpeed): a trainable 2-D matrix with both sides > 1, not one of the
    drafter's vocabulary matrices (names containing an entry of its `vocabulary_matrices`; speculators'
    `split_named_params_for_muon` rule)."""
    vocabulary = any(fragment in name for fragment in vocabulary_matrices)
    return param.requires_grad and param.ndim == 2 and min(param.shape) > 1 and not vocabulary


def muon_matrix_names(model: torch.nn.Module) -> list[str]:
    """The names of the trainable tensors Muon updates, by `is_muon_matrix`, in parameter order."""
    vocabulary = tuple(getattr(model, "vocabulary_matrices", DrafterBase.vocabulary_matrices))
    return [name for name, param in model.named_parameters() if is_muon_matrix(name, param, vocabulary)]


def optimizer_split(model: torch.nn.Module, training: TrainingConfig) -> dict[str, list[str]]:
    """{"muon": names, "adamw": names}: the trainable tensors each half of the run's optimizer updates, in parameter
    order (under training.optimizer=adamw, AdamW takes them all). A checkpoint records it: its optimizer state fits
    only this split (pipeline/training/resume.py)."""
    on_muon = set(muon_matrix_names(model)) if training.optimizer == "muon" else set()
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    return {"muon": [name for name in trainable if name in on_muon],
            "adamw": [name for name in trainable if name not in on_muon]}


def planned_optimizer_split(spec: DrafterSpec, training: TrainingConfig) -> dict[str, list[str]]:
    """`optimizer_split` of the drafter `spec` builds, without its weights (on the meta device: names and shapes
    only), so that the driver can check a resume before any worker starts."""
    from pipeline.drafters import drafter_class

    with torch.device("meta"):
        return optimizer_split(drafter_class(spec.algorithm)(spec), training)


def split_for_muon(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the trainable tensors Muon updates, the trainable rest), in parameter order."""
    on_muon = set(muon_matrix_names(model))
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    return [p for name, p in trainable if name in on_muon], [p for name, p in trainable if name not in on_muon]


def torch_optimizers(model: torch.nn.Module, training: TrainingConfig) -> list[torch.optim.Optimizer]:
    """The run's optimizers without DeepSpeed: [AdamW], or [Muon over the matrices, AdamW over the rest]."""
    if training.optimizer == "adamw":
        trainable = [p for p in model.parameters() if p.requires_grad]
        return [torch.optim.AdamW(trainable, lr=training.lr, weight_decay=training.weight_decay)]
    matrices, rest = split_for_muon(model)
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(torch.optim.Muon(matrices, lr=training.muon_lr, momentum=training.muon_momentum,
                                           weight_decay=training.muon_weight_decay, adjust_lr_fn="original"))
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=training.lr, weight_decay=training.weight_decay))
    return optimizers


def deepspeed_grad_clip(training: TrainingConfig) -> float:
    """DeepSpeed's `gradient_clipping` for the run (0 = none).

    With Muon it is 0: DeepSpeed 0.19's ZeRO-1/2 orthogonalises the Muon half while it reduces the gradients, then
    clips the global norm of what it holds, which for a matrix is the update (Frobenius norm ~ sqrt(min(rows, cols)),
    ~150 over a one-layer drafter's matrices), not the gradient. A clip of 1.0 then shrank every step ~150x and the
    drafter did not learn (SmolLM2 EAGLE-3 on the default store, one worker, 75 steps: loss 9.3 and first-token
    accuracy 0.01, against 4.1 and 0.30 without the clip). Muon's update size is fixed by muon_lr whatever the
    gradient's norm, and Adam's by lr up to its moment estimates, so the clip is dropped rather than applied to the
    wrong tensor."""
    return 0.0 if training.optimizer == "muon" else float(training.grad_clip)


def muon_param_groups(model: torch.nn.Module, training: TrainingConfig) -> list[dict]:
    """DeepSpeed `MuonWithAuxAdam`'s parameter groups: [the Muon half, the AdamW half], split by `is_muon_matrix`,
    each group flagged `use_muon` and each tensor tagged `use_muon` (ZeRO reads the tag off the tensor when it
    orthogonalises the Muon half). Passing the optimizer ourselves keeps DeepSpeed's own tagging out: it puts every
    tensor of two or more dimensions not named "embed" or "lm_head" on Muon, which would move DSpark's [V, rank]
    Markov matrices (at sqrt(V / rank) ~ 28 times muon_lr) and confidence projection, P-EAGLE's [1, 1, A*H]
    mask_hidden and DFlash2's convolution kernels and codebooks off the AdamW half that speculators and our plain
    engine give them."""
    matrices, rest = split_for_muon(model)
    for params, use_muon in ((matrices, True), (rest, False)):
        for param in params:
            param.use_muon = use_muon  # type: ignore[attr-defined]
    groups = [{"params": matrices, "use_muon": True, "name": "muon-params", "lr": training.muon_lr,
               "momentum": training.muon_momentum, "weight_decay": training.muon_weight_decay, "ns_method": "gram"},
              {"params": rest, "use_muon": False, "name": "adam-params", "lr": training.lr,
               "weight_decay": training.weight_decay}]
    return [group for group in groups if group["params"]]


def deepspeed_muon(model: torch.nn.Module, training: TrainingConfig, offload_optimizer: bool) -> torch.optim.Optimizer:
    """DeepSpeed's ZeRO-aware `MuonWithAuxAdam` over `muon_param_groups`, its AdamW half run by the Adam DeepSpeed
    itself would pick: DeepSpeedCPUAdam when ZeRO offloads the optimizer (`offload_optimizer`, read off the final
    DeepSpeed config), else FusedAdam (Muon's inline Adam if FusedAdam cannot be imported or built). AdamW's betas
    and eps are MuonWithAuxAdam's defaults, (0.9, 0.95) and 1e-10."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    adam: type | None
    if offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        adam, adam_kwargs = DeepSpeedCPUAdam, {"adamw_mode": True, "fp32_optimizer_states": True}
    else:
        try:
            from deepspeed.ops.adam import FusedAdam

            adam, adam_kwargs = FusedAdam, {"adam_w_mode": True}
        except ImportError:
            adam, adam_kwargs = None, {}
    return MuonWithAuxAdam(muon_param_groups(model, training), adam_optimizer=adam, adam_optimizer_kwargs=adam_kwargs,
                           adam_w_mode=True, fallback_to_inline=adam is not None and adam.__name__ == "FusedAdam")
