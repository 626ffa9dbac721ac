"""One lock per stage key: two runs of the same config on one output root never work in the same stage folder at
once (each would delete the other's temporary files as leftovers of a crash). A job takes the locks of all its
stages before it starts and lets go of each once that stage is done (runner.run_stages), so the second one
stops at once, in one line naming the holder, and leaves no MLflow run; once the first finishes, a rerun reuses
its work. A job of another config sharing finished stages with a running one (another drafter on the same
store) goes on.

The lock is an advisory `flock` on `<paths.root>/locks/<stage>-<key>.lock`; the kernel drops it when the holder
exits, however it exits, so a crash leaves no stale lock. (On network file systems flock is only as good as the
server's support for it.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from pipeline.errors import PipelineError


@contextlib.contextmanager
def stage_lock(root: Path, stage: str, key: str) -> Iterator[Path]:
    """Hold the lock of (stage, key) for the block; PipelineError when another process holds it."""
    folder = Path(root) / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stage}-{key}.lock"
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise PipelineError(f"{stage}: this config's {stage} stage ({key}) is taken by the job in {holder} "
                                f"({path}); wait for that job to finish, then rerun to reuse its work") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        yield path
    finally:
        handle.close()  # closing the descriptor releases the flock
