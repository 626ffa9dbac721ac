"""Chains the stages: one MLflow parent run per job, one child run per stage. `jobs/*.py` call pipeline.entry's
`run_job`, which runs them here."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from pipeline.cluster import check_fits_local_ray, raise_if_stopped
from pipeline.config import validate
from pipeline.config.schema import PipelineConfig
from pipeline.context import Context
from pipeline.data.stage import prompts_saved
from pipeline.errors import PipelineError
from pipeline.fsutil import is_remote, output_folder_problem
from pipeline.locks import stage_lock
from pipeline.logs import quieted
from pipeline.paths import StagePaths
from pipeline.stages import STAGES
from pipeline.timings import TOTAL_METRIC, StageTimes, stage_metric
from pipeline.tracking import Tracker, check_tracking_uri, uses_named_store

log = logging.getLogger(__name__)

JOB_STAGES = {
    "generate": ["prompts", "regenerate", "capture"],
    "train": ["train"],
    "evaluate": ["evaluate", "export", "vllm_eval", "promote"],
}


def run_stages(cfg: PipelineConfig, job: str, stages: list[str]) -> dict:
    """Run `stages` in order under one parent run, each in its child run; log one line as each stage ends, each
    stage's seconds to the parent run (time.<stage>_s, and time.total_s), and a table of the times at the end,
    also when a stage fails. Every stage's lock is taken before any MLflow run is made (and before the local store
    under paths.root is; a store the user named is opened first), and held until that stage is done.
    Returns each stage's result by name (and the parent run's id); raises PipelineError for bad input or a stage
    another job holds, and whatever a stage raises."""
    from pipeline.drafters.build import check_configured_drafter
    from pipeline.families import check_verifier_family

    validate(cfg)
    check_tracking_uri(cfg)  # at once, like the config: the verifier's checks below may convert or fetch it first
    check_output_folders(cfg)  # before the verifier is converted or built into verifier.cache_dir
    ctx = Context.create(cfg, track=False)
    check_verifier_family(ctx.verifier_path)
    check_configured_drafter(cfg.drafter, ctx.verifier_path)
    check_input_files(cfg, stages, ctx.paths)
    check_fits_local_ray(cfg, stages, prompts_made=prompts_saved(ctx.paths.prompts))
    # A store the user named is opened before anything is made under paths.root (the stage locks): MLflow refuses
    # some URIs only when it opens them (a file store, a file that is no SQLite database), and a refused job
    # leaves nothing behind. The local store under paths.root is made only once the locks are held.
    user_store = Tracker(cfg) if uses_named_store(cfg) else None
    with contextlib.ExitStack() as held:
        # every stage's lock before any run: a job refused by another one leaves no run behind
        locks = {stage: held.enter_context(contextlib.ExitStack()) for stage in stages}
        for stage, lock in locks.items():
            lock.enter_context(stage_lock(ctx.paths.root, stage, ctx.paths.stage_key(stage)))
        ctx.tracker = user_store or Tracker(cfg)
        return _run_under_parent_run(ctx, job, locks)


def _run_under_parent_run(ctx: Context, job: str, locks: dict[str, contextlib.ExitStack]) -> dict:
    """Run the stages in `locks`' order, letting go of each one's lock once it is done: a job of another config
    that shares it (another drafter on the same store) need not wait for this job's later stages."""
    results: dict[str, Any] = {}
    times = StageTimes()
    with ctx.tracking(job).parent_run(job) as parent_run_id:
        results["_parent_run_id"] = parent_run_id
        completed = False
        try:
            for stage, lock in locks.items():
                _run_stage(ctx, stage, results, times)
                lock.close()
                raise_if_stopped()  # a stop signal whose exception a finalizer swallowed mid-stage
            completed = True
        finally:
            log.info("%s", times.table(job))
            _log_times(ctx, {TOTAL_METRIC: times.total}, strict=completed)
    return results


def check_output_folders(cfg: PipelineConfig) -> None:
    """The folders this job writes on this machine take a file, before any stage: paths.root, a local
    cluster.storage_path (an unwritable one failed in Ray Train's controller with a traceback) and
    verifier.cache_dir where a verifier is converted or built there. paths.cache alone is only a cache the local
    MLflow store may be seeded from. Raises PipelineError naming the field."""
    fields = ["paths.root", "cluster.storage_path"]
    if cfg.verifier.gguf_package or cfg.verifier.tiny:
        fields.append("verifier.cache_dir")
    for field in fields:
        value = str(OmegaConf.select(cast(DictConfig, cfg), field))  # the composed DictConfig it is
        if not is_remote(value):  # s3://, gs://: Ray Train writes it, not this machine
            problem = output_folder_problem(Path(value).expanduser(), field)
            if problem:
                raise PipelineError(problem)


def check_input_files(cfg: PipelineConfig, stages: list[str], paths: StagePaths) -> None:
    """The files this job's stages read that the config names, checked before any stage (validate cannot: on a
    cluster they live on its shared mount, not where the manifests are rendered): a jsonl/parquet prompt file, the
    file of each eval set evaluated, a training.resume_from folder, and what a stage reads that an earlier stage
    makes when this job does not run that one (_made_before). Raises PipelineError naming the field or the
    stage."""
    from pipeline.data.prompts import LOCAL_FILE_SOURCES, check_hub_dataset, load_prompts, prompt_file, split_prompts
    from pipeline.evaluation.eval_sets import read_named_set, set_config
    from pipeline.training.stage import own_latest_checkpoint

    splits = {"prompts", "regenerate", "evaluate"} & set(stages) and not prompts_saved(paths.prompts)
    if cfg.data.source in LOCAL_FILE_SOURCES:  # every stage's key holds the file's digest (paths.py)
        prompt_file(cfg.data)
    # A source read here in a moment (a local file, the packaged HumanEval), while a stage of this job will split
    # it (the stage reads it again, then logs what it left out): an empty, malformed or too small one, or more
    # prompts asked for than it holds, is refused before MLflow's store, a lock or a log
    if splits and (cfg.data.source in LOCAL_FILE_SOURCES or cfg.data.source == "humaneval"):
        with quieted(logging.getLogger("pipeline.data")):  # the stage reads it again, and logs
            split_prompts(load_prompts(cfg.data), cfg.data)
    elif cfg.data.source == "hub" and splits:
        check_hub_dataset(str(cfg.data.path), "data.path")
    if "evaluate" in stages:
        for name in cfg.evaluation.datasets:
            if name in cfg.evaluation.sets:
                definition = set_config(name, cfg.evaluation)
                if definition.source in LOCAL_FILE_SOURCES:
                    prompt_file(definition, f"evaluation.sets.{name}.path")
                    with quieted(logging.getLogger("pipeline.data")):  # the stage reads it again, and logs
                        read_named_set(name, cfg.evaluation)
                # a finished report is reused without its sets read again: an offline rerun of an online evaluation
                elif definition.source == "hub" and not (paths.evaluation / "report.json").is_file():
                    check_hub_dataset(str(definition.path), f"evaluation.sets.{name}.path")
    resume_from = cfg.training.resume_from
    # read only when the run has neither its final checkpoint nor one of its own to continue (training/stage.py)
    if "train" in stages and resume_from and not (paths.final_checkpoint / "spec.json").is_file() \
            and own_latest_checkpoint(cfg, paths) is None:
        _check_given_resume_point(Path(str(resume_from)).expanduser().resolve(), cfg.training.max_steps)
    for stage in stages:
        for maker, folder, marker, what, remedy in _made_before(stage, paths):
            if maker not in stages[:stages.index(stage)] and not (folder / marker).exists():
                raise PipelineError(f"{stage}: no {what} at {folder}; {remedy}")


def _check_given_resume_point(folder: Path, max_steps: int) -> None:
    """training.resume_from is a folder that leaves steps to train (its train_state.json's step, when it has a
    readable one: the train stage names what else is wrong with it)."""
    from pipeline.checkpoint import STATE_FILE
    from pipeline.training.stage import check_steps_left

    if not folder.is_dir():
        raise PipelineError(f"training.resume_from: '{folder}' is not a checkpoint folder (no such folder)")
    try:
        step = json.loads((folder / STATE_FILE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(step, int) and not isinstance(step, bool):
        check_steps_left(step, max_steps, folder)


def _made_before(stage: str, paths: StagePaths) -> list[tuple[str, Path, str, str, str]]:
    """What `stage` reads that an earlier stage makes, when this job does not run that stage first: (the stage
    that makes it, its folder, the file whose presence marks it made ("" for the folder itself), what it is, what
    to run). Each stage checks these itself too; checked here, a job missing one is refused before MLflow's
    store, its runs, a lock or a log is made."""
    trained = ("train", paths.final_checkpoint, "spec.json", "trained drafter",
               "run jobs/train.py with this config first")
    if stage == "capture":
        return [("regenerate", paths.regenerated, "", "regenerated set", "run jobs/generate.py first")]
    if stage == "train" and not (paths.final_checkpoint / "spec.json").is_file():  # reused without its store
        return [("capture", paths.store, "manifest.json", "hidden-state store (manifest.json)",
                 "run jobs/generate.py with this config first")]
    if stage in ("evaluate", "export"):
        return [trained]
    if stage == "vllm_eval":
        return [trained, ("evaluate", paths.evaluation, "report.json", "evaluation report", "run the evaluate stage"),
                ("export", paths.export, "config.json", "exported checkpoint", "run the export stage")]
    return []


def _run_stage(ctx: Context, stage: str, results: dict, times: StageTimes) -> None:
    log.info("stage %s", stage)
    start = time.perf_counter()
    try:
        with ctx.tracking(stage).child_run(stage) as run_id:
            raise_if_stopped()  # one dropped while MLflow opened the runs (SQLAlchemy's finalizers)
            results[stage] = STAGES[stage](ctx, results, run_id)
    except BaseException:
        seconds = times.add(stage, time.perf_counter() - start, failed=True)
        log.error("stage %s failed after %.1f s", stage, seconds)
        _log_times(ctx, {stage_metric(stage): seconds}, strict=False)
        raise
    seconds = times.add(stage, time.perf_counter() - start)
    log.info("stage %s done in %.1f s", stage, seconds)
    _log_times(ctx, {stage_metric(stage): seconds}, strict=True)


def _log_times(ctx: Context, metrics: dict, strict: bool) -> None:
    """Log to the active run, the parent once a child run has closed. Not strict (a stage's error is on its way
    out): a failure to log is a warning, so that it does not take the place of that error."""
    try:
        ctx.log_metrics(metrics)
    except Exception as error:
        if strict:
            raise
        log.warning("could not log %s to MLflow: %s", ", ".join(metrics), error)
