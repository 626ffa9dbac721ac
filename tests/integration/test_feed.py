"""The Ray Data stream of micro-batches returns exactly the planned samples, in the planned order, in windows
or as one stream."""

from __future__ import annotations

import torch

from pipeline.data.store import iter_samples, read_samples, sample_locations, write_manifest, write_shard
from pipeline.training.feed import plan_row, stream_micro_batches

LAYERS = [1, 2, 4]


def sample(sample_id: str, length: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"sample_id": sample_id, "input_ids": torch.randint(0, 50, (length,), generator=generator),
            "loss_mask": torch.randint(0, 2, (length,), generator=generator),
            "hidden": {i: torch.randn(length, 8, generator=generator) for i in LAYERS}}


def test_the_stream_holds_the_planned_samples_in_the_planned_order(tmp_path, ray_local):
    shards = [write_shard(tmp_path, [sample(f"s{i}", 4 + i, i) for i in group], LAYERS, torch.bfloat16, compression)
              for group, compression in (([0, 1], "none"), ([2, 3, 4], "fp8"))]
    manifest = write_manifest(tmp_path, shards, {"layer_ids": LAYERS, "dtype": "bfloat16"})
    locations = sample_locations(tmp_path, manifest)
    whole = {s["sample_id"]: s for s in iter_samples(tmp_path, manifest, [1, 2], 4)}
    by_slices = {s["sample_id"]: s for s in read_samples(tmp_path, locations, [1, 2], 4)}
    plan_ids = [(1, 0, [3, 0]), (1, 1, [4]), (2, 0, [1, 2, 3]), (2, 1, [0])]
    plan = [plan_row(step, micro, [locations[i] for i in ids]) for step, micro, ids in plan_ids]

    streamed = list(stream_micro_batches(plan, str(tmp_path), [1, 2], 4, prefetch=2))
    # windows of 3 rows: two Ray Data streams, one cut between the micro-batches of step 2
    windowed = list(stream_micro_batches(plan, str(tmp_path), [1, 2], 4, prefetch=2, window=3))

    assert [(row["step"], row["micro"]) for row in streamed] == [(s, m) for s, m, _ in plan_ids]
    assert [(row["step"], row["micro"]) for row in windowed] == [(s, m) for s, m, _ in plan_ids]
    for one, other in zip(streamed, windowed):
        for mine, theirs in zip(one["samples"], other["samples"], strict=True):
            assert all(torch.equal(mine[key], theirs[key]) for key in ("input_ids", "loss_mask", "aux", "last"))
    for row, (_, _, ids) in zip(streamed, plan_ids):
        assert len(row["samples"]) == len(ids)
        for got, index in zip(row["samples"], ids):
            expected = whole[locations[index]["sample_id"]]
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(got[key], expected[key]) and torch.equal(by_slices[expected["sample_id"]][key],
                                                                           expected[key])
            for key in ("aux", "last"):  # bf16 and fp8-dequantized rows arrive as float32, value for value
                assert got[key].dtype == torch.float32 and torch.equal(got[key], expected[key].float())
