"""The promotion gate against a real MLflow registry (a SQLite store): it moves `champion` only to a version that
beats the champion's tau on the same evaluation and that vLLM serves within the allowed tau gap."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipeline.config import compose
from pipeline.config.schema import GateConfig
from pipeline.evaluation.gate import decide, evaluation_signature, promote
from pipeline.tracking import Tracker

GATE = OmegaConf.structured(GateConfig)
REQUESTS = [{"prompt_ids": [1, 2, 3], "tokens": [4]}]


def report(tau: float, k: int = 4) -> dict:
    values = {"pooled_tau": tau, "num_speculative_tokens": k, "max_new_tokens": 64, "temperature": 0.0,
              "verifier": "v"}
    return {**values, "signature": evaluation_signature(values, REQUESTS)}


def served(gap: float | None) -> dict:
    return {"skipped": "vLLM is not installed"} if gap is None else {"tau": 1.5, "tau_gap": gap}


@pytest.fixture
def registry(tmp_path):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    with tracker.parent_run("evaluate") as run_id:
        def register(tau: float, gap: float | None, k: int = 4):
            candidate = report(tau, k)
            version = tracker.register("m", "speculator", run_id, {"eval.pooled_tau": str(tau),
                                                                    "eval.signature": candidate["signature"]})
            return version, promote(tracker, "m", version, candidate, served(gap), GATE)
        yield tracker, register


def champion(tracker) -> str | None:
    tags = tracker.alias_tags("m", "champion")
    return tags and tags["version"]


def test_the_gate_promotes_only_better_checkpoints_that_vllm_serves_alike(registry):
    tracker, register = registry
    first, decision = register(1.50, 0.01)
    assert decision.promote and champion(tracker) == first

    worse, decision = register(1.40, 0.01)
    assert not decision.promote and "does not beat" in decision.reason
    assert champion(tracker) == first
    assert tracker.client.get_model_version("m", worse).tags["gate.decision"] == "refused"

    equal, decision = register(1.50, 0.0)
    assert not decision.promote and champion(tracker) == first

    _, decision = register(1.70, 0.05)  # better, but vLLM serves it 5% away from what we measured
    assert not decision.promote and "gap" in decision.reason and champion(tracker) == first

    _, decision = register(1.70, None)  # better, but nobody checked it in vLLM
    assert not decision.promote and "vLLM is not installed" in decision.reason

    _, decision = register(1.90, 0.0, k=3)  # better, on another K: not comparable
    assert not decision.promote and "not comparable" in decision.reason

    better, decision = register(1.60, 0.02)
    assert decision.promote and champion(tracker) == better
    assert tracker.client.get_model_version("m", better).tags["vllm.tau_gap"] == "0.0200"


def test_a_drafter_whose_drafts_are_never_accepted_is_never_promoted():
    refused = decide(1.0, 0.0, "s", None, GATE)
    assert not refused.promote and "no draft was accepted" in refused.reason
    assert decide(1.01, 0.0, "s", None, GATE).promote


@pytest.mark.parametrize("tau,gap", [(float("nan"), 0.0), (float("inf"), 0.0), (1.5, float("nan")),
                                     (1.5, float("-inf"))])
def test_a_tau_or_gap_that_is_no_finite_number_is_never_promoted(tau, gap):
    """NaN compares false with every threshold: read from a damaged report or cross-check it would pass them all."""
    refused = decide(tau, gap, "s", None, GATE)
    assert not refused.promote and "not a finite number" in refused.reason


@pytest.mark.parametrize("edited", ["1.5x", "nan", "inf", "", None])
def test_a_champion_whose_tau_tag_was_edited_to_no_number_is_not_replaced_on_doubt(edited):
    signature = report(1.5)["signature"]
    holder = {"eval.signature": signature, "version": "1"}
    if edited is not None:
        holder["eval.pooled_tau"] = edited
    refused = decide(1.9, 0.0, signature, holder, GATE)
    assert not refused.promote and "eval.pooled_tau tag" in refused.reason


def test_a_promoted_version_with_an_edited_tau_tag_cannot_take_the_alias_back(registry):
    tracker, register = registry
    first, _ = register(1.50, 0.01)
    second, decision = register(1.60, 0.01)
    assert decision.promote and champion(tracker) == second
    tracker.set_version_tags("m", first, {"eval.pooled_tau": "9e999"})  # inf: it would win settle's max
    third, decision = register(1.70, 0.01)
    assert decision.promote and champion(tracker) == third


def test_gate_thresholds_are_settings():
    gate = OmegaConf.merge(GATE, {"max_tau_gap": 0.10, "min_tau_gain": 0.05})
    signature = report(1.5)["signature"]
    holder = {"eval.signature": signature, "eval.pooled_tau": "1.5", "version": "1"}
    assert decide(1.60, 0.08, signature, holder, gate).promote
    assert not decide(1.54, 0.0, signature, holder, gate).promote  # gains less than min_tau_gain


def test_the_champion_evaluated_again_keeps_its_alias_and_tags(registry):
    tracker, register = registry
    first, _ = register(1.50, 0.01)
    before = tracker.client.get_model_version("m", first).tags
    decision = promote(tracker, "m", first, report(1.50), served(0.01), GATE)  # a rerun that reused the version
    assert decision.promote and "already holds champion" in decision.reason
    assert champion(tracker) == first and tracker.client.get_model_version("m", first).tags == before


def test_a_failing_registry_read_is_an_error_and_never_promotes(registry, monkeypatch):
    from mlflow.exceptions import MlflowException

    from pipeline.errors import PipelineError

    tracker, register = registry
    first, _ = register(1.50, 0.01)
    candidate = report(1.90)
    version = tracker.register("m", "speculator", tracker.client.get_model_version("m", first).run_id,
                               {"eval.pooled_tau": "1.9", "eval.signature": candidate["signature"]})
    real_get = tracker.client.get_registered_model
    failures = [MlflowException("Service Unavailable", error_code="TEMPORARILY_UNAVAILABLE"),
                MlflowException("Permission denied", error_code="PERMISSION_DENIED"),
                ConnectionError("connection reset by peer")]
    for failure in failures:
        def failing(name, failure=failure):
            raise failure
        monkeypatch.setattr(tracker.client, "get_registered_model", failing)
        with pytest.raises(PipelineError, match="cannot read alias 'champion' of 'm'.*nothing is promoted on doubt"):
            promote(tracker, "m", version, candidate, served(0.01), GATE)
    monkeypatch.setattr(tracker.client, "get_registered_model", real_get)
    assert champion(tracker) == first
    assert "gate.decision" not in tracker.client.get_model_version("m", version).tags
    assert tracker.alias_tags("no-such-model", "champion") is None  # a model not registered yet: no champion


def test_concurrent_promotions_end_with_the_better_version(registry, monkeypatch):
    """Two promoters read the same champion; the better one writes first, the worse one last. Without settling,
    the alias ends at the worse version."""
    tracker, register = registry
    register(1.50, 0.01)
    stale_read = tracker.alias_tags("m", "champion")
    better, decision = register(2.00, 0.01)
    assert decision.promote and champion(tracker) == better
    reads = []
    real_read = tracker.alias_tags

    def read_before_the_other_promotion(name, alias):
        reads.append(alias)
        return stale_read if len(reads) == 1 else real_read(name, alias)

    monkeypatch.setattr(tracker, "alias_tags", read_before_the_other_promotion)
    worse, decision = register(1.80, 0.01)  # beats the stale champion (1.50), not the current one (2.00)
    assert decision.promote
    monkeypatch.setattr(tracker, "alias_tags", real_read)
    assert champion(tracker) == better
    assert tracker.client.get_model_version("m", worse).tags["gate.decision"] == "promoted"


def test_a_champion_an_operator_took_the_alias_from_is_never_put_back(registry, caplog):
    """An operator removed `champion` from a version; the next promotion's settle moved it back there, and the log
    named the new version as champion."""
    import time

    tracker, register = registry
    first, _ = register(1.50, 0.01)
    tracker.set_version_tags("m", first, {"gate.promoted_at": f"{time.time() - 3600:.3f}"})  # an hour ago
    tracker.client.delete_registered_model_alias("m", "champion")  # taken out of service
    with caplog.at_level("INFO", logger="pipeline.evaluation.gate"):
        second, decision = register(1.20, 0.01)  # worse, but there is no champion to beat
    assert decision.promote and champion(tracker) == second
    assert f"version {second} promoted as champion: first champion" in caplog.text
    # an operator's rollback (the alias moved from a better version back to an older one) is not undone either
    better, _ = register(1.80, 0.01)
    tracker.set_version_tags("m", better, {"gate.promoted_at": f"{time.time() - 600:.3f}"})  # ten minutes ago
    tracker.set_alias("m", "champion", second)
    third, decision = register(1.60, 0.01)
    assert decision.promote and champion(tracker) == third  # not `better`, which the operator took it from


def test_a_gain_below_the_tau_tags_precision_does_not_promote(registry):
    """The gate compared the unrounded tau with the champion's 4-decimal tag, and settle then saw a tie."""
    tracker, register = registry
    first, _ = register(1.50, 0.01)
    _, decision = register(1.50004, 0.01)
    assert not decision.promote and "does not beat" in decision.reason and champion(tracker) == first


@pytest.mark.parametrize("vllm_result, refused_for", [
    ({"tau": 1.5, "tau_gap": 0.0, "num_requests": 6, "requests_matching_reference": 5,
      "divergences": [{"near_tie": False}], "divergence_fault": "1 of vLLM's greedy outputs leave the reference's"},
     "1 of vLLM's greedy outputs"),
    # a result that records differences but never judged them (written before judging existed) is doubt too
    ({"tau": 1.5, "tau_gap": 0.0, "num_requests": 6, "requests_matching_reference": 4}, "never judged"),
])
def test_a_greedy_divergence_that_is_not_a_near_tie_is_never_promoted(registry, vllm_result, refused_for):
    tracker, _ = registry
    with tracker.parent_run("evaluate") as run_id:
        candidate = report(1.9)
        version = tracker.register("m", "speculator", run_id, {"eval.pooled_tau": "1.9",
                                                                "eval.signature": candidate["signature"]})
        decision = promote(tracker, "m", version, candidate, vllm_result, GATE)
    assert not decision.promote and refused_for in decision.reason
    assert champion(tracker) is None
    assert tracker.client.get_model_version("m", version).tags["gate.decision"] == "refused"


def test_divergences_all_at_near_ties_still_promote():
    vllm_result = {"tau": 1.5, "tau_gap": 0.0, "num_requests": 6, "requests_matching_reference": 5,
                   "divergences": [{"near_tie": True, "margin": 0.125, "tolerance": 0.5}]}
    from pipeline.evaluation.gate import divergence_doubt

    assert divergence_doubt(vllm_result) is None
    assert decide(1.9, 0.0, "s", None, GATE, lossless_doubt=divergence_doubt(vllm_result)).promote


def test_a_rerun_does_not_give_the_alias_back_to_a_version_that_lost_it(registry, caplog):
    """An operator took `champion` from the version; rerunning its job (which reuses the version) promoted it again
    as "first champion", undoing the operator's decision. Its tags stay as its promotion left them, so a deployment
    pinned to it still serves it."""
    tracker, register = registry
    first, _ = register(1.50, 0.01)
    tags_before = tracker.client.get_model_version("m", first).tags
    tracker.client.delete_registered_model_alias("m", "champion")  # taken out of service
    with caplog.at_level("INFO", logger="pipeline.evaluation.gate"):
        decision = promote(tracker, "m", first, report(1.50), served(0.01), GATE)  # the same job again
    assert not decision.promote and not decision.recorded and "has lost it since" in decision.reason
    assert champion(tracker) is None and f"version {first} NOT promoted as champion" in caplog.text
    assert tracker.client.get_model_version("m", first).tags == tags_before

    superseded, _ = register(1.60, 0.01)  # a version another one beat later is not put back either
    better, _ = register(1.80, 0.01)
    assert champion(tracker) == better
    assert not promote(tracker, "m", superseded, report(1.60), served(0.01), GATE).promote
    assert champion(tracker) == better

    refused, decision = register(1.70, None)  # never promoted (no vLLM check): judged again on a rerun
    assert not decision.promote
    assert not promote(tracker, "m", refused, report(1.70), served(0.01), GATE).promote  # 1.70 < 1.80
    assert "does not beat" in tracker.client.get_model_version("m", refused).tags["gate.reason"]


def test_a_version_stopped_before_its_alias_moved_is_judged_again_on_a_rerun(registry, monkeypatch):
    """The promotion's tags are written before the alias moves: a job stopped in between left a version tagged
    promoted that never held the alias, and its rerun must still be able to promote it."""
    tracker, register = registry
    register(1.50, 0.01)
    candidate = report(1.80)
    version = tracker.register("m", "speculator", tracker.client.search_model_versions("name = 'm'")[0].run_id,
                               {"eval.pooled_tau": "1.8", "eval.signature": candidate["signature"]})

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(tracker, "set_alias", stopped)
        with pytest.raises(KeyboardInterrupt):
            promote(tracker, "m", version, candidate, served(0.01), GATE)
    assert tracker.client.get_model_version("m", version).tags["gate.decision"] == "promoted"
    decision = promote(tracker, "m", version, candidate, served(0.01), GATE)  # the rerun
    assert decision.promote and champion(tracker) == version
    assert "gate.held_alias_at" in tracker.client.get_model_version("m", version).tags


def test_a_version_an_older_release_promoted_keeps_the_rerun_rule(registry):
    """Versions promoted before the held-alias tag existed carry only gate.decision=promoted: one that has lost the
    alias is still not given it back by a rerun."""
    tracker, register = registry
    first, _ = register(1.50, 0.01)
    for tag in ("gate.held_alias_at", "gate.alias_pending_at"):  # as an older release left it
        tracker.client.delete_model_version_tag("m", first, tag)
    tracker.client.delete_registered_model_alias("m", "champion")
    decision = promote(tracker, "m", first, report(1.50), served(0.01), GATE)
    assert not decision.promote and champion(tracker) is None
