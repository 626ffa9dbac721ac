"""The Ray Serve application: vLLM (through Ray Serve LLM) with the speculator, behind an OpenAI-compatible API.

`serve_config` turns the Hydra config and a resolved speculator into one Serve config (the file `serve deploy` and a
KubeRay RayService read); `build_app` is that config's import path, so a local run, `serve deploy` and a
RayService all build the same application from the same arguments.
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.evaluation.vllm_runner import speculative_config

IMPORT_PATH = "pipeline.serving.app:build_app"


def llm_config(serving: Any, served_name: str, verifier_path: str, drafter_dir: str | None, k: int) -> dict:
    """A `ray.serve.llm.LLMConfig` as a plain dict (it goes into a YAML file as is)."""
    engine: dict[str, Any] = {"max_model_len": serving.max_model_len, "dtype": serving.dtype,
                              "tensor_parallel_size": serving.tensor_parallel_size,
                              "gpu_memory_utilization": serving.memory_fraction}
    if drafter_dir is not None:
        engine["speculative_config"] = speculative_config(drafter_dir, k)
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


def serve_config(serving: Any, llm: dict) -> dict:
    """The Serve config file (`serve deploy`, RayService serveConfigV2) for one LLM app."""
    return {
        "http_options": {"host": serving.host, "port": serving.port},
        "applications": [{
            "name": serving.app_name,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": {"llm_config": llm, "api_key_env": serving.api_key_env,
                     "max_request_bytes": serving.max_request_bytes},
        }],
    }


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

    from pipeline.errors import PipelineError
    from pipeline.serving.guard import RequestGuard

    config = LLMConfig(**args["llm_config"])
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
    return serve.deployment(ingress, **options).bind(
        llm_deployments={config.model_id: build_llm_deployment(config)},
        model_cards={config.model_id: to_model_metadata(config.model_id, config)})
