"""Chains the stages: one MLflow parent run per job, one child run per stage. `jobs/*.py` call `run_job`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from pipeline.cluster import shutdown_if_started_here
from pipeline.config import validate
from pipeline.config.schema import STAGE_NAMES
from pipeline.context import Context
from pipeline.errors import PipelineError
from pipeline.locks import stage_lock
from pipeline.logs import setup_job_logging
from pipeline.timings import TOTAL_METRIC, StageTimes, stage_metric

log = logging.getLogger(__name__)

JOB_STAGES = {
    "generate": ["prompts", "regenerate", "capture"],
    "train": ["train"],
    "evaluate": ["evaluate", "export", "vllm_eval", "promote"],
}


def _prompts(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.data import stage

    return stage.run(ctx)


def _regenerate(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.data import stage as prompts
    from pipeline.generation.regenerate_stage import run_regenerate

    train, _ = results.get("prompts") or prompts.run(ctx)
    return run_regenerate(ctx, train)


def _capture(ctx: Context, results: dict, run_id: str) -> Any:
    import datasets

    from pipeline.generation.capture_stage import run_capture

    regenerated = results.get("regenerate")
    if regenerated is None:
        if not ctx.paths.regenerated.is_dir():
            raise PipelineError(f"capture: no regenerated set at {ctx.paths.regenerated}; run jobs/generate.py first")
        regenerated = datasets.load_from_disk(str(ctx.paths.regenerated))
    return run_capture(ctx, regenerated)


def _train(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.training import stage

    return stage.run(ctx, run_id=run_id)


def _final_checkpoint(ctx: Context, results: dict):
    checkpoint = results.get("train") or ctx.paths.final_checkpoint
    if not (checkpoint / "spec.json").is_file():
        raise PipelineError(f"evaluate: no trained drafter at {checkpoint}; run jobs/train.py with this config first")
    return checkpoint


def _evaluate(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.data import stage as prompts
    from pipeline.evaluation import stage

    train, held_out = results.get("prompts") or prompts.run(ctx)
    return stage.run(ctx, _final_checkpoint(ctx, results), held_out, set(train["sample_id"]))


def _report(ctx: Context, results: dict) -> dict | None:
    """This job's evaluation report, or an earlier job's of the same evaluation, or None."""
    from pipeline.evaluation.stage import load_report

    report = results.get("evaluate")
    if report is None and (ctx.paths.evaluation / "report.json").is_file():
        report = load_report(ctx.paths.evaluation)
    return report


def _required_report(ctx: Context, results: dict, required_by: str) -> dict:
    report = _report(ctx, results)
    if report is None:
        raise PipelineError(f"{required_by}: no evaluation report at {ctx.paths.evaluation}; run the evaluate stage")
    return report


def _export(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.export import stage

    report = _report(ctx, results)
    lineage = {
        "lineage.prompts_key": ctx.paths.prompts_key,
        "lineage.regenerated_key": ctx.paths.regenerated_key,
        "lineage.store_key": ctx.paths.store_key,
        "lineage.train_key": ctx.paths.train_key,
        "lineage.parent_run_id": results.get("_parent_run_id", ""),
    }
    return stage.run(ctx, _final_checkpoint(ctx, results), report, run_id, lineage)


def _vllm_eval(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.evaluation import vllm_check
    from pipeline.evaluation.stage import load_requests

    report = _required_report(ctx, results, "vllm_eval")
    export_dir = Path((results.get("export") or {}).get("path") or ctx.paths.export)
    if not (export_dir / "config.json").is_file():
        raise PipelineError(f"vllm_eval: no exported checkpoint at {export_dir}; run the export stage")
    return vllm_check.run(ctx, export_dir, report, load_requests(ctx.paths.evaluation))


def _promote(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.evaluation import gate, vllm_check

    exported = results.get("export") or {}
    if "version" not in exported:  # the gate only ever moves an alias to a version this job registered
        reason = "no version registered in this job (the export stage did not run or tracking.register is false)"
        log.warning("promote: skipped: %s", reason)
        ctx.set_tags({"gate.decision": "skipped", "gate.reason": reason})
        return {"promoted": False, "reason": reason}
    report = _required_report(ctx, results, "promote")
    decision = gate.promote(ctx.tracking("promote"), exported["registered_model"], exported["version"], report,
                            results.get("vllm_eval") or vllm_check.load_result(ctx.paths.evaluation),
                            ctx.cfg.evaluation.gate)
    ctx.set_tags({"gate.decision": "promoted" if decision.promote else "refused", "gate.reason": decision.reason})
    ctx.log_metrics({"gate.promoted": float(decision.promote)})
    return {"promoted": decision.promote, "reason": decision.reason, "alias": ctx.cfg.evaluation.gate.alias,
            "version": exported["version"]}


_STAGE_FUNCTIONS = {"prompts": _prompts, "regenerate": _regenerate, "capture": _capture, "train": _train,
                    "evaluate": _evaluate, "export": _export, "vllm_eval": _vllm_eval, "promote": _promote}
# In the order of the one list of stages (a stage missing here fails at import).
STAGES: dict[str, Callable[[Context, dict, str], Any]] = {name: _STAGE_FUNCTIONS[name] for name in STAGE_NAMES}


def run_stages(cfg: DictConfig, job: str, stages: list[str]) -> dict:
    """Run `stages` in order under one parent run, each in its child run; log one line as each stage ends, each
    stage's seconds to the parent run (time.<stage>_s, and time.total_s), and a table of the times at the end,
    also when a stage fails. Returns each stage's result by name (and the parent run's id); raises PipelineError
    for bad input, and whatever a stage raises."""
    from pipeline.drafters.build import check_configured_aux_layers
    from pipeline.families import check_verifier_family

    validate(cfg)
    ctx = Context.create(cfg)
    check_verifier_family(ctx.verifier_path)
    check_configured_aux_layers(cfg.drafter, ctx.verifier_path)
    results: dict[str, Any] = {}
    times = StageTimes()
    with ctx.tracking(job).parent_run(job) as parent_run_id:
        results["_parent_run_id"] = parent_run_id
        completed = False
        try:
            for stage in stages:
                _run_stage(ctx, stage, results, times)
            completed = True
        finally:
            log.info("%s", times.table(job))
            _log_times(ctx, {TOTAL_METRIC: times.total}, strict=completed)
    return results


def _run_stage(ctx: Context, stage: str, results: dict, times: StageTimes) -> None:
    log.info("stage %s", stage)
    start = time.perf_counter()
    try:
        lock = stage_lock(ctx.paths.root, stage, ctx.paths.stage_key(stage))
        with lock, ctx.tracking(stage).child_run(stage) as run_id:
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


def run_guarded(action: Callable[[], Any]) -> int:
    """What every jobs/*.py entry point does: a clear one-line error and exit code 2 on bad input, and the local
    Ray it started stopped either way."""
    try:
        action()
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        shutdown_if_started_here()
    return 0


def run_job(cfg: DictConfig, job: str) -> int:
    """Run a job's stages (the config's `stages` for `pipeline`) with run_guarded. Returns the exit code."""
    setup_job_logging()
    stages = list(cfg.stages) if job == "pipeline" else JOB_STAGES[job]
    return run_guarded(lambda: run_stages(cfg, job, stages))
