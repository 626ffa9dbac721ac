"""The optimizer and learning-rate schedule of a training run (training.optimizer, training.lr_schedule).

- `adamw`: AdamW over every trainable tensor.
- `muon`: Muon (momentum orthogonalised by Newton-Schulz; Jordan et al. 2024, "Muon: an optimizer for hidden layers
  in neural networks") over the weight matrices, AdamW over the rest; speculators' default recipe splits a drafter
  this way. Under DeepSpeed its own ZeRO-aware `MuonWithAuxAdam` runs (DeepSpeed decides which tensors are matrices:
  every tensor of two or more dimensions but embeddings and heads, so P-EAGLE's [1, 1, A*H] mask_hidden too);
  without DeepSpeed `torch.optim.Muon` runs over the 2-D matrices with both sides > 1. Both scale muon_lr per matrix
  by sqrt(max(1, rows / cols)), Muon's original rule.

The schedule is a multiplier of each group's peak learning rate, by optimizer step: linear warmup over
`warmup_steps`, then cosine or linear down to `min_lr_ratio` at `max_steps`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from pipeline.config.schema import LrSchedule, TrainingConfig
from pipeline.drafters.base import DrafterBase

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
    """A tensor Muon updates without DeepSpeed: a trainable 2-D matrix with both sides > 1, not one of the
    drafter's vocabulary matrices (names containing an entry of its `vocabulary_matrices`; speculators'
    `split_named_params_for_muon` rule)."""
    vocabulary = any(fragment in name for fragment in vocabulary_matrices)
    return param.requires_grad and param.ndim == 2 and min(param.shape) > 1 and not vocabulary


def torch_optimizers(model: torch.nn.Module, training: TrainingConfig) -> list[torch.optim.Optimizer]:
    """The run's optimizers without DeepSpeed: [AdamW], or [Muon over the matrices, AdamW over the rest]."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if training.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=training.lr, weight_decay=training.weight_decay)]
    vocabulary = tuple(getattr(model, "vocabulary_matrices", DrafterBase.vocabulary_matrices))
    on_muon = [is_muon_matrix(name, p, vocabulary) for name, p in named]
    matrices = [p for (_, p), muon in zip(named, on_muon) if muon]
    rest = [p for (_, p), muon in zip(named, on_muon) if not muon]
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(torch.optim.Muon(matrices, lr=training.muon_lr, momentum=training.muon_momentum,
                                           weight_decay=training.muon_weight_decay, adjust_lr_fn="original"))
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=training.lr, weight_decay=training.weight_decay))
    return optimizers


def deepspeed_optimizer(training: TrainingConfig) -> dict | None:
    """The DeepSpeed config's `optimizer` block for Muon (None: the client's AdamW is handed to DeepSpeed)."""
    if training.optimizer != "muon":
        return None
    # muon_lr / lr are the two halves' learning rates; each half's weight decay comes with its parameter group.
    return {"type": "Muon", "params": {"lr": training.lr, "muon_lr": training.muon_lr,
                                       "momentum": training.muon_momentum, "ns_method": "gram"}}


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


def deepspeed_param_groups(model: torch.nn.Module, training: TrainingConfig) -> list[dict]:
    """Parameter groups for DeepSpeed's Muon: matrices (as DeepSpeed tags them) with muon_weight_decay, the rest
    with weight_decay. deepspeed.initialize tags every parameter itself (two or more dimensions and no "embed" or
    "lm_head" in its name) and splits each group into its Muon and Adam halves by that tag, overriding any tag of
    ours; so the groups follow DeepSpeed's rule, not the drafter's `vocabulary_matrices` (under ZeRO, DSpark's
    [V, rank] Markov matrices are updated by Muon, without DeepSpeed by AdamW)."""
    matrices: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        deepspeed_matrix = param.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))
        (matrices if deepspeed_matrix else rest).append(param)
    groups = [{"params": matrices, "weight_decay": training.muon_weight_decay},
              {"params": rest, "weight_decay": training.weight_decay}]
    return [group for group in groups if group["params"]]
