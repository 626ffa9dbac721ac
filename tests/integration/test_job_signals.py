"""A job stopped by SIGTERM once its local Ray is up (`ray job stop`, a pod's shutdown): a real process, a real Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A job that starts its local Ray as the stages do, says so, then waits to be stopped.
JOB = """
import sys, time
from pipeline.cluster import ensure_ray
from pipeline.config.registration import compose
from pipeline.entry import run_guarded

def job():
    ensure_ray(compose(["cluster.local_num_cpus=1"]).cluster)
    print("ray is up", flush=True)
    time.sleep(300)

sys.exit(run_guarded(job))
"""


def test_sigterm_stops_a_job_with_one_line_and_143_and_stops_its_ray():
    """Ray's driver left a fatal-signal handler on SIGTERM: a native stack dump, exit 134 (abort), no line."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    process = subprocess.Popen([sys.executable, "-c", JOB], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ray is up", process.stderr.read() if process.stderr else ""
        time.sleep(1)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, stderr[-3000:]
    assert "error: terminated (SIGTERM); finished stages and checkpoints are kept" in stderr
    assert "SIGTERM received" not in stderr  # Ray's native handler never ran
    # its local Ray went with it: no process of its session group is left
    time.sleep(2)
    left = subprocess.run(["pgrep", "-g", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], left
