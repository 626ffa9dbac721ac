"""Each worker's micro-batches, streamed from the hidden-state store by Ray Data.

A worker turns its share of the run's data order (`pipeline.training.order`) from its resume step on into a Ray
Data stream: one row per micro-batch naming its samples, read from the store's shards by Ray Data tasks
(`map_batches`, as row slices, a few micro-batches ahead of training) and handed over by `iter_torch_batches`.
The order is preserved, so the stream is exactly the run's data order whatever the number of workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pipeline.data.store import read_samples

SAMPLE_KEYS = ("input_ids", "loss_mask", "aux", "last")


class StoreReader:
    """map_batches function: a batch of micro-batch rows -> the same rows holding their samples, concatenated
    (packed) along the token axis, with each sample's length."""

    def __init__(self, store_dir: str, aux_layer_ids: list[int], last_layer_id: int):
        self.store_dir, self.aux_layer_ids, self.last_layer_id = Path(store_dir), aux_layer_ids, last_layer_id

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {key: [] for key in ("step", "micro", "lengths", *SAMPLE_KEYS)}
        for step, micro, files, starts, ends in zip(rows["step"], rows["micro"], rows["files"], rows["starts"],
                                                    rows["ends"]):
            where = [{"sample_id": "", "file": str(f), "start": int(a), "end": int(b)}
                     for f, a, b in zip(files, starts, ends)]
            samples = read_samples(self.store_dir, where, self.aux_layer_ids, self.last_layer_id)
            out["step"].append(int(step))
            out["micro"].append(int(micro))
            out["lengths"].append(np.array([s["input_ids"].shape[0] for s in samples], dtype=np.int64))
            for key in SAMPLE_KEYS:  # float32 for the hidden states: numpy has no bfloat16
                values = torch.cat([s[key] for s in samples])
                out[key].append((values.float() if values.is_floating_point() else values).numpy())
        return {"step": np.array(out["step"]), "micro": np.array(out["micro"]),
                **{key: _ragged(out[key]) for key in ("lengths", *SAMPLE_KEYS)}}


def _ragged(arrays: list[np.ndarray]) -> np.ndarray:
    """A column of differently shaped arrays (Ray Data stores it as a variable-shaped tensor column)."""
    column = np.empty(len(arrays), dtype=object)
    column[:] = arrays
    return column


def unpack(batch: dict[str, np.ndarray]) -> dict:
    """One micro-batch row -> {step, micro, samples: [dict of tensors]}."""
    lengths = np.asarray(batch["lengths"][0]).tolist()
    parts = {key: torch.from_numpy(np.array(batch[key][0])).split(lengths) for key in SAMPLE_KEYS}  # writable
    samples = [{key: parts[key][i] for key in SAMPLE_KEYS} for i in range(len(lengths))]
    return {"step": int(batch["step"][0]), "micro": int(batch["micro"][0]), "samples": samples}


def with_loss_positions(samples: list[dict], loss_positions: str) -> list[dict]:
    """The samples with the loss mask training.loss_positions asks for: as stored (`response`: 1 on the assistant
    turns' tokens), or 1 on every position (`all`). The validation samples keep theirs, so val.* stays comparable."""
    if loss_positions == "response":
        return samples
    return [{**sample, "loss_mask": torch.ones_like(sample["loss_mask"])} for sample in samples]


def _collate_class():
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Unpack(NumpyBatchCollateFn):
        """iter_torch_batches collate_fn: the samples stay on the CPU, where the drafters' index math runs."""

        def __call__(self, batch):
            return unpack(batch)

    return Unpack


def plan_row(step: int, micro: int, locations: list[dict]) -> dict:
    """A micro-batch as a Ray Data row: where its samples lie in the store."""
    return {"step": step, "micro": micro, "files": [w["file"] for w in locations],
            "starts": [w["start"] for w in locations], "ends": [w["end"] for w in locations]}


# Micro-batches per Ray Data stream. Ray Data's streaming executor (ray 2.60) polls without sleeping while its
# output is backpressured and no read task runs, so one stream for a whole run (more samples than the object-store
# budget) kept 0.92 of a core busy per worker beside training, 0.13 in windows
# (benchmarks/results/feed_overhead.json): on 2 cores quality_cpu's P-EAGLE steps took 1.9 s instead of 1.0.
# A window's executor finishes once its window is read.
WINDOW_MICRO_BATCHES = 64


def stream_micro_batches(plan: list[dict], store_dir: str, aux_layer_ids: list[int], last_layer_id: int,
                         prefetch: int, window: int = WINDOW_MICRO_BATCHES) -> Iterator[dict]:
    """Yield {step, micro, samples} for each row of `plan` (plan_row), in order, `window` rows per Ray Data
    stream."""
    import ray.data

    context = ray.data.DataContext.get_current()  # the process's context: every window's stream reads it
    context.execution_options.preserve_order = True  # the plan's order is the run's data order
    context.enable_progress_bars = False  # the training progress bar is the one to watch
    for start in range(0, len(plan), window):
        yield from _stream_window(plan[start:start + window], store_dir, aux_layer_ids, last_layer_id, prefetch)


def _stream_window(plan: list[dict], store_dir: str, aux_layer_ids: list[int], last_layer_id: int,
                   prefetch: int) -> Iterator[dict]:
    import ray.data

    dataset = ray.data.from_items(plan, override_num_blocks=max(1, min(len(plan), 64)))
    # num_cpus=0: the reader is light I/O and the training workers already hold every CPU of a small cluster;
    # one reader task at a time per worker keeps a 2-core machine from starting a process per block.
    samples = dataset.map_batches(StoreReader(store_dir, aux_layer_ids, last_layer_id),
                                  batch_size=1, batch_format="numpy", num_cpus=0,
                                  compute=ray.data.TaskPoolStrategy(size=1))
    yield from samples.iter_torch_batches(batch_size=1, collate_fn=_collate_class()(), prefetch_batches=prefetch)
