"""Stage 6: export the drafter in the speculators format and register it in the MLflow model registry."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pipeline.context import Context
from pipeline.export.speculators_format import export_speculators
from pipeline.training.checkpoint import load_checkpoint

log = logging.getLogger(__name__)

ARTIFACT_PATH = "speculator"


def registered_model_name(cfg) -> str:
    return cfg.tracking.registered_model_name or f"{cfg.verifier.name}-{cfg.drafter.name}"


def run(ctx: Context, checkpoint: Path, report: dict | None, run_id: str | None, lineage: dict) -> dict:
    model, _ = load_checkpoint(checkpoint)
    if model.spec.algorithm == "dspark":  # record the truncation threshold the evaluation used
        model.spec.extra["confidence_threshold"] = float(ctx.cfg.evaluation.confidence_threshold)
    folder = export_speculators(model, ctx.paths.export)
    config = json.loads((folder / "config.json").read_text())
    log.info("export: speculators checkpoint (%s) at %s", config["speculators_model_type"], folder)
    result = {"path": str(folder), "speculators_model_type": config["speculators_model_type"]}
    if not (ctx.tracker and run_id):
        return result
    ctx.log_artifact(folder, ARTIFACT_PATH)
    if not ctx.cfg.tracking.register:
        return result
    tags = {**{k: str(v) for k, v in lineage.items()},
            "algorithm": config["speculators_model_type"], "verifier": ctx.cfg.verifier.name}
    if report:
        tags["eval.pooled_tau"] = f"{report['pooled_tau']:.4f}"
        tags["eval.num_speculative_tokens"] = str(report["num_speculative_tokens"])
        tags["eval.signature"] = report.get("signature", "")
        if report.get("profile"):
            tags["eval.recommended_k"] = str(report["profile"]["recommended_k"])
    name = registered_model_name(ctx.cfg)
    version = ctx.tracker.register(name, ARTIFACT_PATH, run_id, tags)
    log.info("export: registered %s version %s", name, version)
    ctx.set_tags({"registry.name": name, "registry.version": version})
    result.update({"registered_model": name, "version": version})
    return result
