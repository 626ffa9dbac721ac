"""Stage 5: acceptance of the trained drafter on held-out prompts with the greedy reference decoder."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pipeline.context import Context
from pipeline.data.chat import prompt_ids, prompt_messages
from pipeline.errors import PipelineError
from pipeline.evaluation.metrics import expected_tau, per_request_tau
from pipeline.evaluation.reference_decoder import SpeculativeDecoder, verifier_greedy
from pipeline.evaluation.report import write_report
from pipeline.export.speculators_format import round_to_export_dtype
from pipeline.generation.verifier import load_verifier
from pipeline.training.checkpoint import load_checkpoint

log = logging.getLogger(__name__)


def evaluate_prompts(verifier, tokenizer, drafter, conversations: list[list[dict]], eval_cfg) -> dict:
    """Run the decoder on every conversation; compare with verifier.generate when asked. Returns the report."""
    decoder = SpeculativeDecoder(verifier, drafter, eval_cfg.num_speculative_tokens, eval_cfg.temperature,
                                 eval_cfg.seed)
    check_equivalence = eval_cfg.check_greedy_equivalence and eval_cfg.temperature == 0
    eos = tokenizer.eos_token_id
    per_request, mismatches, spec_seconds, plain_seconds, new_tokens = [], [], 0.0, 0.0, 0
    for index, messages in enumerate(conversations):
        prompt = prompt_ids(tokenizer, messages)
        started = time.perf_counter()
        tokens, counts = decoder.generate(prompt, eval_cfg.max_new_tokens, eos)
        spec_seconds += time.perf_counter() - started
        per_request.append(counts)
        new_tokens += len(tokens)
        if check_equivalence:
            started = time.perf_counter()
            reference = verifier_greedy(verifier, prompt, eval_cfg.max_new_tokens, eos)
            plain_seconds += time.perf_counter() - started
            if tokens != reference:
                mismatches.append(index)
    total = per_request[0]
    for counts in per_request[1:]:
        total = total.merge(counts)
    return {
        "num_requests": len(conversations),
        "num_speculative_tokens": eval_cfg.num_speculative_tokens,
        "new_tokens": new_tokens,
        "verify_steps": total.steps,
        "pooled_tau": total.tau,
        "per_request_tau": per_request_tau(per_request),
        "conditional_acceptance": total.conditional_acceptance,
        "cumulative_acceptance": total.cumulative_acceptance,
        "accepted_per_position": total.accepted_at,
        "accepted_tokens": total.accepted_tokens,
        "drafts_per_step": total.proposed_tokens / max(total.steps, 1),
        "expected_tau_from_alpha": expected_tau(total.conditional_acceptance),
        "per_request": [{"tau": c.tau, "steps": c.steps, "accepted_tokens": c.accepted_tokens} for c in per_request],
        "temperature": eval_cfg.temperature,
        "greedy_equivalence_checked": bool(check_equivalence),
        "greedy_mismatches": mismatches,
        "speculative_seconds": spec_seconds,
        "plain_seconds": plain_seconds,
    }


def run(ctx: Context, checkpoint: Path, held_out) -> dict:
    if len(held_out) == 0:
        raise PipelineError("evaluation: no held-out prompts (data.num_eval is 0)")
    drafter = round_to_export_dtype(load_checkpoint(checkpoint)[0])  # measure exactly what vLLM will load
    if hasattr(drafter, "confidence_threshold"):  # DSpark: the block truncation is a decoding setting
        drafter.confidence_threshold = float(ctx.cfg.evaluation.confidence_threshold)
    verifier, tokenizer = load_verifier(ctx.verifier_path, ctx.cfg.verifier.compute_dtype)
    drafter.to(verifier.device)
    conversations = [prompt_messages(row["messages"]) for row in held_out]
    log.info("evaluate: %d held-out prompts, K=%d", len(conversations), ctx.cfg.evaluation.num_speculative_tokens)
    report = evaluate_prompts(verifier, tokenizer, drafter, conversations, ctx.cfg.evaluation)
    report.update({"drafter": drafter.spec.algorithm, "verifier": ctx.cfg.verifier.name,
                   "confidence_threshold": getattr(drafter, "confidence_threshold", None),
                   "checkpoint": str(checkpoint), "dataset": ctx.cfg.data.name})
    folder = ctx.paths.evaluation
    write_report(report, folder)
    metrics = {"eval.pooled_tau": report["pooled_tau"], "eval.per_request_tau": report["per_request_tau"],
               "eval.greedy_mismatches": len(report["greedy_mismatches"]),
               "eval.drafts_per_step": report["drafts_per_step"]}
    metrics.update({f"eval.alpha_pos{i + 1}": a for i, a in enumerate(report["conditional_acceptance"])})
    metrics.update({f"eval.cum_acc_pos{i + 1}": a for i, a in enumerate(report["cumulative_acceptance"])})
    ctx.log_metrics(metrics)
    ctx.log_artifact(folder, "eval")
    log.info("evaluate: pooled tau %.3f, per-position acceptance %s", report["pooled_tau"],
             [round(a, 3) for a in report["conditional_acceptance"]])
    if report["greedy_mismatches"]:
        raise PipelineError(f"evaluation: the speculative decoder's output differs from verifier.generate on "
                            f"held-out prompts {report['greedy_mismatches']} (report in {folder})")
    return report


def load_report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())
