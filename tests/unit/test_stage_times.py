"""The per-stage timing table printed at the end of a job, and the seconds logged to the job's parent MLflow run
(a real SQLite store): one line per stage as it ends, and the table also when a stage fails, naming it."""

from __future__ import annotations

import logging
import time

import mlflow
import pytest

from pipeline import runner, stages
from pipeline.config import compose
from pipeline.errors import PipelineError
from pipeline.timings import StageTimes
from pipeline.tracking import tracking_uri


def test_the_table_has_a_row_per_stage_with_its_share_and_the_total():
    times = StageTimes()
    times.add("prompts", 1.0)
    times.add("regenerate", 30.0)
    times.add("train", 69.0)
    lines = times.table("pipeline").splitlines()
    assert lines[0] == "pipeline: stage times"
    assert lines[1].split() == ["stage", "seconds", "share"]
    assert [line.split() for line in lines[2:]] == [["prompts", "1.0", "1.0%"], ["regenerate", "30.0", "30.0%"],
                                                    ["train", "69.0", "69.0%"], ["total", "100.0", "100.0%"]]
    assert len({len(line) for line in lines[1:]}) == 1  # the columns line up
    assert times.total == 100.0 and times.failed_stage is None


def test_the_table_names_the_failed_stage():
    times = StageTimes()
    times.add("evaluate", 3.0)
    times.add("export", 1.0, failed=True)
    lines = times.table("evaluate").splitlines()
    assert lines[0] == "evaluate: stage times (export failed)"
    assert lines[3].split() == ["export", "1.0", "25.0%", "failed"]
    assert lines[-1].split() == ["total", "4.0", "100.0%"]


def test_an_empty_job_has_a_zero_total():
    assert StageTimes().table("train").splitlines()[-1].split() == ["total", "0.0", "0.0%"]


def sleeper(seconds: float):
    def stage(ctx, results, run_id):
        time.sleep(seconds)
        return run_id
    return stage


def failing(ctx, results, run_id):
    raise PipelineError("export: no trained drafter")


def runs(cfg) -> tuple:
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    found = client.search_runs([experiment.experiment_id])
    parent = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(parent) == 1
    return parent[0], children


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating one takes seconds); each test logs to its own experiment."""
    return tmp_path_factory.mktemp("stage-times")


def test_each_stage_time_is_a_metric_of_the_parent_run(store, monkeypatch, caplog):
    monkeypatch.setitem(stages.STAGES, "prompts", sleeper(0.05))
    monkeypatch.setitem(stages.STAGES, "train", sleeper(0.15))
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)  # stand-in train reads no store
    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-completed"])
    with caplog.at_level(logging.INFO, logger="pipeline.runner"):
        runner.run_stages(cfg, "pipeline", ["prompts", "train"])
    parent, children = runs(cfg)
    metrics = parent.data.metrics
    assert set(metrics) >= {"time.prompts_s", "time.train_s", "time.total_s"}
    # Each stage's time covers at least its own work; comparing the two stages with each other failed under load,
    # when the bookkeeping around the shorter stage outlasted the 0.1 s between them.
    assert metrics["time.prompts_s"] >= 0.05 and metrics["time.train_s"] >= 0.15
    assert metrics["time.total_s"] == pytest.approx(metrics["time.prompts_s"] + metrics["time.train_s"])
    assert not any(key.startswith("time.") for child in children for key in child.data.metrics)
    assert "stage prompts done in" in caplog.text and "stage train done in" in caplog.text
    assert "pipeline: stage times\n" in caplog.text and "total" in caplog.text


def test_a_failed_stage_still_gets_its_time_and_the_table(store, monkeypatch, caplog):
    monkeypatch.setitem(stages.STAGES, "evaluate", sleeper(0.01))
    monkeypatch.setitem(stages.STAGES, "export", failing)
    monkeypatch.setitem(stages.STAGES, "promote", sleeper(0.01))
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)  # stand-in stages read no drafter
    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-failed"])
    with caplog.at_level(logging.INFO, logger="pipeline.runner"), pytest.raises(PipelineError):
        runner.run_stages(cfg, "evaluate", ["evaluate", "export", "promote"])
    parent, _ = runs(cfg)
    assert parent.info.status == "FAILED"
    assert set(parent.data.metrics) >= {"time.evaluate_s", "time.export_s", "time.total_s"}
    assert "time.promote_s" not in parent.data.metrics  # it never ran
    assert "stage export failed after" in caplog.text
    table = caplog.text[caplog.text.index("evaluate: stage times (export failed)"):]
    assert "failed" in next(line for line in table.splitlines() if line.startswith("export"))
    assert "promote" not in table


def interrupted(ctx, results, run_id):
    raise KeyboardInterrupt


def test_a_stage_stopped_by_ctrl_c_leaves_killed_runs_not_failed_ones(store, monkeypatch):
    """Ctrl-C and SIGTERM (both a KeyboardInterrupt here) stop a job: its runs read KILLED in MLflow, as a
    stopped run does, and FAILED stays for a stage that raised."""
    monkeypatch.setitem(stages.STAGES, "evaluate", sleeper(0.01))
    monkeypatch.setitem(stages.STAGES, "export", interrupted)
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)
    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-stopped"])
    with pytest.raises(KeyboardInterrupt):
        runner.run_stages(cfg, "evaluate", ["evaluate", "export"])
    parent, children = runs(cfg)
    assert parent.info.status == "KILLED"
    assert sorted((c.data.tags["stage"], c.info.status) for c in children) == [("evaluate", "FINISHED"),
                                                                              ("export", "KILLED")]


def test_a_store_that_cannot_end_a_stopped_run_does_not_hide_what_stopped_the_job(store, monkeypatch, caplog):
    """An interrupt inside an MLflow write can leave SQLite locked for the rest of the process: ending the runs
    then fails, and that error must not replace the KeyboardInterrupt (the job's one line and exit 130)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setitem(stages.STAGES, "evaluate", interrupted)
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)

    def locked(self, run_id, status="FINISHED", *args, **kwargs):
        raise RuntimeError("(sqlite3.OperationalError) database is locked")

    monkeypatch.setattr(MlflowClient, "set_terminated", locked)
    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-locked"])
    with pytest.raises(KeyboardInterrupt):
        runner.run_stages(cfg, "evaluate", ["evaluate"])
    assert "not marked KILLED (" in caplog.text and "the next job on this host marks it once" in caplog.text


def test_a_job_lets_go_of_each_stages_lock_once_the_stage_is_done(store, monkeypatch):
    """Held to the job's end, the lock of a finished stage refused another config's job that shares it (another
    drafter on the same store) for as long as this job trained and evaluated."""
    from pipeline.locks import stage_lock
    from pipeline.paths import StagePaths

    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-locks"])
    paths = StagePaths(cfg)
    free = {}

    def export(ctx, results, run_id):
        for stage in ("evaluate", "promote"):
            try:
                with stage_lock(paths.root, stage, paths.stage_key(stage)):
                    free[stage] = True
            except PipelineError:
                free[stage] = False
        return run_id

    monkeypatch.setitem(stages.STAGES, "evaluate", sleeper(0.01))
    monkeypatch.setitem(stages.STAGES, "export", export)
    monkeypatch.setitem(stages.STAGES, "promote", sleeper(0.01))
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)
    runner.run_stages(cfg, "evaluate", ["evaluate", "export", "promote"])
    assert free == {"evaluate": True, "promote": False}  # done: let go; still to run: held


def test_runs_a_killed_job_left_running_are_ended_by_the_next_job_on_the_host(store, monkeypatch):
    """`kill -9` (or the kernel's OOM killer) left a job's parent and stage runs RUNNING for ever. The next job on
    the machine marks KILLED those of a process that is gone, or whose pid a later process took; a live process's
    run and one of another machine or pid namespace (which may share the host name) stay."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from pipeline.tracking import HOST_TAG, PID_SPACE, PID_SPACE_TAG, PID_TAG, Tracker

    monkeypatch.setitem(stages.STAGES, "evaluate", sleeper(0.01))
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)
    cfg = compose([f"paths.root={store}", "tracking.experiment_name=times-orphans"])
    gone_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
    client = Tracker(cfg).client
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id
    here, me = socket.gethostname(), str(os.getpid())
    hour_ago_ms = int((time.time() - 3600) * 1000)  # before this test's process started
    left = {name: client.create_run(experiment, run_name=name, start_time=start,
                                    tags={HOST_TAG: here, PID_SPACE_TAG: space, PID_TAG: pid}).info.run_id
            for name, space, pid, start in [("killed", PID_SPACE, gone_pid, None), ("live", PID_SPACE, me, None),
                                            ("pid_taken_again", PID_SPACE, me, hour_ago_ms),
                                            ("other_machine", "another-boot/pid:[1]", gone_pid, None)]}
    runner.run_stages(cfg, "evaluate", ["evaluate"])
    status = {name: client.get_run(run_id) for name, run_id in left.items()}
    assert status["killed"].info.status == status["pid_taken_again"].info.status == "KILLED"
    assert status["killed"].data.tags["process.ended"].startswith(f"process {gone_pid} was gone")
    assert status["live"].info.status == status["other_machine"].info.status == "RUNNING"
    job = [r for r in client.search_runs([experiment]) if r.info.run_id not in left.values()]
    assert {r.info.status for r in job} == {"FINISHED"}
    assert {(r.data.tags[PID_SPACE_TAG], r.data.tags[PID_TAG]) for r in job} == {(PID_SPACE, me)}


class _SignalsInAFinalizer:
    """Sends `signum` to this process from its finalizer: the handler's exception is raised inside __del__, where
    Python prints "Exception ignored" and drops it (as one landing in SQLAlchemy's weakref callback under MLflow)."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        import os

        os.kill(os.getpid(), self.signum)
        time.sleep(0.05)  # the handler runs here, inside the finalizer


@pytest.mark.parametrize("signum, stopped", [("SIGTERM", "Terminated"), ("SIGINT", "KeyboardInterrupt")])
def test_a_stop_signal_whose_exception_a_finalizer_dropped_still_stops_the_job_after_its_stage(
        store, monkeypatch, signum, stopped):
    """SIGTERM (or Ctrl-C) during capture was swallowed by a finalizer and the job went on to exit 0: the handler
    remembers the signal, and the chain stops at the next safe point (between stages; stream_batches between
    batches), as a stopped job, its finished stage kept."""
    import signal
    import threading

    from pipeline import cluster

    def stage_that_is_signalled(ctx, results, run_id):
        _SignalsInAFinalizer(getattr(signal, signum))  # dropped at once: the signal arrives in its __del__
        return {}

    monkeypatch.setitem(stages.STAGES, "prompts", stage_that_is_signalled)
    monkeypatch.setitem(stages.STAGES, "train", sleeper(0.01))
    monkeypatch.setattr(runner, "check_input_files", lambda cfg, stages, paths: None)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert threading.current_thread() is threading.main_thread()
    cluster.stop_cleanly_on_signals()
    try:
        cfg = compose([f"paths.root={store}", f"tracking.experiment_name=times-{signum}"])
        with pytest.raises(KeyboardInterrupt) as raised:
            runner.run_stages(cfg, "pipeline", ["prompts", "train"])
        assert type(raised.value).__name__ == stopped
        assert cluster.sigterm_received() is (signum == "SIGTERM")
        parent, children = runs(cfg)
        assert parent.info.status == "KILLED"
        assert [c.data.tags["stage"] for c in children] == ["prompts"]  # train never started
        assert children[0].info.status == "FINISHED"  # the stage the signal came in finished, and is kept
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cluster.forget_stop_signals()
