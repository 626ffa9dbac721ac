"""Integrity records (pipeline/integrity.py): a checkpoint is used only when every rank's files are there, whole and
unchanged, and nothing else is; a tampered optimizer pickle is refused before anything unpickles it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.checkpoint import STATE_FILE, WEIGHTS_FILE, load_checkpoint, save_checkpoint
from pipeline.errors import PipelineError
from pipeline.integrity import is_intact, seal, verify
from pipeline.training.resume import latest_complete_checkpoint, read_resume_point
from tests.unit.tiny_drafters import tiny_drafter

OPTIMIZER_PICKLE = "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def checkpoint(folder: Path, step: int = 3, world_size: int = 2) -> Path:
    """What two ranks write and Ray Train merges: rank 0 the drafter and its DeepSpeed file, rank 1 its own."""
    model = tiny_drafter("peagle")
    save_checkpoint(folder, model, {"step": step, "global_batch": 2, "world_size": world_size, "zero_stage": 2,
                                    "deepspeed": True})
    (folder / "deepspeed/state").mkdir(parents=True)
    torch.save({"rank": 0}, folder / "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    seal(folder, rank=0, world_size=world_size)
    if world_size == 2:
        torch.save({"rank": 1}, folder / OPTIMIZER_PICKLE)  # after rank 0 sealed: rank 1's own file
        seal_only(folder, [OPTIMIZER_PICKLE], rank=1, world_size=2)
    return folder


def seal_only(folder: Path, files: list[str], rank: int, world_size: int) -> None:
    """Rank `rank`'s record of `files` alone (on a cluster each rank seals its own folder before Ray merges)."""
    from pipeline.integrity import sha256_file

    record = {"rank": rank, "world_size": world_size,
              "files": {f: {"bytes": (folder / f).stat().st_size, "sha256": sha256_file(folder / f)} for f in files}}
    (folder / f"integrity-rank{rank}.json").write_text(json.dumps(record))


def test_a_sealed_checkpoint_of_every_rank_verifies_and_loads(tmp_path):
    folder = checkpoint(tmp_path / "c")
    verify(folder)
    point = read_resume_point(folder, tiny_drafter("peagle").spec)
    assert point.step == 3 and point.world_size == 2


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_field(path, field):
    record = json.loads(path.read_text())
    del record[field]
    path.write_text(json.dumps(record))


def _set_entries(path, entry):
    """Every file's line of the record replaced by `entry` (a damaged record: not {bytes, sha256})."""
    record = json.loads(path.read_text())
    record["files"] = {name: entry for name in record["files"]}
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage, message", [
    (lambda f: _flip_last_byte(f / OPTIMIZER_PICKLE), "does not match the sha256 it was written with"),
    (lambda f: os.truncate(f / WEIGHTS_FILE, 100), "bytes, .* were written \\(truncated\\)"),
    (lambda f: (f / WEIGHTS_FILE).write_bytes((f / WEIGHTS_FILE).read_bytes() + b"x"), "\\(changed\\)"),
    (lambda f: (f / OPTIMIZER_PICKLE).unlink(), "is missing"),
    (lambda f: torch.save({}, f / "deepspeed/state/zero_pp_rank_2_mp_rank_00_optim_states.pt"),
     "zero_pp_rank_2.* was not written with this checkpoint"),
    (lambda f: (f / "integrity-rank1.json").unlink(), "ranks \\[0\\] of a world of 2"),
    (lambda f: [(f / WEIGHTS_FILE).rename(f / "elsewhere"), (f / WEIGHTS_FILE).symlink_to(f / "elsewhere")],
     "is a link or not a file"),
    (lambda f: (f / "integrity-rank0.json").write_text("{"), "is not a readable integrity record"),
    (lambda f: _drop_field(f / "integrity-rank1.json", "rank"), "rank1.json' is not a readable integrity record"),
    (lambda f: _set_entries(f / "integrity-rank0.json", 3), "rank0.json' is not a readable integrity record"),
    (lambda f: _set_entries(f / "integrity-rank0.json", {"bytes": 3}), "rank0.json' is not a readable integrity"),
    (lambda f: [p.unlink() for p in f.glob("integrity-rank*.json")], "has no integrity record"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(damage, message, tmp_path):
    folder = checkpoint(tmp_path / "c")
    damage(folder)
    assert not is_intact(folder)  # what the resume scan asks: a damaged record is no checkpoint, not a traceback
    with pytest.raises(PipelineError, match=message):
        verify(folder)
    with pytest.raises(PipelineError, match=message):
        load_checkpoint(folder)


def test_a_tampered_optimizer_pickle_is_refused_before_anything_loads_it(tmp_path, monkeypatch):
    folder = checkpoint(tmp_path / "c")
    torch.save({"rank": 1, "payload": "changed on shared storage"}, folder / OPTIMIZER_PICKLE)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(PipelineError, match="training.resume_from: .*optim_states.pt' (has|does not match)"):
        read_resume_point(folder, tiny_drafter("peagle").spec)
    assert loads == []


def test_the_latest_checkpoint_with_a_truncated_file_is_passed_over_so_its_steps_are_redone(tmp_path):
    run = tmp_path / "run"
    older = checkpoint(run / "checkpoint_a", step=2)
    newer = checkpoint(run / "checkpoint_b", step=4)
    assert latest_complete_checkpoint(run) == newer
    os.truncate(newer / WEIGHTS_FILE, 10)  # a crash while the file was written
    assert latest_complete_checkpoint(run) == older
    assert json.loads((older / STATE_FILE).read_text())["step"] == 2


def test_sealing_refuses_a_link_in_the_folder(tmp_path):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "secret").symlink_to("/etc/hostname")
    with pytest.raises(PipelineError, match="is a link"):
        seal(folder, 0, 1)


def test_renamed_files_and_folders_are_flushed_before_and_after_the_rename(tmp_path, monkeypatch):
    from pipeline import fsutil

    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(fsutil.os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                         real_fsync(fd)))
    fsutil.atomic_write_text(tmp_path / "a.json", "{}")
    assert flushed[-1] == str(tmp_path) and any(".a.json." in f for f in flushed)  # the file, then its folder
    flushed.clear()
    with fsutil.atomic_folder(tmp_path / "out") as staging:
        (staging / "w.bin").write_bytes(b"123")
    assert any(f.endswith("/w.bin") for f in flushed) and flushed[-1] == str(tmp_path)
    assert (tmp_path / "out" / "w.bin").read_bytes() == b"123"


def test_what_the_pipeline_publishes_has_the_modes_the_umask_gives_not_tempfiles_private_ones(tmp_path):
    """tempfile makes 0600 files and 0700 folders: an export, report or shard published from one could not be read
    by another user of shared storage."""
    import tempfile

    from pipeline.fsutil import FILE_MODE, FOLDER_MODE, atomic_folder, atomic_write_text, publish

    mask = os.umask(0)
    os.umask(mask)
    assert FILE_MODE == 0o666 & ~mask and FOLDER_MODE == 0o777 & ~mask  # the process's umask, read once
    atomic_write_text(tmp_path / "report.json", "{}")
    with atomic_folder(tmp_path / "export") as staging:
        (staging / "config.json").write_text("{}")
        save_file({"weight": torch.zeros(2)}, str(staging / "model.safetensors"))  # safetensors writes it 0600
        (staging / "sub").mkdir(mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    publish(tmp, tmp_path / "part.parquet")
    for path, mode in [(tmp_path / "report.json", FILE_MODE), (tmp_path / "export", FOLDER_MODE),
                       (tmp_path / "export" / "model.safetensors", FILE_MODE),
                       (tmp_path / "export" / "sub", FOLDER_MODE),
                       (tmp_path / "part.parquet", FILE_MODE)]:
        assert path.stat().st_mode & 0o777 == mode, path


class _RayCheckpoint:
    """What ray.train.get_checkpoint() gives a worker: a folder through as_directory()."""

    def __init__(self, folder: Path):
        self.folder = folder

    def as_directory(self):
        import contextlib

        return contextlib.nullcontext(str(self.folder))


def test_a_worker_resumes_from_the_later_complete_of_rays_checkpoint_and_the_drivers_choice(tmp_path):
    """A rerun restores Ray Train's snapshot of the earlier job: its latest registered checkpoint lags the newest one
    on disk (the driver's choice; steps were trained twice and the log named another checkpoint), or is one a crash
    truncated (every worker failed on it, rerun after rerun). Restarted workers within a job get Ray's later one."""
    from pipeline.training.loop import _later_complete

    run = tmp_path / "run"
    older, newer = checkpoint(run / "checkpoint_a", step=3), checkpoint(run / "checkpoint_b", step=6)
    with _later_complete(_RayCheckpoint(older), newer) as folder:
        assert folder == newer  # Ray's snapshot lags: the driver's newer one
    with _later_complete(_RayCheckpoint(newer), older) as folder:
        assert Path(folder) == newer  # a worker restarted within the job: Ray's later one
    with _later_complete(_RayCheckpoint(newer), None) as folder:
        assert Path(folder) == newer
    os.truncate(newer / WEIGHTS_FILE, 10)
    with _later_complete(_RayCheckpoint(newer), older) as folder:
        assert folder == older  # Ray's is truncated: passed over, its steps trained again
