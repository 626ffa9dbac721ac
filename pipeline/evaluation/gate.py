"""The promotion gate: a registered version gets the `champion` alias only if it beats the current champion's
pooled tau on the same evaluation and vLLM serves it with the tau the reference decoder measured (within
`max_tau_gap`). Decisions are pure functions; `promote` applies one to the MLflow registry through the tracker.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def evaluation_signature(report: dict, requests: list[dict]) -> str:
    """What makes two pooled taus comparable: the same prompts, K, length and temperature on the same verifier."""
    content = {"prompts": [r["prompt_ids"] for r in requests], "k": report["num_speculative_tokens"],
               "max_new_tokens": report["max_new_tokens"], "temperature": report["temperature"],
               "verifier": report["verifier"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def decide(candidate_tau: float, tau_gap: Optional[float], signature: str, champion: Optional[dict],
           gate_cfg: Any, no_check_reason: str = "the vllm_eval stage did not run") -> Decision:
    """champion: the current champion version's tags (None when there is none)."""
    if tau_gap is None:
        return Decision(False, f"no vLLM cross-check ({no_check_reason}): the served tau is unknown")
    if tau_gap > gate_cfg.max_tau_gap:
        return Decision(False, f"reference-vs-vLLM tau gap {tau_gap:.1%} exceeds {gate_cfg.max_tau_gap:.1%}")
    if champion is None:
        return Decision(True, f"first champion (tau {candidate_tau:.3f}, vLLM gap {tau_gap:.1%})")
    if champion.get("eval.signature") != signature:
        return Decision(False, f"the champion (version {champion['version']}) was evaluated on other prompts or "
                               "settings; its tau is not comparable")
    champion_tau = float(champion["eval.pooled_tau"])
    if candidate_tau <= champion_tau + gate_cfg.min_tau_gain:
        return Decision(False, f"tau {candidate_tau:.4f} does not beat the champion's {champion_tau:.4f} "
                               f"(version {champion['version']}) by more than {gate_cfg.min_tau_gain}")
    return Decision(True, f"tau {candidate_tau:.4f} beats the champion's {champion_tau:.4f} "
                          f"(version {champion['version']}); vLLM gap {tau_gap:.1%}")


def promote(tracker: Any, name: str, version: str, report: dict, vllm_result: dict, gate_cfg: Any) -> Decision:
    """Decide for `version` of `name`, record the decision on the version, move the alias when it passes.
    The version that already holds the alias (a rerun that reused its registration) keeps it and its tags."""
    champion = tracker.alias_tags(name, gate_cfg.alias)
    if champion is not None and champion["version"] == str(version):
        decision = Decision(True, f"version {version} already holds {gate_cfg.alias}")
        log.info("promote: %s %s", name, decision.reason)
        return decision
    tau_gap = vllm_result.get("tau_gap")
    decision = decide(report["pooled_tau"], tau_gap, report["signature"], champion, gate_cfg,
                      vllm_result.get("skipped", "the vllm_eval stage did not run"))
    tags = {"gate.decision": "promoted" if decision.promote else "refused", "gate.reason": decision.reason}
    if tau_gap is not None:
        tags.update({"vllm.tau": f"{vllm_result['tau']:.4f}", "vllm.tau_gap": f"{tau_gap:.4f}"})
    tracker.set_version_tags(name, version, tags)
    if decision.promote:
        tracker.set_alias(name, gate_cfg.alias, version)
    log.info("promote: %s version %s %s as %s: %s", name, version, "promoted" if decision.promote else "NOT promoted",
             gate_cfg.alias, decision.reason)
    return decision
