"""Stage vllm_eval: the exported checkpoint in vLLM on the reference decoder's prompts and sampling settings.

vLLM's own spec-decode counters give the served tau; the gap to the reference tau is what the promotion gate
checks. vLLM runs as a child program (`pipeline.evaluation.vllm_runner`, whose docstring says why). The result
is content-addressed with the evaluation (same checkpoint, same settings), so a rerun reuses it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel, ConfigDict

from pipeline.context import Context
from pipeline.drafters import drafter_class
from pipeline.errors import PipelineError, read_json_object, required_fields
from pipeline.evaluation import gate
from pipeline.families import load_verifier_config, vllm_unsupported_reason
from pipeline.fsutil import atomic_write_text
from pipeline.metrics import served_figures

if TYPE_CHECKING:
    from pipeline.config.schema import VllmEvalConfig

log = logging.getLogger(__name__)

RESULT_FILE = "vllm.json"


def cross_check_off(vllm_cfg: VllmEvalConfig) -> bool:
    """Whether evaluation.vllm.enabled turns the vLLM cross-check off (auto and true run it where it can)."""
    return str(vllm_cfg.enabled).lower() == "false"


def skip_reason(enabled: str, algorithm: str, on_gpu: bool, verifier_model_type: str = "llama") -> Optional[str]:
    """Why the cross-check cannot run here (None: it runs). `enabled: true` turns a reason into an error.
    verifier_model_type: the verifier config's model_type; vLLM serves no drafter for some families
    (pipeline/families.py)."""
    if enabled == "false":
        return "evaluation.vllm.enabled is false"
    if vllm_unsupported_reason(verifier_model_type):
        reason = vllm_unsupported_reason(verifier_model_type)
    elif importlib.util.find_spec("vllm") is None:
        reason = "vLLM is not installed"
    elif not on_gpu and not drafter_class(algorithm).runs_on_vllm_cpu:
        reason = f"vLLM on CPU does not run {algorithm} drafters (its GPU model runner does)"
    else:
        return None
    if enabled == "true":
        raise PipelineError(f"evaluation.vllm.enabled is true but {reason}")
    return reason


def compare(report: dict, requests: list[dict], served: dict) -> dict:
    """The reference-vs-vLLM comparison the gate reads."""
    figures = served_figures(served["speculative"]["counters"])
    vllm_tokens = served["speculative"]["tokens"]
    result = {**figures, "reference_tau": report["pooled_tau"],
              "tau_gap": abs(figures["tau"] - report["pooled_tau"]) / report["pooled_tau"],
              "num_requests": len(requests)}
    if report["temperature"] == 0:
        same = [request["tokens"] == tokens for request, tokens in zip(requests, vllm_tokens)]
        result["requests_matching_reference"] = sum(same)
    if "baseline" in served:
        result["lossless"] = vllm_tokens == served["baseline"]["tokens"]
    return result


def judge_divergences(ctx: Context, requests: list[dict], vllm_tokens: list[list[int]]) -> dict:
    """At temperature 0, where vLLM's output differs from the reference's: each difference judged by the verifier
    (pipeline/evaluation/divergence.py), and `divergence_fault` (one line) when any is not a near-tie for the dtype."""
    from pipeline.evaluation import divergence
    from pipeline.verifier import DTYPES, load_verifier

    dtype_name = ctx.cfg.verifier.compute_dtype
    verifier, _ = load_verifier(ctx.verifier_path, dtype_name)
    found = divergence.judge(verifier, DTYPES[dtype_name], requests, vllm_tokens,
                             ctx.cfg.evaluation.vllm.near_tie_steps)
    judged: dict[str, Any] = {"divergences": [d.as_dict() for d in found]}
    reason = divergence.fault_reason(found)
    if reason:
        judged["divergence_fault"] = reason
    return judged


def release_cached_gpu_memory() -> None:
    """Give back the GPU memory this process's CUDA caching allocator still holds: the evaluate stage's reference
    decoder loaded the whole verifier here, and the vLLM child on the same GPUs needs that memory. Nothing on CPU."""
    import gc

    import torch

    if torch.cuda.is_available():
        gc.collect()  # the verifier's tensors are unreferenced once the evaluate stage returned
        torch.cuda.empty_cache()


def _run_vllm(ctx: Context, export_dir: Path, requests: list[dict], report: dict) -> dict:
    eval_cfg = ctx.cfg.evaluation
    with tempfile.TemporaryDirectory(prefix="vllm-eval-") as scratch:
        prompts, out = Path(scratch) / "prompts.json", Path(scratch) / "result.json"
        prompts.write_text(json.dumps([r["prompt_ids"] for r in requests]))
        command = [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", ctx.verifier_path,
                   "--drafter", str(export_dir), "--num-speculative-tokens", str(report["num_speculative_tokens"]),
                   "--max-tokens", str(eval_cfg.max_new_tokens), "--prompts", str(prompts), "--out", str(out),
                   "--temperature", str(eval_cfg.temperature), "--seed", str(eval_cfg.seed),
                   "--dtype", ctx.cfg.verifier.compute_dtype, "--max-model-len", str(eval_cfg.vllm.max_model_len),
                   "--memory-fraction", str(eval_cfg.vllm.memory_fraction),
                   "--tensor-parallel-size", str(eval_cfg.vllm.tensor_parallel_size)]
        if eval_cfg.vllm.kv_cache_gb:
            command += ["--kv-cache-gb", str(eval_cfg.vllm.kv_cache_gb)]
        if eval_cfg.vllm.check_lossless and eval_cfg.temperature == 0:
            command.append("--baseline")
        log.info("vllm_eval: %d prompts in vLLM (K=%d)", len(requests), report["num_speculative_tokens"])
        release_cached_gpu_memory()
        try:
            finished = subprocess.run(command, capture_output=True, text=True, timeout=eval_cfg.vllm.timeout_s)
        except subprocess.TimeoutExpired as error:
            raise PipelineError(f"vllm_eval: vLLM did not finish in evaluation.vllm.timeout_s="
                                f"{eval_cfg.vllm.timeout_s} s") from error
        if finished.returncode != 0:
            tail = "\n".join(finished.stderr.strip().splitlines()[-15:])
            raise PipelineError(f"vllm_eval: vLLM failed on {export_dir} (exit {finished.returncode}):\n{tail}")
        return json.loads(out.read_text())


class ResultFigures(BaseModel):
    """What the stage's metrics and promote's gate read back from a cross-check (vllm.json; compare writes them
    all), strictly as JSON kinds: true is no number."""
    model_config = ConfigDict(strict=True, extra="allow")
    tau: float
    tau_gap: float
    cumulative_acceptance: list[float]
    num_requests: int
    reference_tau: float
    requests_matching_reference: Optional[int] = None
    divergence_fault: Optional[str] = None
    lossless: Optional[bool] = None


RESULT_FIELDS = required_fields(ResultFigures)


def load_result(folder: Path, report: dict | None = None) -> dict:
    """An earlier job's cross-check of this evaluation, or {} when there is none, or when `report` is given and
    the cross-check served other weights than it measured (a checkpoint made again at the same path). A damaged
    one is a PipelineError naming the file (read_json), like every file the pipeline reads back."""
    path = folder / RESULT_FILE
    if not path.is_file():
        return {}
    result = read_json_object(path, "vllm_eval", "a finished cross-check", RESULT_FIELDS,
                              "delete it and run the vllm_eval stage again", schema=ResultFigures)
    if report is not None and result.get("checkpoint_digest") != report.get("checkpoint_digest"):
        log.info("vllm_eval: %s served other weights than the report measured; not reused", path)
        return {}
    return result


def run(ctx: Context, export_dir: Path, report: dict, requests: list[dict]) -> dict:
    import torch

    folder = ctx.paths.evaluation
    model_type = load_verifier_config(ctx.verifier_path).model_type
    reason = skip_reason(str(ctx.cfg.evaluation.vllm.enabled).lower(), report["drafter"], torch.cuda.is_available(),
                         model_type)
    if reason:
        log.warning("vllm_eval: skipped: %s", reason)
        ctx.set_tags({"vllm.skipped": reason})
        return {"skipped": reason}
    result = load_result(folder, report)
    reused = bool(result)
    if reused:
        log.info("vllm_eval: reusing %s", folder / RESULT_FILE)
        ctx.set_tags({"vllm.reused": True})
    else:
        served = _run_vllm(ctx, export_dir, requests, report)
        result = {**compare(report, requests, served), "checkpoint_digest": report.get("checkpoint_digest")}
        if result.get("requests_matching_reference", len(requests)) < len(requests):
            result.update(judge_divergences(ctx, requests, served["speculative"]["tokens"]))
        atomic_write_text(folder / RESULT_FILE, json.dumps(result, indent=1))
    metrics = {"vllm.tau": result["tau"], "vllm.tau_gap": result["tau_gap"], "vllm.reference_tau": report["pooled_tau"]}
    metrics.update({f"vllm.cum_alpha_pos{i + 1}": a for i, a in enumerate(result["cumulative_acceptance"])})
    if "requests_matching_reference" in result:
        metrics["vllm.requests_matching_reference"] = result["requests_matching_reference"]
    ctx.log_metrics(metrics)
    if not reused:  # the run that wrote it holds the file
        ctx.log_artifact(folder / RESULT_FILE, "eval")
    log.info("vllm_eval: vLLM tau %.3f vs reference %.3f (gap %.1f%%)%s", result["tau"], report["pooled_tau"],
             100 * result["tau_gap"], "" if result.get("lossless", True) else "; NOT LOSSLESS")
    matching = result.get("requests_matching_reference")
    if matching is not None and matching < result["num_requests"]:
        doubt = gate.divergence_doubt(result)
        if doubt:
            log.error("vllm_eval: %s; the gate will not promote this version", doubt)
        else:
            log.warning("vllm_eval: vLLM's output differs from the reference decoder's on %d of %d requests, each "
                        "at a near-tie for %s (numerics of another kernel)", result["num_requests"] - matching,
                        result["num_requests"], ctx.cfg.verifier.compute_dtype)
    if result.get("lossless") is False:
        raise PipelineError(f"vllm_eval: vLLM's speculative output differs from its plain decoding ({folder})")
    return result
