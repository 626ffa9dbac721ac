"""The job's console output: the known-noise filters drop exactly the repeated internal lines of Ray and Ray Train
(fed lines copied from a smoke run's log), keep the first of a line that says something once, and let every other
record through, real warnings and errors included; progress bars outside a terminal are whole lines."""

from __future__ import annotations

import importlib
import io
import logging
import logging.config

import pytest

from pipeline.logs import (
    KNOWN_NOISE,
    RAY_TRAIN_CONTEXT_LOGGER,
    LineWriter,
    Noise,
    NoiseFilter,
    install_noise_filters,
    progress_bar,
    ray_runtime_env,
)

CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
CONTEXT = RAY_TRAIN_CONTEXT_LOGGER
STORAGE = "ray.train.v2._internal.execution.storage"
DATA_PROGRESS = "ray.data._internal.progress"

FLOOD = ("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
         "Continuing to monitor.")
REPORT = ("Reporting training result 3: TrainingReport(checkpoint=Checkpoint(filesystem=local, "
          "path=/tmp/smoke_base/ray/train-8849ed44d1f3/checkpoint_2026-11-30_17-49-22.550542), "
          "metrics={'train.loss': 12.589203834533691, 'step': 3}, validation=False) from rank 1")
CHECKPOINT = ("Checkpoint successfully created at: Checkpoint(filesystem=local, "
              "path=/tmp/smoke_base/ray/train-8849ed44d1f3/checkpoint_2026-11-30_17-49-22.550542)")
BARS_OFF = "Progress bars disabled. To enable, set `ray.data.DataContext.get_current().enable_progress_bars = True`."
DEAD = ("Detected that the Ray Train controller actor (b3fda86dac63b265f6bf140601000000) is dead. "
        "Cleaning up placement group = [pg-1] created by this run.")


def record(logger: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(logger, level, "x.py", 1, message, None, None)


def passes(noise_filter: NoiseFilter, logger: str, level: int, message: str) -> bool:
    return noise_filter.filter(record(logger, level, message))


@pytest.fixture
def noise_filter() -> NoiseFilter:
    return NoiseFilter(KNOWN_NOISE)


@pytest.mark.parametrize("module", ["ray.train.v2._internal.execution.controller.placement_group_cleaner",
                                    "ray.train.v2._internal.execution.context",
                                    "ray.train.v2._internal.execution.storage", "ray.data._internal.progress"])
def test_each_known_noise_names_the_logger_its_ray_module_logs_through(module):
    logger = importlib.import_module(module).logger
    assert logger.name in {noise.logger for noise in KNOWN_NOISE}


def test_the_known_noise_is_dropped(noise_filter):
    assert not passes(noise_filter, CONTEXT, logging.INFO, REPORT)
    assert not passes(noise_filter, STORAGE, logging.INFO, CHECKPOINT)
    assert not passes(noise_filter, DATA_PROGRESS, logging.WARNING, BARS_OFF)


def test_the_controller_flood_keeps_its_first_line(noise_filter):
    kept = [passes(noise_filter, CLEANER, logging.WARNING, FLOOD) for _ in range(371)]
    assert kept[0] and not any(kept[1:])


def test_real_warnings_and_errors_pass(noise_filter):
    assert passes(noise_filter, CLEANER, logging.WARNING, DEAD)  # same logger, another message
    assert passes(noise_filter, CLEANER, logging.WARNING, "Failed to clean up placement group: timeout")
    assert passes(noise_filter, CONTEXT, logging.ERROR, REPORT)  # a known message above its usual level
    assert passes(noise_filter, STORAGE, logging.WARNING, CHECKPOINT)
    assert passes(noise_filter, DATA_PROGRESS, logging.WARNING,
                  "Progress bars for operators disabled. To enable, set `enable_operator_progress_bars = True`.")
    assert passes(noise_filter, DATA_PROGRESS, logging.WARNING, "[dataset]: Run `pip install rich` to enable "
                                                                "progress reporting.")


def test_the_same_text_from_another_logger_passes(noise_filter):
    assert passes(noise_filter, "pipeline.training.stage", logging.INFO, REPORT)
    assert passes(noise_filter, "ray.train", logging.WARNING, FLOOD)
    assert passes(noise_filter, "root", logging.INFO, "stage train done in 123.4 s")


def test_the_filters_are_installed_once_and_survive_a_reconfigured_parent_logger():
    # A private stand-in for Ray Train's loggers: each worker reconfigures `ray.train` after it starts, which
    # resets its children's levels (a level set there would be lost) but leaves their filters.
    parent, child = "tests.logs.train", "tests.logs.train.execution.context"
    noises = [Noise(child, "Reporting training result", logging.INFO)]
    install_noise_filters(noises)
    install_noise_filters(noises)
    logger = logging.getLogger(child)
    assert sum(isinstance(f, NoiseFilter) for f in logger.filters) == 1
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                               "loggers": {parent: {"level": "DEBUG"}}})
    captured = []
    handler = logging.Handler()
    handler.emit = captured.append
    logger.addHandler(handler)
    try:
        logger.info(REPORT)
        logger.warning("Reporting training result 4 is late")  # the same start at WARNING passes
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in captured] == ["Reporting training result 4 is late"]


def test_the_workers_runtime_env_quiets_bars_and_lets_an_exported_value_win(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    env = ray_runtime_env()
    assert env["worker_process_setup_hook"] == "pipeline.logs.setup_ray_worker"
    assert env["env_vars"]["HF_HUB_DISABLE_PROGRESS_BARS"] == "0"
    assert env["env_vars"]["RAY_DATA_DISABLE_PROGRESS_BARS"] == "1"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_line_writer_writes_whole_lines_at_most_every_interval_and_the_last_on_close():
    out, clock = io.StringIO(), Clock()
    writer = LineWriter(out, interval_s=30, clock=clock)
    writer.write("\rtrain:   0%|          | 0/300")
    clock.now = 10
    writer.write("\rtrain:   3%|          | 10/300")  # held back: 10 s after the last line
    writer.write("\r" + " " * 40 + "\r")  # tqdm clearing its line
    clock.now = 31
    writer.write("\rtrain:  10%|█         | 30/300")
    clock.now = 40
    writer.write("\rtrain: 100%|██████████| 300/300")
    writer.write("\n")  # tqdm closing the bar
    assert out.getvalue().splitlines() == ["train:   0%|          | 0/300", "train:  10%|█         | 30/300",
                                           "train: 100%|██████████| 300/300"]


def test_progress_bar_outside_a_terminal_prints_its_start_and_its_end_with_the_postfix():
    out = io.StringIO()
    bar = progress_bar(6, "train", stream=out)
    for step in range(6):
        bar.update(1)
        bar.set_postfix(loss=f"{step:.3f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train:   0%") and "\r" not in out.getvalue()
    assert lines[1].startswith("train: 100%") and "6/6" in lines[1] and "loss=5.000" in lines[1]


def test_a_disabled_bar_prints_nothing():
    out = io.StringIO()
    bar = progress_bar(3, "train", disable=True, stream=out)
    bar.update(3)
    bar.close()
    assert out.getvalue() == ""


def test_a_submitted_jobs_own_runtime_env_wins_over_the_quiet_one(monkeypatch):
    import ray

    from pipeline import cluster

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if "runtime_env" in kwargs:  # what ray.init raises when the job was submitted with the same keys
            raise ValueError("Failed to merge the Job's runtime env {...} with a ray.init's runtime env {...}")

    monkeypatch.setattr(ray, "init", init)
    cluster._connect("http://head:8265")
    assert [sorted(call) for call in calls] == [["address", "log_to_driver", "runtime_env"],
                                                ["address", "log_to_driver"]]


def test_another_init_error_is_not_swallowed(monkeypatch):
    import ray

    from pipeline import cluster

    def init(**kwargs):
        raise ValueError("Invalid address")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="Invalid address"):
        cluster._connect("nowhere")


RAY_LLM_LOGGING_SETUP = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[logging.FileHandler(sys.argv[1])])
from pipeline.logs import root_logging_kept
with root_logging_kept():
    from ray.llm._internal.serve.observability import setup_observability
    setup_observability()  # what importing ray.serve.llm runs (tests/e2e's serve test reads the job's real log)
    print([type(handler).__name__ for handler in logging.getLogger().handlers])
logging.getLogger("pipeline.serving.job").info("serving at http://127.0.0.1:8000/v1")
"""


def test_the_serve_jobs_log_file_survives_ray_llms_logging_setup(tmp_path):
    """ray.serve.llm's import replaces the root logger's handlers with its JSON one on stderr (printed from inside
    the block): the serve job's log file stopped at "starting a local Ray"."""
    import subprocess
    import sys

    log_file = tmp_path / "serve.log"
    done = subprocess.run([sys.executable, "-c", RAY_LLM_LOGGING_SETUP, str(log_file)], check=True,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-1] == "['StreamHandler']"
    assert "serving at http://127.0.0.1:8000/v1" in log_file.read_text()


def test_a_jobs_error_line_reaches_its_log_file_too(tmp_path, capsys):
    """The line went to stderr only: the log of a job that failed in a stage ended without saying why."""
    from pipeline.entry import run_guarded
    from pipeline.errors import PipelineError

    handler = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        def failing():
            logging.getLogger("pipeline.runner").warning("stage train")
            raise PipelineError("train: the Ray Train run failed: boom")

        assert run_guarded(failing) == 2
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert capsys.readouterr().err == "error: train: the Ray Train run failed: boom\n"
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith(
        "error: train: the Ray Train run failed: boom")
