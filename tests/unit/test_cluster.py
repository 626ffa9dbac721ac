"""pipeline.cluster: a local Ray node that misses Ray's fixed startup wait is stopped and started again."""

import subprocess
import sys

import psutil
import pytest

from pipeline import cluster

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet failed "
                    "to startup or the GCS has become overloaded.")
# A process that starts a grandchild (as the raylet starts Ray's agents) and sleeps; the grandchild's pid on stdout.
NODE = ("import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(child.pid, flush=True); time.sleep(60)")


class FlakyInit:
    """A stand-in for ray.init: each failing call starts a process tree (like a half-started node's) and raises."""

    def __init__(self, failures: int, error: Exception = TIMEOUT):
        self.failures, self.error = failures, error
        self.calls = 0
        self.started: list[int] = []  # every pid the failing calls started, grandchildren included

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            node = subprocess.Popen([sys.executable, "-c", NODE], stdout=subprocess.PIPE, text=True)
            self.started += [node.pid, int(node.stdout.readline())]
            raise self.error

    def still_running(self) -> list[int]:
        return [pid for pid in self.started if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def no_ray_shutdown(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "shutdown", lambda: None)


def stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def test_a_node_that_misses_the_startup_wait_is_stopped_and_started_again(no_ray_shutdown):
    init = FlakyInit(failures=2)
    cluster.start_local(init, attempts=3)
    assert init.calls == 3 and len(init.started) == 4
    assert init.still_running() == []  # each failed node and the process it started are gone (they sleep 60 s)


def test_the_last_attempts_error_is_raised_after_its_node_is_stopped(no_ray_shutdown):
    init = FlakyInit(failures=5)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.start_local(init, attempts=2)
    assert init.calls == 2
    assert init.still_running() == []


def test_any_other_error_is_raised_at_once(no_ray_shutdown):
    init = FlakyInit(failures=5, error=ValueError("num_cpus must be positive"))
    try:
        with pytest.raises(ValueError, match="num_cpus"):
            cluster.start_local(init, attempts=3)
        assert init.calls == 1
    finally:
        stop(init.started)


def test_processes_running_before_the_attempt_are_left_alone(no_ray_shutdown):
    bystander = subprocess.Popen([sys.executable, "-c", NODE], stdout=subprocess.PIPE, text=True)
    its_child = int(bystander.stdout.readline())
    try:
        cluster.start_local(FlakyInit(failures=1), attempts=2)
        assert bystander.poll() is None and psutil.Process(its_child).status() != psutil.STATUS_ZOMBIE
    finally:
        stop([its_child, bystander.pid])
        bystander.wait()
