"""Write-then-rename helpers: readers (and restarts) only ever see complete files and folders."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _process_umask() -> int:
    """The umask, read from /proc where Linux shows it; elsewhere by setting it and putting it straight back (a file
    another thread made in that instant would get 022)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share(path: Path | str, mode: int) -> None:
    """chmod `path` to `mode`; a filesystem that refuses chmod (some FUSE and SMB mounts) keeps its own modes."""
    with contextlib.suppress(OSError):
        os.chmod(path, mode)


# tempfile makes its files 0600 and folders 0700, for privacy while they are written; what the pipeline publishes
# gets the modes any other file of the process would (0666 / 0777 less the umask), so that another user of shared
# storage (a Ray worker, a Serve replica, a colleague) can read the export, store and reports.
_UMASK = _process_umask()
FILE_MODE, FOLDER_MODE = 0o666 & ~_UMASK, 0o777 & ~_UMASK


def _share_tree(folder: Path) -> None:
    """Give what `folder` holds the umask's modes; a link is left alone (chmod would change its target)."""
    for root, folders, names in os.walk(folder):
        for name, mode in [*((name, FOLDER_MODE) for name in folders), *((name, FILE_MODE) for name in names)]:
            if not (Path(root) / name).is_symlink():
                share(Path(root) / name, mode)


def fsync_tree(folder: Path) -> None:
    """Flush every file under `folder`, then the folders themselves, to disk: a rename is durable only once what it
    names is (after a power loss, a renamed but unflushed file can read back empty)."""
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            if not path.is_symlink():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(tmp: Path | str, final: Path) -> None:
    """Rename a finished temporary file to its final name, durably: the file's bytes, then the rename."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    share(tmp, FILE_MODE)
    os.replace(tmp, final)
    _fsync_dir(Path(final).parent)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        share(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself


@contextlib.contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces `target`, on error it is removed. What it
    holds gets the umask's modes (safetensors, like tempfile, writes its files 0600)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        share(staging, FOLDER_MODE)
        yield staging
        _share_tree(staging)
        fsync_tree(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def copy_folder_atomic(source: Path, target: Path) -> None:
    with atomic_folder(target) as staging:
        shutil.copytree(source, staging, dirs_exist_ok=True)


def safetensors_is_whole(path: Path) -> bool:
    """Whether a safetensors file is exactly as long as its own header says (8-byte header length, the JSON header,
    then the tensors' bytes): a truncated copy, a file cut short by a full disk, or one with bytes appended is not.
    Cheap: reads the header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size)) if 0 < header_size <= size else {}
        data_bytes = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=-1)
        return size == 8 + header_size + data_bytes
    except (OSError, ValueError, TypeError, AttributeError, KeyError, IndexError):
        return False


def output_file_problem(path: Path | str, flag: str = "--out") -> str | None:
    """Why `path` cannot take a file this process writes at the end of a long run (None when it can): it is a
    folder, a folder above it is a file, or the nearest folder above it that exists takes no new file (a probe
    file is made there and removed at once: permissions, a read-only or virtual file system). Checked before the
    run, so a mistyped --out is one line at once rather than a traceback after the work."""
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path}: is a folder; give the JSON file to write"
    if any(parent.exists() and not parent.is_dir() for parent in path.parents):
        return f"{flag} {path}: a folder above it is a file"
    return _write_probe_problem(path.absolute().parents, f"{flag} {path}")


def is_remote(location: str) -> bool:
    """Whether a configured location is a URI another system writes (s3://, gs://: Ray Train's storage), not a path
    on this machine."""
    return "://" in location


def output_folder_problem(path: Path | str, field: str) -> str | None:
    """Why a folder a stage makes and writes into cannot be (None when it can): the nearest of it and the folders
    above it that exists takes no new file (a probe file is made there and removed at once: permissions, a
    read-only or virtual file system such as /proc). For the folders validate cannot probe (it also runs where the
    manifests for a cluster are rendered): checked by the job on its own machine before any stage."""
    path = Path(path).absolute()
    return _write_probe_problem([path, *path.parents], f"{field}: '{path}'")


def _write_probe_problem(candidates, named: str) -> str | None:
    """`named` and why the first existing folder of `candidates` takes no new file, or None when it takes one."""
    import tempfile

    nearest = next(folder for folder in candidates if folder.exists())
    try:
        with tempfile.NamedTemporaryFile(dir=nearest, prefix=".write-probe-"):
            pass
    except OSError as error:
        return f"{named}: cannot write in {nearest} ({error.strerror or error})"
    return None
