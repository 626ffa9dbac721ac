"""`jobs/serve.py` as a child process that is up once its OpenAI endpoint answers (tests and the load benchmark)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ready(url: str, api_key: Optional[str]) -> bool:
    request = urllib.request.Request(f"{url}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def serve_job(overrides: list[str], port: int, log_path: Path, api_key: Optional[str] = None,
              env: Optional[dict] = None, timeout_s: float = 900) -> Iterator[str]:
    """Run `python jobs/serve.py serving.port=<port> ...` until the block ends; yields the base URL. The job and the
    local Ray it started die together (its own process group)."""
    environment = {**os.environ, **(env or {})}
    environment.pop("RAY_ADDRESS", None)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "jobs/serve.py", f"serving.port={port}", *overrides],
                                   cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(url, api_key):
            if process.poll() is not None:
                raise RuntimeError(f"jobs/serve.py exited with {process.returncode}:\n"
                                   f"{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs/serve.py was not up after {timeout_s} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)  # the job stops Serve and its local Ray
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
