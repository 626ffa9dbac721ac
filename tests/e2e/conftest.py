"""The default run, shared by every end-to-end test that reads its outputs: the README's first command, with a
shorter training on fewer, shorter answers (DEFAULT_RUN_OVERRIDES), runs once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_job

REPO = Path(__file__).resolve().parents[2]


def run_pipeline(root: Path, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    """`python jobs/run_pipeline.py paths.root=<root> <overrides>` as a user runs it, with a local Ray and MLflow store
    whatever the environment names; fails the test with the job's stderr tail on a non-zero exit."""
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    result = run_job([sys.executable, "jobs/run_pipeline.py", f"paths.root={root}", *overrides], timeout, cwd=REPO,
                     env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


# The default config but a fraction of its work: 32 of HumanEval's prompts answered in up to 64 tokens, trained for
# 60 steps, and evaluated on the default's 8 held-out prompts at K=4 for 32 new tokens, not 64. The default (64 x 128
# tokens, 300 steps, 64 evaluated tokens) is 18 minutes here on 2 AVX2 cores, more than a third of CI's 50; this is
# about 6 alone. Measured here: 361 s alone against 418 s for 80 steps on answers of up to 96 tokens (regenerate 78
# s, capture 48, train 94, evaluate 65, vllm_eval 51), with a first-position acceptance of 0.41 and pooled tau 1.45
# (0.36 and 1.41 for the longer run). Every stage, backend and check is the default's.
DEFAULT_RUN_OVERRIDES = ("data.num_train=32", "generation.max_new_tokens=64", "training.max_steps=60",
                         "evaluation.max_new_tokens=32", "evaluation.profile_max_new_tokens=16")


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    """The output root of `python jobs/run_pipeline.py <DEFAULT_RUN_OVERRIDES>`. Tests that run more jobs on it pass
    the same overrides and add their own keys (another drafter) or only reuse; the rerun test in
    test_pipeline_job.py checks nothing is recomputed."""
    root = tmp_path_factory.mktemp("default")
    run_pipeline(root, *DEFAULT_RUN_OVERRIDES, timeout=2700)
    return root


def worst_capture_error(store: Path, hf) -> float:
    """Largest relative error (norm of the difference / norm) between the hidden states a store holds and what
    transformers (`hf`, an HFVerifier) captures for the same samples, over every stored layer."""
    from pipeline.data.store import iter_samples, verify_store

    manifest = verify_store(store)
    layers, worst = manifest["layer_ids"], 0.0
    for sample in iter_samples(store, manifest, layers[:-1], layers[-1]):
        expected = hf.capture([sample["input_ids"].tolist()], layers)[0]
        stored = {**dict(zip(layers[:-1], sample["aux"].float().split(manifest["hidden_size"], dim=-1))),
                  layers[-1]: sample["last"].float()}
        for layer_id in layers:
            error = (stored[layer_id] - expected[layer_id]).norm() / expected[layer_id].norm()
            worst = max(worst, float(error))
    return worst
