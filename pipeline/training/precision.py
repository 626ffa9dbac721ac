"""Which dtype training autocasts to: torch only, so that content keys (pipeline/paths.py) can ask without
importing DeepSpeed."""

from __future__ import annotations

import torch

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
