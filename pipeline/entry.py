"""What every jobs/*.py entry point does around its stages: one line and exit 2 for bad input (a config Hydra
cannot compose, credentials in an override), exit 130/143 with a line on Ctrl-C/SIGTERM, the local Ray it started
stopped, and no Hydra folder left by a job that was refused. The stages themselves run in pipeline/runner.py."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from pipeline.cluster import (
    forget_stop_signals,
    shutdown_if_started_here,
    sigterm_received,
    stop_cleanly_on_signals,
)
from pipeline.config.schema import PathsConfig, PipelineConfig
from pipeline.errors import PipelineError
from pipeline.logs import setup_job_logging, to_log_files

INTERRUPTED = 130  # the shell's exit status for a process ended by SIGINT
TERMINATED = 143  # and by SIGTERM


# what a stopped job says it kept: the stage jobs'; jobs/serve.py says its own
KEPT_AND_RESUMES = "finished stages and checkpoints are kept, and the same command resumes"


def run_guarded(action: Callable[[], Any], cfg: PipelineConfig | None = None, stopped: str = KEPT_AND_RESUMES) -> int:
    """What every jobs/*.py entry point does: a clear one-line error and exit code 2 on bad input (INTERRUPTED on
    Ctrl-C, TERMINATED on SIGTERM where stop_cleanly_on_signals ran, each with a line saying so), and the local Ray
    it started stopped either way. With the job's Hydra `cfg`, a refused job also leaves no run folder
    (remove_unused_hydra_run_folder). `stopped` ends the line of a stopped job: what it kept and how to go on."""
    try:
        action()
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        if cfg is not None:
            remove_unused_hydra_run_folder(cfg)
        to_log_files(f"error: {error}")  # the log of a job that got as far as logging says how it ended
        return 2
    except KeyboardInterrupt:
        return _stopped(stopped)
    except SystemExit:
        if not sigterm_received():
            raise
        return _stopped(stopped)  # ray.get's SystemExit after our SIGTERM handler raised in its wait
    finally:
        shutdown_if_started_here()
    return 0


def _stopped(what_next: str) -> int:
    """Say what stopped the job, then `what_next`, and return its exit code. Told by the SIGTERM handler's flag, not
    the exception's class: ray.get turns the handler's Terminated into a plain KeyboardInterrupt (or SystemExit)."""
    terminated = sigterm_received()
    line = f"error: {'terminated (SIGTERM)' if terminated else 'interrupted (Ctrl-C)'}; {what_next}"
    print(line, file=sys.stderr)
    to_log_files(line)
    return TERMINATED if terminated else INTERRUPTED


def run_hydra_main(main: Callable[[], Any], stopped: str = KEPT_AND_RESUMES) -> None:
    """Call a jobs/*.py `@hydra.main` function. A config Hydra cannot compose (an unknown key, a wrong type, a
    group option that does not exist, a group set to null, an override it cannot parse) is one line naming the key
    and exit code 2, like every other bad input; Hydra alone prints several lines and exits 1. HYDRA_FULL_ERROR=1
    set by the user keeps Hydra's full report. `stopped`: as run_guarded's."""
    import os

    from hydra.errors import CompactHydraException

    from pipeline.config.registration import config_error_line, is_composition_error

    try:
        refuse_credentials_in_overrides(sys.argv[1:])
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    _note_absent_root(sys.argv[1:])
    forget_stop_signals()  # this process's job starts here: a signal from now on is its own
    stop_cleanly_on_signals()  # before Ray starts too (ray.init replaces it; ensure_ray puts it back)
    started = time.time()
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises what it cannot compose instead of printing it
    try:
        main()
    except (CompactHydraException, ValueError) as error:
        if not is_composition_error(error):
            raise
        print(f"error: {config_error_line(error, sys.argv[1:])}", file=sys.stderr)
        _remove_records_of_sweeps_that_ran_nothing(sys.argv[1:], started)
        sys.exit(2)
    except KeyboardInterrupt:  # before run_guarded's try (Hydra composing) or in its cleanup
        sys.exit(_stopped(stopped))
    except OSError as error:
        if not _raised_making_hydras_run_folder(error):
            raise
        # Hydra makes its run folder (under paths.root) before the job starts: a root that is a file or unwritable
        print(f"error: paths.root: cannot create Hydra's run folder '{error.filename}': {error.strerror or error}",
              file=sys.stderr)
        sys.exit(2)


URI_IN_OVERRIDE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,'\"()\[\]]*")


def refuse_credentials_in_overrides(arguments: list[str]) -> None:
    """A URI with credentials in a command-line override, refused before Hydra starts: under `-m` Hydra logs each
    job's overrides and saves them (multirun.yaml) before any job runs its own checks (validate). Each URI of a
    value is checked, a sweep's too (`key=uri1,uri2`); an empty paths.root too (Hydra's run folder goes under it).
    Raises PipelineError naming the key."""
    from pipeline.tracking import USER_INFO, refuse_credentials

    for argument in arguments:
        key, assigned, value = argument.partition("=")
        if assigned and not key.startswith("-"):
            for uri in URI_IN_OVERRIDE.findall(value):
                refuse_credentials(uri, key.lstrip("+~"))
            # a password with characters that end URI_IN_OVERRIDE's match: an '@' after a URI's end
            if USER_INFO.search(value) and "@" in URI_IN_OVERRIDE.sub("", value):
                raise PipelineError(f"{key.lstrip('+~')}: a URI in this override carries credentials (user:password@"
                                    "host); give them to the service through its environment instead, so they never "
                                    "reach params, logs or manifests")
            # Hydra makes its run folder under paths.root before validate: an empty one is the filesystem's root
            if key.lstrip("+") == "paths.root" and not value.strip("'\" "):
                raise PipelineError("paths.root: must name a folder (it is empty)")


_root_made_here: Path | None = None  # the top-most folder of paths.root that did not exist when the job started


def _command_line_root(arguments: list[str]) -> Path | None:
    """paths.root as the command line gives it (the last override), else the schema's default; None for one given
    through an interpolation or a sweep, which is not followed."""
    root = PathsConfig.root
    for argument in arguments:
        key, _, value = argument.partition("=")
        if key.lstrip("+") == "paths.root":
            root = value
    return None if "${" in root or "," in root else Path(root).expanduser()


def _note_absent_root(arguments: list[str]) -> None:
    """Remember the part of paths.root (the command line's, else the schema's default) that does not exist yet:
    Hydra makes it for its run folder before any check, and a refused job should leave nothing it made. A root
    given through an interpolation or a sweep is not followed."""
    global _root_made_here
    root = _command_line_root(arguments)
    if root is None:
        return
    path, top = root.absolute(), None
    while not path.exists() and path != path.parent:
        path, top = path.parent, path
    _root_made_here = top


def _remove_records_of_sweeps_that_ran_nothing(arguments: list[str], since: float) -> None:
    """Under `-m` Hydra writes the sweep's multirun.yaml (and makes paths.root for it) before it composes the first
    job: a sweep refused while composing ran nothing, and leaves neither. Removes each such record under the
    command line's paths.root written since `since` (epoch seconds) with nothing beside it, then the folders above
    it left empty, paths.root included when this job made it (_note_absent_root)."""
    if not {"-m", "--multirun"} & set(arguments):
        return
    root = _command_line_root(arguments)
    if root is None:
        return
    root_path = root.resolve()
    # the folders go while empty, up to paths.root, or up to the top-most folder of it this job made
    stop_at = _root_made_here.resolve().parent if _made_by_this_job(root_path) and _root_made_here else root_path
    for record in root_path.glob("hydra/multirun/*/*/multirun.yaml"):
        sweep = record.parent
        if record.stat().st_mtime < since - 1 or [entry.name for entry in sweep.iterdir()] != [record.name]:
            continue
        record.unlink()
        for empty in (sweep, *sweep.parents):
            if empty == stop_at:
                break
            try:
                empty.rmdir()
            except OSError:  # holds another sweep or run
                break


def _raised_making_hydras_run_folder(error: OSError) -> bool:
    """Whether `error` came from Hydra's own mkdir of the job's run folder (hydra.core.utils.run_job), before any
    job code ran, rather than from the job."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    for index, frame in enumerate(frames):
        if frame.name == "run_job" and frame.filename.replace("\\", "/").endswith("hydra/core/utils.py"):
            return all(later.filename.endswith("pathlib.py") for later in frames[index + 1:])
    return False


def run_job(cfg: PipelineConfig, job: str) -> int:
    """Run a job's stages (the config's `stages` for `pipeline`) with run_guarded. Returns the exit code."""
    from pipeline.runner import JOB_STAGES, run_stages  # the stages' imports (torch, datasets): not for serve

    setup_job_logging()
    stages = [str(stage) for stage in cfg.stages] if job == "pipeline" else JOB_STAGES[job]
    return run_guarded(lambda: run_stages(cfg, job, stages), cfg)


def remove_unused_hydra_run_folder(cfg: PipelineConfig) -> None:
    """Hydra makes its run folder under paths.root, with an empty job log, before any check runs: a job refused
    with nothing logged leaves nothing behind. Only this job's empty log goes, then each folder above it that is
    left empty, up to paths.root, which stays unless this job made it (_note_absent_root: then it goes too, with
    the folders above it the job made); a logged line, or another job's log, keeps its folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # called as a library (tests, benchmarks): Hydra made no folder
        return
    hydra = HydraConfig.get()
    folder = Path(hydra.runtime.output_dir).resolve()
    root = Path(cfg.paths.root).expanduser().resolve()
    own_log = folder / f"{hydra.job.name}.log"
    if root not in folder.parents or not own_log.is_file() or own_log.stat().st_size:
        return
    own_log.unlink()  # only this job's: another job started in the same second shares the folder
    sweep = Path(hydra.sweep.dir).resolve() if hydra.mode == RunMode.MULTIRUN else None
    for empty in (folder, *folder.parents):  # the run folder, the date folder, then hydra/, while empty
        if empty == root and not _made_by_this_job(root):
            break
        if _root_made_here is not None and empty == _root_made_here.resolve().parent:  # existed before the job
            break
        if empty == sweep:
            _remove_sweep_record_of_refused_sweep(sweep)
        try:
            empty.rmdir()
        except OSError:  # holds another run's log or folder
            break


def _made_by_this_job(root: Path) -> bool:
    """Whether paths.root lies in what did not exist before this job (_note_absent_root): then it goes too, once
    empty, up to the top-most folder the job made."""
    made = _root_made_here.resolve() if _root_made_here else None
    return made is not None and (root == made or made in root.parents)


def _remove_sweep_record_of_refused_sweep(sweep: Path) -> None:
    """Under `-m` Hydra saves the sweep's overrides (multirun.yaml) in the sweep folder before any job runs. A
    refused job exits, which ends the sweep (the basic launcher runs jobs one after another): with no earlier job's
    folder left beside it, the record is of a sweep that ran nothing, and goes."""
    record = sweep / "multirun.yaml"
    if [entry.name for entry in sweep.iterdir()] == [record.name]:
        record.unlink()
