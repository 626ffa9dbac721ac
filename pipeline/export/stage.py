"""Stage 6: export the drafter in the speculators format and register it in the MLflow model registry."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

from pipeline.checkpoint import load_checkpoint
from pipeline.context import Context
from pipeline.errors import first_line
from pipeline.evaluation.gate import tau_tag
from pipeline.export.model_card import CARD_FILE, model_card, without_gate_decision
from pipeline.export.speculators_format import export_digest, export_speculators
from pipeline.fsutil import atomic_write_text
from pipeline.integrity import seal
from pipeline.paths import decoding_options

log = logging.getLogger(__name__)

ARTIFACT_PATH = "speculator"
DIGEST_TAG = "export.sha256"
UNEVALUATED = "unevaluated"  # the eval.signature of a version exported without an evaluation report


def registered_model_name(cfg) -> str:
    return cfg.tracking.registered_model_name or f"{cfg.verifier.name}-{cfg.drafter.name}"


def _version_tags(ctx: Context, config: dict, report: dict | None, lineage: dict) -> dict[str, str]:
    tags = {**{k: str(v) for k, v in lineage.items()},
            "algorithm": config["speculators_model_type"], "verifier": ctx.cfg.verifier.name}
    if report:
        tags["eval.pooled_tau"] = tau_tag(report["pooled_tau"])
        tags["eval.num_speculative_tokens"] = str(report["num_speculative_tokens"])  # eval.signature: identity
        if report.get("profile"):
            tags["eval.recommended_k"] = str(report["profile"]["recommended_k"])
    return tags


def version_identity(digest: str, report: dict | None) -> dict[str, str]:
    """What makes two registrations the same version: the export's bytes and the evaluation its tags and card
    describe (the same weights evaluated at another K or on other prompts get their own version, so a version's
    figures and the gate's decisions on it always belong to one evaluation). Returns version tags."""
    return {DIGEST_TAG: digest, "eval.signature": (report or {}).get("signature") or UNEVALUATED}


class Registration(NamedTuple):
    name: str
    version: str
    created: bool  # False: an identical earlier registration was reused


def _register(ctx: Context, run_id: str, config: dict, digest: str, report: dict | None,
              lineage: dict) -> Registration:
    """The version holding this export and evaluation: an earlier one reused, else one registered now. A reused
    version whose run no longer exists (deleted for good by `mlflow gc`) can never hold files again: it is removed
    and the export registered anew."""
    name = registered_model_name(ctx.cfg)
    tracker = ctx.tracking("export")
    tags, identity = _version_tags(ctx, config, report, lineage), version_identity(digest, report)
    version, created = tracker.register_once(name, ARTIFACT_PATH, run_id, tags, identity)
    while not created and tracker.version_files(name, version).run_id is None:  # each such version, oldest first
        log.warning("export: %s version %s points at a run that no longer exists; registering the export again",
                    name, version)
        tracker.delete_version(name, version, missing_ok=True)  # another job may have removed it first
        version, created = tracker.register_once(name, ARTIFACT_PATH, run_id, tags, identity)
    if created:
        log.info("export: registered %s version %s", name, version)
    ctx.set_tags({"registry.name": name, "registry.version": version, "registry.reused": not created})
    return Registration(name, version, created)


def _publish(ctx: Context, folder: Path, card: str, registered: Registration | None, describe: bool) -> None:
    """Write the card into the export and upload the folder to where its registered version points, then mark the
    version's files complete (tracking.FILES_TAG); `describe`: set the card as the version's description too (a new
    version, or a reused one that has none). A reused version whose files are all there is not uploaded again (one
    registered before the tag existed is tagged then); one whose upload never finished (a job stopped while
    exporting it) gets its files now, in the run it points at. A version this call registered is removed again
    when its upload fails or is stopped, as far as the store lets (one it cannot remove is completed by the next
    run), so the registry never keeps pointing at missing files. Without registration the folder goes to this
    stage's run."""
    atomic_write_text(folder / CARD_FILE, card)
    seal(folder)  # what a server that downloads this version checks before serving it
    if registered is None:
        ctx.log_artifact(folder, ARTIFACT_PATH)
        return
    tracker = ctx.tracking("export")
    where = tracker.version_files(registered.name, registered.version)
    # a card written now (`describe`) is not the one an earlier upload holds: its files go up again with it
    reusable = not registered.created and not describe and _uploaded_already(tracker, where, folder)
    if not where.complete and not reusable:
        if not registered.created:
            log.warning("export: %s version %s has incomplete files (a job stopped while exporting it); uploading "
                        "them now", registered.name, registered.version)
        try:
            tracker.log_artifact(folder, where.artifact_path, run_id=where.run_id)
        except BaseException:
            if registered.created:
                _remove_unfinished(tracker, registered)
            raise
    if describe:
        tracker.describe_version(registered.name, registered.version, card)
    if not where.complete:
        tracker.mark_files_complete(registered.name, registered.version)


def _uploaded_already(tracker, where, folder: Path) -> bool:
    """Whether the version's artifact folder holds every file of `folder` at its size (the same export: its digest
    is the version's identity)."""
    listed = tracker.artifact_sizes(where.run_id, where.artifact_path)
    local = {path.relative_to(folder).as_posix(): path.stat().st_size for path in folder.rglob("*") if path.is_file()}
    return all(listed.get(name) == size for name, size in local.items())


def _remove_unfinished(tracker, registered: Registration) -> None:
    """Delete a version whose upload failed; a store that refuses now (SQLite locked by the interrupted write)
    leaves it for the next run to complete, and the upload's own error is what the job reports."""
    try:
        tracker.delete_version(registered.name, registered.version)
    except Exception as error:  # noqa: BLE001 - any store error: the next run completes the version
        log.warning("export: %s version %s left without complete files (%s); the next run of this config "
                    "uploads them", registered.name, registered.version, first_line(error))


def run(ctx: Context, checkpoint: Path, report: dict | None, run_id: str | None, lineage: dict) -> dict:
    """Export the checkpoint in the speculators format with its model card (README.md); when tracked, register it
    (or reuse the version an identical export and evaluation registered before) and log the folder. Returns
    {path, speculators_model_type, sha256} plus {registered_model, version, reused} when registered; raises
    PipelineError for a checkpoint the format cannot hold and MlflowException when the registry refuses."""
    model, _ = load_checkpoint(checkpoint)
    model.spec.extra.update(decoding_options(ctx.cfg.drafter))  # the export records them: DSpark's threshold
    folder = export_speculators(model, ctx.paths.export)
    config = json.loads((folder / "config.json").read_text())
    digest = export_digest(folder)
    log.info("export: speculators checkpoint (%s) at %s, sha256 %s", config["speculators_model_type"], folder, digest)
    result = {"path": str(folder), "speculators_model_type": config["speculators_model_type"], "sha256": digest}
    tracked = bool(ctx.tracker and run_id)
    registered = _register(ctx, run_id, config, digest, report, lineage) if (
        run_id and tracked and ctx.cfg.tracking.register) else None
    if registered:
        result.update({"registered_model": registered.name, "version": registered.version,
                       "reused": not registered.created})
    card = ""
    if registered and not registered.created:  # the reused version's own card: its labels and lineage
        card = without_gate_decision(ctx.tracking("export").version_description(registered.name,
                                                                                 registered.version))
    describe = not card.strip()  # a new export, or a reused version whose card was never written (a stopped job)
    if describe:
        card = model_card(ctx.cfg, config, str(folder), report, {**lineage, DIGEST_TAG: digest},
                          (registered.name, registered.version) if registered else None)
    if tracked:
        _publish(ctx, folder, card, registered, describe)
    else:
        atomic_write_text(folder / CARD_FILE, card)
        seal(folder)
    return result
