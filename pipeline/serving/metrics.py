"""Served acceptance: vLLM's spec-decode counters as Ray's metrics endpoint exports them, read with the metric spec.

Ray re-exports vLLM's Prometheus metrics with `:` turned into `_` and a `ray_` prefix, e.g.
`ray_vllm_spec_decode_num_accepted_tokens_total{model_name=...}`; every replica is a labelled series, summed here.
"""

from __future__ import annotations

import urllib.request
from typing import Optional

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(metrics_text: str, model_name: Optional[str] = None) -> dict:
    """{num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos} summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict = {name: 0 for name in COUNTERS}
    per_position: dict[int, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix("ray_").removeprefix("vllm_spec_decode_").removesuffix("_total")
            if not sample.name.removeprefix("ray_").startswith("vllm_spec_decode_"):
                continue
            if model_name and sample.labels.get("model_name", model_name) != model_name:
                continue
            if name in COUNTERS:
                counters[name] += int(sample.value)
            elif name == "num_accepted_tokens_per_pos":
                position = int(sample.labels.get("position", 0))
                per_position[position] = per_position.get(position, 0) + int(sample.value)
    counters["num_accepted_tokens_per_pos"] = [per_position[p] for p in sorted(per_position)]
    return counters


def scrape(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # a loopback URL from our config
        return response.read().decode()


def served_metrics(counters: dict) -> dict[str, float]:
    """MLflow metrics for the registry version's run; empty until a draft step was counted."""
    from pipeline.metrics import served_figures

    if not counters["num_drafts"]:
        return {}
    figures = served_figures(counters)  # the same reading the evaluation's vLLM cross-check makes
    metrics = {"served.tau": figures["tau"], "served.num_drafts": float(figures["num_drafts"]),
               "served.num_accepted_tokens": float(figures["num_accepted_tokens"])}
    metrics.update({f"served.cum_alpha_pos{i + 1}": a for i, a in enumerate(figures["cumulative_acceptance"])})
    return metrics
