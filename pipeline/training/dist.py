"""The one module that knows rank and world size (from Ray Train's context, or a single process)."""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


def rank() -> int:
    try:
        import ray.train

        return ray.train.get_context().get_world_rank()
    except Exception:  # outside a Ray Train worker
        return 0


def world_size() -> int:
    try:
        import ray.train

        return ray.train.get_context().get_world_size()
    except Exception:
        return 1


def is_rank_zero() -> bool:
    return rank() == 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor
