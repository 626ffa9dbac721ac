"""Each stage's contract on a tiny verifier: its inputs produce an artifact with the promised fields, tracked
in MLflow (one parent run, a child per stage), and a rerun reuses finished hidden-state shards."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import compose
from pipeline.config.schema import STAGE_NAMES
from pipeline.data.store import verify_store
from pipeline.errors import PipelineError
from pipeline.paths import StagePaths
from pipeline.runner import run_stages
from pipeline.tracking import tracking_uri
from tests.conftest import tiny_overrides, write_jsonl

ALL_STAGES = list(STAGE_NAMES)
EXTRA_PROMPTS = [{"messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]} for i in range(10)] + [
    {"prompt": "Name a colour."}, {"prompt": "Name a fruit."}]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_verifier_path, ray_local):
    root = tmp_path_factory.mktemp("contracts")
    prompts = write_jsonl(root / "prompts.jsonl", [
        {"messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]} for i in range(10)])
    extra = write_jsonl(root / "extra.jsonl", EXTRA_PROMPTS)  # holds the training prompts too
    cfg = compose(tiny_overrides(root, tiny_verifier_path, prompts) + [
        "training.max_steps=4", "training.checkpoint_every=2", "evaluation.max_new_tokens=10",
        "evaluation.datasets=[held_out,extra]", "evaluation.prompts_per_set=5", "evaluation.batch_size=3",
        f"+evaluation.sets.extra={{source: jsonl, path: '{extra}'}}"])
    results = run_stages(cfg, "pipeline", ALL_STAGES)
    return cfg, results, StagePaths(cfg)


def client(cfg):
    return mlflow.MlflowClient(tracking_uri(cfg))


def test_prompts_contract(chain):
    cfg, results, _ = chain
    train, held_out = results["prompts"]
    assert len(train) == cfg.data.num_train and len(held_out) == cfg.data.num_eval
    assert set(train.column_names) >= {"sample_id", "messages"}
    assert not set(train["sample_id"]) & set(held_out["sample_id"])


def test_regenerate_contract(chain):
    _, results, _ = chain
    regenerated = results["regenerate"]
    assert set(regenerated.column_names) >= {"sample_id", "messages", "input_ids", "loss_mask"}
    for row in regenerated:
        assert len(row["input_ids"]) == len(row["loss_mask"])
        assert row["loss_mask"][0] == 0 and row["loss_mask"][-1] == 1  # prompt masked, response trained on
        assert row["messages"][-1]["role"] == "assistant"


def test_capture_contract(chain):
    cfg, results, paths = chain
    manifest = results["capture"]
    assert manifest == verify_store(paths.store)
    assert manifest["num_samples"] == cfg.data.num_train
    # every drafter's default aux layers of a 6-layer verifier (EAGLE: 1, 3, 5; DFlash: 1, 2, 3) + the last one
    assert manifest["layer_ids"] == [1, 2, 3, 5, 6]
    for key in ("dtype", "hidden_size", "verifier", "chat_template_hash", "num_tokens"):
        assert manifest[key]
    assert all(len(shard["sha256"]) == 64 and shard["sample_ids"] for shard in manifest["shards"])


def test_train_contract_checkpoint_and_metrics(chain):
    cfg, results, paths = chain
    checkpoint = results["train"]
    assert checkpoint == paths.final_checkpoint
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert state["step"] == cfg.training.max_steps
    weights = load_file(str(checkpoint / "drafter.safetensors"))
    assert "mask_hidden" in weights and "lm_head.weight" not in weights
    train_run = _child_runs(cfg)["train"]
    history = client(cfg).get_metric_history(train_run.info.run_id, "train.loss")
    assert [m.step for m in history] == list(range(1, cfg.training.max_steps + 1))
    ray_checkpoints = list(Path(cfg.cluster.storage_path).glob("train-*/checkpoint_*"))
    assert len(ray_checkpoints) >= 2  # every checkpoint_every steps and the last one


def test_evaluate_contract(chain):
    cfg, results, paths = chain
    report = results["evaluate"]
    assert report["pooled_tau"] >= 1.0 and report["per_request_tau"] >= 1.0
    assert len(report["conditional_acceptance"]) == cfg.evaluation.num_speculative_tokens
    assert report["greedy_equivalence_checked"] and report["greedy_mismatches"] == []
    for name in ("report.json", "report.md", "acceptance.png", "requests.json"):
        assert (paths.evaluation / name).is_file()
    per_set = report["datasets"]
    assert {name: r["num_requests"] for name, r in per_set.items()} == {"held_out": 2, "extra": 5}
    assert report["num_requests"] == 7 and report["verify_steps"] == sum(r["verify_steps"] for r in per_set.values())
    assert [row["k"] for row in report["profile"]["per_k"]] == [1, 2, 3]
    assert 1 <= report["profile"]["recommended_k"] <= 3
    metrics = _child_runs(cfg)["evaluate"].data.metrics
    assert metrics["eval.extra.pooled_tau"] == pytest.approx(per_set["extra"]["pooled_tau"])
    assert metrics["eval.recommended_k"] == report["profile"]["recommended_k"]


def test_eval_sets_never_hand_back_a_training_prompt(chain):
    from transformers import AutoTokenizer

    from pipeline.data.chat import prompt_ids

    cfg, results, paths = chain
    tokenizer = AutoTokenizer.from_pretrained(cfg.verifier.path)
    trained = {tuple(prompt_ids(tokenizer, row["messages"][:1])) for row in results["prompts"][0]}
    requests = json.loads((paths.evaluation / "requests.json").read_text())
    assert [r["set"] for r in requests] == ["held_out"] * 2 + ["extra"] * 5
    assert not trained & {tuple(r["prompt_ids"]) for r in requests}


def test_gate_refuses_what_vllm_did_not_check(chain):
    cfg, results, _ = chain
    assert results["vllm_eval"]["skipped"] == "evaluation.vllm.enabled is false"
    assert results["promote"]["promoted"] is False and "no vLLM cross-check" in results["promote"]["reason"]
    version = client(cfg).get_model_version(results["export"]["registered_model"], results["export"]["version"])
    assert version.tags["gate.decision"] == "refused"
    assert version.tags["eval.signature"] == results["evaluate"]["signature"]
    name, number = results["export"]["registered_model"], results["export"]["version"]
    assert "\n## Promotion gate\n\nRefused: no vLLM cross-check" in version.description  # the card says so
    assert f"python jobs/serve.py serving.model=models:/{name}/{number} serving.allow_unpromoted=true" in \
        version.description.splitlines()
    assert not client(cfg).get_registered_model(results["export"]["registered_model"]).aliases


def test_export_contract_and_registry_link(chain):
    cfg, results, paths = chain
    exported = results["export"]
    config = json.loads((paths.export / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"]["name_or_path"]
    assert isinstance(config["transformer_layer_config"], dict) and "mask_token_id" in config
    version = client(cfg).get_model_version(exported["registered_model"], exported["version"])
    assert version.run_id == _child_runs(cfg)["export"].info.run_id
    assert version.tags["lineage.store_key"] == paths.store_key
    assert version.tags["lineage.evaluation_key"] == paths.evaluation_key == paths.export.name
    assert version.tags["lineage.parent_run_id"] == results["_parent_run_id"]
    # sealed after the card: every file a server downloads is in the integrity record, the card too
    from pipeline.integrity import verify

    verify(paths.export)
    card = paths.export / "README.md"
    original = card.read_text()
    card.write_text(original + "changed after export\n")
    try:
        with pytest.raises(PipelineError, match="README.md"):
            verify(paths.export)
    finally:
        card.write_text(original)  # the module's other tests read this export


def test_one_parent_run_with_a_child_per_stage(chain):
    cfg, results, _ = chain
    children = _child_runs(cfg)
    assert set(children) == set(ALL_STAGES)
    parent = client(cfg).get_run(results["_parent_run_id"])
    assert parent.data.params["drafter.name"] == "peagle"  # params = the resolved config
    assert parent.data.tags["git_sha"] and parent.data.tags["version.torch"]
    artifacts = {a.path for a in client(cfg).list_artifacts(children["capture"].info.run_id, "store")}
    assert "store/manifest.json" in artifacts
    paths = StagePaths(cfg)  # each data stage's run names what it made: the lineage from prompts to store
    assert children["prompts"].data.tags["prompts.key"] == paths.prompts_key
    assert children["regenerate"].data.tags["regenerated.key"] == paths.regenerated_key
    assert children["capture"].data.tags["store.key"] == paths.store_key


def test_rerun_reuses_finished_shards(chain):
    cfg, _, paths = chain
    before = {p.name: p.stat().st_mtime_ns for p in paths.store.glob("shard-*.safetensors")}
    results = run_stages(cfg, "generate", ["prompts", "regenerate", "capture"])
    after = {p.name: p.stat().st_mtime_ns for p in paths.store.glob("shard-*.safetensors")}
    assert before == after and results["capture"]["num_samples"] == cfg.data.num_train
    capture_run = _child_runs(cfg, results["_parent_run_id"])["capture"]
    assert capture_run.data.metrics["capture.new_samples"] == 0


def test_a_lost_shard_is_recaptured_without_touching_the_others(chain):
    cfg, _, paths = chain
    shards = sorted(paths.store.glob("shard-*.safetensors"))
    lost, kept = shards[0], shards[1:]
    kept_mtimes = {p.name: p.stat().st_mtime_ns for p in kept}
    lost.unlink()
    # the manifest's sha256 of the lost shard stands for bytes a capture need not repeat (batching changes them)
    manifest = json.loads((paths.store / "manifest.json").read_text())
    next(s for s in manifest["shards"] if s["file"] == lost.name)["sha256"] = "0" * 64
    (paths.store / "manifest.json").write_text(json.dumps(manifest))
    results = run_stages(cfg, "generate", ["capture"])
    assert {p.name: p.stat().st_mtime_ns for p in kept} == kept_mtimes
    assert lost.is_file() and results["capture"]["num_samples"] == cfg.data.num_train
    verify_store(paths.store)  # the recaptured shard's own sha256 is in the manifest, not the lost one's


def test_exported_checkpoint_reloads_with_the_same_drafts(chain):
    from pipeline.checkpoint import load_checkpoint
    from pipeline.export.speculators_format import load_speculators, round_to_export_dtype

    cfg, _, paths = chain
    trained, _ = load_checkpoint(paths.final_checkpoint)
    exported = load_speculators(paths.export)
    aux = torch.randn(1, 9, 3 * trained.spec.hidden_size)
    ids = torch.randint(0, 1000, (1, 9))
    round_to_export_dtype(trained)
    assert exported.spec.aux_layer_ids == trained.spec.aux_layer_ids
    assert torch.equal(exported.draft(aux, ids, 4), trained.draft(aux, ids, 4))


def _child_runs(cfg, parent_run_id=None):
    mlflow_client = client(cfg)
    experiment = mlflow_client.get_experiment_by_name(cfg.tracking.experiment_name)
    runs = mlflow_client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    if parent_run_id is None:
        parent_run_id = next(r for r in reversed(runs) if "mlflow.parentRunId" not in r.data.tags).info.run_id
    return {r.data.tags["stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_run_id}


def test_speculators_library_loads_the_export_with_our_weights(chain):
    from speculators import SpeculatorModel
    from speculators.models.peagle import PEagleSpeculatorConfig

    cfg, _, paths = chain
    config = PEagleSpeculatorConfig.from_pretrained(str(paths.export))  # its pydantic schema validates ours
    assert config.speculators_model_type == "peagle" and config.norm_before_residual is True
    assert config.eagle_aux_hidden_state_layer_ids == [1, 3, 5]
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = SpeculatorModel.from_pretrained(str(paths.export), config=config).state_dict()
    ours = load_file(str(paths.export / "model.safetensors"))
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name].to(tensor.dtype), tensor), name
