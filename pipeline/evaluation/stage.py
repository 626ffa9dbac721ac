"""Stage 5: acceptance of the trained drafter on the eval sets with the lossless reference decoder.

Writes report.json / report.md / acceptance.png (per eval set, pooled, and the speculation profile) and
requests.json (every prompt's token ids and the decoder's output) that the vLLM cross-check decodes again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pipeline.context import Context
from pipeline.data.chat import prompt_ids
from pipeline.errors import PipelineError, read_json, read_json_object, required_fields
from pipeline.evaluation.eval_sets import eval_sets
from pipeline.evaluation.gate import evaluation_signature
from pipeline.evaluation.measured_drafter import decoding_drafter
from pipeline.evaluation.profile import speculation_profile
from pipeline.evaluation.reference_decoder import SpeculativeDecoder, greedy_mismatches
from pipeline.evaluation.report import ReportFigures, write_report
from pipeline.evaluation.vllm_check import cross_check_off
from pipeline.fsutil import atomic_write_text
from pipeline.integrity import folder_digest
from pipeline.logs import progress_bar
from pipeline.metrics import AcceptanceCounts, expected_tau, merged, per_request_tau
from pipeline.paths import decoding_options
from pipeline.verifier import load_verifier, stop_token_ids

log = logging.getLogger(__name__)

REQUESTS_FILE = "requests.json"


def summarize(per_request: list[AcceptanceCounts]) -> dict:
    """The metric spec's figures over a list of requests."""
    total = merged(per_request)
    return {
        "num_requests": len(per_request),
        "verify_steps": total.steps,
        "pooled_tau": total.tau,
        "per_request_tau": per_request_tau(per_request),
        "conditional_acceptance": total.conditional_acceptance,
        "cumulative_acceptance": total.cumulative_acceptance,
        "accepted_per_position": total.accepted_at,
        "accepted_tokens": total.accepted_tokens,
        "drafts_per_step": total.proposed_tokens / max(total.steps, 1),
        "expected_tau_from_alpha": expected_tau(total.conditional_acceptance),
    }


def evaluate_prompts(verifier, tokenizer, drafter, conversations: list[list[dict]],
                     eval_cfg, set_name: str = "") -> tuple[dict, list[AcceptanceCounts]]:
    """Decode every conversation, `batch_size` at a time, under a progress bar of requests; when asked, check each
    output is what verifier.generate would give (`greedy_mismatches`).
    Returns the set's summary and each request's counts."""
    decoder = SpeculativeDecoder(verifier, drafter, eval_cfg.num_speculative_tokens, eval_cfg.temperature,
                                 eval_cfg.seed)
    check_equivalence = eval_cfg.check_greedy_equivalence and eval_cfg.temperature == 0
    stops = stop_token_ids(tokenizer, verifier.generation_config)
    prompts = [prompt_ids(tokenizer, messages) for messages in conversations]
    outputs, counts = [], []
    started = time.perf_counter()
    with progress_bar(len(prompts), f"evaluate {set_name}".strip(), unit="request") as progress:
        for start in range(0, len(prompts), eval_cfg.batch_size):
            for tokens, request_counts in decoder.generate_batch(prompts[start:start + eval_cfg.batch_size],
                                                                 eval_cfg.max_new_tokens, stops):
                outputs.append(tokens)
                counts.append(request_counts)
            progress.update(min(eval_cfg.batch_size, len(prompts) - start))
    spec_seconds = time.perf_counter() - started
    mismatches, check_seconds = [], 0.0
    if check_equivalence:  # one teacher-forced forward per request, not a second decode
        started = time.perf_counter()
        mismatches = greedy_mismatches(verifier, prompts, outputs, eval_cfg.max_new_tokens, stops,
                                       eval_cfg.batch_size, eval_cfg.vllm.near_tie_steps)
        check_seconds = time.perf_counter() - started
    return {
        **summarize(counts),
        "new_tokens": sum(len(tokens) for tokens in outputs),
        "per_request": [{"tau": c.tau, "steps": c.steps, "accepted_tokens": c.accepted_tokens} for c in counts],
        "greedy_equivalence_checked": bool(check_equivalence),
        "greedy_mismatches": mismatches,
        "speculative_seconds": spec_seconds,
        "equivalence_check_seconds": check_seconds,
        "requests": [{"prompt_ids": p, "tokens": t} for p, t in zip(prompts, outputs)],
    }, counts


def prompt_token_limit(verifier_config, eval_cfg) -> int:
    """The longest prompt (tokens) an eval set may hold: its longest decode (max_new_tokens, or the profile's) must
    fit the verifier's context (max_position_embeddings) and, unless the cross-check is off
    (evaluation.vllm.enabled=false), the context vLLM serves (evaluation.vllm.max_model_len), so the reference
    decoder and vLLM measure the same prompts."""
    text_config = verifier_config.get_text_config(decoder=True)
    contexts = [getattr(text_config, "max_position_embeddings", None)]
    if not cross_check_off(eval_cfg.vllm):
        contexts.append(eval_cfg.vllm.max_model_len)
    known = [context for context in contexts if context]
    decode = max(eval_cfg.max_new_tokens, eval_cfg.profile_max_new_tokens or 0)
    return (min(known) if known else eval_cfg.vllm.max_model_len) - decode


def fitting_prompts(set_name: str, conversations: list, tokenizer, limit: int) -> list:
    """The set's conversations whose prompt is at most `limit` tokens; the rest are left out, counted in a warning
    (as regenerate leaves out prompts past generation.max_length). Raises PipelineError naming the set when none
    fits."""
    kept = [messages for messages in conversations if len(prompt_ids(tokenizer, messages)) <= limit]
    if len(kept) < len(conversations):
        log.warning("evaluate: %s: left out %d of %d prompts longer than %d tokens (the context less the longest "
                    "decode)", set_name, len(conversations) - len(kept), len(conversations), limit)
    if conversations and not kept:
        raise PipelineError(f"evaluation.datasets: every prompt of eval set '{set_name}' is longer than {limit} "
                            "tokens (evaluation.vllm.max_model_len or the verifier's context, less "
                            "evaluation.max_new_tokens or profile_max_new_tokens)")
    return kept


def _load_drafter(ctx: Context, checkpoint: Path):
    return decoding_drafter(checkpoint, decoding_options(ctx.cfg.drafter))  # exactly what vLLM will load


def _profile(verifier, tokenizer, drafter, conversations: list[list[dict]], eval_cfg) -> dict | None:
    if eval_cfg.profile_prompts == 0:
        return None
    prompts = [prompt_ids(tokenizer, m) for m in conversations[: eval_cfg.profile_prompts]]
    max_new_tokens = eval_cfg.profile_max_new_tokens or eval_cfg.max_new_tokens
    log.info("evaluate: speculation profile, K = 1..%d on %d prompts of %d new tokens",
             eval_cfg.num_speculative_tokens, len(prompts), max_new_tokens)
    profile = speculation_profile(
        lambda k: SpeculativeDecoder(verifier, drafter, k, eval_cfg.temperature, eval_cfg.seed),
        prompts, max_new_tokens, stop_token_ids(tokenizer, verifier.generation_config),
        eval_cfg.num_speculative_tokens)
    return {**profile, "max_new_tokens": max_new_tokens}


def _metrics(report: dict) -> dict[str, float]:
    metrics = {"eval.pooled_tau": report["pooled_tau"], "eval.per_request_tau": report["per_request_tau"],
               "eval.greedy_mismatches": len(report["greedy_mismatches"]),
               "eval.drafts_per_step": report["drafts_per_step"]}
    metrics.update({f"eval.alpha_pos{i + 1}": a for i, a in enumerate(report["conditional_acceptance"])})
    metrics.update({f"eval.cum_alpha_pos{i + 1}": a for i, a in enumerate(report["cumulative_acceptance"])})
    for name, result in report["datasets"].items():
        metrics[f"eval.{name}.pooled_tau"] = result["pooled_tau"]
        metrics[f"eval.{name}.per_request_tau"] = result["per_request_tau"]
    if report.get("profile"):
        metrics["eval.recommended_k"] = report["profile"]["recommended_k"]
        for row in report["profile"]["per_k"]:
            metrics[f"eval.profile.k{row['k']}.tau"] = row["tau"]
            metrics[f"eval.profile.k{row['k']}.predicted_speedup"] = row["predicted_speedup"]
    return metrics


def _requests_of(per_set: dict[str, dict]) -> list[dict]:
    return [{"set": name, **request} for name, result in per_set.items() for request in result.pop("requests")]


def _finished_report(folder: Path, checkpoint: Path) -> dict | None:
    """A complete report of this checkpoint's weights under these settings (the folder is keyed by the training's
    key and the settings; a checkpoint made again under the same key is told apart by report_is_of)."""
    if not (folder / "report.json").is_file() or not (folder / REQUESTS_FILE).is_file():
        return None
    try:
        report = load_report(folder)
    except PipelineError as error:  # damaged after it was written (it is renamed into place whole): measure again
        log.warning("%s; measuring again", error)  # its message names the stage (read_json)
        return None
    if not report_is_of(report, checkpoint, folder / "report.json"):
        log.info("evaluate: the report in %s was measured on other weights; measuring again", folder)
        return None
    return report


def report_is_of(report: dict, checkpoint: Path, written: Path) -> bool:
    """Whether `report` (read from the file `written`) measured the weights now at `checkpoint`, which may have
    been made again under the same key after failing its integrity check: the digest of the checkpoint's integrity
    records (integrity.folder_digest), wherever the root now lies. A report written before reports carried the
    digest counts when it names this checkpoint, is newer than its records and no checkpoint was set aside
    beside it since (training/stage.py: _set_aside)."""
    from pipeline.integrity import sealed_at

    try:
        digest = folder_digest(checkpoint)
    except PipelineError:  # no readable records: nothing to tie a report to
        return False
    if "checkpoint_digest" in report:
        return report["checkpoint_digest"] == digest
    set_aside = any(checkpoint.parent.glob(f"{checkpoint.name}.damaged-*"))
    return report.get("checkpoint") == str(checkpoint) and not set_aside \
        and written.stat().st_mtime >= sealed_at(checkpoint)


def _publish(ctx: Context, report: dict, folder: Path, reused: bool = False) -> None:
    """The report's metrics on this stage's run, and its folder as the `eval` artifact unless reused (the run that
    wrote it holds the files; a rerun does not upload them again)."""
    ctx.log_metrics(_metrics(report))
    if not reused:
        ctx.log_artifact(folder, "eval")
    log.info("evaluate: pooled tau %.3f, per-position acceptance %s%s", report["pooled_tau"],
             [round(a, 3) for a in report["conditional_acceptance"]],
             f", recommended K {report['profile']['recommended_k']}" if report["profile"] else "")


def run(ctx: Context, checkpoint: Path, held_out, trained: set[str]) -> dict:
    """Evaluate the checkpoint on the held-out split and the named eval sets (less the `trained` prompt keys,
    eval_sets.trained_prompts), or reuse its finished report. Returns the report."""
    eval_cfg = ctx.cfg.evaluation
    folder = ctx.paths.evaluation
    finished = _finished_report(folder, checkpoint)
    if finished is not None:
        log.info("evaluate: reusing the finished report in %s", folder)
        ctx.set_tags({"eval.reused": True})
        _publish(ctx, finished, folder, reused=True)
        return finished
    if len(held_out) == 0 and "held_out" in eval_cfg.datasets:
        raise PipelineError("evaluation: no held-out prompts (data.num_eval is 0)")
    drafter = _load_drafter(ctx, checkpoint)
    verifier, tokenizer = load_verifier(ctx.verifier_path, ctx.cfg.verifier.compute_dtype)
    drafter.to(verifier.device)
    limit = prompt_token_limit(verifier.config, eval_cfg)
    sets = eval_sets(eval_cfg, held_out, trained, ctx.prompt_writer(),
                     fit=lambda name, conversations: fitting_prompts(name, conversations, tokenizer, limit),
                     file_sha256=ctx.paths.eval_set_sha256)
    per_set, all_counts = {}, []
    for name, conversations in sets.items():
        log.info("evaluate: %s, %d prompts, K=%d, batch %d", name, len(conversations),
                 eval_cfg.num_speculative_tokens, eval_cfg.batch_size)
        per_set[name], counts = evaluate_prompts(verifier, tokenizer, drafter, conversations, eval_cfg, name)
        all_counts += counts
        log.info("evaluate: %s pooled tau %.3f", name, per_set[name]["pooled_tau"])
    requests = _requests_of(per_set)
    mismatches = [f"{name}[{i}]" for name, result in per_set.items() for i in result["greedy_mismatches"]]
    report = {
        **summarize(all_counts),
        "num_speculative_tokens": eval_cfg.num_speculative_tokens,
        "temperature": eval_cfg.temperature,
        "max_new_tokens": eval_cfg.max_new_tokens,
        "greedy_equivalence_checked": bool(eval_cfg.check_greedy_equivalence and eval_cfg.temperature == 0),
        "greedy_mismatches": mismatches,
        "datasets": per_set,
        "drafter": drafter.spec.algorithm, "verifier": ctx.cfg.verifier.name,
        "confidence_threshold": drafter.decoding_options().get("confidence_threshold"),
        "checkpoint": str(checkpoint), "checkpoint_digest": folder_digest(checkpoint), "dataset": ctx.cfg.data.name,
    }
    report["signature"] = evaluation_signature(report, requests)
    if mismatches:  # kept for inspection, under a name a rerun never takes for a finished report
        write_report({**report, "profile": None}, folder / "failed")
        raise PipelineError(f"evaluation: the speculative decoder's output differs from verifier.generate on "
                            f"{mismatches} (report in {folder / 'failed'})")
    # Profiled only once the decoder is known lossless: a failing run would throw the minutes away.
    report["profile"] = _profile(verifier, tokenizer, drafter, next(iter(sets.values())), eval_cfg)
    atomic_write_text(folder / REQUESTS_FILE, json.dumps(requests))
    write_report(report, folder)  # report.json is written last: its presence marks a finished evaluation
    _publish(ctx, report, folder)
    return report


# What the later stages read from a report (export's card, vllm_eval, promote's gate, _publish).
REPORT_FIELDS = required_fields(ReportFigures)


def load_report(folder: Path) -> dict:
    """The evaluation report in `folder`; one that is not JSON, not an object, lacks a field the later stages
    read or holds another kind of value in one (report.ReportFigures) is a PipelineError naming the file and
    the field."""
    return read_json_object(folder / "report.json", "evaluate", "a finished evaluation report", REPORT_FIELDS,
                            "run the evaluate stage again", schema=ReportFigures)


def load_requests(folder: Path) -> list[dict]:
    return read_json(folder / REQUESTS_FILE, "evaluate")
