"""Integrity records: the size and sha256 of every file a writer put in a folder, checked before the folder is used.

A training checkpoint is written by every rank into its own folder and Ray Train merges them, so each rank seals
what it wrote (`integrity-rank<r>.json`, with the world size). A folder is intact when it holds a record for every
rank of that world size, every listed file is a regular file (not a link) of the listed size and digest, and no
file is there that no record lists. DeepSpeed's optimizer files are pickles that run code when loaded: one changed
on shared storage, or put beside them, is refused before anything reads it; a file truncated by a crash is found
by its size.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.errors import PipelineError

RECORD_PREFIX = "integrity-rank"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_record(relative: str) -> bool:
    return "/" not in relative and relative.startswith(RECORD_PREFIX) and relative.endswith(".json")


def _files(folder: Path) -> dict[str, Path]:
    """Every entry under `folder` that is not a directory, by its path relative to `folder` (links included, not
    followed, so that a check can refuse them)."""
    found = {}
    for root, directories, names in os.walk(folder, followlinks=False):
        for name in names + [d for d in directories if (Path(root) / d).is_symlink()]:
            path = Path(root) / name
            found[path.relative_to(folder).as_posix()] = path
    return found


def seal(folder: Path, rank: int = 0, world_size: int = 1) -> Path:
    """Record every file now under `folder` as rank `rank`'s of `world_size` writers (a folder one process writes,
    such as an export: the defaults); returns the record."""
    files = {}
    for relative, path in sorted(_files(folder).items()):
        if _is_record(relative):
            continue
        if path.is_symlink():
            raise PipelineError(f"integrity: '{path}' is a link; a sealed folder holds only its own files")
        files[relative] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    record = folder / f"{RECORD_PREFIX}{rank}.json"
    record.write_text(json.dumps({"rank": rank, "world_size": world_size, "files": files}, indent=1))
    return record


def _is_entry(entry: object) -> bool:
    """One file's line of a record: {"bytes": int, "sha256": str}."""
    return (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str))


def record_paths(folder: Path) -> list[Path]:
    """The integrity records in `folder`, one per rank that wrote it."""
    return sorted(Path(folder).glob(f"{RECORD_PREFIX}*.json"))


def sealed_at(folder: Path) -> float:
    """When `folder` was last sealed (the newest of its integrity records' mtimes, seconds); 0.0 with none."""
    return max((path.stat().st_mtime for path in record_paths(folder)), default=0.0)


def _records(folder: Path) -> list[dict]:
    records = []
    for path in record_paths(folder):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("files"), dict)
                and isinstance(record.get("world_size"), int) and isinstance(record.get("rank"), int)
                and all(_is_entry(entry) for entry in record["files"].values())):
            raise PipelineError(f"integrity: '{path}' is not a readable integrity record")
        records.append(record)
    return records


def verify(folder: Path, what: str = "checkpoint") -> None:  # what: the field or kind the message names
    """Raise PipelineError naming the first problem: no record, a rank's record missing, a listed file missing,
    linked, truncated or changed, or a file no record lists."""
    folder = Path(folder)
    records = _records(folder)
    if not records:
        raise PipelineError(f"{what}: '{folder}' has no integrity record ({RECORD_PREFIX}<rank>.json); it was not "
                            "written by this pipeline's training, or not completely")
    world_size = records[0]["world_size"]
    ranks = sorted(record["rank"] for record in records)
    if ranks != list(range(world_size)) or any(r["world_size"] != world_size for r in records):
        raise PipelineError(f"{what}: '{folder}' holds the records of ranks {ranks} of a world of {world_size}; "
                            "some rank's files are missing")
    listed: dict[str, dict] = {}
    for record in records:
        listed.update(record["files"])
    present = _files(folder)
    for relative, expected in listed.items():
        path = present.get(relative)
        if path is None:
            raise PipelineError(f"{what}: '{folder / relative}' is missing")
        if path.is_symlink() or not path.is_file():
            raise PipelineError(f"{what}: '{path}' is a link or not a file; it is not what training wrote")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise PipelineError(f"{what}: '{path}' has {size} bytes, {expected['bytes']} were written "
                                f"({'truncated' if size < expected['bytes'] else 'changed'})")
        if sha256_file(path) != expected["sha256"]:
            raise PipelineError(f"{what}: '{path}' does not match the sha256 it was written with (changed)")
    unlisted = sorted(r for r in present if r not in listed and not _is_record(r))
    if unlisted:
        raise PipelineError(f"{what}: '{folder / unlisted[0]}' was not written with this {what} (no integrity "
                            "record lists it)")


def folder_digest(folder: Path) -> str:
    """One sha256 (hex) for everything the folder's integrity records list, from the digests they hold (nothing is
    hashed again): what tells apart two sets of weights written to the same path. Raises PipelineError for a folder
    without readable records."""
    listed: dict[str, str] = {}
    for record in _records(Path(folder)):
        listed.update({relative: entry["sha256"] for relative, entry in record["files"].items()})
    if not listed:
        raise PipelineError(f"integrity: '{folder}' has no integrity record ({RECORD_PREFIX}<rank>.json)")
    return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()


def is_intact(folder: Path) -> bool:
    try:
        verify(folder)
    except PipelineError:
        return False
    return True
