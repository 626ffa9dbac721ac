"""pipeline.cluster: a local Ray node that misses Ray's fixed startup wait is stopped and started again."""

import subprocess
import sys

import psutil
import pytest

from pipeline import cluster

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the Ray processes "
                    "failed to startup.")


class FlakyInit:
    """A stand-in for ray.init: each failing call starts a process (like a half-started node's agents) and raises
    Ray's startup-timeout error."""

    def __init__(self, failures: int, error: Exception = TIMEOUT):
        self.failures, self.error = failures, error
        self.calls = 0
        self.started: list[subprocess.Popen] = []

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            self.started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise self.error


@pytest.fixture
def no_ray_shutdown(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "shutdown", lambda: None)


def test_a_node_that_misses_the_startup_wait_is_stopped_and_started_again(no_ray_shutdown):
    init = FlakyInit(failures=2)
    cluster._start_local(init, attempts=3)
    assert init.calls == 3
    for process in init.started:  # what the failed attempts left has ended (it would sleep 60 s), not holding a core
        process.wait(timeout=5)
        assert not psutil.pid_exists(process.pid)


def test_the_last_attempts_error_is_raised(no_ray_shutdown):
    init = FlakyInit(failures=5)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster._start_local(init, attempts=2)
    assert init.calls == 2


def test_any_other_error_is_raised_at_once(no_ray_shutdown):
    init = FlakyInit(failures=5, error=ValueError("num_cpus must be positive"))
    with pytest.raises(ValueError, match="num_cpus"):
        cluster._start_local(init, attempts=3)
    assert init.calls == 1
    init.started[0].kill()


def test_processes_running_before_the_attempt_are_left_alone(no_ray_shutdown):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster._start_local(FlakyInit(failures=1), attempts=2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
