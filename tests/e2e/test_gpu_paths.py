"""The GPU paths of capture, training (bf16 autocast, DeepSpeed ZeRO-2/3 on NCCL) and reference decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_every_gpu_path_of_capture_training_and_decoding_works(tmp_path, smollm2_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tokenizer", smollm2_path, "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=1200)
    report = json.loads(out.read_text()) if out.is_file() else {}
    failed = {k: v.get("error", v) for k, v in report.items() if isinstance(v, dict) and not v.get("ok")}
    assert result.returncode == 0 and report.get("all_ok"), (failed, result.stderr[-3000:])
    assert report["capture"]["gpu_vs_cpu_max_rel_diff"] < 1e-3
    for drafter in ("eagle3", "peagle", "dflash", "dspark", "dflash2"):  # gpu_check.DRAFTERS
        assert report[f"decode-{drafter}"]["mismatched_prompts"] == 0
        assert report[f"train-{drafter}"]["autocast"] == "torch.bfloat16"
