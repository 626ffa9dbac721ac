"""What a job prints: the libraries' repeated internal lines quieted, every real warning and error kept.

The switches come first: environment variables the libraries read when they are imported (set for the driver
before it imports them, and for every Ray worker through the job's runtime_env). Lines that no switch reaches get
a filter on the one logger that emits them, matching the start of one known message at its usual level; any other
record, and the same message at a higher level, passes. Ray's workers install those filters at start through
`worker_process_setup_hook` (`ray_runtime_env`), since Ray Train reconfigures its loggers' levels after that.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, TextIO

# Read at import by Ray Data and datasets: the driver's own stage bars already show the progress, and without a
# terminal Ray Data logs a seven-line block every 10 s instead of a bar.
DRIVER_ENV = {
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}
# A bar inside an actor reaches the driver as one line per redraw ("Loading weights" of every verifier actor).
WORKER_ENV = {**DRIVER_ENV, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
WORKER_SETUP_HOOK = "pipeline.logs.setup_ray_worker"
LINE_INTERVAL_S = 30.0


@dataclass(frozen=True)
class Noise:
    """A known repeated line: the logger that emits it, the start of its message, the level it is emitted at, and
    whether its first occurrence is kept (it says something once, not every time)."""

    logger: str
    prefix: str
    level: int
    keep_first: bool = False


def ray_file_logger(relative_path: str) -> str:
    """The name of a logger that a Ray module creates with `logging.getLogger(__file__)`: the path of its source
    file under the installed `ray` package, e.g. ray_file_logger('train/v2/_internal/execution/context.py').
    Returns the path without importing Ray (a path under no folder when Ray is not installed); raises nothing."""
    spec = importlib.util.find_spec("ray")
    root = os.path.dirname(spec.origin) if spec and spec.origin else "<no ray>"
    return os.path.join(root, *relative_path.split("/"))


# This one Ray module names its logger by its file, not by its module.
RAY_TRAIN_CONTEXT_LOGGER = ray_file_logger("train/v2/_internal/execution/context.py")

KNOWN_NOISE = (
    # Ray Train's placement-group cleaner asks the State API every second; with no dashboard every ask fails.
    Noise("ray.train.v2._internal.execution.controller.placement_group_cleaner",
          "Failed to query Ray Train Controller actor state", logging.WARNING, keep_first=True),
    # Each rank logs each ray.train.report in full; the metrics are in MLflow and on the train bar.
    Noise(RAY_TRAIN_CONTEXT_LOGGER, "Reporting training result", logging.INFO),
    # Each rank logs each persisted checkpoint; the train stage logs the one it keeps.
    Noise("ray.train.v2._internal.execution.storage", "Checkpoint successfully created at", logging.INFO),
    # Ray Data's hint to turn back on the bars that the training feed turns off on purpose.
    Noise("ray.data._internal.progress", "Progress bars disabled", logging.WARNING),
)


class NoiseFilter(logging.Filter):
    """A logger filter that drops the records matching one of `noises` (same logger, message start, at or below
    the noise's level), except the first of a `keep_first` noise."""

    def __init__(self, noises: Iterable[Noise]):
        super().__init__()
        self._noises = tuple(noises)
        self._seen: set[Noise] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        """Returns False to drop `record`, True to let it through; raises nothing."""
        noise = self._match(record)
        if noise is None:
            return True
        if noise.keep_first and noise not in self._seen:
            self._seen.add(noise)
            return True
        return False

    def _match(self, record: logging.LogRecord) -> Optional[Noise]:
        for noise in self._noises:
            if record.name == noise.logger and record.levelno <= noise.level and \
                    record.getMessage().startswith(noise.prefix):
                return noise
        return None


def install_noise_filters(noises: Iterable[Noise] = KNOWN_NOISE) -> None:
    """Attach a NoiseFilter to each logger that `noises` names, once per logger (a second call adds nothing).
    A logger's own filter sees only the records it emits, and it survives `logging.config.dictConfig`, which
    Ray Train and Ray Data call after a worker starts. Returns None; raises nothing."""
    by_logger: dict[str, list[Noise]] = {}
    for noise in noises:
        by_logger.setdefault(noise.logger, []).append(noise)
    for name, rules in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, NoiseFilter) for existing in logger.filters):
            logger.addFilter(NoiseFilter(rules))


def setup_job_logging() -> None:
    """Quiet this driver process: the progress switches of DRIVER_ENV (a value already exported wins) and the
    known-noise filters. Call it where a job starts, before the job imports Ray Data or datasets. Returns None;
    raises nothing."""
    for key, value in DRIVER_ENV.items():
        os.environ.setdefault(key, value)
    install_noise_filters()


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Put back the root logger's handlers and level after the block: importing ray.serve.llm replaces them with
    one JSON handler on stderr (ray.llm's logging setup), which cut the job's own log file off mid-run."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers = handlers
        root.setLevel(level)


def to_log_files(line: str) -> None:
    """Write `line` (a job's last line, which goes to stderr with print) to the log files the job's logging writes
    (Hydra's `<job>.log`), where one still exists. Returns None; raises nothing."""
    record = logging.LogRecord("pipeline", logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and os.path.exists(handler.baseFilename):
            handler.handle(record)


def setup_ray_worker() -> None:
    """Ray's `worker_process_setup_hook`: installs the known-noise filters in each worker process of the job.
    Returns None; raises nothing."""
    install_noise_filters()


def ray_runtime_env() -> dict:
    """The runtime_env a job passes to `ray.init`: WORKER_ENV for every worker (a value exported in the driver
    wins) and the hook that installs the noise filters there. Returns a new dict; raises nothing."""
    return {"env_vars": {key: os.environ.get(key, value) for key, value in WORKER_ENV.items()},
            "worker_process_setup_hook": WORKER_SETUP_HOOK}


class LineWriter:
    """A file for tqdm where nobody sees a terminal (a log file; a Ray worker, whose output reaches the driver line
    by line): each redraw becomes one whole line, at most one every `interval_s` seconds. A redraw held back is
    written when the bar closes (tqdm's closing newline), so the last state is always shown."""

    def __init__(self, stream: TextIO, interval_s: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._stream = stream
        self.encoding = getattr(stream, "encoding", None)  # tqdm draws its bar in ASCII when this is unknown
        self._interval_s = interval_s
        self._clock = clock
        self._last: Optional[float] = None
        self._pending = ""

    def write(self, text: str) -> int:
        """Takes tqdm's carriage-return redraws and its closing newline; returns len(text); raises what the
        underlying stream raises."""
        line = text.replace("\r", "").strip()
        if line:
            self._redraw(line)
        elif "\n" in text and self._pending:
            self._emit(self._pending)
        return len(text)

    def flush(self) -> None:
        """Flushes the underlying stream; returns None."""
        self._stream.flush()

    def _redraw(self, line: str) -> None:
        if self._last is None or self._clock() - self._last >= self._interval_s:
            self._emit(line)
        else:
            self._pending = line

    def _emit(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()
        self._last = self._clock()
        self._pending = ""


def progress_bar(total: int, desc: str, *, initial: int = 0, unit: str = "it", disable: bool = False,
                 stream: Optional[TextIO] = None):
    """A tqdm bar on `stream` (default stderr): redrawn in place on a terminal, else written as whole lines
    through LineWriter (one every LINE_INTERVAL_S seconds, plus the last). Returns the tqdm instance; raises
    nothing."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    options = {"total": total, "initial": initial, "desc": desc, "unit": unit, "disable": disable}
    if _is_terminal(stream):
        return tqdm(file=stream, mininterval=5, **options)
    return tqdm(file=LineWriter(stream), mininterval=LINE_INTERVAL_S, **options)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def quieted(logger: logging.Logger) -> Iterator[None]:
    """Only errors from `logger` inside the block (a library's retry warnings, a file read ahead as a check), then
    its own level again."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
