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

from pipeline.cluster import raise_if_stopped
from pipeline.config.schema import PipelineConfig
from pipeline.context import Context
from pipeline.errors import PipelineError, first_line
from pipeline.export.stage import registered_model_name
from pipeline.fsutil import atomic_write_text
from pipeline.serving.app import build_app, llm_config, serve_config, speculator_source, with_speculator
from pipeline.serving.metrics import scrape, served_metrics, spec_decode_counters
from pipeline.serving.registry import ResolvedSpeculator, pinned_uri, served_model_name

log = logging.getLogger(__name__)


def model_uri(cfg: PipelineConfig) -> str:
    return cfg.serving.model or f"models:/{registered_model_name(cfg)}@{cfg.evaluation.gate.alias}"


def serve_config_for(cfg: PipelineConfig, verifier_path: str, tracking_uri: str) -> dict:
    """The Serve config of this Hydra config: what jobs/serve.py runs and what a KubeRay RayService's
    serveConfigV2 holds (jobs/render_infra.py writes it there through this same function)."""
    name = served_model_name(model_uri(cfg), registered_model_name(cfg))
    llm = llm_config(cfg.serving, name, verifier_path)
    speculator = None
    if cfg.serving.speculative:
        download_dir = Path(cfg.paths.root).expanduser().resolve() / "serve" / "speculators"
        speculator = speculator_source(model_uri(cfg), cfg.serving.num_speculative_tokens, str(download_dir),
                                       tracking_uri, cfg.verifier.name, cfg.serving.allow_unpromoted)
    return serve_config(cfg.serving, llm, speculator)


def prepare(ctx: Context) -> tuple[dict, Optional[ResolvedSpeculator]]:
    """(the Serve config, the resolved speculator or None for the plain verifier); writes the config file.

    The speculator is resolved here too (`build_app` then reuses the download), so that a wrong URI or a missing
    K fails before Ray starts, and so that served tau can be logged to the version's run. An alias is pinned to
    the version it resolved to: the app serves the version checked here, and its served tau goes to that
    version's run, even when the alias moves before the app starts (jobs/render_infra.py's RayService config keeps
    the alias).
    """
    config = serve_config_for(ctx.cfg, ctx.verifier_path, ctx.tracking("serve").uri)
    app = config["applications"][0]
    resolved = None
    if app["args"]["speculator"]:  # build_app logs what it resolved to
        _, resolved = with_speculator(app["args"]["llm_config"], app["args"]["speculator"])
        if resolved.version is not None:
            app["args"]["speculator"]["uri"] = pinned_uri(app["args"]["speculator"]["uri"], resolved.version)
    path = Path(ctx.cfg.serving.serve_config_path)
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
    log.info("serve: Serve config written to %s (serve deploy / RayService serveConfigV2)", path)
    return config, resolved


def served_name(config: dict) -> str:
    return config["applications"][0]["args"]["llm_config"]["model_loading_config"]["model_id"]


def start(config: dict) -> str:
    """Deploy the application on the local (or RAY_ADDRESS) Ray; returns the base URL."""
    from ray import serve

    from pipeline.logs import root_logging_kept

    http = config["http_options"]
    serve.start(http_options={"host": http["host"], "port": http["port"]})
    app = config["applications"][0]
    # importing ray.serve.llm replaces the root logger's handlers (ray.llm's logging setup, run once at import);
    # imported here first, so that build_app's and serve.run's log lines reach the job's log
    with root_logging_kept():
        import ray.serve.llm  # noqa: F401
    serve.run(build_app(app["args"]), name=app["name"], route_prefix=app["route_prefix"], blocking=False)
    return f"http://{http['host']}:{http['port']}"


def record_served_tau(client: Any, resolved: ResolvedSpeculator, model_name: str,
                      metrics_url: str) -> dict[str, float]:
    """Log the served acceptance so far to the registry version's run; returns what was logged."""
    from pipeline.tracking import log_metric_batch

    metrics = served_metrics(spec_decode_counters(scrape(metrics_url), model_name))
    if metrics and resolved.run_id:
        log_metric_batch(client, resolved.run_id, metrics, step=int(time.time()))
    return metrics


def report_served_tau(client: Any, resolved: ResolvedSpeculator, model_name: str, metrics_url: str) -> dict:
    """record_served_tau for the serving loop: a failed scrape or MLflow call is one warning, and the endpoint keeps
    serving (leaving the loop would stop the Ray it runs on); the next round tries again."""
    try:
        served = record_served_tau(client, resolved, model_name, metrics_url)
    except Exception as error:  # noqa: BLE001 - urllib, MLflow and parse errors alike must not end serving
        log.warning("serve: served tau not recorded this round (%s: %s); still serving", type(error).__name__,
                    first_line(error))
        return {}
    if served:
        log.info("serve: served tau %.3f over %d draft steps", served["served.tau"], served["served.num_drafts"])
    return served


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
            raise_if_stopped()  # a SIGTERM whose exception a finalizer dropped (MLflow's, in the reporting below)
            time.sleep(ctx.cfg.serving.metrics_interval_s or 3600)
            if resolved and ctx.cfg.serving.metrics_interval_s:
                report_served_tau(ctx.tracking("serve").client, resolved, served_name(config), metrics_url)
    except KeyboardInterrupt:
        log.info("serve: stopping")
    return result


def _check_registry_exists(cfg: PipelineConfig) -> None:
    """With no tracking URI configured the speculator is resolved from the local store under paths.root: when
    there is none, no pipeline has registered one here, and opening it would only create an empty store."""
    import os

    if not cfg.serving.speculative or cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return
    store = Path(cfg.paths.root).expanduser().resolve() / "mlflow" / "mlflow.db"
    if not store.is_file():
        raise PipelineError(f"serving.model: no MLflow store at {store} to resolve '{model_uri(cfg)}' from; run "
                            "the pipeline with this paths.root first, or set tracking.tracking_uri")


# what a serve job stopped before it served says (one stopped while serving ends cleanly: "serve: stopping", 0)
STOPPED_SERVING = "nothing is served; the same command starts serving again"


def _port_in_use(host: str, port: int, host_field: str, port_field: str) -> bool:
    """Whether a server already listens where one would bind host:port (SO_REUSEADDR, as uvicorn and Ray bind:
    a port in TIME_WAIT is free). Raises PipelineError when host:port cannot be bound here at all, naming
    `host_field` for a host that is not this machine's and `port_field` otherwise (a port below 1024 needs root)."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return True
        field = host_field if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL else port_field
        raise PipelineError(f"{field}: cannot listen on {host}:{port} here ({error.strerror or error})") from None
    return False


def check_serving_inputs(cfg: PipelineConfig) -> None:
    """What the serve job would only find out after Ray and Serve are up (tens of seconds, then a Ray traceback):
    the API key's variable is set (build_app reads it in this process), and, on a Ray this job starts itself, the
    endpoint's and the metrics endpoint's ports are free (a cluster the job joins binds them on its own nodes).
    Raises PipelineError naming the field."""
    import os

    from pipeline.cluster import starts_local_ray

    serving = cfg.serving
    if serving.api_key_env and not os.environ.get(serving.api_key_env):
        raise PipelineError(f"serving.api_key_env: the environment variable {serving.api_key_env} is not set")
    if not starts_local_ray(cfg.cluster):
        return
    if _port_in_use(serving.host, serving.port, "serving.host", "serving.port"):
        raise PipelineError(f"serving.port: {serving.host}:{serving.port} is in use by another server; stop it or "
                            "pick another port")
    # Ray's metrics agent binds every interface (Ray never takes a loopback address for its node)
    if _port_in_use("0.0.0.0", serving.metrics_port, "serving.metrics_port", "serving.metrics_port"):
        raise PipelineError(f"serving.metrics_port: port {serving.metrics_port} is in use by another server; stop "
                            "it or pick another port")


def run_serve(cfg: PipelineConfig) -> int:
    """Entry point for jobs/serve.py."""
    from pipeline.cluster import check_fits_local_ray
    from pipeline.config import validate
    from pipeline.entry import run_guarded

    def validated_serve() -> None:
        validate(cfg)
        _check_registry_exists(cfg)
        check_fits_local_ray(cfg, ["serve"])
        check_serving_inputs(cfg)
        serve(Context.create(cfg))

    return run_guarded(validated_serve, cfg, stopped=STOPPED_SERVING)
