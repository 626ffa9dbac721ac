"""Serving without a server: request checks, the Serve config built from Hydra, registry resolution against a real
MLflow store, and served tau read from Ray's Prometheus text."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.config import compose, validate
from pipeline.errors import PipelineError
from pipeline.serving.app import IMPORT_PATH, llm_config, serve_config
from pipeline.serving.guard import RequestGuard, request_problem
from pipeline.serving.metrics import served_metrics, spec_decode_counters
from pipeline.serving.registry import resolve
from pipeline.tracking import Tracker


@pytest.mark.parametrize("path,body,problem", [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "must be a JSON object"),
    ("/v1/chat/completions", b'{"model": "m", "messages": []}', "messages: must be a non-empty list"),
    ("/v1/chat/completions", b'{"model": "m"}', "messages: must be a non-empty list"),
    ("/v1/completions", b'{"model": "m", "prompt": ""}', "prompt: must be a non-empty"),
    ("/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": 4096}', "max_tokens: 4096 does not fit"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
     "max_tokens: must be a positive integer"),
])
def test_bad_requests_are_named(path, body, problem):
    assert problem in request_problem(path, body, max_model_len=2048)


def test_good_requests_pass():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}).encode()
    assert request_problem("/v1/chat/completions", body, 2048) is None
    assert request_problem("/v1/completions", b'{"model": "m", "prompt": "hi"}', 2048) is None


def call(guard, path, body=b"", headers=(), method="POST"):
    """One request through the ASGI middleware: (status, JSON body or the downstream app's reply)."""
    sent, chunks = [], [{"type": "http.request", "body": body[:5], "more_body": True},
                        {"type": "http.request", "body": body[5:], "more_body": False}]

    async def receive():
        return chunks.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(guard({"type": "http", "path": path, "method": method, "headers": list(headers)}, receive, send))
    status = sent[0]["status"]
    return status, json.loads(sent[1]["body"])


async def echo_app(scope, receive, send):
    body = (await receive())["body"]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": json.dumps({"echo": body.decode()}).encode()})


def test_guard_checks_the_key_then_the_body_and_hands_the_whole_body_on():
    guard = RequestGuard(echo_app, api_key="s3cret", max_request_bytes=2000, max_model_len=2048)
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert call(guard, "/v1/chat/completions", good)[0] == 401
    assert call(guard, "/v1/chat/completions", good, [(b"authorization", b"Bearer wrong")])[0] == 401
    key = [(b"authorization", b"Bearer s3cret")]
    status, reply = call(guard, "/v1/chat/completions", good, key)
    assert status == 200 and reply == {"echo": good.decode()}
    status, reply = call(guard, "/v1/chat/completions", b'{"messages": []}', key)
    assert status == 400 and "messages" in reply["error"]["message"]
    assert call(guard, "/v1/completions", b"x" * 3000, key)[0] == 413
    assert call(guard, "/-/healthz", b"", method="GET")[0] == 200  # Serve's own routes stay open


def test_serve_config_comes_from_the_hydra_config(tmp_path):
    cfg = compose([f"paths.root={tmp_path}", "serving.port=8123", "serving.api_key_env=MY_KEY"])
    validate(cfg)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    llm = llm_config(cfg.serving, "m", "/verifier", str(drafter), 3)
    config = serve_config(cfg.serving, llm)
    app = config["applications"][0]
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert app["import_path"] == IMPORT_PATH and app["args"]["api_key_env"] == "MY_KEY"
    assert llm["model_loading_config"] == {"model_id": "m", "model_source": "/verifier"}
    assert llm["engine_kwargs"]["speculative_config"] == {"model": str(drafter), "num_speculative_tokens": 3,
                                                          "method": "eagle3", "parallel_drafting": True}
    assert llm["accelerator_config"] == {"kind": "cpu"}
    assert llm["deployment_config"]["autoscaling_config"]["target_ongoing_requests"] == 8
    gpu = llm_config(compose(["serving=a100", "serving.tensor_parallel_size=2"]).serving, "m", "/v", None, 0)
    assert gpu["accelerator_type"] == "A100" and gpu["engine_kwargs"]["tensor_parallel_size"] == 2
    assert "speculative_config" not in gpu["engine_kwargs"] and "accelerator_config" not in gpu


def test_bad_serving_settings_are_refused_by_name(tmp_path):
    with pytest.raises(PipelineError, match="serving.model"):
        validate(compose([f"paths.root={tmp_path}", "serving.model=champion"]))
    with pytest.raises(PipelineError, match="serving.accelerator"):
        validate(compose([f"paths.root={tmp_path}", "serving.accelerator=tpu"]))


def test_registry_uris_resolve_to_the_exported_folder(tmp_path):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
    with tracker.parent_run("evaluate") as run_id:
        tracker.log_artifact(export, "speculator")
        version = tracker.register("m", "speculator", run_id, {"eval.recommended_k": "3"})
    tracker.set_alias("m", "champion", version)
    for uri in ("models:/m@champion", f"models:/m/{version}", f"runs:/{run_id}/speculator"):
        resolved = resolve(tracker.client, uri, tmp_path / "downloads")
        assert json.loads((resolved.local_dir / "config.json").read_text())["speculators_model_type"] == "dflash"
        assert resolved.algorithm == "dflash" and resolved.run_id == run_id
    assert resolve(tracker.client, "models:/m@champion", tmp_path / "d2").recommended_k == 3
    assert resolve(tracker.client, "models:/m@champion", tmp_path / "d3").served_name == "m"
    with pytest.raises(PipelineError, match="cannot resolve 'models:/m@nobody'"):
        resolve(tracker.client, "models:/m@nobody", tmp_path / "d4")
    with pytest.raises(PipelineError, match="is not models:/"):
        resolve(tracker.client, "m", tmp_path / "d5")


RAY_METRICS = """\
# HELP ray_vllm_spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE ray_vllm_spec_decode_num_drafts_total counter
ray_vllm_spec_decode_num_drafts_total{ReplicaId="a",engine="0",model_name="m"} 30.0
ray_vllm_spec_decode_num_drafts_total{ReplicaId="b",engine="0",model_name="m"} 10.0
ray_vllm_spec_decode_num_drafts_total{ReplicaId="c",engine="0",model_name="other"} 99.0
# HELP ray_vllm_spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE ray_vllm_spec_decode_num_draft_tokens_total counter
ray_vllm_spec_decode_num_draft_tokens_total{ReplicaId="a",engine="0",model_name="m"} 160.0
# HELP ray_vllm_spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE ray_vllm_spec_decode_num_accepted_tokens_total counter
ray_vllm_spec_decode_num_accepted_tokens_total{ReplicaId="a",engine="0",model_name="m"} 16.0
ray_vllm_spec_decode_num_accepted_tokens_total{ReplicaId="b",engine="0",model_name="m"} 4.0
# HELP ray_vllm_spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE ray_vllm_spec_decode_num_accepted_tokens_per_pos_total counter
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="a",engine="0",model_name="m",position="0"} 12.0
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="a",engine="0",model_name="m",position="1"} 4.0
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="b",engine="0",model_name="m",position="0"} 4.0
ray_serve_num_http_requests_total{route="/"} 7.0
"""


def test_served_tau_sums_the_replicas_of_one_model():
    counters = spec_decode_counters(RAY_METRICS, "m")
    assert counters == {"num_drafts": 40, "num_draft_tokens": 160, "num_accepted_tokens": 20,
                        "num_accepted_tokens_per_pos": [16, 4]}
    metrics = served_metrics(counters)
    assert metrics["served.tau"] == pytest.approx(1.5)
    assert metrics["served.cum_acc_pos1"] == pytest.approx(0.4) and metrics["served.cum_acc_pos2"] == pytest.approx(0.1)
    assert served_metrics(spec_decode_counters("", "m")) == {}


def test_the_serve_config_file_is_what_serve_deploy_accepts(tmp_path):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    cfg = compose([f"paths.root={tmp_path}"])
    config = serve_config(cfg.serving, llm_config(cfg.serving, "m", "/verifier", None, 0))
    schema = ServeDeploySchema.model_validate(yaml.safe_load(yaml.safe_dump(config)))
    assert schema.applications[0].import_path == IMPORT_PATH
    assert schema.http_options.host == "127.0.0.1"
