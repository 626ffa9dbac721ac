"""The Ray Serve application: vLLM (through Ray Serve LLM) with the speculator, behind an OpenAI-compatible API.

`serve_config` turns the Hydra config into one Serve config (the file `serve deploy` and a KubeRay RayService read);
`build_app` is that config's import path, so a local run, `serve deploy` and a RayService all build the same
application from the same arguments. The config names the speculator by its registry URI, not by a local folder:
`build_app` resolves it where the app is built (on a cluster: against the MLflow server, into shared storage), so the
file can be written before the speculator exists and a new champion needs no new file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import PipelineError
from pipeline.export.vllm_config import speculative_config
from pipeline.families import vllm_engine_options
from pipeline.serving.registry import LocatedSpeculator, ResolvedSpeculator, fetch, locate

IMPORT_PATH = "pipeline.serving.app:build_app"


def llm_config(serving: Any, served_name: str, verifier_path: str) -> dict:
    """A `ray.serve.llm.LLMConfig` as a plain dict (it goes into a YAML file as is), without the speculator and
    without the options the verifier's family needs: `build_app` adds both where the app is built (`verifier_path`
    may be a hub id that only the cluster can read; a RayService manifest is rendered offline)."""
    engine: dict[str, Any] = {"max_model_len": serving.max_model_len, "dtype": str(serving.dtype),
                              "tensor_parallel_size": serving.tensor_parallel_size,
                              "gpu_memory_utilization": serving.memory_fraction}
    if serving.accelerator == "cpu":
        engine["enforce_eager"] = True
    engine.update(dict(serving.engine_kwargs))
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": served_name, "model_source": verifier_path},
        "engine_kwargs": engine,
        "deployment_config": {
            "autoscaling_config": dict(serving.autoscaling),
            # The replica actor itself does no compute (the engine has its own bundle); on a 2-core machine its
            # default CPU would leave none for the router.
            "ray_actor_options": {"num_cpus": serving.replica_cpus},
        },
        "log_engine_metrics": True,
    }
    if serving.accelerator == "cpu":
        config["accelerator_config"] = {"kind": "cpu"}
    elif serving.accelerator_type:
        config["accelerator_type"] = serving.accelerator_type
    return config


def speculator_source(uri: str, num_speculative_tokens: Optional[int], download_dir: str,
                      tracking_uri: Optional[str], verifier_name: Optional[str] = None,
                      allow_unpromoted: bool = False) -> dict:
    """Where `build_app` finds the speculator: a registry URI, the MLflow store (None = MLFLOW_TRACKING_URI of
    the node), a folder for the download (shared storage on a cluster), K (None = the evaluated K), the
    verifier.name it must have been trained on (None: its shapes are checked only) and whether a version the
    promotion gate did not promote may be served."""
    return {"uri": uri, "num_speculative_tokens": num_speculative_tokens, "download_dir": download_dir,
            "tracking_uri": tracking_uri, "verifier_name": verifier_name, "allow_unpromoted": allow_unpromoted}


def serve_config(serving: Any, llm: dict, speculator: Optional[dict]) -> dict:
    """The Serve config file (`serve deploy`, RayService serveConfigV2) for one LLM app; speculator None serves
    the verifier alone."""
    return {
        "http_options": {"host": serving.host, "port": serving.port},
        "applications": [{
            "name": serving.app_name,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": {"llm_config": llm, "speculator": speculator, "api_key_env": serving.api_key_env,
                     "max_request_bytes": serving.max_request_bytes},
        }],
    }


def with_family_options(llm: dict) -> dict:
    """The LLM config with the engine options its verifier's family needs (`vllm_engine_options`: a multimodal
    verifier served as its text model), read from the verifier's config where the app is built; an engine option
    the config already sets (serving.engine_kwargs) is kept."""
    family = vllm_engine_options(str(llm["model_loading_config"]["model_source"]))
    return {**llm, "engine_kwargs": {**family, **llm["engine_kwargs"]}}


def with_speculator(llm: dict, source: dict) -> tuple[dict, ResolvedSpeculator]:
    """The LLM config with the resolved speculator's `speculative_config`; downloads it on first use."""
    from pipeline.tracking import client_for

    client = client_for(source.get("tracking_uri"))
    # every check reads the tags and config.json only: a refused speculator's weights are never downloaded
    located = locate(client, source["uri"], Path(source["download_dir"]))
    check_served_gate(located, bool(source.get("allow_unpromoted")))
    k = source.get("num_speculative_tokens") or located.recommended_k
    if not k:
        raise PipelineError(f"serving.num_speculative_tokens: {located.uri} has no evaluated K; set it")
    check_served_k(located, int(k))
    check_served_verifier(located, str(llm["model_loading_config"]["model_source"]), source.get("verifier_name"))
    resolved = fetch(client, located, Path(source["download_dir"]))
    engine = {**llm["engine_kwargs"], "speculative_config": speculative_config(str(resolved.local_dir), int(k))}
    return {**llm, "engine_kwargs": engine}, resolved


def check_served_gate(located: LocatedSpeculator, allow_unpromoted: bool) -> None:
    """Refuse a registry version the promotion gate did not promote (tag gate.decision: refused, or none: never
    judged), unless allow_unpromoted: its served acceptance is in doubt (no vLLM cross-check, a tau gap, a
    speed-up below 1). A run's artifact (runs:/...) is never registered or judged, so it is the user's own choice.
    Raises PipelineError naming serving.model."""
    if located.version is None or located.tags.get("gate.decision") == "promoted":
        return
    decision = located.tags.get("gate.decision")
    why = (f"the promotion gate {decision} it ({located.tags.get('gate.reason', 'no reason recorded')})"
           if decision else "the promotion gate never judged it")
    if allow_unpromoted:
        logging.getLogger(__name__).warning("serve: %s: %s; served because serving.allow_unpromoted is true",
                                            located.uri, why)
        return
    raise PipelineError(f"serving.model: {located.uri} is not served: {why}; serve a promoted version (the "
                        "champion alias), or set serving.allow_unpromoted=true")


def check_served_k(resolved: LocatedSpeculator, k: int) -> None:
    """Refuse a K past the one a parallel drafter trained for: vLLM runs it, but the slots beyond were never
    trained, so a served K the evaluation never measured would quietly draft noise. A drafter that drafts one step
    at a time (drafts_past_trained_k), or one whose config names no trained K, is not checked. Raises
    PipelineError naming serving.num_speculative_tokens."""
    from pipeline.drafters import DRAFTERS

    drafter = DRAFTERS.get(resolved.algorithm)
    if resolved.trained_k is None or drafter is None or drafter.drafts_past_trained_k:
        return
    if k > resolved.trained_k:
        raise PipelineError(f"serving.num_speculative_tokens: {k} exceeds the K={resolved.trained_k} "
                            f"{resolved.uri} was trained for (a {resolved.algorithm} drafter drafts at most that "
                            "many tokens)")


def check_served_verifier(resolved: LocatedSpeculator, verifier_path: str, verifier_name: Optional[str]) -> None:
    """Refuse a speculator trained on another verifier than the one served: vLLM would load it (any drafter of the
    same hidden size runs) and accept almost nothing, or fail deep in its engine. Compares the version's
    `verifier` tag (the export's verifier.name) with verifier_name, then the shapes the speculator's config.json
    records (target_hidden_size, the layer config's vocab_size, the verifier's architecture) with the served
    verifier's config.json; a field either side lacks is not compared. Raises PipelineError naming
    serving.model."""
    from pipeline.families import text_config_dict, verifier_config_dict

    trained_on = resolved.tags.get("verifier")
    if verifier_name and trained_on and trained_on != verifier_name:
        raise PipelineError(f"serving.model: {resolved.uri} was trained on verifier '{trained_on}', not on "
                            f"verifier.name '{verifier_name}' (if it is the same model, set "
                            f"verifier.name={trained_on})")
    served = verifier_config_dict(verifier_path)
    if not served:
        return
    text = text_config_dict(served)
    drafter = resolved.config
    pairs = {"hidden size": (drafter.get("target_hidden_size"), text.get("hidden_size")),
             "vocabulary size": ((drafter.get("transformer_layer_config") or {}).get("vocab_size"),
                                 text.get("vocab_size")),
             "architecture": ((((drafter.get("speculators_config") or {}).get("verifier") or {})
                               .get("architectures") or [None])[0], (served.get("architectures") or [None])[0])}
    for what, (trained, serving) in pairs.items():
        if trained and serving and trained != serving:  # a field either side lacks (None, "") is not compared
            raise PipelineError(f"serving.model: {resolved.uri} was trained on a verifier of {what} {trained}; "
                                f"the served verifier '{verifier_path}' has {serving}")


def build_app(args: dict) -> Any:
    """Serve application builder: Ray Serve LLM's OpenAI ingress on a FastAPI app that our RequestGuard fronts.

    The API key is read from the environment variable `api_key_env` names, on the node that builds the app,
    never from the config file.
    """
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import init as new_router_app
    from ray.serve.llm import LLMConfig, build_llm_deployment
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

    from pipeline.serving.guard import RequestGuard

    llm = with_family_options(args["llm_config"])
    if args.get("speculator"):
        llm, resolved = with_speculator(llm, args["speculator"])
        logging.getLogger(__name__).info("serve: %s -> %s (%s, K=%d)", resolved.uri, resolved.local_dir,
                                         resolved.algorithm,
                                         llm["engine_kwargs"]["speculative_config"]["num_speculative_tokens"])
    config = LLMConfig(**llm)
    api_key = None
    if args.get("api_key_env"):
        api_key = os.environ.get(args["api_key_env"])
        if not api_key:
            raise PipelineError(f"serving.api_key_env: the environment variable {args['api_key_env']} is not set")
    app = new_router_app()  # Ray's own app, with its error and request-id middlewares
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=int(args.get("max_request_bytes", 1 << 20)),
                       max_model_len=int(config.engine_kwargs.get("max_model_len", 2048)))
    ingress = make_fastapi_ingress(OpenAiIngress, app=app)
    options = OpenAiIngress.get_deployment_options([config])
    options.setdefault("ray_actor_options", {})["num_cpus"] = 0  # routing only
    # serve.deployment(cls, **options) is a Deployment; the stubs type only the decorator form
    return serve.deployment(ingress, **options).bind(  # type: ignore[attr-defined]
        llm_deployments={config.model_id: build_llm_deployment(config)},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)})
