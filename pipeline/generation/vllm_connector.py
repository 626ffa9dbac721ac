"""vLLM's ExampleHiddenStatesConnector, made to run on the CPU backend.

The upstream connector copies the captured states off the GPU on a CUDA stream into pinned memory; the CPU build
has neither, and fails with "pin_memory=True requires a CUDA ... backend". On CPU the states already live in host
memory, so this subclass slices them out and writes the file synchronously; the scheduling, file naming and lock
protocol are the upstream connector's. vLLM loads it through `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import os

from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event upstream polls: a synchronous write is finished when it returns."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        import torch

        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        if self._kv_cache is None:
            raise RuntimeError("vllm capture: the hidden-states connector was asked to write before its cache exists")
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock readers wait on
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]  # duck-typed: upstream polls it
