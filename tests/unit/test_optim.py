"""training.optimizer and training.lr_schedule: which tensors Muon updates, the schedules' shapes, and a plain
(DeepSpeed-free) engine that steps, saves and resumes both optimizers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import save_checkpoint
from pipeline.errors import PipelineError
from pipeline.training.engine import Engine
from pipeline.training.optim import lr_factor, muon_param_groups, torch_optimizers
from pipeline.training.resume import ResumePoint
from tests.unit.test_training_loop import NO_DEEPSPEED, TRAINING
from tests.unit.tiny_drafters import tiny_drafter, tiny_options, tiny_samples

MUON = dataclasses.replace(TRAINING, optimizer="muon", muon_weight_decay=0.1, weight_decay=0.01)


def test_linear_schedule_falls_to_its_floor_at_the_last_step():
    factor = lr_factor("linear", warmup=2, total=12, min_ratio=0.0)
    assert [factor(s) for s in (0, 1, 2, 7, 12, 20)] == [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
    assert lr_factor("linear", 2, 12, 0.2)(7) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="training.lr_schedule: 'step'"):
        lr_factor("step", 2, 12, 0.0)


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3", "dspark"])
def test_muon_takes_the_weight_matrices_and_adamw_the_rest(algorithm):
    model = tiny_drafter(algorithm)
    muon, adamw = torch_optimizers(model, MUON)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    on_muon = _names(model, [p for g in muon.param_groups for p in g["params"]])
    on_adamw = _names(model, [p for g in adamw.param_groups for p in g["params"]])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert on_muon | on_adamw == trainable and not on_muon & on_adamw  # every trainable tensor once, frozen none
    assert "fc.weight" in on_muon and "layers.0.self_attn.q_proj.weight" in on_muon
    assert all(model.get_parameter(name).ndim == 2 for name in on_muon)
    assert {"layers.0.input_layernorm.weight", "norm.weight"} <= on_adamw
    if algorithm == "peagle":
        assert "mask_hidden" in on_adamw  # a [1, 1, A*H] vector is no matrix
    if algorithm == "dspark":
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= on_adamw  # vocabulary matrices
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["weight_decay"] == 0.1
    assert adamw.param_groups[0]["lr"] == MUON.lr and adamw.param_groups[0]["weight_decay"] == 0.01
    assert torch_optimizers(model, TRAINING)[0].param_groups[0]["params"] == [
        p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("algorithm", ["peagle", "dspark", "dflash2"])
def test_deepspeed_muon_groups_split_the_drafter_as_the_plain_engine_does(algorithm):
    """DeepSpeed's own tagging would put P-EAGLE's mask_hidden, DSpark's Markov matrices and confidence projection
    and DFlash2's convolution kernels and codebooks on Muon; the groups handed to its MuonWithAuxAdam follow our rule
    instead."""
    model = tiny_drafter(algorithm)
    muon_group, adam_group = muon_param_groups(model, MUON)
    plain_muon, plain_adamw = torch_optimizers(model, MUON)
    assert muon_group["use_muon"] and not adam_group["use_muon"]
    assert _names(model, muon_group["params"]) == _names(model, plain_muon.param_groups[0]["params"])
    assert _names(model, adam_group["params"]) == _names(model, plain_adamw.param_groups[0]["params"])
    assert all(p.use_muon for p in muon_group["params"]) and not any(p.use_muon for p in adam_group["params"])
    assert (muon_group["lr"], muon_group["weight_decay"]) == (0.02, 0.1)
    assert (adam_group["lr"], adam_group["weight_decay"]) == (MUON.lr, 0.01)
    deepspeed_would_take = {
        "peagle": {"mask_hidden"},
        "dspark": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"},
        "dflash2": {"layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.base_kernel",
                    "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}}
    assert deepspeed_would_take[algorithm] <= _names(model, adam_group["params"])


def _step(engine: Engine, samples) -> float:
    loss, _, _ = engine.module.training_loss(samples, tiny_options().deterministic())
    engine.backward_and_step(loss)
    return float(loss)


def test_plain_engine_with_muon_trains_both_halves_and_resumes_the_same_curve(tmp_path: Path):
    samples = tiny_samples(2)
    engine = Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters() if p.requires_grad}
    losses = [_step(engine, samples) for _ in range(3)]
    assert losses[-1] < losses[0]
    moved = {name for name, p in engine.module.named_parameters() if name in before
             and not torch.equal(before[name], p)}
    assert {"fc.weight", "mask_hidden", "norm.weight"} <= moved  # Muon's and AdamW's tensors both train
    folder = tmp_path / "checkpoint"
    save_checkpoint(folder, engine.module, {"step": 3})
    engine.save_state(folder)
    uninterrupted = [_step(engine, samples) for _ in range(2)]

    resumed = Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2)
    point = ResumePoint(folder, step=3, global_batch=2, world_size=1, zero_stage=-1, uses_deepspeed=False,
                        token_budget=0, val_samples=0)
    resumed.load_state(point, tmp_path / "scratch")
    assert [_step(resumed, samples) for _ in range(2)] == pytest.approx(uninterrupted, abs=1e-6)
    assert resumed.lr() == engine.lr()  # the schedules were restored with the optimizer states


def _saved_state(engine: Engine, folder: Path, **recorded) -> ResumePoint:
    save_checkpoint(folder, engine.module, {"step": 1})
    engine.save_state(folder)
    return ResumePoint(folder, step=1, global_batch=2, world_size=1, zero_stage=-1, uses_deepspeed=False,
                       token_budget=0, val_samples=0, **recorded)


def test_a_resume_with_another_optimizer_is_refused_naming_the_tensors_that_moved(tmp_path: Path):
    adamw = Engine(tiny_drafter("peagle"), TRAINING, NO_DEEPSPEED, micro_batch=2)
    assert adamw.optimizer_split["muon"] == [] and "mask_hidden" in adamw.optimizer_split["adamw"]
    point = _saved_state(adamw, tmp_path, optimizer_split=adamw.optimizer_split)
    muon = Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2)
    with pytest.raises(PipelineError, match=r"^training\.optimizer: checkpoint .* another parameter split: "
                                            r"fc\.weight \(AdamW there, Muon here\), .* and \d+ more;"):
        muon.load_state(point, tmp_path / "scratch")


def test_a_resume_that_trains_another_set_of_tensors_is_refused_naming_them(tmp_path: Path):
    """The split covers AdamW's half too: a run that also trains the embedding (drafter.embed_requires_grad,
    outside the drafter identity a resume checks) cannot take the checkpoint's AdamW moments."""
    engine = Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2)
    point = _saved_state(engine, tmp_path, optimizer_split=engine.optimizer_split)
    embedding_too = tiny_drafter("peagle")
    embedding_too.embed_tokens.requires_grad_(True)
    resumed = Engine(embedding_too, MUON, NO_DEEPSPEED, micro_batch=2)
    with pytest.raises(PipelineError, match=r"another parameter split: embed_tokens\.weight "
                                            r"\(not trained there, AdamW here\);"):
        resumed.load_state(point, tmp_path / "scratch")


def test_a_state_that_records_no_split_and_does_not_fit_is_refused_in_one_line(tmp_path: Path):
    """A checkpoint from before the split was recorded: torch's own check of the group sizes, as one line."""
    fc_on_adamw = tiny_drafter("peagle")  # as DeepSpeed's own tagging once moved tensors between the halves
    fc_on_adamw.vocabulary_matrices = (*fc_on_adamw.vocabulary_matrices, "fc.")
    point = _saved_state(Engine(fc_on_adamw, MUON, NO_DEEPSPEED, micro_batch=2), tmp_path)  # no split recorded
    with pytest.raises(PipelineError) as error:
        Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2).load_state(point, tmp_path / "scratch")
    message = str(error.value)
    assert message.startswith("training.optimizer: checkpoint") and "\n" not in message
    assert "another parameter split (loaded state dict contains a parameter group that doesn't match" in message
    adamw_state = _saved_state(Engine(tiny_drafter("peagle"), TRAINING, NO_DEEPSPEED, micro_batch=2),
                               tmp_path / "adamw")
    with pytest.raises(PipelineError, match="holds 1 optimizer states, this run's training.optimizer has 2"):
        Engine(tiny_drafter("peagle"), MUON, NO_DEEPSPEED, micro_batch=2).load_state(adamw_state, tmp_path / "s")


def test_the_driver_plans_the_split_the_workers_build(tmp_path: Path):
    """The train stage checks a resume's split before any worker starts, from the drafter built on the meta
    device: it must be the split the engine then builds, for every drafter and both optimizers."""
    from pipeline.training.optim import optimizer_split, planned_optimizer_split

    for algorithm in ("eagle3", "peagle", "dflash", "dspark", "dflash2"):
        model = tiny_drafter(algorithm)
        for training in (TRAINING, MUON):
            assert planned_optimizer_split(model.spec, training) == optimizer_split(model, training)
        assert optimizer_split(model, MUON)["muon"]  # the matrices


def run_single_rank(script: str, port: int, *args: str) -> dict:
    """Run `script` as rank 0 of a one-process DeepSpeed world on CPU (its own interpreter: DeepSpeed's process group
    and op builds stay out of the test process); returns the JSON object its last output line prints."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(repo)}
    finished = subprocess.run([sys.executable, "-c", script, *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


DEEPSPEED_MUON_STEP = """
import dataclasses, json, sys
from pipeline.config.schema import DeepSpeedConfig
from pipeline.training.engine import Engine
from tests.unit.test_optim import MUON
from tests.unit.tiny_drafters import tiny_drafter, tiny_samples

engine = Engine(tiny_drafter("dspark"), dataclasses.replace(MUON, warmup_steps=1),
                DeepSpeedConfig(enabled=True, zero_stage=int(sys.argv[1]), bf16=False), micro_batch=2)

def weights():  # whole tensors (ZeRO-3 partitions them)
    with engine.full_weights():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}

before = weights()
loss, _, _ = engine.module.training_loss(tiny_samples(2), engine.module.config_class(max_anchors=8).deterministic())
engine.backward_and_step(loss)
after = weights()
print(json.dumps({"moved": {n: float((after[n] - before[n]).norm()) for n in before},
                  "largest_step": {n: float((after[n] - before[n]).abs().max()) for n in before},
                  "clip": engine.engine.gradient_clipping(), "shape": list(before["fc.weight"].shape),
                  "group_flags": [bool(g["use_muon"]) for g in engine.optimizer.param_groups],
                  "optimizer": type(engine.engine.basic_optimizer).__name__}))
"""


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_muon_steps_by_muon_lr_whatever_the_other_matrices_norms(tmp_path: Path, zero_stage: int):
    """DeepSpeed ZeRO-2 clips after it orthogonalises the Muon half; with gradient_clipping on, the clip shrank
    fc's step by the global norm of every matrix's update. One step must move fc by about muon_lr times the
    orthogonalised update's norm, sqrt(min(rows, cols)) (Newton-Schulz leaves singular values near 1). The
    tensors our rule gives to AdamW step as Adam's, inside the real ZeRO-2 and ZeRO-3 engines (ZeRO-3 refuses Muon
    with its default reduce-scatter)."""
    result = run_single_rank(DEEPSPEED_MUON_STEP, 29620 + zero_stage, str(zero_stage))
    rows, cols = result["shape"]
    expected = MUON.muon_lr * min(rows, cols) ** 0.5 * max(1.0, rows / cols) ** 0.5
    assert 0.5 * expected < result["moved"]["fc.weight"] < 1.5 * expected, (result, expected)
    assert result["clip"] == 0.0
    assert result["optimizer"] == "MuonWithAuxAdam" and sorted(result["group_flags"]) == [False, True]
    # DSpark's Markov matrices are on the AdamW half: no element moves by more than about lr in the first step
    # (Adam's first update is lr * sign(grad)); DeepSpeed's own tagging gave them Muon at sqrt(V / rank) x muon_lr.
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert result["largest_step"][name] <= 1.01 * MUON.lr, (name, result["largest_step"][name])
    assert result["largest_step"]["markov_head.markov_w2.weight"] > 0.5 * MUON.lr  # zero-initialised: its gradient


DEEPSPEED_MUON_RESUME = """
import dataclasses, json, sys
from pathlib import Path
from pipeline.checkpoint import save_checkpoint
from pipeline.errors import PipelineError
from pipeline.config.schema import DeepSpeedConfig
from pipeline.training.engine import Engine
from pipeline.training.resume import ResumePoint
from tests.unit.test_optim import MUON
from tests.unit.tiny_drafters import tiny_drafter, tiny_samples

folder, samples = Path(sys.argv[1]), tiny_samples(2)
training, zero2 = dataclasses.replace(MUON, warmup_steps=1), DeepSpeedConfig(enabled=True, zero_stage=2, bf16=False)

def step(engine):
    loss, _, _ = engine.module.training_loss(samples, engine.module.config_class(max_anchors=8).deterministic())
    engine.backward_and_step(loss)
    return float(loss)

engine = Engine(tiny_drafter("dspark"), training, zero2, micro_batch=2)
first = [step(engine) for _ in range(3)]
save_checkpoint(folder, engine.module, {"step": 3})
engine.save_state(folder)
uninterrupted = [step(engine) for _ in range(3)]
point = ResumePoint(folder, step=3, global_batch=2, world_size=1, zero_stage=2, uses_deepspeed=True,
                    token_budget=0, val_samples=0, optimizer_split=engine.optimizer_split)
resumed = Engine(tiny_drafter("dspark"), training, zero2, micro_batch=2)
resumed.load_state(point, folder / "scratch")
resumed_losses = [step(resumed) for _ in range(3)]
adamw = Engine(tiny_drafter("dspark"), dataclasses.replace(training, optimizer="adamw"), zero2, micro_batch=2)
try:
    adamw.load_state(point, folder / "scratch-adamw")
    refused = ""
except PipelineError as error:
    refused = str(error)
print(json.dumps({"first": first, "uninterrupted": uninterrupted, "resumed": resumed_losses, "refused": refused}))
"""


def test_deepspeed_muon_resumes_the_same_curve_from_its_checkpoint(tmp_path: Path):
    """Our MuonWithAuxAdam is a client optimizer to DeepSpeed: its two halves' states (Muon's momentum, Adam's
    moments) go into the ZeRO-2 checkpoint and come back, so a resumed run takes the steps the uninterrupted one
    took (the first loss after the resume reads only the weights; the next two read the optimizer's state). The
    split the checkpoint records refuses an AdamW engine by name."""
    result = run_single_rank(DEEPSPEED_MUON_RESUME, 29619, str(tmp_path))
    assert result["first"][-1] < result["first"][0]  # it trains
    assert result["resumed"] == pytest.approx(result["uninterrupted"], abs=1e-5)
    # the recorded split refuses an AdamW engine before DeepSpeed reads the Muon state
    assert result["refused"].startswith("training.optimizer: checkpoint")
    assert "fc.weight (Muon there, AdamW here)" in result["refused"]
