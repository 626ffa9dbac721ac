"""Regenerated samples land in part files (Parquet), one per verifier batch, written under a temporary name and
renamed when complete. A killed run keeps every finished part; the rerun regenerates only the samples no part holds.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pandas as pd

from pipeline.errors import PipelineError, first_line
from pipeline.fsutil import publish

PART_GLOB = "part-*.parquet"
COLUMNS = ["sample_id", "messages_json", "input_ids", "loss_mask", "skip_reason", "truncated"]


def part_name(sample_ids: list[str]) -> str:
    return f"part-{hashlib.sha256(chr(10).join(sample_ids).encode()).hexdigest()[:16]}.parquet"


def write_part(folder: Path, rows: list[dict]) -> str:
    """rows carry COLUMNS; returns the part's file name."""
    folder.mkdir(parents=True, exist_ok=True)
    name = part_name([r["sample_id"] for r in rows])
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    os.close(fd)
    pd.DataFrame(rows, columns=COLUMNS).to_parquet(tmp, index=False)
    publish(tmp, folder / name)
    return name


def read_parts(folder: Path) -> pd.DataFrame:
    """Every finished part's rows (a sample appears once: a batch's samples are never in two parts)."""
    paths = sorted(folder.glob(PART_GLOB)) if folder.is_dir() else []
    if not paths:
        return pd.DataFrame(columns=COLUMNS)
    return pd.concat([_read_part(p) for p in paths], ignore_index=True)


def _read_part(path: Path) -> pd.DataFrame:
    """One part's rows; a part that is not Parquet or lacks a column (damaged after it was renamed into place, or
    not written here) is a PipelineError naming it."""
    import pyarrow

    try:
        rows = pd.read_parquet(path)
    except (OSError, pyarrow.ArrowException) as error:
        raise PipelineError(f"regenerate: part '{path}' is damaged ({type(error).__name__}: {first_line(error)}); "
                            "delete it and rerun to regenerate its batch") from None
    missing = [column for column in COLUMNS if column not in rows.columns]
    if missing:
        raise PipelineError(f"regenerate: part '{path}' lacks the columns {missing}; delete it and rerun to "
                            "regenerate its batch")
    return rows


def remove_stale_parts(folder: Path) -> None:
    for path in folder.glob(".part-*") if folder.is_dir() else []:
        path.unlink(missing_ok=True)
