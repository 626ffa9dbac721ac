"""The promotion gate: a registered version gets the `champion` alias only if it beats the current champion's
pooled tau on the same evaluation and vLLM serves it with the tau the reference decoder measured (within
`max_tau_gap`). Decisions are pure functions; `promote` applies one to the MLflow registry through the tracker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.config.schema import GateConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    recorded: bool = True  # False: the version's tags and card were left as an earlier decision wrote them


def evaluation_signature(report: dict, requests: list[dict]) -> str:
    """What makes two pooled taus comparable: the same prompts, K, length and temperature on the same verifier."""
    content = {"prompts": [r["prompt_ids"] for r in requests], "k": report["num_speculative_tokens"],
               "max_new_tokens": report["max_new_tokens"], "temperature": report["temperature"],
               "verifier": report["verifier"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def divergence_doubt(result: dict) -> Optional[str]:
    """Why vLLM's greedy output cannot be trusted as lossless (None: it can): a judged fault, or differences that
    were never judged (a result written before judging existed)."""
    if result.get("divergence_fault"):
        return result["divergence_fault"]
    matching = result.get("requests_matching_reference")
    if matching is not None and matching < result["num_requests"] and "divergences" not in result:
        return (f"vLLM's output differs from the reference's on {result['num_requests'] - matching} requests and "
                "the differences were never judged (delete the evaluation's vllm.json to rerun the check)")
    return None


def decide(candidate_tau: float, tau_gap: Optional[float], signature: str, champion: Optional[dict],
           gate_cfg: GateConfig, no_check_reason: str = "the vllm_eval stage did not run",
           lossless_doubt: Optional[str] = None) -> Decision:
    """champion: the current champion version's tags (None when there is none). lossless_doubt: why vLLM's greedy
    output is not trusted to be the verifier's (divergence_doubt), None when it is. A tau or gap that is not a
    finite number (a damaged report or cross-check, a champion's tag edited in MLflow) is doubt: refused."""
    if tau_gap is None:
        return Decision(False, f"no vLLM cross-check ({no_check_reason}): the served tau is unknown")
    if not math.isfinite(candidate_tau) or not math.isfinite(tau_gap):
        return Decision(False, f"tau {candidate_tau} or its vLLM gap {tau_gap} is not a finite number")
    if lossless_doubt:
        return Decision(False, f"vLLM's greedy output is not the verifier's: {lossless_doubt}")
    if tau_gap > gate_cfg.max_tau_gap:
        return Decision(False, f"reference-vs-vLLM tau gap {tau_gap:.1%} exceeds {gate_cfg.max_tau_gap:.1%}")
    if candidate_tau <= 1.0:  # every verifier step would pay for drafts and gain nothing
        return Decision(False, f"tau {candidate_tau:.3f}: no draft was accepted, so serving it can only be slower")
    if champion is None:
        return Decision(True, f"first champion (tau {candidate_tau:.3f}, vLLM gap {tau_gap:.1%})")
    if champion.get("eval.signature") != signature:
        return Decision(False, f"the champion (version {champion['version']}) was evaluated on other prompts or "
                               "settings; its tau is not comparable")
    champion_tau = tag_tau(champion)
    if champion_tau is None:
        return Decision(False, f"the champion's (version {champion['version']}) eval.pooled_tau tag "
                               f"{champion.get('eval.pooled_tau')!r} is no tau to compare with")
    if candidate_tau <= champion_tau + gate_cfg.min_tau_gain:
        return Decision(False, f"tau {candidate_tau:.4f} does not beat the champion's {champion_tau:.4f} "
                               f"(version {champion['version']}) by more than {gate_cfg.min_tau_gain}")
    return Decision(True, f"tau {candidate_tau:.4f} beats the champion's {champion_tau:.4f} "
                          f"(version {champion['version']}); vLLM gap {tau_gap:.1%}")


def _promoted_since(tags: dict, since: float) -> bool:
    """Whether a version's gate.promoted_at tag (epoch seconds) is at or after `since`; one without the tag (or
    with an edited one) was promoted before the tag existed, long before."""
    try:
        return float(tags["gate.promoted_at"]) >= since
    except (KeyError, TypeError, ValueError):
        return False


def tau_tag(tau: float) -> str:
    """A pooled tau as a version's eval.pooled_tau tag records it (the export stage writes it)."""
    return f"{tau:.4f}"


def tag_tau(tags: dict) -> Optional[float]:
    """A registered version's pooled tau from its eval.pooled_tau tag; None when the tag is missing or is not a
    finite number (tags can be edited in MLflow's UI)."""
    try:
        tau = float(tags["eval.pooled_tau"])
    except (KeyError, TypeError, ValueError):
        return None
    return tau if math.isfinite(tau) else None


# Set on a version once the alias is seen on it after its promotion (not at the promotion's tags, which a job stopped
# before it moved the alias also leaves; those carry ALIAS_PENDING_TAG): a rerun of its job never gives it back an
# alias it has lost. A version promoted by a release before these tags has neither and counts as having held it.
HELD_ALIAS_TAG = "gate.held_alias_at"
ALIAS_PENDING_TAG = "gate.alias_pending_at"


def held_alias_before(tags: dict[str, str]) -> bool:
    """Whether a version's tags say the alias was on it once (HELD_ALIAS_TAG, or promoted by an older release)."""
    return HELD_ALIAS_TAG in tags or (tags.get("gate.decision") == "promoted" and ALIAS_PENDING_TAG not in tags)


# How long before a promoter read the champion another promoter's promotion still counts as concurrent with it
# (tag, alias and settle take well under a second; the rest is clock skew between the nodes that promote, which
# must stay below it). A version promoted earlier that does not hold the alias lost it (superseded, or removed by
# an operator) and is not put back.
CONCURRENT_PROMOTION_S = 60.0


def promote(tracker: Any, name: str, version: str, report: dict, vllm_result: dict, gate_cfg: GateConfig) -> Decision:
    """Decide for `version` of `name`, record the decision on the version, move the alias when it passes.
    The version that already holds the alias (a rerun that reused its registration) keeps it and its tags; one
    promoted before that no longer holds it (superseded, or taken out of service by an operator) is not promoted
    again by a rerun."""
    read_at = time.time()
    champion = tracker.alias_tags(name, gate_cfg.alias)
    if champion is not None and champion["version"] == str(version):
        decision = Decision(True, f"version {version} already holds {gate_cfg.alias}")
        if HELD_ALIAS_TAG not in champion:  # promoted by a release before the tag
            tracker.set_version_tags(name, version, {HELD_ALIAS_TAG: f"{time.time():.3f}"})
        log.info("promote: %s %s", name, decision.reason)
        return decision
    if held_alias_before(tracker.version_tags(name, version)):
        # its tags and card keep their promotion: a deployment pinned to this version still serves it
        decision = Decision(False, f"version {version} held {gate_cfg.alias} before and has lost it since (to a "
                                   "better version, or taken back by an operator); a rerun does not give it back",
                            recorded=False)
        log.info("promote: %s version %s NOT promoted as %s: %s", name, version, gate_cfg.alias, decision.reason)
        return decision
    tau_gap = vllm_result.get("tau_gap")
    # the tau as its tag records it: settle_alias compares tags, and a gain below the tag's precision would win
    # the gate and tie there
    decision = decide(float(tau_tag(report["pooled_tau"])), tau_gap, report["signature"], champion, gate_cfg,
                      vllm_result.get("skipped", "the vllm_eval stage did not run"),
                      divergence_doubt(vllm_result) if tau_gap is not None else None)
    tags = {"gate.decision": "promoted" if decision.promote else "refused", "gate.reason": decision.reason}
    if decision.promote:
        tags["gate.promoted_at"] = tags[ALIAS_PENDING_TAG] = f"{time.time():.3f}"
    if tau_gap is not None:
        tags.update({"vllm.tau": f"{vllm_result['tau']:.4f}", "vllm.tau_gap": f"{tau_gap:.4f}"})
    tracker.set_version_tags(name, version, tags)  # before the alias moves: a concurrent promoter's settle sees it
    if not decision.promote:
        log.info("promote: %s version %s NOT promoted as %s: %s", name, version, gate_cfg.alias, decision.reason)
        return decision
    tracker.set_alias(name, gate_cfg.alias, version)
    holder = settle_alias(tracker, name, gate_cfg.alias, report["signature"], champion and champion["version"],
                          read_at - CONCURRENT_PROMOTION_S)
    if holder == str(version):
        tracker.set_version_tags(name, version, {HELD_ALIAS_TAG: f"{time.time():.3f}"})
        log.info("promote: %s version %s promoted as %s: %s", name, version, gate_cfg.alias, decision.reason)
    else:
        log.info("promote: %s version %s passed the gate (%s), but version %s, promoted at the same time with a "
                 "tau at least as high, holds %s", name, version, decision.reason, holder, gate_cfg.alias)
    return decision


def settle_alias(tracker: Any, name: str, alias: str, signature: str, seen: Optional[str], since: float,
                 max_rounds: int = 10) -> str:
    """After a promotion, point `alias` at the best promoted version of this evaluation, re-reading until a read
    after this promoter's last write shows it there. MLflow has no compare-and-set: two promoters that read the same
    champion both move the alias, and the later write could leave the worse one. Each writes its decision tag
    before its alias, so the last promoter to settle sees every promoted version and leaves the best. The versions
    it weighs are the champion this promoter read (`seen`) and those promoted since `since` (epoch seconds): one
    an operator took the alias from stays out. Ties keep the older version (a promotion needs a strictly higher
    tau). Returns the version the alias ends at."""
    for _ in range(max_rounds):
        promoted = [v for v in tracker.versions_tagged(name, {"gate.decision": "promoted", "eval.signature": signature})
                    if v["version"] == seen or _promoted_since(v, since)]
        taus = {v["version"]: tau for v in promoted if (tau := tag_tau(v)) is not None}  # an edited tag cannot win
        if not taus:
            raise PipelineError(f"registry: no promoted version of '{name}' has an eval.pooled_tau tag that is a "
                                "number; fix the tags in MLflow and rerun the promote stage")
        best = max(taus, key=lambda version: (taus[version], -int(version)))
        current = tracker.alias_tags(name, alias)
        if current is not None and current["version"] == best:
            return best
        log.info("promote: %s is at version %s; the best promoted version is %s, moving it", alias,
                 current and current["version"], best)
        tracker.set_alias(name, alias, best)
    raise PipelineError(f"registry: alias '{alias}' of '{name}' kept moving for {max_rounds} rounds (concurrent "
                        "promotions); rerun the promote stage")
