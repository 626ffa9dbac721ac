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


def device() -> torch.device:
    """This worker's device: its GPU under Ray Train with use_gpu (Ray sets CUDA_VISIBLE_DEVICES), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray.train.torch

        return ray.train.torch.get_device()
    except Exception:  # outside a Ray Train worker
        return torch.device("cuda", torch.cuda.current_device())


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over every rank, in place. NCCL reduces GPU tensors only, so a CPU tensor goes through the GPU."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return tensor
    if torch_dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_gpu = tensor.to(device())
        torch_dist.all_reduce(on_gpu, op=torch_dist.ReduceOp.SUM)
        return tensor.copy_(on_gpu)
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor
