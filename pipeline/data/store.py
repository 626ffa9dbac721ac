"""The hidden-state store: self-describing safetensors shards plus a manifest.

Each shard holds several samples concatenated along tokens (``offsets`` marks where each starts) and carries its
own sample ids in the safetensors header, so the manifest can always be rebuilt from the shards on disk. A shard
is written under a temporary name and renamed when complete: a killed run leaves either a whole shard or none.

Compression ``fp8`` stores each hidden row as float8 (e4m3) with one float32 scale per row (``scale.<layer>``),
about half the bytes of bf16; readers dequantize transparently and the capture reports the measured error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import PipelineError, first_line
from pipeline.fsutil import atomic_write_text, publish, safetensors_is_whole
from pipeline.integrity import sha256_file

MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.safetensors"
SHARD_NAME = re.compile(r"shard-[0-9a-f]{16}\.safetensors")  # shard_name()'s
SHA256 = re.compile(r"[0-9a-f]{64}")
CORRUPT_SHARD = "store: shard '{}' does not match its sha256 in the manifest (corrupt); "
RECAPTURE = "delete it and rerun jobs/generate.py with this config to capture its samples again"
FORMAT_VERSION = 2
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
COMPRESSIONS = ("none", "fp8")
BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2, "float16": 2}


def shard_name(sample_ids: list[str]) -> str:
    digest = hashlib.sha256("\n".join(sample_ids).encode()).hexdigest()[:16]
    return f"shard-{digest}.safetensors"


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (float8 values [T, H], float32 scale per row [T]); a row's largest magnitude maps to FP8_MAX."""
    scale = rows.float().abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    return (rows.float() / scale[:, None]).to(FP8), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """quantize_fp8's inverse: float8 values [T, H] and float32 scale per row [T] -> rows [T, H] in `dtype`."""
    return (values.float() * scale[:, None]).to(dtype)


def _hidden_tensors(layer_id: int, rows: torch.Tensor, dtype: torch.dtype, compression: str) -> dict:
    if compression == "fp8":
        values, scale = quantize_fp8(rows)
        return {f"hidden.{layer_id}": values.contiguous(), f"scale.{layer_id}": scale.contiguous()}
    return {f"hidden.{layer_id}": rows.to(dtype).contiguous()}


def write_shard(store_dir: Path, samples: list[dict[str, Any]], layer_ids: list[int], dtype: torch.dtype,
                compression: str = "none") -> dict:
    """samples: [{sample_id, input_ids [T], loss_mask [T], hidden: {layer_id: [T, H]}}] -> the shard's entry,
    which records the relative error of what was stored against the hidden states as given."""
    sample_ids = [s["sample_id"] for s in samples]
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.cat([s["input_ids"].long() for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
        "offsets": offsets,
    }
    squared_error = squared_norm = 0.0
    for layer_id in layer_ids:
        rows = torch.cat([s["hidden"][layer_id] for s in samples])
        layer_tensors = _hidden_tensors(layer_id, rows, dtype, compression)
        stored = _as_read(layer_tensors[f"hidden.{layer_id}"], layer_tensors.get(f"scale.{layer_id}"))
        squared_error += float((rows.float() - stored).pow(2).sum())
        squared_norm += float(rows.float().pow(2).sum())
        tensors.update(layer_tensors)
    metadata = {"sample_ids": json.dumps(sample_ids), "layer_ids": json.dumps(layer_ids),
                "compression": compression}
    name = shard_name(sample_ids)
    final = store_dir / name
    store_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=store_dir)
    os.close(fd)
    save_file(tensors, tmp, metadata=metadata)
    publish(tmp, final)
    return {"file": name, "sha256": sha256_file(final), "sample_ids": sample_ids, "num_tokens": sum(lengths),
            "relative_error": (squared_error / max(squared_norm, 1e-24)) ** 0.5}


def _as_read(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Hidden rows as readers see them: fp8 rows dequantized to bf16, other dtypes as stored. Raises PipelineError
    for fp8 rows stored without their scale."""
    if values.dtype != FP8:
        return values
    if scale is None:
        raise PipelineError("store: a shard holds fp8 hidden states without their scale; capture it again")
    return dequantize_fp8(values, scale)


def _read_hidden(handle: Any, layer_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of a layer's hidden states (all of them by default), as readers see them."""
    values = handle.get_slice(f"hidden.{layer_id}")[start:end]
    scale = handle.get_slice(f"scale.{layer_id}")[start:end] if values.dtype == FP8 else None
    return _as_read(values, scale)


def remove_stale_temporaries(store_dir: Path) -> int:
    """Delete half-written shards a killed run left behind (they never carry the final name)."""
    stale = list(store_dir.glob(".shard-*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def projected_store_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: str, compression: str) -> int:
    """Bytes a store of `num_tokens` will take: hidden rows (+ fp8 scales) plus ids, mask and offsets."""
    per_value = 1 if compression == "fp8" else BYTES_PER_VALUE[dtype]
    scales = 4 * num_layers if compression == "fp8" else 0
    return num_tokens * (num_layers * (hidden_size * per_value) + scales + 8 + 1)


def check_shard_whole(path: Path) -> None:
    """A shard is written under a temporary name and renamed whole, so one that is shorter or longer than its own
    safetensors header says was damaged after it was written (fsutil.safetensors_is_whole). Raises PipelineError
    naming the file."""
    if not safetensors_is_whole(path):
        raise PipelineError(f"store: shard '{path}' is damaged (its size does not match its header); {RECAPTURE}")


def read_shard_entry(path: Path) -> dict:
    """A shard's manifest entry, read from its own header. Raises PipelineError naming a shard that is damaged or
    that this pipeline did not write (no sample ids, no offsets)."""
    from safetensors import SafetensorError

    check_shard_whole(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            offsets = handle.get_tensor("offsets")
        sample_ids = json.loads(metadata["sample_ids"])
        num_tokens = int(offsets[-1])
    except (SafetensorError, KeyError, TypeError, IndexError, ValueError) as error:  # JSONDecodeError too
        raise PipelineError(f"store: shard '{path}' is not one this pipeline wrote ({type(error).__name__}: "
                            f"{first_line(error)}); {RECAPTURE}") from None
    if not _is_id_list(sample_ids):
        raise PipelineError(f"store: shard '{path}' is not one this pipeline wrote (its sample_ids are not a list of "
                            f"ids); {RECAPTURE}")
    return {"file": path.name, "sha256": sha256_file(path), "sample_ids": sample_ids, "num_tokens": num_tokens}


def scan_shards(store_dir: Path, known: dict[str, dict] | None = None) -> list[dict]:
    """Entries for every complete shard on disk; reuse `known` entries (by file name) instead of re-hashing, once the
    file is still whole (check_shard_whole). Raises PipelineError naming a damaged shard."""
    known = known or {}
    entries = []
    for path in sorted(store_dir.glob(SHARD_GLOB)):
        if path.name in known:
            check_shard_whole(path)
            entries.append(known[path.name])
        else:
            entries.append(read_shard_entry(path))  # checks the shard whole too
    return entries


def entries_still_current(store_dir: Path, manifest: dict | None) -> dict[str, dict]:
    """The manifest's shard entries by file name, less those of shards written after the manifest: a shard
    captured again under its old name (a name is its sample ids' hash) by a run stopped before it wrote the
    manifest holds other bytes than the entry's sha256, and is read afresh."""
    if manifest is None:
        return {}
    written = (store_dir / MANIFEST).stat().st_mtime_ns
    return {entry["file"]: entry for entry in manifest.get("shards", [])
            if not (store_dir / entry["file"]).is_file() or (store_dir / entry["file"]).stat().st_mtime_ns <= written}


def load_manifest(store_dir: Path) -> dict | None:
    """The store's manifest (None when there is none yet); a manifest that is not what write_manifest writes is
    refused in one line naming the file and the field, before any shard it lists is opened."""
    path = store_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise PipelineError(f"store: manifest '{path}' is not JSON ({reason})") from None
    _check_manifest(manifest, path)
    return manifest


def _check_manifest(manifest: Any, path: Path) -> None:
    def require(condition: bool, problem: str) -> None:
        if not condition:
            raise PipelineError(f"store: manifest '{path}': {problem}")

    require(isinstance(manifest, dict), "must be a JSON object")
    require(isinstance(manifest.get("layer_ids"), list) and all(isinstance(i, int) for i in manifest["layer_ids"]),
            "'layer_ids' must be a list of layer numbers")
    require(isinstance(manifest.get("shards"), list), "'shards' must be a list")
    for index, shard in enumerate(manifest["shards"]):
        field = f"shards[{index}]"
        require(isinstance(shard, dict), f"'{field}' must be an object")
        # Only a shard's own name: a path ('../x', '/etc/x') would read outside the store.
        require(isinstance(shard.get("file"), str) and SHARD_NAME.fullmatch(shard["file"]) is not None,
                f"'{field}.file' must be a shard file name in the store (shard-<hex>.safetensors), got "
                f"{shard.get('file')!r}")
        require(isinstance(shard.get("sha256"), str) and SHA256.fullmatch(shard["sha256"]) is not None,
                f"'{field}.sha256' must be a sha256 hex digest")
        require(_is_id_list(shard.get("sample_ids")), f"'{field}.sample_ids' must be a list of sample ids")
        require(_is_count(shard.get("num_tokens")), f"'{field}.num_tokens' must be a token count")
    for name in ("num_samples", "num_tokens", "bytes"):  # write_manifest's totals, which readers print and log
        require(_is_count(manifest.get(name)), f"'{name}' must be a count, got {manifest.get(name)!r}")
    listed = sum(len(shard["sample_ids"]) for shard in manifest["shards"])
    require(manifest["num_samples"] == listed, f"'num_samples' is {manifest['num_samples']} but the shards list "
                                               f"{listed} samples")
    listed = sum(shard["num_tokens"] for shard in manifest["shards"])
    require(manifest["num_tokens"] == listed, f"'num_tokens' is {manifest['num_tokens']} but the shards hold "
                                              f"{listed} tokens")
    for name, (is_valid, kind) in OPTIONAL_MANIFEST_FIELDS.items():  # stores written by older code may lack them
        require(name not in manifest or is_valid(manifest[name]),
                f"'{name}' must be {kind}, got {manifest.get(name)!r}")


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, str) for i in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_positive(value: Any) -> bool:
    return _is_count(value) and value > 0


# Fields the capture stage writes that hand-made or older stores may lack; where present, readers compare them with
# their own values, so a wrong type would surface as a TypeError far from the file.
OPTIONAL_MANIFEST_FIELDS = {
    "format_version": (_is_positive, "a positive whole number"),
    "hidden_size": (_is_positive, "a positive whole number"),
    "num_verifier_layers": (_is_positive, "a positive whole number"),
    "projected_bytes": (_is_count, "a count"),
    "tokenizer_fingerprint": (lambda value: isinstance(value, str), "a string"),
    "compression": (lambda value: isinstance(value, str), "a string"),
    "dtype": (lambda value: isinstance(value, str), "a string"),
}


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
    """The manifest, after checking every listed shard exists and matches its sha256 and that no sample is listed
    twice; raises naming the shard."""
    manifest = load_manifest(store_dir)
    if manifest is None:
        raise PipelineError(f"store: no {MANIFEST} in '{store_dir}'")
    if manifest.get("format_version", 1) > FORMAT_VERSION:
        raise PipelineError(f"store: '{store_dir}' has format {manifest['format_version']}, newer than this code")
    seen: dict[str, str] = {}
    for shard in manifest["shards"]:
        for sample_id in shard["sample_ids"]:
            if sample_id in seen:
                raise PipelineError(f"store: sample {sample_id} is in both {seen[sample_id]} and {shard['file']}")
            seen[sample_id] = shard["file"]
    for shard in manifest["shards"]:
        path = store_dir / shard["file"]
        if not path.is_file():
            raise PipelineError(f"store: shard '{path}' listed in the manifest is missing; rerun jobs/generate.py "
                                "with this config to capture its samples again")
        if sha256_file(path) != shard["sha256"]:
            raise PipelineError(CORRUPT_SHARD.format(path) + RECAPTURE)
    return manifest


def iter_trained_tokens(store_dir: Path, manifest: dict) -> Iterator[torch.Tensor]:
    """The loss-carrying (assistant) token ids of each shard, without reading any hidden state."""
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), framework="pt") as handle:
            input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
        yield input_ids[loss_mask.bool()]


def sample_locations(store_dir: Path, manifest: dict) -> list[dict]:
    """Every sample of the store in store order: {sample_id, file, start, end}. Reads only each shard's offsets,
    so a reader can fetch any sample later without holding the store."""
    locations = []
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), framework="pt") as handle:
            offsets = handle.get_tensor("offsets").tolist()
        locations += [{"sample_id": sample_id, "file": shard["file"], "start": offsets[i], "end": offsets[i + 1]}
                      for i, sample_id in enumerate(shard["sample_ids"])]
    return locations


def _check_layers(manifest: dict, layer_ids: list[int]) -> None:
    missing = [i for i in layer_ids if i not in manifest["layer_ids"]]
    if missing:
        raise PipelineError(f"store: layers {missing} were not captured (store has {manifest['layer_ids']})")


def read_samples(store_dir: Path, locations: list[dict], aux_layer_ids: list[int], last_layer_id: int) -> list[dict]:
    """The samples at `locations` (from sample_locations), each read as row slices of its shard: the same dicts as
    iter_samples yields, without loading whole shards."""
    samples = []
    for where in locations:
        start, end = where["start"], where["end"]
        with safe_open(str(store_dir / where["file"]), framework="pt") as handle:
            samples.append({
                "sample_id": where["sample_id"],
                "input_ids": handle.get_slice("input_ids")[start:end],
                "loss_mask": handle.get_slice("loss_mask")[start:end].long(),
                "aux": torch.cat([_read_hidden(handle, i, start, end) for i in aux_layer_ids], dim=-1),
                "last": _read_hidden(handle, last_layer_id, start, end),
            })
    return samples


def iter_samples(store_dir: Path, manifest: dict, aux_layer_ids: list[int], last_layer_id: int) -> Iterator[dict]:
    """Yield {sample_id, input_ids, loss_mask, aux [T, A*H], last [T, H]} for every sample of the store."""
    _check_layers(manifest, [*aux_layer_ids, last_layer_id])
    for shard in manifest["shards"]:
        with safe_open(str(store_dir / shard["file"]), framework="pt") as handle:
            offsets = handle.get_tensor("offsets").tolist()
            input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
            aux = torch.cat([_read_hidden(handle, i) for i in aux_layer_ids], dim=-1)
            last = _read_hidden(handle, last_layer_id)
        for index, sample_id in enumerate(shard["sample_ids"]):
            start, end = offsets[index], offsets[index + 1]
            yield {
                "sample_id": sample_id,
                "input_ids": input_ids[start:end],
                "loss_mask": loss_mask[start:end].long(),
                "aux": aux[start:end],
                "last": last[start:end],
            }
