"""Pieces of the worker loop that run without Ray: data order, LR schedule, DeepSpeed config, plain engine."""

from __future__ import annotations

import itertools

import torch

from pipeline.training.loop import Engine, batches, deepspeed_config, native_bf16, resolve_autocast, warmup_cosine
from tests.unit.tiny_drafters import HIDDEN, OPTIONS, VOCAB, tiny_drafter

TRAINING = {"micro_batch_size": 2, "grad_accum_steps": 1, "grad_clip": 1.0, "lr": 3e-3, "weight_decay": 0.0,
            "warmup_steps": 2, "max_steps": 10}


def test_batches_are_seeded_and_reshuffled_each_epoch():
    samples = [{"id": i} for i in range(6)]
    first = [(e, [s["id"] for s in b]) for e, b in itertools.islice(batches(samples, 2, seed=3), 6)]
    again = [(e, [s["id"] for s in b]) for e, b in itertools.islice(batches(samples, 2, seed=3), 6)]
    assert first == again
    epoch0 = [i for e, ids in first if e == 0 for i in ids]
    epoch1 = [i for e, ids in first if e == 1 for i in ids]
    assert sorted(epoch0) == sorted(epoch1) == list(range(6)) and epoch0 != epoch1


def test_auto_autocast_uses_bf16_only_where_the_cpu_computes_it_natively():
    assert resolve_autocast("auto", "cpu") == (torch.bfloat16 if native_bf16("cpu") else None)
    assert resolve_autocast(None, "cpu") is None
    assert resolve_autocast("bfloat16", "cpu") == torch.bfloat16


def test_warmup_then_cosine_to_a_tenth():
    factor = warmup_cosine(warmup=4, total=20)
    assert [round(factor(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(20) == 0.1 and all(factor(s) >= factor(s + 1) for s in range(4, 20))


def test_deepspeed_config_from_the_groups():
    config = deepspeed_config({"zero_stage": 3, "bf16": True, "offload_optimizer": True,
                               "extra": {"wall_clock_breakdown": True}}, TRAINING)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 1.0
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["wall_clock_breakdown"] is True


def test_plain_engine_steps_and_follows_the_schedule():
    model = tiny_drafter()
    engine = Engine(model, TRAINING, {"enabled": False})
    generator = torch.Generator().manual_seed(0)
    sample = {"aux": torch.randn(16, 3 * HIDDEN, generator=generator), "last": torch.randn(16, HIDDEN),
              "input_ids": torch.randint(0, VOCAB - 1, (16,), generator=generator),
              "loss_mask": torch.tensor([0] * 4 + [1] * 12)}
    before = model.fc.weight.detach().clone()
    lrs = []
    for _ in range(3):
        loss, _, _ = engine.module.training_loss([sample], OPTIONS)
        engine.backward_and_step(loss)
        lrs.append(engine.lr())
    assert not torch.equal(before, model.fc.weight)
    assert lrs == [3e-3, 3e-3 * warmup_cosine(2, 10)(2), 3e-3 * warmup_cosine(2, 10)(3)]
