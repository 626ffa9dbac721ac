"""The bad-input suite: each bad input ends the job with exit code 2 and one line `error: <field or file>: ...`,
no traceback, before any expensive work (the stage's output folder is never created).

Kinds: prompt files (through the generate job's prompts stage), config overrides (validated before the first stage),
store manifests (read by every stage after capture) and registry URIs (serving.model). HTTP requests are in
tests/unit/test_serving.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import compose
from pipeline.data.store import load_manifest
from pipeline.entry import run_job
from pipeline.errors import PipelineError
from tests.conftest import tiny_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[2]

# (name, the file's bytes, what the one line must say)
PROMPT_FILES = [
    ("not_json", b'{"prompt": "fine"}\n{prompt: bare}\n', r"line 2 of .*' is not JSON"),
    ("json_list", b'["a", "b"]\n', r"line 1 of .*' is a JSON list, not an object"),
    ("json_string", b'"just text"\n', r"line 1 of .*' is a JSON str"),
    ("messages_string", b'{"messages": "hello"}\n', r"line 1 .*'messages' must be a list of \{role, content\}"),
    ("message_not_object", b'{"messages": ["hello"]}\n', r"'messages\[0\]' must be an object with role and content"),
    ("message_without_content", b'{"messages": [{"role": "user"}]}\n', r"'messages\[0\]' has no 'content'"),
    ("role_not_string", b'{"messages": [{"role": 3, "content": "x"}]}\n', r"'messages\[0\]\.role' must be a string"),
    ("role_missing", b'{"messages": [{"content": "x"}]}\n', r"'messages\[0\]\.role' must be a string, got null"),
    ("content_number", b'{"messages": [{"role": "user", "content": 7}]}\n',
     r"'messages\[0\]\.content' must be a string or a list of text parts, got int"),
    ("content_object", b'{"messages": [{"role": "user", "content": {"text": "x"}}]}\n',
     r"'messages\[0\]\.content' must be a string or a list of text parts, got dict"),
    ("text_part_without_text", b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}\n',
     r"'messages\[0\]\.content\[0\]\.text' must be a string, got null"),
    ("text_part_number", b'{"messages": [{"role": "user", "content": [5]}]}\n',
     r"'messages\[0\]\.content\[0\]' must be a text part object, got int"),
    ("prompt_number", b'{"prompt": 42}\n', r"'prompt' must be a string or a list of strings, got int"),
    ("prompt_list_of_numbers", b'{"prompt": [1, 2]}\n', r"'prompt' must be a string or a list of strings, got int"),
    ("prompt_object", b'{"prompt": {"q": "x"}}\n', r"'prompt' must be a string or a list of strings, got dict"),
    ("conversations_object", b'{"conversations": {"from": "human"}}\n', r"'conversations' must be a list"),
    ("conversations_value_number", b'{"conversations": [{"from": "human", "value": 1}]}\n',
     r"'conversations\[0\]\.value' must be a string, got int"),
    ("conversation_turn_string", b'{"conversations": ["hi"]}\n', r"'conversations\[0\]' must be an object"),
    ("ultrachat_number", b'{"data": ["q", 4]}\n', r"'data\[1\]' must be a string, got int"),
    ("not_utf8", b'{"prompt": "caf\xe9"}\n', r"line 1 of .*' is not valid UTF-8"),
    ("empty", b"", r"the prompt file .*' is empty"),
    ("blank_lines", b"\n  \n\n", r"the prompt file .*' is empty"),
    ("no_known_field", b'{"question": "x"}\n{"question": "y"}\n',
     r"no usable conversation .* 2 no 'messages', 'conversations', 'data' or 'prompt' field"),
    ("only_images", b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}\n',
     r"no usable conversation .* 1 a 'image_url' content part"),
]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("name, content, message", PROMPT_FILES, ids=[case[0] for case in PROMPT_FILES])
def test_a_bad_prompt_file_exits_2_naming_the_line_and_field(name, content, message, tmp_path, tiny_verifier_path,
                                                             capsys):
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(content)
    assert run_job(compose(tiny_overrides(tmp_path, tiny_verifier_path, path)), "generate") == 2
    line = _error_line(capsys)
    assert line.startswith("error: data"), line
    assert re.search(message, line), line
    assert not (tmp_path / "prompts").exists()


def test_a_missing_prompt_file_and_a_non_parquet_file_are_named(tmp_path, tiny_verifier_path, capsys):
    overrides = tiny_overrides(tmp_path, tiny_verifier_path, tmp_path / "absent.jsonl")
    assert run_job(compose(overrides), "generate") == 2
    assert _error_line(capsys).startswith("error: data.path: prompt file")
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    overrides = [*tiny_overrides(tmp_path, tiny_verifier_path, fake), "data=parquet", f"data.path={fake}"]
    assert run_job(compose(overrides), "generate") == 2
    assert "is not a readable Parquet file" in _error_line(capsys)


@pytest.mark.parametrize("override, field", [("evaluation.datasets=[held_out,gsm8k]", "evaluation.sets.gsm8k.path"),
                                             ("data=ultrachat", "data.path")])
def test_a_hub_dataset_neither_cached_nor_reachable_is_named_before_any_stage_or_run(override, field, tmp_path,
                                                                                       capsys, monkeypatch):
    """Offline, `datasets` retried the hub for 25 s in the evaluate (or prompts) stage, after the job's MLflow runs
    were made, and left them FAILED. Once cached, the same set passes the check (`datasets` reads its copy)."""
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "datasets")

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", unreachable)
    cfg = compose([f"paths.root={tmp_path}", override])
    path = str(cfg.evaluation.sets.gsm8k.path if field.startswith("evaluation") else cfg.data.path)
    assert run_job(cfg, "pipeline") == 2
    assert _error_line(capsys) == (f"error: {field}: hub dataset '{path}' is not in the local cache, and the hub did "
                                   "not give it (ConnectionError: Name or service not known)")
    assert not (tmp_path / "mlflow").exists() and not (tmp_path / "prompts").exists()
    from pipeline.data.prompts import check_hub_dataset

    namespace, name = path.split("/")
    (tmp_path / "datasets" / f"{namespace}___{name}").mkdir(parents=True)  # as datasets names it: snake_case
    check_hub_dataset(path, field)


def test_a_hub_dataset_in_datasets_cache_under_its_snake_case_name_counts_as_cached(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    from pipeline.data.prompts import check_hub_dataset

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(HfApi, "dataset_info", lambda self, repo_id, **kwargs: (_ for _ in ()).throw(OSError("down")))
    with pytest.raises(PipelineError, match="^data.path: hub dataset 'Open-Orca/SlimOrca' is not in the local cache"):
        check_hub_dataset("Open-Orca/SlimOrca", "data.path")
    (tmp_path / "datasets" / "Open-Orca___slim_orca").mkdir(parents=True)
    check_hub_dataset("Open-Orca/SlimOrca", "data.path")
    (tmp_path / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)  # the hub client's own cache
    check_hub_dataset("openai/gsm8k", "evaluation.sets.gsm8k.path")


# (override, what the one line must say): refused before the first stage.
OVERRIDES = [
    ("training.checkpoint_every=0", "training.checkpoint_every: must be >= 1"),
    ("training.log_every=0", "training.log_every: must be >= 1"),
    ("training.keep_checkpoints=0", "training.keep_checkpoints: must be >= 1"),
    ("training.micro_batch_size=0", "training.micro_batch_size: must be >= 1"),
    ("training.grad_accum_steps=0", "training.grad_accum_steps: must be >= 1"),
    ("training.warmup_steps=-1", "training.warmup_steps: must be >= 0"),
    ("training.grad_clip=-1", "training.grad_clip: must be >= 0"),
    ("training.max_failures=-5", "training.max_failures: must be >= 0, or -1 for no limit"),
    ("evaluation.gate.alias=latest", "evaluation.gate.alias: 'latest' alias name (case insensitive) is reserved"),
    ("evaluation.gate.alias=LATEST", "evaluation.gate.alias: 'latest' alias name (case insensitive) is reserved"),
    ("evaluation.gate.alias=v3", "evaluation.gate.alias: Version alias name 'v3' is reserved"),
    ("evaluation.gate.alias='best one'", "evaluation.gate.alias: Invalid alias name: 'best one'"),
    ("evaluation.gate.min_tau_gain=-0.1", "evaluation.gate.min_tau_gain: must be >= 0"),
    ("serving.host=0.0.0.0", "serving.host: '0.0.0.0' reaches beyond this machine; set serving.api_key_env"),
    ("serving.host=example.com", "serving.host: 'example.com' reaches beyond this machine"),
    ("serving.port=0", "serving.port: must be a TCP port"),
    ("serving.model=champion", "serving.model: 'champion' is not models:/<name>@<alias>"),
    ("serving.model='runs:/0a1b/../..'", "serving.model: 'runs:/0a1b/../..': the path after the run id"),
    ("serving.model=runs:/0a1b//etc", "serving.model: 'runs:/0a1b//etc': the path after the run id"),
    ("serving.model=models:/m/latest", "serving.model: 'models:/m/latest' is not"),
    ("evaluation.datasets=[held_out,nope]", "evaluation.datasets: unknown eval set 'nope'; known: held_out, chat, "),
    ("stages=[train,prompts]", "stages: ['train', 'prompts'] must name each stage once, in the order ['prompts', "),
    ("stages=[prompts,prompts]", "stages: ['prompts', 'prompts'] must name each stage once"),
    ("+training.no_such_option=3", "training.no_such_option: unknown config key"),
    # each reached a Ray worker or vLLM before it failed
    ("training.torch_threads_per_worker=0", "training.torch_threads_per_worker: must be >= 1"),
    ("generation.torch_threads=0", "generation.torch_threads: must be >= 1"),
    ("generation.cpus_per_actor=0", "generation.cpus_per_actor: must be >= 1"),
    ("generation.gpu_memory_utilization=1.5", "generation.gpu_memory_utilization: must be in (0, 1]"),
    ("evaluation.vllm.memory_fraction=0", "evaluation.vllm.memory_fraction: must be in (0, 1]"),
    ("evaluation.vllm.max_model_len=0", "evaluation.vllm.max_model_len: must be >= 1"),
    ("evaluation.max_new_tokens=2048", "evaluation.vllm.max_model_len: must exceed evaluation.max_new_tokens=2048"),
    ("serving.memory_fraction=2", "serving.memory_fraction: must be in (0, 1]"),
    ("serving.max_model_len=0", "serving.max_model_len: must be >= 1"),
    ("evaluation.max_new_tokens=0", "evaluation.max_new_tokens: must be >= 1"),
    ("evaluation.vllm.kv_cache_gb=0", "evaluation.vllm.kv_cache_gb: must be > 0"),
    ("evaluation.vllm.timeout_s=0", "evaluation.vllm.timeout_s: must be >= 1"),
    ("serving.metrics_port=0", "serving.metrics_port: must be a TCP port"),
    ("serving.metrics_port=8000", "serving.metrics_port: 8000 is serving.port's too"),
    ("cluster.local_num_cpus=0", "cluster.local_num_cpus: must be >= 1"),
    ("evaluation.vllm.tensor_parallel_size=2", "evaluation.vllm.tensor_parallel_size: GPUs of the job driver's node"),
    # a folder no file can be made in (a virtual file system here): Ray Train's controller failed with a traceback
    ("cluster.storage_path=/proc/no-such-storage", "cluster.storage_path: '/proc/no-such-storage': cannot write in"),
    # the default verifier is converted from its GGUF into verifier.cache_dir (${paths.cache}/verifiers)
    ("paths.cache=/proc/no-such-cache", "verifier.cache_dir: '/proc/no-such-cache/verifiers': cannot write in /proc"),
    # a K no sample can train: it failed only on memory when the drafter was built
    ("drafter.num_speculative_tokens=100000", "drafter.num_speculative_tokens: 100000 must be below "
                                              "generation.max_length="),
    # every number: no NaN, infinity or negative value (a NaN passes every `x <= 0` check)
    ("training.lr=inf", "training.lr: must be a finite number >= 0, got inf"),
    ("data.shuffle_seed=-1", "data.shuffle_seed: must be a finite number >= 0, got -1"),
    ("data.synthetic.temperature=nan", "data.synthetic.temperature: must be a finite number >= 0, got nan"),
    ("serving.replica_cpus=-4", "serving.replica_cpus: must be a finite number >= 0"),
    # a whole number past what torch's generators or an int64 take overflowed inside a Ray worker
    ("training.seed=99999999999999999999", "training.seed: must be at most 4294967295, got 99999999999999999999"),
    ("evaluation.seed=4294967296", "evaluation.seed: must be at most 4294967295"),
    ("generation.seed=4294967296", "generation.seed: must be at most 4294967295"),
    ("data.synthetic.seed=4294967296", "data.synthetic.seed: must be at most 4294967295"),
    ("training.max_steps=9223372036854775808", "training.max_steps: must be at most 9223372036854775807"),
    # MLflow's rules for its names, before any store exists (they failed at the export stage, after the chain)
    ("tracking.registered_model_name=bad/name", "tracking.registered_model_name: Invalid model name 'bad/name'"),
    ("tracking.registered_model_name=a:b", "tracking.registered_model_name: Invalid model name 'a:b'"),
    ("tracking.registered_model_name=..", "tracking.registered_model_name: Invalid value \"..\""),
    ("verifier.name=Org/Model", "verifier.name (the default tracking.registered_model_name is <verifier.name>-"),
    ("tracking.experiment_name=", "tracking.experiment_name: Invalid experiment name: ''"),
    ("tracking.experiment_name=" + "x" * 501, "tracking.experiment_name: 'name' exceeds the maximum length"),
    # serving.autoscaling goes to Ray Serve: checked by its own model, an unknown key refused
    ("serving.autoscaling.max_replicas=abc", "serving.autoscaling.max_replicas: Input should be a valid integer"),
    ("serving.autoscaling.min_replicas=5", "serving.autoscaling: Value error, max_replicas (1) must be greater"),
    ("+serving.autoscaling.max_replica=2", "serving.autoscaling.max_replica: not a Ray Serve autoscaling setting"),
]


def test_a_decode_longer_than_vllms_context_is_allowed_when_vllm_never_runs():
    from pipeline.config import validate

    validate(compose(["evaluation.vllm.enabled=false", "evaluation.max_new_tokens=4096"]))
    with pytest.raises(PipelineError, match=r"^evaluation\.vllm\.max_model_len: must exceed "):
        validate(compose(["evaluation.vllm.enabled=true", "evaluation.max_new_tokens=4096"]))


@pytest.mark.parametrize("override, message", OVERRIDES, ids=[case[0][:60] for case in OVERRIDES])
def test_a_bad_override_exits_2_before_the_first_stage(override, message, tmp_path, capsys):
    cfg = compose([f"paths.root={tmp_path}", override])
    assert run_job(cfg, "pipeline") == 2
    assert _error_line(capsys).startswith(f"error: {message}")
    assert not (tmp_path / "prompts").exists()


@pytest.mark.parametrize("override,message", [
    ("training.optimizer=sgd", "training.optimizer: 'sgd' is not one of [adamw, muon]"),
    ("training.lr_schedule=step", "training.lr_schedule: 'step' is not one of [cosine, linear]"),
    ("training.autocast_dtype=fp8", "training.autocast_dtype: 'fp8' is not one of [auto, bfloat16, float16]"),
    ("generation.compression=zstd", "generation.compression: 'zstd' is not one of [none, fp8]"),
    ("generation.overlength=wrap", "generation.overlength: 'wrap' is not one of [truncate, drop]"),
    ("verifier.tiny=llama", "verifier.tiny: 'llama' is not one of [qwen3, qwen3_moe, gemma4]"),
    ("stages=[prompts,nope]", "stages[1]: 'nope' is not one of [prompts, regenerate, capture, train, evaluate, export, "
                              "vllm_eval, promote]"),
    ("generation.responses=copy", "generation.responses: 'copy' is not one of [regenerate, keep]"),
    ("generation.backend=sglang", "generation.backend: 'sglang' is not one of [hf, vllm]"),
    ("generation.capture_backend=sglang", "generation.capture_backend: 'sglang' is not one of [hf, vllm]"),
    ("data.synthetic.backend=sglang", "data.synthetic.backend: 'sglang' is not one of [hf, vllm]"),
    ("data.source=csv", "data.source: 'csv' is not one of [humaneval, synthetic, general, jsonl, parquet, hub]"),
    ("verifier.compute_dtype=fp8", "verifier.compute_dtype: 'fp8' is not one of [float32, bfloat16, float16]"),
    ("verifier.save_dtype=float64", "verifier.save_dtype: 'float64' is not one of [float32, bfloat16, float16]"),
    ("serving.dtype=fp33", "serving.dtype: 'fp33' is not one of [auto, float32, bfloat16, float16]"),
    ("serving.accelerator=tpu", "serving.accelerator: 'tpu' is not one of [cpu, gpu]"),
    ("training.select_best_by=val.loss", "training.select_best_by: 'val.loss' is not one of [val.proxy_tau, val.tau]"),
    # a field below a single value: OmegaConf spoke of converting a dict ("experiment: Cannot convert 'dict' to
    # string"), which render_infra's own advice led to
    ("experiment.foo=1", "experiment: is a single value, not a group of fields: 'experiment.foo' names no option "
                         "(set experiment=...)"),
    ("training.max_steps.every=1", "training.max_steps: is a single value, not a group of fields: "
                                   "'training.max_steps.every' names no option (set training.max_steps=...)"),
    ("+paths.root.x=1", "paths.root: is a single value, not a group of fields: 'paths.root.x' names no option "
                        "(set paths.root=...)"),
])
def test_a_value_outside_a_settings_choices_is_refused_when_the_config_is_composed(override, message, tmp_path):
    """The schema types these choices (Enums): the config never composes, so no stage can start."""
    from pipeline.config.registration import ConfigError

    with pytest.raises(ConfigError) as error:
        compose([f"paths.root={tmp_path}", override])
    assert str(error.value) == message
    assert isinstance(error.value, PipelineError)


def test_loopback_hosts_need_no_key_and_a_key_opens_any_host(tmp_path):
    from pipeline.config.validate import validate

    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        validate(compose([f"paths.root={tmp_path}", f"serving.host={host}"]))
    validate(compose([f"paths.root={tmp_path}", "serving.host=0.0.0.0", "serving.api_key_env=KEY"]))


def _store_with(tmp_path: Path, manifest) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return store


GOOD_SHARD = {"file": "shard-0123456789abcdef.safetensors", "sha256": "0" * 64, "sample_ids": ["a"], "num_tokens": 3}
GOOD_MANIFEST = {"layer_ids": [1], "shards": [GOOD_SHARD], "num_samples": 1, "num_tokens": 3, "bytes": 10}
MANIFESTS = [
    ("not_json", "{shards: [", "is not JSON"),
    ("nested_too_deeply", "[" * 100_000 + "]" * 100_000, "is not JSON (nested too deeply)"),
    ("a_list", [], "must be a JSON object"),
    ("no_shards", {"layer_ids": [1]}, "'shards' must be a list"),
    ("no_layers", {"shards": []}, "'layer_ids' must be a list of layer numbers"),
    ("shard_escapes", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "file": "../x.safetensors"}]},
     "'shards[0].file' must be a shard file name in the store"),
    ("shard_absolute", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "file": "/etc/passwd"}]},
     "'shards[0].file' must be a shard file name in the store"),
    ("shard_in_subfolder", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "file": "sub/shard-0123456789abcdef"
                                                                            ".safetensors"}]},
     "'shards[0].file' must be a shard file name"),
    ("bad_sha", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "sha256": "xyz"}]}, "'shards[0].sha256' must be"),
    ("ids_not_list", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "sample_ids": "a"}]},
     "'shards[0].sample_ids' must be a list"),
    ("tokens_negative", {"layer_ids": [1], "shards": [{**GOOD_SHARD, "num_tokens": -1}]},
     "'shards[0].num_tokens' must be a token count"),
    # the totals and the typed fields readers print or compare: each was a KeyError or TypeError before
    ("no_totals", {"layer_ids": [1], "shards": [GOOD_SHARD]}, "'num_samples' must be a count, got None"),
    ("samples_as_text", {**GOOD_MANIFEST, "num_samples": "1"}, "'num_samples' must be a count, got '1'"),
    ("bytes_negative", {**GOOD_MANIFEST, "bytes": -5}, "'bytes' must be a count"),
    ("samples_miscounted", {**GOOD_MANIFEST, "num_samples": 2}, "'num_samples' is 2 but the shards list 1 samples"),
    ("tokens_miscounted", {**GOOD_MANIFEST, "num_tokens": 4}, "'num_tokens' is 4 but the shards hold 3 tokens"),
    ("version_as_text", {**GOOD_MANIFEST, "format_version": "2"}, "'format_version' must be a positive whole"),
    ("hidden_size_bool", {**GOOD_MANIFEST, "hidden_size": True}, "'hidden_size' must be a positive whole number"),
    ("layers_zero", {**GOOD_MANIFEST, "num_verifier_layers": 0}, "'num_verifier_layers' must be a positive whole"),
    ("fingerprint_number", {**GOOD_MANIFEST, "tokenizer_fingerprint": 5}, "'tokenizer_fingerprint' must be a string"),
]


@pytest.mark.parametrize("name, manifest, message", MANIFESTS, ids=[case[0] for case in MANIFESTS])
def test_a_malformed_store_manifest_is_refused_naming_the_field(name, manifest, message, tmp_path):
    store = _store_with(tmp_path, manifest)
    with pytest.raises(PipelineError) as refused:
        load_manifest(store)
    text = str(refused.value)
    assert text.startswith(f"store: manifest '{store / 'manifest.json'}'") and message in text, text
    assert "\n" not in text


def test_a_well_formed_manifest_loads(tmp_path):
    assert load_manifest(_store_with(tmp_path, GOOD_MANIFEST)) == GOOD_MANIFEST


def test_verify_store_names_a_malformed_manifest_field_in_one_line(tmp_path):
    store = _store_with(tmp_path, {**GOOD_MANIFEST, "format_version": "2"})
    done = subprocess.run([sys.executable, str(REPO / "jobs" / "verify_store.py"), str(store)], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 2 and not done.stdout, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: store: manifest '{store / 'manifest.json'}': 'format_version' must be a positive whole number, "
        "got '2'"]


def test_a_malformed_manifest_ends_the_training_job_with_exit_2(tmp_path, tiny_verifier_path, capsys):
    from pipeline.paths import StagePaths

    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path))
    store = StagePaths(cfg).store
    store.mkdir(parents=True)
    (store / "manifest.json").write_text(json.dumps({"layer_ids": [1], "shards": [{**GOOD_SHARD, "file": "../x"}]}))
    assert run_job(cfg, "train") == 2
    assert "'shards[0].file' must be a shard file name" in _error_line(capsys)


CREDENTIAL_URIS = [
    ("tracking.tracking_uri", "https://alice:hunter2@mlflow.example.com"),
    ("tracking.tracking_uri", "https://hunter2@mlflow.example.com"),
    ("tracking.tracking_uri", "postgresql://mlflow:hunter2@db:5432/mlflow"),
    ("cluster.mlflow_uri", "http://alice:hunter2@mlflow:5000"),
    # a password in the query (libpq and SQLAlchemy read it there), and any field that holds a URI
    ("tracking.tracking_uri", "'postgresql:///mlflow?host=127.0.0.1&user=mlflow&password=hunter2'"),
    ("tracking.tracking_uri", "'https://mlflow.example.com/?token=hunter2'"),
    ("cluster.address", "ray://alice:hunter2@head:10001"),
    ("data.path", "'https://example.com/prompts.jsonl?X-Amz-Signature=hunter2'"),
    # every kind of secret parameter, wherever in the URI it sits: libpq's sslpassword, Azure SAS's sig, Google's
    # key, a token in the fragment, a password among a path's parameters
    ("tracking.tracking_uri", "'sqlite:////tmp/mlflow.db?sslpassword=hunter2'"),
    ("data.path", "'https://acct.blob.core.windows.net/c/prompts.jsonl?sv=2022-11-02&sig=hunter2'"),
    ("data.path", "'https://example.com/prompts.jsonl?key=hunter2'"),
    ("tracking.tracking_uri", "'http://127.0.0.1:9/mlflow#access_token=hunter2'"),
    ("tracking.tracking_uri", "'mssql+pyodbc://db/mlflow;password=hunter2'"),
]


@pytest.mark.parametrize("field, uri", CREDENTIAL_URIS)
def test_a_uri_with_credentials_is_refused_without_echoing_them(field, uri, tmp_path, capsys):
    assert run_job(compose([f"paths.root={tmp_path}", f"{field}={uri}"]), "pipeline") == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "alice" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {field}: '") and "carries credentials" in err


def test_a_refused_secret_on_the_command_line_is_written_nowhere(tmp_path):
    """Hydra writes no copy of the composed config (hydra.output_subdir: null): it would do so before any check, so a
    refused secret would still land under paths.root."""
    result = subprocess.run([sys.executable, "jobs/train.py", f"paths.root={tmp_path}",
                             "tracking.tracking_uri=https://alice:hunter2@mlflow.example.com"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "hunter2" not in result.stderr + result.stdout
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "hunter2" in p.read_text(errors="replace")] == []
    assert not any(tmp_path.iterdir())  # not even Hydra's run folder with its empty log


@pytest.mark.parametrize("override", ["tracking.tracking_uri=https://alice:hunter2@mlflow.example.com",
                                      "tracking.tracking_uri=http://127.0.0.1:5000,http://bob:hunter2@h:5000",
                                      "+cluster.address=ray://bob:hunter2@head:10001",
                                      "+cluster.address=ray://bob:hunter2(x@head:10001"])  # ( ends a URI match
def test_a_secret_in_a_multirun_override_is_refused_before_hydra_logs_or_saves_it(tmp_path, override):
    """Under -m Hydra prints each job's overrides and writes multirun.yaml before any job runs validate."""
    result = subprocess.run([sys.executable, "jobs/train.py", "-m", f"paths.root={tmp_path}", override],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "hunter2" not in result.stderr + result.stdout, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {override.split('=')[0].lstrip('+')}: ")
    assert not any(tmp_path.iterdir())


def test_an_empty_paths_root_is_refused_before_hydra_makes_its_run_folder(tmp_path):
    existed = Path("/hydra").exists()
    result = subprocess.run([sys.executable, str(REPO / "jobs" / "train.py"), "paths.root="], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and result.stderr.strip() == "error: paths.root: must name a folder (it is empty)"
    assert Path("/hydra").exists() == existed and not any(tmp_path.iterdir())


def test_a_refused_job_leaves_no_hydra_run_folder_but_keeps_another_runs(tmp_path):
    earlier = tmp_path / "hydra" / "2026-01-01" / "00-00-00"
    earlier.mkdir(parents=True)
    (earlier / "train.log").write_text("an earlier run's log\n")
    for job in ("train", "generate", "serve"):
        result = subprocess.run([sys.executable, f"jobs/{job}.py", f"paths.root={tmp_path}", "training.lr=-1"],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.strip() == "error: training.lr: must be > 0", result.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "hydra", "hydra/2026-01-01", "hydra/2026-01-01/00-00-00", "hydra/2026-01-01/00-00-00/train.log"]


def test_a_refused_job_leaves_no_paths_root_it_made_but_keeps_one_that_was_there(tmp_path):
    """Hydra makes paths.root (and the folders above it) for its run folder before any check."""
    for job in ("train", "serve"):
        root = tmp_path / "new" / "root"
        result = subprocess.run([sys.executable, f"jobs/{job}.py", f"paths.root={root}", "training.lr=-1"],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.strip() == "error: training.lr: must be > 0", result.stderr
        assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    subprocess.run([sys.executable, "jobs/train.py", f"paths.root={tmp_path / 'there'}", "training.lr=-1"],
                   cwd=REPO, capture_output=True, text=True, timeout=120)
    assert [p.name for p in tmp_path.iterdir()] == ["there"] and not any((tmp_path / "there").iterdir())


def test_a_sweep_refused_at_its_first_job_leaves_no_sweep_record(tmp_path):
    result = subprocess.run([sys.executable, "jobs/train.py", "-m", f"paths.root={tmp_path}", "training.lr=-1,1e-3"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().endswith("error: training.lr: must be > 0"), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value, message", [("drafter=peagle,nosuch", "drafter: 'nosuch' is not one of"),
                                            ("training.max_steps=5,abc", "training.max_steps: Value 'abc'")])
def test_a_sweep_hydra_refuses_while_composing_leaves_no_record_and_no_root_it_made(tmp_path, value, message):
    """Hydra writes multirun.yaml (making paths.root for it) before it composes the first job."""
    made, kept = tmp_path / "made" / "root", tmp_path / "kept"
    kept.mkdir()
    for root in (made, kept):
        result = subprocess.run([sys.executable, "jobs/train.py", "-m", f"paths.root={root}", value], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and list(kept.iterdir()) == []


def test_a_sweep_record_beside_an_earlier_jobs_folder_is_kept(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "earlier").mkdir(parents=True)
    (sweep / "earlier" / "train.log").write_text("an earlier job of this sweep\n")
    command = ["jobs/train.py", "-m", f"paths.root={tmp_path}", f"hydra.sweep.dir={sweep}", "training.lr=-1"]
    result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert sorted(p.name for p in sweep.iterdir()) == ["earlier", "multirun.yaml"]


def test_a_paths_root_hydra_cannot_make_its_run_folder_under_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    result = subprocess.run([sys.executable, "jobs/train.py", f"paths.root={tmp_path / 'a_file'}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.fullmatch(r"error: paths\.root: cannot create Hydra's run folder '.*/a_file/hydra/.*': Not a directory",
                        result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("uri", ["https://alice:hunter2@mlflow.example.com", "http://alice:hunter2@[::1",
                                 "http://[::1/?token=hunter2", "https://bob@[::1/?password=hunter2&x=1"])
def test_credentials_in_the_mlflow_environment_variable_are_refused_too(uri, tmp_path, capsys, monkeypatch):
    """A URI urlsplit cannot parse (an unclosed IPv6 bracket) was let through, and the next check echoed it whole."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert run_job(compose([f"paths.root={tmp_path}"]), "pipeline") == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "alice" not in err and "bob" not in err
    assert err.strip().splitlines()[-1].startswith("error: MLFLOW_TRACKING_URI: '")


# (a tracking URI MLflow cannot use, what the one line must say after "MLflow cannot use '<uri>': ")
UNUSABLE_TRACKING_URIS = [
    ("file://{tmp}/mlruns", r"MLflow cannot use 'file://.*/mlruns': MlflowException: The filesystem tracking backend"),
    ("{tmp}/mlruns", r"MLflow cannot use '.*/mlruns': MlflowException: The filesystem tracking backend"),
    ("nosuchscheme://host/store", r"MLflow cannot use 'nosuchscheme://host/store': .*unsupported URI"),
    ("http://127.0.0.1:1", r"no MLflow server answers at 'http://127\.0\.0\.1:1' \(Connection refused\)"),
    ("http://", r"'http://' names no host"),
    ("http://[::1", r"'http://\[::1' is not a valid URI \("),
    ("http://127.0.0.1:99999", r"'http://127\.0\.0\.1:99999' is not a valid URI \("),
    # a database MLflow supports: its driver missing (ModuleNotFoundError, not MLflow's own error) or no server
    ("postgresql://127.0.0.1:1/mlflow", r"MLflow cannot use 'postgresql://127\.0\.0\.1:1/mlflow': \w+"),
    ("sqlite:///{tmp}/a_file/mlflow.db", r"MLflow cannot use 'sqlite:///.*/a_file/mlflow\.db': \w+"),
    ("sqlite:///{tmp}/a_file", r"MLflow cannot use 'sqlite:///.*/a_file': \w+"),  # a file, not a database
    # a database path that is a folder or a device: named at once (SQLAlchemy retried a folder for ~2 minutes)
    ("sqlite:///{tmp}", r"'sqlite:///.*' names '.*', which is a folder, not an SQLite database file"),
    ("sqlite:////dev/null", r"'sqlite:////dev/null' names '/dev/null', which is not a regular file, not an SQLite "
                            r"database file"),
    # relative to the working folder: MLflow made the database there, then failed on the artifact location
    ("sqlite:///relative.db", r"'sqlite:///relative\.db' names a path relative to the working folder"),
]


@pytest.mark.parametrize("uri, message", UNUSABLE_TRACKING_URIS,
                         ids=["file", "path", "scheme", "no_server", "no_host", "ipv6", "port", "driver", "sqlite",
                              "sqlite_not_a_database", "sqlite_folder", "sqlite_device", "sqlite_relative"])
def test_a_tracking_uri_mlflow_cannot_use_is_one_line_before_any_stage(uri, message, tmp_path, capsys, monkeypatch):
    uri = uri.format(tmp=tmp_path)
    monkeypatch.chdir(tmp_path)  # where a relative database would land
    (tmp_path / "a_file").write_text("not a folder")
    for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):  # the server is reached directly
        monkeypatch.delenv(proxy, raising=False)
    assert run_job(compose([f"paths.root={tmp_path}", f"tracking.tracking_uri='{uri}'"]), "pipeline") == 2
    line = _error_line(capsys)
    assert re.fullmatch(r"error: tracking\.tracking_uri: " + message + ".*", line), line
    assert not (tmp_path / "prompts").exists() and not (tmp_path / "locks").exists()  # nothing made for it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the same URI from the environment names the variable
    assert run_job(compose([f"paths.root={tmp_path}"]), "pipeline") == 2
    assert re.fullmatch(r"error: MLFLOW_TRACKING_URI: " + message + ".*", _error_line(capsys))
    assert not (tmp_path / "relative.db").exists() and not (tmp_path / "locks").exists()


def test_a_tracking_server_that_does_not_answer_is_named_before_the_verifier_is_read(tmp_path, capsys, monkeypatch):
    """The URI's own probes run with the config's checks, ahead of the verifier's (which may convert or fetch it),
    while the store itself is created only after every input check passed."""
    for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    cfg = compose([f"paths.root={tmp_path}", "tracking.tracking_uri=http://127.0.0.1:1", "verifier=hf",
                   f"verifier.path={tmp_path / 'no_such_verifier'}"])
    assert run_job(cfg, "pipeline") == 2
    assert _error_line(capsys).startswith("error: tracking.tracking_uri: no MLflow server answers")
    assert not any(tmp_path.iterdir())


def test_a_tracking_server_that_accepts_but_never_answers_is_named_after_the_probes_timeout(monkeypatch):
    """A port that takes connections and never answers (a dead backend behind a forward) would hold MLflow for its
    request timeout times its retries."""
    import socket

    from pipeline.tracking import check_server_reachable

    for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(PipelineError, match=rf"^tracking\.tracking_uri: no MLflow server answers at '{uri}'"):
            check_server_reachable(uri, "tracking.tracking_uri", timeout_s=0.5)


def test_a_tracking_server_behind_a_proxy_is_left_to_mlflow(monkeypatch):
    """MLflow's requests go through HTTP(S)_PROXY, a direct connection would not: only a server reached directly
    is probed."""
    from pipeline.tracking import check_server_reachable

    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    check_server_reachable("http://127.0.0.1:1", "tracking.tracking_uri")  # proxied: not probed
    monkeypatch.delenv("HTTP_PROXY")
    monkeypatch.setenv("ALL_PROXY", "http://proxy.invalid:3128")  # requests uses it for every scheme
    check_server_reachable("http://127.0.0.1:1", "tracking.tracking_uri")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with pytest.raises(PipelineError, match=r"^tracking\.tracking_uri: no MLflow server answers"):
        check_server_reachable("http://127.0.0.1:1", "tracking.tracking_uri")


@pytest.mark.parametrize("aux, message", [
    ("[3,1,2]", r"\[3, 1, 2\] is not in increasing order; vLLM concatenates .* \(\[1, 2, 3\]\)"),
    ("[1,2,6]", r"6 is outside 1\.\.5 for this verifier of 6 layers \(layer 6's state is stored after the final"),
    ("[0,2,3]", r"0 is outside 1\.\.5"),
    ("[1,2,2]", r"\[1, 2, 2\] repeats a layer"),
])
def test_aux_layer_ids_vllm_would_read_otherwise_are_refused(aux, message, tiny_verifier_path, tmp_path, capsys):
    from transformers import AutoConfig

    from pipeline.drafters.build import make_spec

    # before the first stage: exit 2, one line, nothing generated
    cfg = compose([*tiny_overrides(tmp_path, tiny_verifier_path), f"drafter.aux_layer_ids={aux}"])
    assert run_job(cfg, "generate") == 2
    assert re.match(r"error: drafter\.aux_layer_ids: " + message, _error_line(capsys))
    assert not any(tmp_path.iterdir())  # not even MLflow's store
    # and wherever a spec is made from a config (training, a resume)
    config = AutoConfig.from_pretrained(tiny_verifier_path)
    with pytest.raises(PipelineError, match=r"drafter\.aux_layer_ids: " + message):
        make_spec(compose([f"drafter.aux_layer_ids={aux}"]).drafter, config, "t", tiny_verifier_path, 0)


@pytest.mark.parametrize("mask", ["-1", "99999999"])
def test_a_mask_token_outside_the_vocabulary_is_refused_before_any_stage(mask, tiny_verifier_path, tmp_path, capsys):
    from transformers import AutoConfig

    from pipeline.drafters.build import make_spec

    cfg = compose([*tiny_overrides(tmp_path, tiny_verifier_path), "drafter=dflash", f"drafter.mask_token_id={mask}"])
    assert run_job(cfg, "generate") == 2
    assert re.match(rf"error: drafter\.mask_token_id: {mask} is outside the verifier's vocabulary \(0\.\.\d+\)",
                    _error_line(capsys))
    assert not any(tmp_path.iterdir())
    config = AutoConfig.from_pretrained(tiny_verifier_path)
    with pytest.raises(PipelineError, match=r"drafter\.mask_token_id: "):
        make_spec(compose(["drafter=dflash", f"drafter.mask_token_id={mask}"]).drafter, config, "t",
                  tiny_verifier_path, 0)


@pytest.mark.parametrize("option, message", [
    ("drafter.conv_group_size=7", r"drafter\.conv_group_size: 7 does not divide the verifier's hidden size \d+$"),
    ("drafter.selector_top_k=99999999", r"drafter\.selector_top_k: 99999999 exceeds the verifier's vocabulary "
                                        r"\(\d+\)$"),
])
def test_a_drafter_shape_the_verifier_cannot_take_is_refused_before_any_stage(option, message, tiny_verifier_path,
                                                                                tmp_path, capsys):
    """A module's own check against the verifier's sizes (DFlash2's convolution groups, its selector's candidates)
    runs before the first stage, when the drafter is built without memory on the meta device: not as a traceback
    after generation and capture."""
    cfg = compose([*tiny_overrides(tmp_path, tiny_verifier_path), "drafter=dflash2", option])
    assert run_job(cfg, "generate") == 2
    assert re.match("error: " + message, _error_line(capsys))
    assert not any(tmp_path.iterdir())


def test_a_resume_with_another_draft_vocabulary_of_the_same_size_names_the_first_difference(tmp_path):
    import dataclasses

    from pipeline.training.resume import check_same_drafter
    from tests.unit.tiny_drafters import tiny_drafter

    spec = tiny_drafter("eagle3").spec
    saved = spec.to_dict()
    ours = dataclasses.replace(spec, draft_token_ids=[0, 1, 2, 5])
    saved["draft_token_ids"] = [0, 1, 3, 5]
    with pytest.raises(PipelineError, match=r"another draft vocabulary of the same 4 tokens \(entry 2: token 3, this "
                                            r"run has 2"):
        check_same_drafter(saved, ours, tmp_path)
    saved["draft_token_ids"] = [0, 1, 3]
    with pytest.raises(PipelineError, match="a draft vocabulary of 3 tokens, this run has 4"):
        check_same_drafter(saved, ours, tmp_path)



def test_a_second_run_of_one_config_on_one_root_stops_naming_the_holder(tmp_path, tiny_verifier_path, capsys):
    from pipeline.locks import stage_lock
    from pipeline.paths import StagePaths

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"question {i}"} for i in range(10)])
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts))
    paths = StagePaths(cfg)
    # the first run holds its capture stage (taken at its start, while it may still be in prompts): the second
    # is refused before its first stage and before MLflow's store, so it leaves no run
    with stage_lock(paths.root, "capture", paths.stage_key("capture")):
        assert run_job(cfg, "generate") == 2
        line = _error_line(capsys)
        assert line.startswith(f"error: capture: this config's capture stage ({paths.store_key}) is taken by the job "
                               f"in pid {os.getpid()} on ")
        assert not paths.prompts.exists()  # the second run wrote nothing
        assert sorted(path.name for path in paths.root.iterdir()) == ["locks", "p.jsonl"]  # no MLflow store
        from pipeline.runner import run_stages

        # the refused job let go of the prompts lock it took before capture's; a job of other stages runs
        assert "prompts" in run_stages(cfg, "generate", ["prompts"])
        assert paths.prompts.exists()


class FailingVerifierActor:
    """A capture actor that fails the way vLLM refused a sample one token too long for its context."""

    def __call__(self, batch):
        raise ValueError("The decoder prompt (length 200) is longer than the maximum model length of 200.")


def test_an_actor_failure_reaches_the_user_as_its_cause_not_ray_datas_retry_advice():
    from types import SimpleNamespace

    import ray

    from pipeline.generation.common import stream_batches

    gen = SimpleNamespace(num_actors=1, cpus_per_actor=0.5, tensor_parallel_size=1, use_gpu=False)
    try:
        with pytest.raises(PipelineError) as failed:
            list(stream_batches([{"batch": 0}], FailingVerifierActor, {}, gen))
    finally:
        ray.shutdown()
    assert str(failed.value) == ("FailingVerifierActor: a verifier actor failed: ValueError: The decoder prompt "
                                 "(length 200) is longer than the maximum model length of 200.; finished batches are "
                                 "kept, rerun to continue")


def test_a_pipeline_error_raised_in_a_worker_reads_as_its_own_line():
    from pipeline.errors import remote_cause

    carried = Exception("\x1b[36mray::MapWorker(MapBatches(W)).submit()\x1b[39m (pid=1)\n  File \"w.py\", line 3\n"
                        "pipeline.errors.PipelineError: verifier.path: '/x' has no config.json\n\nThe above exception "
                        "was the direct cause of the following exception:\n\nray.exceptions.UserCodeException: UDF "
                        "failed to process a data block.\nTo change retry attempts, backoff, or ...")
    assert remote_cause(carried) == "verifier.path: '/x' has no config.json"
    assert remote_cause(Exception("no traceback here\nlast line")) == "last line"


def _fails_in_a_worker():
    raise ValueError("verifier.path: nothing there")


def test_a_failed_ray_task_reaches_the_driver_as_one_line_naming_the_step(ray_local):
    import ray

    from pipeline.cluster import get_remote

    with pytest.raises(PipelineError) as raised:
        get_remote(ray.remote(num_cpus=0)(_fails_in_a_worker).remote(), "data.synthetic: the prompt writer failed")
    assert str(raised.value) == "data.synthetic: the prompt writer failed: ValueError: verifier.path: nothing there"


def test_capture_gives_vllm_one_token_of_context_beyond_the_longest_sample():
    from pipeline.generation.common import vllm_options

    gen = compose(["generation.max_length=200"]).generation
    assert vllm_options(gen)["max_model_len"] == 200  # regeneration: prompt + answer within max_length
    assert vllm_options(gen, capture=True)["max_model_len"] == 201  # a 200-token sample prefills, then 1 token


CHECKPOINT_DAMAGE = {
    "truncated weights": (lambda f: os.truncate(f / "drafter.safetensors", 100),
                          r"drafter\.safetensors' has 100 bytes"),
    "zero-byte optimizer file": (lambda f: (f / "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt")
                                 .write_bytes(b""), r"optim_states\.pt' has 0 bytes"),
    "changed spec": (lambda f: (f / "spec.json").write_text((f / "spec.json").read_text() + " "),
                     r"spec\.json' has \d+ bytes"),
    "no integrity record": (lambda f: [p.unlink() for p in f.glob("integrity-rank*.json")],
                            "has no integrity record"),
    "weights swapped for a link": (lambda f: [(f / "drafter.safetensors").rename(f / "elsewhere"),
                                              (f / "drafter.safetensors").symlink_to(f / "elsewhere")],
                                   "is a link or not a file"),
}


@pytest.mark.parametrize("damage", sorted(CHECKPOINT_DAMAGE))
def test_the_evaluate_job_on_a_damaged_checkpoint_exits_2_naming_the_file(damage, tmp_path, tiny_verifier_path,
                                                                          prompts_jsonl, capsys):
    from pipeline.paths import StagePaths
    from tests.unit.test_integrity import checkpoint

    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts_jsonl))
    final = checkpoint(StagePaths(cfg).final_checkpoint)
    harm, message = CHECKPOINT_DAMAGE[damage]
    harm(final)
    assert run_job(cfg, "evaluate") == 2
    line = _error_line(capsys)
    assert line.startswith("error: ") and re.search(message, line), line
    assert not (StagePaths(cfg).evaluation / "report.json").exists()


def test_a_finished_checkpoint_that_fails_its_check_is_never_deleted(tmp_path, tiny_verifier_path, prompts_jsonl,
                                                                    capsys):
    """One stray file in final/ fails the integrity check. With no store to train it again the train job stops
    and final/ is left as it was; once it can be made again, it is moved aside whole, never removed."""
    from pipeline.paths import StagePaths
    from pipeline.training.stage import _set_aside
    from tests.unit.test_integrity import checkpoint

    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts_jsonl))
    final = checkpoint(StagePaths(cfg).final_checkpoint)
    (final / "NOTES.txt").write_text("the user's notes")
    before = sorted(p.relative_to(final).as_posix() for p in final.rglob("*"))
    assert run_job(cfg, "train") == 2
    assert "no hidden-state store" in _error_line(capsys)
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == before
    aside = _set_aside(final, PipelineError("checkpoint: NOTES.txt was not written with this checkpoint"))
    assert not final.exists() and aside.parent == final.parent and aside.name.startswith("final.damaged-")
    assert sorted(p.relative_to(aside).as_posix() for p in aside.rglob("*")) == before


@pytest.mark.parametrize("job, extra, message", [
    ("generate", ["data.path={missing}"], r"data\.path: prompt file '.*missing\.jsonl' does not exist"),
    ("evaluate", ["data.path={folder}"], r"data\.path: prompt file '.*folder' is a folder, not a file"),
    ("pipeline", ["evaluation.datasets=[held_out,mine]", "+evaluation.sets.mine={{source: jsonl, path: '{missing}'}}"],
     r"evaluation\.sets\.mine\.path: prompt file '.*missing\.jsonl' does not exist"),
    ("train", ["training.resume_from={missing}"], r"training\.resume_from: '.*missing\.jsonl' is not a checkpoint "
                                                  r"folder \(no such folder\)"),
    ("evaluate", [], r"evaluate: no trained drafter at '?.*/final'?; run jobs/train\.py with this config first"),
    ("train", [], r"train: no hidden-state store \(manifest\.json\) at .*/stores/\w+; run jobs/generate\.py with "
                  r"this config first"),
    ("pipeline", ["stages=[capture]"], r"capture: no regenerated set at .*/regenerated/\w+; run jobs/generate\.py "
                                       r"first"),
    ("pipeline", ["stages=[vllm_eval]"], r"vllm_eval: no trained drafter at .*/final; run jobs/train\.py with this "
                                         r"config first"),
    # the contents of a prompt file, while a stage of the job splits it, and of an evaluated set's file
    ("pipeline", ["stages=[prompts]", "data.path={empty}"], r"data\.path: the prompt file '.*empty\.jsonl' is empty"),
    ("generate", ["data.path={broken}"], r"data\.path: line 2 of '.*broken\.jsonl' .*"),
    ("pipeline", ["stages=[prompts]", "data.path={one}"], r"data\.num_train \+ data\.num_eval = \d+ but the source "
                                                         r"has only 1 distinct usable conversations \(.*\)"),
    # more prompts than the packaged HumanEval holds: refused in its prompts stage, after the store and locks
    ("generate", ["data.source=humaneval", "data.num_train=100000"], r"data\.num_train \+ data\.num_eval = 100\d+ "
                                                                    r"but the source has only 164 distinct usable .*"),
    ("pipeline", ["evaluation.datasets=[held_out,mine]", "+evaluation.sets.mine={{source: jsonl, path: '{empty}'}}"],
     r"evaluation\.sets\.mine\.path: the prompt file '.*empty\.jsonl' is empty"),
    ("pipeline", ["evaluation.datasets=[held_out,mine]", "+evaluation.sets.mine={{source: jsonl, path: '{unusable}'}}"],
     # not "evaluation.sets.mine: data: no usable ..."
     r"evaluation\.sets\.mine: no usable conversation in 'jsonl' .*unusable\.jsonl.*"),
], ids=["prompt file", "prompt folder", "eval set file", "resume_from", "no checkpoint", "no store", "no answers",
        "nothing to cross-check", "empty prompt file", "malformed line", "too few prompts", "too few humaneval",
        "empty eval set file",
        "unusable eval set file"])
def test_a_file_the_job_reads_is_checked_before_any_stage_or_store(job, extra, message, tmp_path, tiny_verifier_path,
                                                                   prompts_jsonl, capsys):
    """Each was refused only inside its stage: after MLflow's store, the stage locks, the prompts the evaluate job
    wrote first and (in a whole pipeline) regeneration, capture and training."""
    root = tmp_path / "out"
    names = {"missing": tmp_path / "missing.jsonl", "folder": tmp_path / "folder", "empty": tmp_path / "empty.jsonl",
             "broken": tmp_path / "broken.jsonl", "one": tmp_path / "one.jsonl",
             "unusable": tmp_path / "unusable.jsonl"}
    names["folder"].mkdir()
    names["empty"].write_text("\n\n")
    names["broken"].write_text('{"prompt": "fine"}\n{"prompt": \n')
    names["one"].write_text('{"prompt": "only one"}\n')
    names["unusable"].write_text('{"text": "no prompt field"}\n')
    cfg = compose(tiny_overrides(root, tiny_verifier_path, prompts_jsonl) + [e.format(**names) for e in extra])
    assert run_job(cfg, job) == 2
    assert re.fullmatch(f"error: {message}", _error_line(capsys))
    assert not root.exists() or not any(root.iterdir())


def test_a_prompt_file_is_read_up_front_while_its_prompts_stage_saved_only_one_split(tmp_path, tiny_verifier_path,
                                                                                     capsys):
    from pipeline.paths import StagePaths

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"prompt": \n')
    cfg = compose(tiny_overrides(tmp_path / "out", tiny_verifier_path, broken))
    (StagePaths(cfg).prompts / "train").mkdir(parents=True)  # a run stopped between saving the two splits
    assert run_job(cfg, "generate") == 2
    assert re.fullmatch(r"error: data\.path: line 2 of '.*broken\.jsonl' .*", _error_line(capsys))
    assert not (tmp_path / "out" / "mlflow").exists()


@pytest.mark.parametrize("job, override, message", [
    ("pipeline", "training.num_workers=64", r"training\.num_workers: asks for 64 CPUs \(64 Ray Train workers of "),
    ("generate", "generation.num_actors=64", r"generation\.num_actors: asks for \d+ CPUs \(64 verifier actors of "),
    ("generate", "cluster.local_num_cpus=1", r"generation\.num_actors: asks for 2 CPUs .*the local Ray this job "
                                             r"starts has 1 "),
])
def test_a_request_the_local_ray_cannot_grant_is_refused_before_it_waits_for_ever(job, override, message, tmp_path,
                                                                                  capsys, monkeypatch):
    """Ray queues an infeasible request: Ray Train retried its worker group every minute with no end."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray.is_initialized", lambda: False)  # a Ray another test left running here is not this job's
    monkeypatch.setattr("pipeline.cluster.running_local_cluster", lambda: None)
    cfg = compose([f"paths.root={tmp_path}", override])
    assert run_job(cfg, job) == 2
    assert re.match(f"error: {message}", _error_line(capsys))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, message", [
    (["serving.replica_cpus=64"], r"serving\.replica_cpus: asks for 65\.0 CPUs \(1 LLM replicas, each an actor of "
                                  r"serving\.replica_cpus=64\.0 CPUs beside its vLLM engine's 1\)"),
    (["serving.autoscaling.min_replicas=3", "serving.autoscaling.max_replicas=3", "cluster.local_num_cpus=2"],
     r"serving\.replica_cpus: asks for 3\.0 CPUs \(3 LLM replicas, .* has 2 "),
    # the engine's own bundles: one CPU per tensor-parallel worker
    (["serving.tensor_parallel_size=2", "cluster.local_num_cpus=1"],
     r"serving\.replica_cpus: asks for 2\.0 CPUs .* has 1 "),
    (["serving.tensor_parallel_size=2", "cluster.local_num_cpus=2"], None),
    # the engine's own option wins over serving.tensor_parallel_size (llm_config), and so in the count
    (["+serving.engine_kwargs.tensor_parallel_size=4", "cluster.local_num_cpus=2"],
     r"serving\.replica_cpus: asks for 4\.0 CPUs ")])
def test_a_serve_job_whose_replicas_the_local_ray_cannot_place_is_refused_before_ray_starts(overrides, message,
                                                                                             tmp_path, capsys,
                                                                                             monkeypatch):
    """Serve waits for ever on a replica no node can take, as Ray Train did on its workers. Each replica holds its
    actor's CPUs and its vLLM engine's."""
    from pipeline.cluster import check_fits_local_ray
    from pipeline.serving.job import run_serve

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("pipeline.cluster.running_local_cluster", lambda: None)
    started = []
    monkeypatch.setattr("pipeline.cluster.ensure_ray", lambda *args, **kwargs: started.append(args))
    cfg = compose([f"paths.root={tmp_path / 'root'}", "serving.speculative=false", *overrides])
    if message is None:  # fits: the check lets it through to Ray
        check_fits_local_ray(cfg, ["serve"])
        return
    assert run_serve(cfg) == 2
    assert re.match(f"error: {message}", _error_line(capsys)) and not started
    assert not (tmp_path / "root").exists()


def test_a_job_that_joins_a_cluster_is_not_held_to_this_machines_cpus(monkeypatch):
    from pipeline.cluster import check_fits_local_ray

    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr("pipeline.cluster.running_local_cluster", lambda: None)
    cfg = compose(["training.num_workers=64"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_fits_local_ray(cfg, ["train"])
    monkeypatch.delenv("RAY_ADDRESS")
    check_fits_local_ray(compose(["training.num_workers=64", "cluster.address=10.0.0.1:6379"]), ["train"])
    check_fits_local_ray(compose(["training.num_workers=64", "cluster.local_num_cpus=64"]), ["train"])
    with pytest.raises(PipelineError, match=r"^training\.num_workers: "):
        check_fits_local_ray(cfg, ["train"])


def test_a_given_checkpoint_at_or_past_max_steps_is_refused_before_any_store(tmp_path, capsys):
    """Refused inside the train stage before, after MLflow's store, the runs and the stage lock were made."""
    checkpoint = tmp_path / "elsewhere" / "final"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text(json.dumps({"step": 9}))
    root = tmp_path / "out"
    assert run_job(compose([f"paths.root={root}", "training.max_steps=9", f"training.resume_from={checkpoint}"]),
                   "train") == 2
    assert _error_line(capsys) == (f"error: training.max_steps: 9 leaves nothing to train after step 9, which "
                                   f"training.resume_from '{checkpoint}' already holds")
    assert not root.exists() or not any(root.iterdir())


def test_serving_with_no_store_to_resolve_from_creates_none(tmp_path, capsys, monkeypatch):
    from pipeline.serving.job import run_serve

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for model in ([], ["serving.model=runs:/deadbeef/speculator"]):
        assert run_serve(compose([f"paths.root={tmp_path}", *model])) == 2
        assert re.fullmatch(r"error: serving\.model: no MLflow store at .*mlflow\.db to resolve '(models|runs):/.*' "
                            r"from; .*", _error_line(capsys))
    assert not any(tmp_path.iterdir())


def test_a_missing_resume_from_is_not_read_when_the_run_has_its_final_checkpoint(tmp_path, tiny_verifier_path,
                                                                                prompts_jsonl):
    """resume_from is read only to start training; a finished run reuses final/ whether or not it is still there."""
    from pipeline.paths import StagePaths
    from pipeline.runner import check_input_files
    from tests.unit.test_integrity import checkpoint

    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts_jsonl)
                  + [f"training.resume_from={tmp_path / 'cleaned_up'}"])
    paths = StagePaths(cfg)
    with pytest.raises(PipelineError, match=r"^training\.resume_from: .*cleaned_up' is not a checkpoint folder"):
        check_input_files(cfg, ["train"], paths)
    checkpoint(paths.final_checkpoint)
    check_input_files(cfg, ["train"], paths)
