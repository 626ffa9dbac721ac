"""The shard store: atomic self-describing shards, manifest rebuilt from disk, checksums that catch corruption."""

from __future__ import annotations

import pytest
import torch

from pipeline.data.store import iter_samples, load_manifest, scan_shards, verify_store, write_manifest, write_shard
from pipeline.errors import PipelineError

LAYERS = [1, 2, 4]


def sample(sample_id: str, length: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"sample_id": sample_id, "input_ids": torch.randint(0, 100, (length,), generator=generator),
            "loss_mask": torch.tensor([0, 1] * (length // 2)),
            "hidden": {i: torch.randn(length, 8, generator=generator) for i in LAYERS}}


def make_store(folder, groups):
    shards = [write_shard(folder, [sample(f"s{i}", 4 + i, i) for i in group], LAYERS, torch.bfloat16)
              for group in groups]
    return write_manifest(folder, shards, {"layer_ids": LAYERS, "dtype": "bfloat16"})


def test_manifest_has_the_promised_fields_and_samples_round_trip(tmp_path):
    manifest = make_store(tmp_path, [[0, 1], [2]])
    assert manifest["num_samples"] == 3 and manifest["num_tokens"] == 4 + 5 + 6
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert verify_store(tmp_path) == load_manifest(tmp_path)
    samples = {s["sample_id"]: s for s in iter_samples(tmp_path, manifest, [1, 2], 4)}
    original = sample("s1", 5, 1)
    assert torch.equal(samples["s1"]["input_ids"], original["input_ids"])
    expected_aux = torch.cat([original["hidden"][1], original["hidden"][2]], -1).to(torch.bfloat16)
    assert torch.equal(samples["s1"]["aux"], expected_aux)
    assert samples["s1"]["last"].shape == (5, 8)


def test_a_corrupt_shard_is_named(tmp_path):
    manifest = make_store(tmp_path, [[0], [1]])
    victim = tmp_path / manifest["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match=manifest["shards"][1]["file"]):
        verify_store(tmp_path)


def test_manifest_is_rebuilt_from_shards_after_a_crash(tmp_path):
    make_store(tmp_path, [[0], [1]])
    (tmp_path / "manifest.json").unlink()  # killed after the shards, before the manifest
    (tmp_path / ".shard-partial.safetensors.tmp").write_bytes(b"half")  # and a half-written temp file
    shards = scan_shards(tmp_path)
    assert sorted(sid for s in shards for sid in s["sample_ids"]) == ["s0", "s1"]


def test_missing_layers_are_refused(tmp_path):
    manifest = make_store(tmp_path, [[0]])
    with pytest.raises(PipelineError, match="not captured"):
        list(iter_samples(tmp_path, manifest, [3], 4))
