"""`jobs/serve.py`: resolve the speculator from the registry, write the Serve config, run it on Ray Serve.

While it serves, vLLM's spec-decode counters are read from Ray's metrics endpoint and logged to the registry
version's run as served tau (`served.tau`), next to the tau the evaluation measured.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig

from pipeline.context import Context
from pipeline.errors import PipelineError
from pipeline.export.stage import registered_model_name
from pipeline.fsutil import atomic_write_text
from pipeline.serving.app import build_app, llm_config, serve_config
from pipeline.serving.metrics import scrape, served_metrics, spec_decode_counters
from pipeline.serving.registry import ResolvedSpeculator, resolve

log = logging.getLogger(__name__)


def model_uri(cfg: DictConfig) -> str:
    return cfg.serving.model or f"models:/{registered_model_name(cfg)}@{cfg.evaluation.gate.alias}"


def speculative_tokens(cfg: DictConfig, resolved: ResolvedSpeculator) -> int:
    k = cfg.serving.num_speculative_tokens or resolved.recommended_k
    if k is None:
        raise PipelineError(f"serving.num_speculative_tokens: {resolved.uri} has no evaluated K; set it")
    return int(k)


def prepare(ctx: Context) -> tuple[dict, Optional[ResolvedSpeculator]]:
    """(the Serve config, the resolved speculator or None for the plain verifier); writes the config file."""
    cfg = ctx.cfg
    resolved, drafter_dir, k = None, None, 0
    name = registered_model_name(cfg)
    if cfg.serving.speculative:
        resolved = resolve(ctx.tracker.client, model_uri(cfg), ctx.paths.root / "serve" / "speculators")
        drafter_dir, k, name = str(resolved.local_dir), speculative_tokens(cfg, resolved), resolved.served_name
        log.info("serve: %s -> %s (%s, K=%d)", resolved.uri, resolved.local_dir, resolved.algorithm, k)
    config = serve_config(cfg.serving, llm_config(cfg.serving, name, ctx.verifier_path, drafter_dir, k))
    path = Path(cfg.serving.serve_config_path)
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
    log.info("serve: Serve config written to %s (serve deploy / RayService serveConfigV2)", path)
    return config, resolved


def start(config: dict) -> str:
    """Deploy the application on the local (or RAY_ADDRESS) Ray; returns the base URL."""
    from ray import serve

    http = config["http_options"]
    serve.start(http_options={"host": http["host"], "port": http["port"]})
    app = config["applications"][0]
    serve.run(build_app(app["args"]), name=app["name"], route_prefix=app["route_prefix"], blocking=False)
    return f"http://{http['host']}:{http['port']}"


def record_served_tau(client: Any, resolved: ResolvedSpeculator, metrics_url: str) -> dict[str, float]:
    """Log the served acceptance so far to the registry version's run; returns what was logged."""
    from pipeline.tracking import log_metric_batch

    metrics = served_metrics(spec_decode_counters(scrape(metrics_url), resolved.served_name))
    if metrics and resolved.run_id:
        log_metric_batch(client, resolved.run_id, metrics, step=int(time.time()))
    return metrics


def serve(ctx: Context) -> dict:
    from pipeline.cluster import ensure_ray

    config, resolved = prepare(ctx)
    ensure_ray(ctx.cfg.cluster, metrics_export_port=ctx.cfg.serving.metrics_port)
    url = start(config)
    log.info("serve: %s is serving at %s/v1 (OpenAI API)", config["applications"][0]["name"], url)
    metrics_url = f"http://127.0.0.1:{ctx.cfg.serving.metrics_port}/metrics"
    result = {"url": url, "config": config, "resolved": resolved, "metrics_url": metrics_url}
    if not ctx.cfg.serving.blocking:
        return result
    try:
        while True:
            time.sleep(ctx.cfg.serving.metrics_interval_s or 3600)
            if resolved and ctx.cfg.serving.metrics_interval_s:
                served = record_served_tau(ctx.tracker.client, resolved, metrics_url)
                if served:
                    log.info("serve: served tau %.3f over %d draft steps", served["served.tau"],
                             served["served.num_drafts"])
    except KeyboardInterrupt:
        log.info("serve: stopping")
    return result


def run_serve(cfg: DictConfig) -> int:
    """Entry point for jobs/serve.py."""
    from pipeline.config import validate
    from pipeline.runner import run_guarded

    def validated_serve() -> None:
        validate(cfg)
        serve(Context.create(cfg))

    return run_guarded(validated_serve)
