"""How vLLM runs one of our exports: its `speculative_config`, from the export's speculators_model_type and the
drafter class's vllm_method. Read by the vLLM evaluation (pipeline/evaluation/vllm_runner.py), the model card and
Ray Serve; light (json, no torch until a drafter class is looked up) since vllm_runner runs in its own process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def speculative_method(algorithm: str) -> dict[str, Any]:
    """The keys of vLLM's speculative_config that name how it runs a speculators_model_type (the drafter class's
    vllm_method: `method`, plus `parallel_drafting` for P-EAGLE). Never raises; an algorithm we do not train is
    passed through as the method."""
    from pipeline.drafters import DRAFTERS

    return DRAFTERS[algorithm].vllm_method() if algorithm in DRAFTERS else {"method": algorithm}


def speculative_config(drafter_dir: str, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's speculative_config for one of our exports, from its speculators_model_type."""
    algorithm = json.loads((Path(drafter_dir) / "config.json").read_text())["speculators_model_type"]
    config: dict[str, Any] = {"model": drafter_dir, "num_speculative_tokens": num_speculative_tokens}
    config.update(speculative_method(algorithm))
    return config
