"""Serving without a server: request checks, the Serve config built from Hydra, registry resolution against a real
MLflow store, and served tau read from Ray's Prometheus text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from pipeline.config import compose, validate
from pipeline.errors import PipelineError
from pipeline.integrity import seal
from pipeline.serving.app import IMPORT_PATH, llm_config, speculator_source, with_family_options, with_speculator
from pipeline.serving.guard import RequestGuard, request_problem
from pipeline.serving.job import serve_config_for
from pipeline.serving.metrics import served_metrics, spec_decode_counters
from pipeline.serving.registry import resolve, served_model_name
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
    assert call(guard, "/-/healthz", b"", method="GET")[0] == 200  # the health probe stays open


def test_serve_config_comes_from_the_hydra_config(tmp_path):
    cfg = compose([f"paths.root={tmp_path}", "serving.port=8123", "serving.api_key_env=MY_KEY"])
    validate(cfg)
    config = serve_config_for(cfg, "/verifier", "sqlite:///mlflow.db")
    app = config["applications"][0]
    llm = app["args"]["llm_config"]
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert app["import_path"] == IMPORT_PATH and app["args"]["api_key_env"] == "MY_KEY"
    assert llm["model_loading_config"] == {"model_id": "SmolLM2-135M-Instruct-peagle", "model_source": "/verifier"}
    assert app["args"]["speculator"] == {"uri": "models:/SmolLM2-135M-Instruct-peagle@champion",
                                         "num_speculative_tokens": None,
                                         "download_dir": str(tmp_path.resolve() / "serve" / "speculators"),
                                         "tracking_uri": "sqlite:///mlflow.db",
                                         "verifier_name": "SmolLM2-135M-Instruct", "allow_unpromoted": False}
    assert "speculative_config" not in llm["engine_kwargs"]  # added where the app is built, once resolved
    assert llm["accelerator_config"] == {"kind": "cpu"}
    assert llm["deployment_config"]["autoscaling_config"]["target_ongoing_requests"] == 8
    pinned = serve_config_for(compose(["serving.model=models:/other/7", "serving.num_speculative_tokens=2"]), "/v",
                              None)
    assert pinned["applications"][0]["args"]["llm_config"]["model_loading_config"]["model_id"] == "other"
    assert pinned["applications"][0]["args"]["speculator"]["num_speculative_tokens"] == 2
    plain = serve_config_for(compose(["serving.speculative=false"]), "/v", None)
    assert plain["applications"][0]["args"]["speculator"] is None
    gpu = llm_config(compose(["serving=a100", "serving.tensor_parallel_size=2"]).serving, "m", "/v")
    assert gpu["accelerator_type"] == "A100" and gpu["engine_kwargs"]["tensor_parallel_size"] == 2
    assert "accelerator_config" not in gpu


def test_the_serve_config_reads_no_verifier_and_the_app_adds_its_familys_options_where_it_is_built(tmp_path,
                                                                                                   monkeypatch):
    """A RayService manifest is rendered where the verifier's hub id cannot be read: the config names the verifier
    only. The app adds the family's engine options from the verifier's own config where it is built; an engine
    option the config sets wins."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Serve config read the verifier's config")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    config = serve_config_for(compose(["experiment=gemma4_31b_dspark"]), "google/gemma-4-31B-it", None)
    llm = config["applications"][0]["args"]["llm_config"]
    assert "hf_overrides" not in llm["engine_kwargs"] and "language_model_only" not in llm["engine_kwargs"]
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text"}, "vision_config": {}, "architectures": ["Gemma4ForConditionalGeneration"]}))
    local = llm_config(compose([]).serving, "m", str(verifier))
    assert with_family_options(local)["engine_kwargs"]["hf_overrides"] == {"architectures": ["Gemma4ForCausalLM"]}
    assert with_family_options(local)["engine_kwargs"]["max_model_len"] == local["engine_kwargs"]["max_model_len"]
    pinned = llm_config(compose(["+serving.engine_kwargs.hf_overrides={architectures: [Mine]}"]).serving, "m",
                        str(verifier))
    assert with_family_options(pinned)["engine_kwargs"]["hf_overrides"] == {"architectures": ["Mine"]}


def test_the_app_adds_the_resolved_speculator_and_its_evaluated_k(tmp_path):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    version = register_speculator(tracker, tmp_path, "peagle", {"eval.recommended_k": "3"})
    llm = llm_config(compose([]).serving, "m", "/verifier")
    source = speculator_source("models:/m@champion", None, str(tmp_path / "downloads"), tracker.uri)
    with_spec, resolved = with_speculator(llm, source)
    run_id = tracker.client.get_model_version("m", version).run_id
    drafter = tmp_path / "downloads" / f"m-v{version}-{run_id[:12]}" / "speculator"
    assert resolved.local_dir == drafter and resolved.version == version
    assert with_spec["engine_kwargs"]["speculative_config"] == {
        "model": str(drafter), "num_speculative_tokens": 3, "method": "eagle3", "parallel_drafting": True}
    assert "speculative_config" not in llm["engine_kwargs"]  # the config itself is left as it was
    pinned, _ = with_speculator(llm, {**source, "num_speculative_tokens": 2})
    assert pinned["engine_kwargs"]["speculative_config"]["num_speculative_tokens"] == 2
    for edited in ("three", "0", "-1", "2.5", "²", "٣"):  # registry tags are editable in MLflow's UI
        tracker.set_version_tags("m", version, {"eval.recommended_k": edited})
        with pytest.raises(PipelineError, match=r"^serving\.model: models:/m@champion's tag eval\.recommended_k="):
            with_speculator(llm, source)
        assert with_speculator(llm, {**source, "num_speculative_tokens": 2})[0]  # a K set in the config is used
    tracker.set_version_tags("m", version, {"eval.recommended_k": ""})
    with pytest.raises(PipelineError, match="serving.num_speculative_tokens"):
        with_speculator(llm, {**source, "download_dir": str(tmp_path / "d2")})


@pytest.mark.parametrize("algorithm,served_past_trained_k", [
    ("peagle", False), ("dflash", False), ("dspark", False), ("dflash2", False), ("eagle3", True)])
def test_a_parallel_drafter_is_not_served_past_the_k_it_trained_for(tmp_path, algorithm, served_past_trained_k):
    """vLLM runs a parallel drafter at any K, but its slots past the trained K are untrained: refused by name.
    EAGLE-3 drafts one trained step at a time, so a larger K is its own choice."""
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    register_speculator(tracker, tmp_path, algorithm, {"eval.recommended_k": "3"}, trained_k=4)
    llm = llm_config(compose([]).serving, "m", "/verifier")
    source = speculator_source("models:/m@champion", None, str(tmp_path / "downloads"), tracker.uri)
    for k in (None, 4):  # the evaluated K, and the trained K itself
        served, resolved = with_speculator(llm, {**source, "num_speculative_tokens": k})
        assert served["engine_kwargs"]["speculative_config"]["num_speculative_tokens"] == (k or 3)
    assert resolved.trained_k == 4
    past = {**source, "num_speculative_tokens": 5}
    if served_past_trained_k:
        assert with_speculator(llm, past)[0]["engine_kwargs"]["speculative_config"]["num_speculative_tokens"] == 5
    else:
        with pytest.raises(PipelineError, match=r"^serving\.num_speculative_tokens: 5 exceeds the K=4 "):
            with_speculator(llm, past)


def test_a_speculator_is_not_served_on_a_verifier_it_was_not_trained_on(tmp_path):
    """vLLM loads any drafter of the served verifier's hidden size and accepts almost nothing: refused by name."""
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    register_speculator(tracker, tmp_path, "peagle", {"eval.recommended_k": "3", "verifier": "SmolLM2-135M-Instruct"},
                        shapes=(576, 49152, "LlamaForCausalLM"))
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    served = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "vocab_size": 49152}
    llm = llm_config(compose([]).serving, "m", str(verifier))
    source = speculator_source("models:/m@champion", None, str(tmp_path / "downloads"), tracker.uri,
                               "SmolLM2-135M-Instruct")
    for change, refused in [({}, None), ({"hidden_size": 1024}, "hidden size 576"),
                            ({"vocab_size": 151936}, "vocabulary size 49152"),
                            ({"architectures": ["Qwen3ForCausalLM"]}, "architecture LlamaForCausalLM"),
                            ({"text_config": {"hidden_size": 2048, "vocab_size": 49152}, "vision_config": {}},
                             "hidden size 576")]:
        (verifier / "config.json").write_text(json.dumps({**served, **change}))
        if refused is None:
            assert with_speculator(llm, source)[1].algorithm == "peagle"
        else:
            with pytest.raises(PipelineError, match=rf"^serving\.model: models:/m@champion was trained on a "
                                                    rf"verifier of {refused}; the served verifier '{verifier}' has "):
                with_speculator(llm, source)
    (verifier / "config.json").write_text(json.dumps(served))
    with pytest.raises(PipelineError, match=r"^serving\.model: models:/m@champion was trained on verifier "
                                            r"'SmolLM2-135M-Instruct', not on verifier\.name 'tiny-qwen3' \(if it "
                                            r"is the same model, set verifier\.name=SmolLM2-135M-Instruct\)$"):
        with_speculator(llm, {**source, "verifier_name": "tiny-qwen3"})


@pytest.mark.parametrize("tags, source_change, refused", [
    ({"eval.recommended_k": ""}, {}, r"serving\.num_speculative_tokens: .* has no evaluated K"),
    ({}, {"num_speculative_tokens": 5}, r"serving\.num_speculative_tokens: 5 exceeds the K=4"),
    ({}, {"verifier_name": "tiny-qwen3"}, r"serving\.model: .* was trained on verifier"),
    ({"gate.decision": "refused"}, {}, r"serving\.model: .* is not served: the promotion gate refused it")])
def test_a_refused_speculator_is_judged_on_its_tags_and_config_and_never_downloaded(tmp_path, tags, source_change,
                                                                                  refused):
    """A serve job refused for its K or verifier left the speculator's whole download under paths.root."""
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    register_speculator(tracker, tmp_path, "peagle", {"eval.recommended_k": "3", "verifier": "SmolLM2-135M-Instruct",
                                                      **tags}, trained_k=4)
    llm = llm_config(compose([]).serving, "m", "/verifier")
    source = speculator_source("models:/m@champion", None, str(tmp_path / "downloads"), tracker.uri)
    with pytest.raises(PipelineError, match=refused):
        with_speculator(llm, {**source, **source_change, "allow_unpromoted": False})
    assert not (tmp_path / "downloads").exists()
    tracker.set_version_tags("m", "1", {"eval.recommended_k": "3", "gate.decision": "promoted"})
    assert with_speculator(llm, source)[1].local_dir.is_relative_to(tmp_path / "downloads")


def test_a_run_folder_is_named_with_or_without_a_trailing_slash_and_one_without_config_json_is_named(tmp_path):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    version = register_speculator(tracker, tmp_path, "peagle", {})
    run_id = tracker.client.get_model_version("m", version).run_id
    assert resolve(tracker.client, f"runs:/{run_id}/speculator/", tmp_path / "d").algorithm == "peagle"
    elsewhere = tmp_path / "notes"
    elsewhere.mkdir()
    (elsewhere / "README.md").write_text("no speculator here")
    with tracker.parent_run("evaluate") as other:
        tracker.log_artifact(elsewhere, "notes")
    for path in ("notes", "nothing"):
        with pytest.raises(PipelineError, match=rf"^serving\.model: {other}/{path} holds no speculators config\.json$"):
            resolve(tracker.client, f"runs:/{other}/{path}", tmp_path / "d2")
    assert not (tmp_path / "d2").exists()


@pytest.mark.parametrize("decision", ["refused", None])
def test_a_version_the_gate_did_not_promote_is_served_only_when_allowed(tmp_path, decision, caplog):
    """A version the gate refused (no vLLM cross-check, a speed-up below 1) or never judged was served without a
    word when named by its number; refused, it is not even downloaded."""
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    tags = {"eval.recommended_k": "3", "gate.decision": decision, "gate.reason": "the served tau is unknown"}
    version = register_speculator(tracker, tmp_path, "peagle", {k: v for k, v in tags.items() if v is not None})
    if decision is None:
        tracker.client.delete_model_version_tag("m", version, "gate.decision")
    llm = llm_config(compose([]).serving, "m", "/verifier")
    source = speculator_source(f"models:/m/{version}", None, str(tmp_path / "downloads"), tracker.uri)
    why = ("the promotion gate refused it \\(the served tau is unknown\\)" if decision
           else "the promotion gate never judged it")
    with pytest.raises(PipelineError, match=rf"^serving\.model: models:/m/{version} is not served: {why}; serve a "
                                            r"promoted version \(the champion alias\), or set "
                                            r"serving\.allow_unpromoted=true$"):
        with_speculator(llm, source)
    assert not (tmp_path / "downloads").exists()  # refused on its tags: its weights were never fetched
    with caplog.at_level("WARNING"):
        assert with_speculator(llm, {**source, "allow_unpromoted": True})[1].version == version
    assert "served because serving.allow_unpromoted is true" in caplog.text
    tracker.set_version_tags("m", version, {"gate.decision": "promoted"})
    assert with_speculator(llm, source)[1].version == version


def test_bad_serving_settings_are_refused_by_name(tmp_path):
    with pytest.raises(PipelineError, match="serving.model"):
        validate(compose([f"paths.root={tmp_path}", "serving.model=champion"]))


@pytest.fixture
def no_cluster(monkeypatch):
    """This job would start its own Ray: no address given and no `ray start` cluster on the machine."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("pipeline.cluster.running_local_cluster", lambda: None)


@pytest.mark.parametrize("field", ["serving.port", "serving.metrics_port"])
def test_a_port_another_server_holds_is_refused_by_name_before_ray_starts(tmp_path, no_cluster, field):
    """Ray Serve (serving.port) and Ray's metrics agent (serving.metrics_port, every interface) failed with a Ray
    traceback after Ray and Serve had started."""
    import socket

    from pipeline.serving.job import check_serving_inputs

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        taken = server.getsockname()[1]
        other = free_port_but(taken)
        ports = {"serving.port": taken, "serving.metrics_port": other} if field == "serving.port" else {
            "serving.port": other, "serving.metrics_port": taken}
        cfg = compose([f"paths.root={tmp_path}", *(f"{k}={v}" for k, v in ports.items())])
        with pytest.raises(PipelineError, match=rf"^{field}: .*{taken} is in use by another server; stop it or pick "
                                                "another port$"):
            check_serving_inputs(cfg)
    check_serving_inputs(cfg)  # free again


def free_port_but(taken: int) -> int:
    """A free port on 127.0.0.1 other than `taken`."""
    from pipeline.serving.process import free_port

    return next(port for port in iter(free_port, None) if port != taken)


def test_a_host_that_is_not_this_machines_and_an_unset_key_variable_are_refused_by_name(tmp_path, no_cluster,
                                                                                      monkeypatch):
    """Both failed only after Ray and Serve had started (the key where build_app reads it)."""
    from pipeline.serving.job import check_serving_inputs

    ports = [f"serving.port={free_port_but(0)}", f"serving.metrics_port={free_port_but(0)}"]
    monkeypatch.setenv("SOME_KEY", "k")  # a host beyond loopback needs a key (validate)
    with pytest.raises(PipelineError, match=r"^serving.host: cannot listen on 203\.0\.113\.77:\d+ here"):
        check_serving_inputs(compose([f"paths.root={tmp_path}", *ports, "serving.host=203.0.113.77",
                                     "serving.api_key_env=SOME_KEY"]))
    monkeypatch.delenv("UNSET_SPECULATOR_KEY", raising=False)
    unset = compose([f"paths.root={tmp_path}", *ports, "serving.api_key_env=UNSET_SPECULATOR_KEY"])
    with pytest.raises(PipelineError, match="^serving.api_key_env: the environment variable UNSET_SPECULATOR_KEY is "
                                            "not set$"):
        check_serving_inputs(unset)
    monkeypatch.setenv("UNSET_SPECULATOR_KEY", "k")
    check_serving_inputs(unset)


def test_a_cluster_the_job_joins_binds_its_own_ports_but_the_key_is_read_here(tmp_path, monkeypatch):
    """On a cluster the Serve proxy and the metrics agent run on its nodes; build_app reads the key in this
    process either way."""
    import socket

    from pipeline.serving.job import check_serving_inputs

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    monkeypatch.delenv("UNSET_SPECULATOR_KEY", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        taken = [f"paths.root={tmp_path}", f"serving.port={server.getsockname()[1]}"]
        check_serving_inputs(compose(taken))
        with pytest.raises(PipelineError, match="^serving.api_key_env: the environment variable UNSET_SPECULATOR_KEY"):
            check_serving_inputs(compose([*taken, "serving.api_key_env=UNSET_SPECULATOR_KEY"]))


def test_a_port_this_user_may_not_bind_names_the_port_not_the_host(tmp_path, no_cluster, monkeypatch):
    """A port below 1024 without root: the bind's EACCES (raised here by a socket that refuses every bind, since
    these tests may run as root) was reported as serving.host."""
    import errno
    import socket

    from pipeline.serving.job import check_serving_inputs

    class RefusingSocket(socket.socket):
        def bind(self, address):
            raise PermissionError(errno.EACCES, "Permission denied")

    cfg = compose([f"paths.root={tmp_path}", "serving.port=443"])
    monkeypatch.setattr(socket, "socket", RefusingSocket)
    with pytest.raises(PipelineError, match=r"^serving.port: cannot listen on 127\.0\.0\.1:443 here \(Permission "
                                            r"denied\)$"):
        check_serving_inputs(cfg)


def register_speculator(tracker, tmp_path, algorithm, tags, trained_k=None, shapes=None):
    """An exported folder logged by a run and registered as `m`, alias champion; returns the version. trained_k
    writes the speculators_config an export carries (its proposal's speculative_tokens); shapes (hidden, vocab,
    verifier architecture) the verifier's shapes it records."""
    export = tmp_path / "export"
    export.mkdir(exist_ok=True)
    config: dict = {"speculators_model_type": algorithm}
    if trained_k is not None:
        config["speculators_config"] = {"proposal_methods": [{"proposal_type": "greedy",
                                                              "speculative_tokens": trained_k}]}
    if shapes is not None:
        config["target_hidden_size"], vocab, architecture = shapes
        config["transformer_layer_config"] = {"vocab_size": vocab}
        config.setdefault("speculators_config", {})["verifier"] = {"architectures": [architecture]}
    (export / "config.json").write_text(json.dumps(config))
    seal(export)  # as the export stage seals it
    with tracker.parent_run("evaluate") as run_id:
        tracker.log_artifact(export, "speculator")
        version = tracker.register("m", "speculator", run_id, {"gate.decision": "promoted", **tags})
    tracker.set_alias("m", "champion", version)
    return version


def test_registry_uris_resolve_to_the_exported_folder(tmp_path):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    version = register_speculator(tracker, tmp_path, "dflash", {"eval.recommended_k": "3"})
    run_id = tracker.client.get_model_version("m", version).run_id
    for uri in ("models:/m@champion", f"models:/m/{version}", f"runs:/{run_id}/speculator"):
        resolved = resolve(tracker.client, uri, tmp_path / "downloads")
        assert json.loads((resolved.local_dir / "config.json").read_text())["speculators_model_type"] == "dflash"
        assert resolved.algorithm == "dflash" and resolved.run_id == run_id
    assert resolve(tracker.client, "models:/m@champion", tmp_path / "d2").recommended_k == 3
    assert served_model_name("models:/m@champion", "x") == "m" and served_model_name("runs:/ab/s", "x") == "x"
    with pytest.raises(PipelineError, match="cannot resolve 'models:/m@nobody'"):
        resolve(tracker.client, "models:/m@nobody", tmp_path / "d4")
    with pytest.raises(PipelineError, match="is not models:/"):
        resolve(tracker.client, "m", tmp_path / "d5")


def test_jobs_serve_writes_the_config_a_rayservice_gets_and_resolves_the_speculator_first(tmp_path):
    import torch
    from safetensors.torch import save_file

    from pipeline.context import Context
    from pipeline.serving.job import prepare

    verifier = tmp_path / "verifier"  # what the job checks of a verifier folder, no model: serving is not started
    verifier.mkdir()
    (verifier / "config.json").write_text("{}")
    (verifier / "tokenizer.json").write_text("{}")
    save_file({"lm_head.weight": torch.zeros(1)}, str(verifier / "model.safetensors"))
    cfg = compose([f"paths.root={tmp_path}", "verifier=hf", f"verifier.path={verifier}", "verifier.name=v",
                   "tracking.registered_model_name=m"])
    ctx = Context.create(cfg)
    version = register_speculator(ctx.tracker, tmp_path, "peagle", {"eval.recommended_k": "2"})
    config, resolved = prepare(ctx)
    rendered = serve_config_for(cfg, str(verifier), ctx.tracker.uri)  # what jobs/render_infra.py uses
    assert rendered["applications"][0]["args"]["speculator"]["uri"] == "models:/m@champion"
    # the job serves the version it checked, whatever the alias points at when the app starts
    rendered["applications"][0]["args"]["speculator"]["uri"] = f"models:/m/{version}"
    assert config == rendered
    assert yaml.safe_load(Path(cfg.serving.serve_config_path).read_text()) == config
    assert resolved.version == version and (resolved.local_dir / "config.json").is_file()
    newer = register_speculator(ctx.tracker, tmp_path, "peagle", {"eval.recommended_k": "2"})  # takes the alias
    app = config["applications"][0]["args"]
    assert newer != version and with_speculator(app["llm_config"], app["speculator"])[1].version == version
    with pytest.raises(PipelineError, match="cannot resolve"):
        prepare(Context.create(compose([f"paths.root={tmp_path / 'empty'}", "verifier=hf", f"verifier.path={verifier}",
                                        "verifier.name=v", "tracking.registered_model_name=m"])))


def test_a_finished_download_is_reused_and_a_failed_one_leaves_nothing(tmp_path, monkeypatch):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    register_speculator(tracker, tmp_path, "peagle", {})
    first = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    calls = []
    monkeypatch.setattr(tracker.client, "download_artifacts", lambda *args: calls.append(args))
    assert resolve(tracker.client, "models:/m@champion", tmp_path / "downloads").local_dir == first.local_dir
    assert calls == []  # the version's folder was complete: nothing downloaded again

    def broken_download(run_id, path, dst):
        (Path(dst) / path).mkdir(parents=True)
        (Path(dst) / path / "weights.bin").write_bytes(b"half")
        raise OSError("connection reset")

    monkeypatch.setattr(tracker.client, "download_artifacts", broken_download)
    with pytest.raises(OSError):
        resolve(tracker.client, "models:/m@champion", tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nor the download folder it made for it
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError):
        resolve(tracker.client, "models:/m@champion", tmp_path / "kept" / "deeper")
    assert list((tmp_path / "kept").iterdir()) == []  # a folder there before stays


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
    assert metrics["served.cum_alpha_pos1"] == pytest.approx(0.4)
    assert metrics["served.cum_alpha_pos2"] == pytest.approx(0.1)
    assert served_metrics(spec_decode_counters("", "m")) == {}


def test_the_serve_config_file_is_what_serve_deploy_accepts(tmp_path):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    cfg = compose([f"paths.root={tmp_path}"])
    config = serve_config_for(cfg, "/verifier", None)
    schema = ServeDeploySchema.model_validate(yaml.safe_load(yaml.safe_dump(config)))
    assert schema.applications[0].import_path == IMPORT_PATH
    assert schema.http_options.host == "127.0.0.1"


POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/tokenize", "/detokenize")
GET_ROUTES = ("/v1/models", "/v1/models/m", "/docs", "/openapi.json", "/redoc")
KEY = [(b"authorization", b"Bearer s3cret")]
GOOD_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}


def call_at(guard, path, body=b"", headers=(), method="POST", root_path=""):
    """call() with the app mounted below root_path, as Ray Serve mounts it below a route_prefix."""
    sent, chunks = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": root_path + path, "root_path": root_path, "method": method,
             "headers": list(headers)}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.mark.parametrize("root_path", ["", "/speculator"])
@pytest.mark.parametrize("method, path", [("POST", r) for r in POST_ROUTES] + [("GET", r) for r in GET_ROUTES])
def test_every_route_below_the_root_path_needs_the_key(method, path, root_path):
    guard = RequestGuard(echo_app, api_key="s3cret", max_request_bytes=4096, max_model_len=2048)
    body = json.dumps(GOOD_BODY).encode() if method == "POST" else b""
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", "Bearer clé".encode())],
                    [(b"authorization", b"\xff\xfe")], [(b"authorization", b"s3cret")]):
        status, reply = call_at(guard, path, body, headers, method, root_path)
        assert status == 401 and reply["error"]["type"] == "authentication_error", (headers, reply)
    assert call_at(guard, path, body, KEY, method, root_path)[0] == 200


@pytest.mark.parametrize("path", ["/health", "/-/healthz"])
def test_the_health_probe_needs_no_key(path):
    guard = RequestGuard(echo_app, api_key="s3cret")
    assert call_at(guard, path, method="GET")[0] == 200
    assert call_at(guard, path, method="GET", root_path="/speculator")[0] == 200


@pytest.mark.parametrize("path", POST_ROUTES)
def test_every_post_route_refuses_deep_nesting_and_oversize_bodies_with_a_4xx(path):
    guard = RequestGuard(echo_app, api_key="s3cret", max_request_bytes=16384, max_model_len=2048)
    for depth in (65, 5000):  # past our limit, and past Python's recursion limit (a RecursionError: was a 500)
        nested = b'{"model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"
        status, reply = call_at(guard, path, nested, KEY)
        assert status == 400 and "nests deeper than 64 levels" in reply["error"]["message"], reply
    status, reply = call(guard, path, b'{"prompt": "' + b"x" * 17000 + b'"}', KEY)  # streamed in two chunks
    assert status == 413 and "larger than 16384 bytes" in reply["error"]["message"]
    declared = KEY + [(b"content-length", b"99999")]
    assert call_at(guard, path, b"{}", declared)[0] == 413  # refused on its declared length, before reading
    status, reply = call_at(guard, path, b"[1]", KEY)
    assert status == 400 and "must be a JSON object" in reply["error"]["message"]


@pytest.mark.parametrize("extra", [{"stream": True}, {"n": 3}, {"logprobs": True, "top_logprobs": 5},
                                   {"stream": True, "stream_options": {"include_usage": True}}, {"logprobs": 2}])
def test_streaming_n_and_logprobs_requests_reach_the_engine_whole(extra):
    guard = RequestGuard(echo_app, api_key="s3cret", max_request_bytes=4096, max_model_len=2048)
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = json.dumps({**GOOD_BODY, **extra}).encode()
        status, reply = call_at(guard, path, body, KEY)
        assert status == 200 and json.loads(reply["echo"]) == {**GOOD_BODY, **extra}


def test_a_multipart_upload_is_not_parsed_as_json():
    guard = RequestGuard(echo_app, api_key="s3cret", max_request_bytes=4096)
    headers = KEY + [(b"content-type", b"multipart/form-data; boundary=x")]
    assert call_at(guard, "/v1/audio/transcriptions", b"--x\r\n\r\n--x--", headers)[0] == 200


def test_a_failed_metrics_scrape_or_mlflow_call_is_a_warning_and_serving_goes_on(monkeypatch, caplog):
    import urllib.error

    from pipeline.serving import job
    from pipeline.serving.registry import ResolvedSpeculator

    resolved = ResolvedSpeculator(uri="models:/m/1", local_dir=Path("/nowhere"), run_id="0a",
                                  config={"speculators_model_type": "eagle3"})
    counters = "".join(f'# TYPE ray_vllm_spec_decode_{name}_total counter\n'
                       f'ray_vllm_spec_decode_{name}_total{{model_name="m"}} {value}\n'
                       for name, value in (("num_drafts", 10), ("num_draft_tokens", 40), ("num_accepted_tokens", 12)))
    outcomes = [urllib.error.URLError("connection refused"), counters]

    def scrape(url):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    class FailingClient:  # MLflow down: every call raises
        def log_batch(self, *args, **kwargs):
            raise RuntimeError("503 Service Unavailable")

    monkeypatch.setattr(job, "scrape", scrape)
    assert job.report_served_tau(FailingClient(), resolved, "m", "http://127.0.0.1:1/metrics") == {}
    assert "served tau not recorded this round (URLError" in caplog.text
    assert job.report_served_tau(FailingClient(), resolved, "m", "http://127.0.0.1:1/metrics") == {}
    assert "(RuntimeError: 503 Service Unavailable); still serving" in caplog.text


def test_a_download_is_checked_against_its_integrity_record_and_never_deletes_a_finished_one(tmp_path, monkeypatch):
    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    version = register_speculator(tracker, tmp_path, "peagle", {})
    run_id = tracker.client.get_model_version("m", version).run_id
    first = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    assert first.local_dir.parent.name == f"m-v{version}-{run_id[:12]}"  # a recreated model has other runs

    (first.local_dir / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))  # cache damaged
    again = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    assert again.algorithm == "peagle"  # downloaded again, not served from the changed cache

    real = tracker.client.download_artifacts

    def tampered(run, path, dst):
        local = real(run, path, dst)
        if Path(local).is_dir():  # the folder, after its config.json alone was read
            (Path(local) / "config.json").write_text(json.dumps({"speculators_model_type": "dflash"}))
        return local

    monkeypatch.setattr(tracker.client, "download_artifacts", tampered)
    with pytest.raises(PipelineError, match=r"serving.model: .*config.json' has \d+ bytes|does not match the sha256"):
        resolve(tracker.client, "models:/m@champion", tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())

    # Another resolver finishes while this one downloads: its folder, maybe in use, stays; ours is dropped.
    def racing(run, path, dst):
        local = real(run, path, dst)
        if Path(local).is_dir():  # the folder, after its config.json alone was read
            monkeypatch.setattr(tracker.client, "download_artifacts", real)
            resolve(tracker.client, "models:/m@champion", tmp_path / "race")  # the other resolver, to completion
        return local

    monkeypatch.setattr(tracker.client, "download_artifacts", racing)
    resolved = resolve(tracker.client, "models:/m@champion", tmp_path / "race")
    assert resolved.algorithm == "peagle" and (resolved.local_dir / "config.json").is_file()
    assert [p.name for p in (tmp_path / "race").iterdir() if not p.name.endswith(".lock")] == [
        resolved.local_dir.parent.name]  # no staging left


def test_two_resolvers_that_both_find_the_cache_damaged_never_delete_each_others_finished_download(tmp_path,
                                                                                                  monkeypatch):
    import threading

    from pipeline.serving import registry

    tracker = Tracker(compose([f"paths.root={tmp_path}"]))
    register_speculator(tracker, tmp_path, "peagle", {})
    first = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    (first.local_dir / "config.json").write_text("{}")  # the cache is damaged for both resolvers
    folder = first.local_dir.parent
    returned = []  # (who, inode of the folder it returned), in the order they returned

    def other_resolver():
        other = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
        returned.append(("other", other.local_dir.parent.stat().st_ino))

    real_usable, armed = registry._usable, {"after_download": False}
    real_download = tracker.client.download_artifacts

    def download(run, path, dst):
        local = real_download(run, path, dst)
        # this resolver's folder download (not the config.json it read first)
        armed["after_download"] = threading.current_thread() is threading.main_thread() and Path(local).is_dir()
        return local

    def usable_then_race(local):
        looked = real_usable(local)
        if armed.pop("after_download", False):  # this resolver has looked: the other one runs now
            racer = threading.Thread(target=other_resolver)
            racer.start()
            racer.join(timeout=2)  # it finishes unless it has to wait for this resolver
            armed["racer"] = racer
        return looked

    monkeypatch.setattr(tracker.client, "download_artifacts", download)
    monkeypatch.setattr(registry, "_usable", usable_then_race)
    mine = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    returned.append(("mine", mine.local_dir.parent.stat().st_ino))
    armed["racer"].join(timeout=60)
    assert len(returned) == 2
    # whoever returned first still has its folder in place: nothing replaced it under a user
    assert folder.stat().st_ino == returned[0][1]
    assert registry.resolve(tracker.client, "models:/m@champion", tmp_path / "downloads").algorithm == "peagle"
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [folder.name]


@pytest.mark.parametrize("headers, reaches_app", [((), False), ([(b"authorization", b"Bearer wrong")], False),
                                                  (KEY, True)])
def test_a_websocket_needs_the_key_too(headers, reaches_app):
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    guard = RequestGuard(app, api_key="s3cret")
    asyncio.run(guard({"type": "websocket", "path": "/v1/realtime", "root_path": "", "headers": list(headers)},
                      receive, send))
    assert bool(reached) is reaches_app
    assert sent == ([] if reaches_app else [{"type": "websocket.close", "code": 1008}])
