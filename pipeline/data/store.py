"""The hidden-state store: self-describing safetensors shards plus a manifest.

Each shard holds several samples concatenated along tokens (``offsets`` marks where each starts) and carries its
own sample ids in the safetensors header, so the manifest can always be rebuilt from the shards on disk. A shard
is written under a temporary name and renamed when complete: a killed run leaves either a whole shard or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text

MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.safetensors"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_name(sample_ids: list[str]) -> str:
    digest = hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()[:16]
    return f"shard-{digest}.safetensors"


def write_shard(store_dir: Path, samples: list[dict[str, Any]], layer_ids: list[int], dtype: torch.dtype) -> dict:
    """samples: [{sample_id, input_ids [T], loss_mask [T], hidden: {layer_id: [T, H]}}] -> the shard's entry."""
    sample_ids = [s["sample_id"] for s in samples]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s["input_ids"].long() for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
        "offsets": offsets,
    }
    for layer_id in layer_ids:
        tensors[f"hidden.{layer_id}"] = torch.cat([s["hidden"][layer_id] for s in samples]).to(dtype).contiguous()
    metadata = {"sample_ids": json.dumps(sample_ids), "layer_ids": json.dumps(layer_ids)}
    name = shard_name(sample_ids)
    final = store_dir / name
    store_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=store_dir)
    os.close(fd)
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, final)
    return {"file": name, "sha256": sha256_file(final), "sample_ids": sample_ids, "num_tokens": sum(lengths)}


def read_shard_entry(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        offsets = handle.get_tensor("offsets")
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "sample_ids": json.loads(metadata["sample_ids"]),
        "num_tokens": int(offsets[-1]),
    }


def scan_shards(store_dir: Path, known: dict[str, dict] | None = None) -> list[dict]:
    """Entries for every complete shard on disk; reuse `known` entries (by file name) instead of re-hashing."""
    known = known or {}
    return [known.get(p.name) or read_shard_entry(p) for p in sorted(store_dir.glob(SHARD_GLOB))]


def load_manifest(store_dir: Path) -> dict | None:
    path = store_dir / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_manifest(store_dir: Path, shards: list[dict], info: dict) -> dict:
    manifest = {
        "format_version": FORMAT_VERSION,
        **info,
        "num_samples": sum(len(s["sample_ids"]) for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "bytes": sum((store_dir / s["file"]).stat().st_size for s in shards),
        "shards": shards,
    }
    atomic_write_text(store_dir / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify_store(store_dir: Path) -> dict:
    """The manifest, after checking every listed shard exists and matches its sha256; raises naming the shard."""
    manifest = load_manifest(store_dir)
    if manifest is None:
        raise PipelineError(f"store: no {MANIFEST} in '{store_dir}'")
    for shard in manifest["shards"]:
        path = store_dir / shard["file"]
        if not path.is_file():
            raise PipelineError(f"store: shard '{path}' listed in the manifest is missing")
        if sha256_file(path) != shard["sha256"]:
            raise PipelineError(f"store: shard '{path}' does not match its sha256 in the manifest (corrupt)")
    return manifest


def iter_trained_tokens(store_dir: Path, manifest: dict) -> Iterator[torch.Tensor]:
    """The loss-carrying (assistant) token ids of each shard, without reading any hidden state."""
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), framework="pt") as handle:
            input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
        yield input_ids[loss_mask.bool()]


def iter_samples(store_dir: Path, manifest: dict, aux_layer_ids: list[int], last_layer_id: int) -> Iterator[dict]:
    """Yield {sample_id, input_ids, loss_mask, aux [T, A*H], last [T, H]} for every sample of the store."""
    missing = [i for i in [*aux_layer_ids, last_layer_id] if i not in manifest["layer_ids"]]
    if missing:
        raise PipelineError(f"store: layers {missing} were not captured (store has {manifest['layer_ids']})")
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), framework="pt") as handle:
            offsets = handle.get_tensor("offsets").tolist()
            input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
            aux = torch.cat([handle.get_tensor(f"hidden.{i}") for i in aux_layer_ids], dim=-1)
            last = handle.get_tensor(f"hidden.{last_layer_id}")
        for index, sample_id in enumerate(shard["sample_ids"]):
            start, end = offsets[index], offsets[index + 1]
            yield {
                "sample_id": sample_id,
                "input_ids": input_ids[start:end],
                "loss_mask": loss_mask[start:end].long(),
                "aux": aux[start:end],
                "last": last[start:end],
            }
