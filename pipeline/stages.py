"""The stages as the runner calls them: each takes (context, results of the earlier stages of this job, its MLflow
child run id) and finds its inputs in `results` or, when an earlier job made them, on disk under the content keys.
STAGES maps the one list of stage names (pipeline/config/schema.py STAGE_NAMES) to these functions."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from pipeline.config.schema import STAGE_NAMES
from pipeline.context import Context, load_saved_dataset
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)


def _prompts(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.data import stage

    return stage.run(ctx)


def _regenerate(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.data import stage as prompts
    from pipeline.generation.regenerate_stage import run_regenerate

    train, _ = results.get("prompts") or prompts.run(ctx)
    return run_regenerate(ctx, train)


def _capture(ctx: Context, results: dict, run_id: str) -> Any:
    from pipeline.generation.capture_stage import run_capture

    regenerated = results.get("regenerate")
    if regenerated is None:
        if not ctx.paths.regenerated.is_dir():
            raise PipelineError(f"capture: no regenerated set at {ctx.paths.regenerated}; run jobs/generate.py first")
        regenerated = load_saved_dataset(ctx.paths.regenerated, "capture")
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
    from pipeline.evaluation.eval_sets import trained_prompts

    train, held_out = results.get("prompts") or prompts.run(ctx)
    return stage.run(ctx, _final_checkpoint(ctx, results), held_out, trained_prompts(train))


def _report(ctx: Context, results: dict) -> dict | None:
    """This job's evaluation report, or an earlier job's of the same evaluation, or None."""
    from pipeline.evaluation.stage import load_report, report_is_of

    report = results.get("evaluate")
    if report is None and (ctx.paths.evaluation / "report.json").is_file():
        report = load_report(ctx.paths.evaluation)
        checkpoint = _final_checkpoint(ctx, results)
        if not report_is_of(report, checkpoint, ctx.paths.evaluation / "report.json"):  # made again since
            raise PipelineError(f"evaluate: the report in {ctx.paths.evaluation} was measured on other weights than "
                                f"those now at {checkpoint}; run the evaluate stage again")
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
        "lineage.evaluation_key": ctx.paths.evaluation_key,  # also the export folder's (paths.export)
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
    if "export" not in results:
        _check_export_is_of_checkpoint(export_dir, _final_checkpoint(ctx, results))
    return vllm_check.run(ctx, export_dir, report, load_requests(ctx.paths.evaluation))


def _check_export_is_of_checkpoint(export_dir: Path, checkpoint: Path) -> None:
    """An earlier job's export sealed before the checkpoint was (made again after failing its check) holds other
    weights than those the report measured: vLLM would cross-check, and promote gate, the wrong drafter."""
    from pipeline.integrity import sealed_at

    if sealed_at(export_dir) < sealed_at(checkpoint):
        raise PipelineError(f"vllm_eval: the export at {export_dir} was made before the checkpoint at {checkpoint} "
                            "was; run the export stage again")


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
                            results.get("vllm_eval") or vllm_check.load_result(ctx.paths.evaluation, report),
                            ctx.cfg.evaluation.gate)
    if decision.recorded:
        _card_with_gate_decision(ctx, exported["registered_model"], exported["version"], decision)
    ctx.set_tags({"gate.decision": "promoted" if decision.promote else "refused", "gate.reason": decision.reason})
    ctx.log_metrics({"gate.promoted": float(decision.promote)})
    return {"promoted": decision.promote, "reason": decision.reason, "alias": ctx.cfg.evaluation.gate.alias,
            "version": exported["version"]}


def _card_with_gate_decision(ctx: Context, name: str, version: str, decision: Any) -> None:
    """The version's card (its registry description) says what the gate decided, and how a refused one is served."""
    from pipeline.export.model_card import with_gate_decision

    tracker = ctx.tracking("promote")
    card = tracker.version_description(name, version)
    tracker.describe_version(name, version, with_gate_decision(card, name, version, decision.promote,
                                                               decision.reason, ctx.cfg.evaluation.gate.alias))


_STAGE_FUNCTIONS = {"prompts": _prompts, "regenerate": _regenerate, "capture": _capture, "train": _train,
                    "evaluate": _evaluate, "export": _export, "vllm_eval": _vllm_eval, "promote": _promote}
# In the order of the one list of stages (a stage missing here fails at import).
STAGES: dict[str, Callable[[Context, dict, str], Any]] = {name: _STAGE_FUNCTIONS[name] for name in STAGE_NAMES}
