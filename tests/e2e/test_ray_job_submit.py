"""`ray job submit -- python jobs/run_pipeline.py ...` against a Ray head started on 127.0.0.1 runs the chain, with the
driver placed the way the KubeRay RayJobs place it (the `pipeline_driver` resource of the GPU pods)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.infra.kuberay import driver_resources
from tests.conftest import run_job, tiny_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray_bin = str(Path(sys.executable).parent / "ray")
    gcs_port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    temp_dir = Path("/tmp") / f"ray-e2e-{gcs_port}"  # short: Ray's socket paths must stay under 108 bytes
    # Its own session: every daemon `ray start` leaves behind keeps that session id, so the teardown stops this head
    # alone (`ray stop --force` kills every Ray on the machine: a developer's own, or another test's).
    # The job agent's HTTP port defaults to 52365 for every Ray on the machine: when another test's local Ray holds it,
    # this head's agent never registers and every submission is refused ('No available agent'). Hence a free port.
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--num-cpus=2",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         f"--dashboard-agent-listen-port={agent_port}", f"--temp-dir={temp_dir}",
         f"--resources={driver_resources()}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = head.communicate(timeout=180)
    assert head.returncode == 0, stderr[-2000:]
    # `ray start` enables token auth and writes the token under ~/.ray; the client must be told to send it.
    client_env = {**env, "RAY_AUTH_MODE": "token"}
    try:
        yield ray_bin, f"http://127.0.0.1:{dashboard_port}", client_env
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(head.pid)], capture_output=True, timeout=60)


def submit_when_agent_ready(command: list[str], env: dict, attempts: int = 12) -> subprocess.CompletedProcess:
    """The head answers HTTP before its job agent is up (seconds to a minute on a busy 2-core machine); until then a
    submission is refused with 'No available agent' and nothing is submitted, so it is safe to ask again."""
    for _ in range(attempts):
        result = run_job(command, 900, env=env)
        if "No available agent" not in result.stderr:
            return result
        time.sleep(10)
    return result


@pytest.mark.slow
def test_pipeline_job_runs_under_ray_job_submit(ray_head, tmp_path, tiny_verifier_path):
    ray_bin, address, env = ray_head
    prompts = write_jsonl(tmp_path / "prompts.jsonl",
                          [{"prompt": f"Name {i} colours."} for i in range(10)])
    overrides = tiny_overrides(tmp_path / "out", tiny_verifier_path, prompts) + ["training.max_steps=2"]
    result = submit_when_agent_ready(
        [ray_bin, "job", "submit", f"--address={address}", f"--working-dir={REPO}",
         f"--entrypoint-resources={driver_resources()}", "--",
         "python", "jobs/run_pipeline.py", *overrides], env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout.lower()
    config = json.loads(next((tmp_path / "out" / "export").glob("*/config.json")).read_text())
    assert config["speculators_model_type"] == "peagle"
