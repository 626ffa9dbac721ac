"""Pieces of the worker loop that run without Ray: data order, LR schedule, DeepSpeed config, plain engine."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipeline.config.schema import DeepSpeedConfig, TrainingConfig
from pipeline.errors import PipelineError
from pipeline.training.engine import Engine, deepspeed_config
from pipeline.training.optim import lr_factor
from pipeline.training.order import GlobalOrder, pack_to_token_budget
from pipeline.training.precision import native_bf16, resolve_autocast
from pipeline.training.resume import (
    ResumePoint,
    check_optimizer_carries_over,
    check_same_data_order,
    micro_batch_for,
    read_resume_point,
)
from tests.unit.tiny_drafters import HIDDEN, VOCAB, tiny_drafter, tiny_options, tiny_samples

TRAINING = TrainingConfig(micro_batch_size=2, grad_accum_steps=1, grad_clip=1.0, lr=3e-3, weight_decay=0.0,
                          warmup_steps=2, max_steps=10, optimizer="adamw", muon_lr=0.02, muon_momentum=0.95,
                          muon_weight_decay=0.0, lr_schedule="cosine", min_lr_ratio=0.1)
NO_DEEPSPEED = DeepSpeedConfig(enabled=False)


def test_the_global_order_is_seeded_reshuffled_each_epoch_and_free_of_the_world_size():
    order = GlobalOrder([10] * 6, global_batch=4, seed=3)
    two_workers = [[i for rank in range(2) for i in order.micro_batch(step, 0, 1, rank, 2)] for step in range(6)]
    one_worker = [order.micro_batch(step, 0, 1, 0, 1) for step in range(6)]
    two_micro_steps = [[i for m in range(2) for i in order.micro_batch(step, m, 2, 0, 1)] for step in range(6)]
    assert two_workers == one_worker == two_micro_steps  # the same samples per optimizer step, however split
    stream = [i for batch in one_worker for i in batch]  # 24 positions = 4 epochs of 6
    epochs = [stream[e * 6:(e + 1) * 6] for e in range(4)]
    assert all(sorted(e) == list(range(6)) for e in epochs) and epochs[0] != epochs[1]
    assert GlobalOrder([10] * 6, 4, seed=3).micro_batch(5, 0, 1, 0, 1) == one_worker[5]  # a fresh object agrees
    assert order.epoch(5) == 3


def test_packing_fills_each_micro_batch_up_to_the_token_budget_in_the_shuffled_order():
    assert pack_to_token_budget([3, 0, 1, 2], [5, 3, 9, 2], 8) == [[3, 0], [1], [2]]  # 2+5, 3 then 9 alone, 9
    lengths = [5, 3, 9, 2, 2, 4, 6, 1]
    order = GlobalOrder(lengths, global_batch=2, seed=1, token_budget=8)
    for epoch in range(3):
        units = order.units(epoch)
        assert sorted(i for unit in units for i in unit) == list(range(8))  # every sample once per epoch
        assert all(sum(lengths[i] for i in unit) <= 8 or len(unit) == 1 for unit in units)
    one_worker = [order.micro_batch(step, 0, 1, 0, 1) for step in range(9)]
    two_workers = [[i for rank in range(2) for i in order.micro_batch(step, 0, 1, rank, 2)] for step in range(9)]
    fresh = GlobalOrder(lengths, global_batch=2, seed=1, token_budget=8)
    assert one_worker == two_workers == [fresh.micro_batch(step, 0, 1, 0, 1) for step in reversed(range(9))][::-1]
    stream = [unit for epoch in range(4) for unit in order.units(epoch)]
    assert one_worker == [stream[2 * s] + stream[2 * s + 1] for s in range(9)]  # epochs follow each other


def test_a_resume_splits_the_saved_global_batch_or_refuses():
    assert micro_batch_for(8, accum=1, world_size=2) == 4 and micro_batch_for(8, accum=2, world_size=1) == 4
    with pytest.raises(PipelineError, match="does not split over 3 workers"):
        micro_batch_for(8, accum=1, world_size=3)


def test_a_resume_keeps_the_packing_and_the_held_out_samples(tmp_path):
    point = ResumePoint(tmp_path, step=3, global_batch=2, world_size=2, zero_stage=2, uses_deepspeed=True,
                        token_budget=0, val_samples=4)
    check_same_data_order(point, TrainingConfig(max_tokens_per_micro_batch=0, val_samples=4))
    with pytest.raises(PipelineError, match="training.max_tokens_per_micro_batch: checkpoint .* trained with 0"):
        check_same_data_order(point, TrainingConfig(max_tokens_per_micro_batch=4096, val_samples=4))
    with pytest.raises(PipelineError, match="training.val_samples: checkpoint .* trained with 4, this run has 2"):
        check_same_data_order(point, TrainingConfig(max_tokens_per_micro_batch=0, val_samples=2))


def test_a_muon_checkpoint_resumes_only_on_the_layout_that_wrote_it(tmp_path):
    """DeepSpeed's universal checkpoint carries no Muon momentum: a Muon run on another worker count or ZeRO stage
    is refused before any worker starts; AdamW converts, and the same layout needs no conversion."""
    point = ResumePoint(tmp_path, step=3, global_batch=2, world_size=2, zero_stage=2, uses_deepspeed=True)
    muon, adamw = TrainingConfig(optimizer="muon"), TrainingConfig(optimizer="adamw")
    check_optimizer_carries_over(point, muon, num_workers=2, zero_stage=2)
    check_optimizer_carries_over(point, adamw, num_workers=1, zero_stage=3)
    for workers, stage in ((1, 2), (2, 3)):
        with pytest.raises(PipelineError, match=r"training\.num_workers: .* trained with Muon on 2 workers at ZeRO "
                                                 rf"stage 2; .* to {workers} workers at stage {stage}"):
            check_optimizer_carries_over(point, muon, num_workers=workers, zero_stage=stage)


def test_a_checkpoint_of_another_drafter_or_verifier_is_refused(tmp_path):
    spec = tiny_drafter().spec
    (tmp_path / "spec.json").write_text(json.dumps({**spec.to_dict(), "algorithm": "dflash"}))
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(PipelineError, match="has algorithm 'dflash', this run has 'peagle'"):
        read_resume_point(tmp_path, spec)
    other_verifier = {**spec.to_dict(), "verifier_name": "Qwen3-8B"}
    (tmp_path / "spec.json").write_text(json.dumps(other_verifier))
    with pytest.raises(PipelineError, match="has verifier 'Qwen3-8B'"):
        read_resume_point(tmp_path, spec)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    with pytest.raises(PipelineError, match="weights only"):
        read_resume_point(tmp_path, spec)


def test_auto_autocast_uses_bf16_only_where_the_cpu_computes_it_natively():
    assert resolve_autocast("auto", "cpu") == (torch.bfloat16 if native_bf16("cpu") else None)
    assert resolve_autocast(None, "cpu") is None
    assert resolve_autocast("bfloat16", "cpu") == torch.bfloat16


def test_warmup_then_cosine_to_a_tenth():
    factor = lr_factor("cosine", warmup=4, total=20, min_ratio=0.1)
    assert [round(factor(s), 3) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(20) == 0.1 and all(factor(s) >= factor(s + 1) for s in range(4, 20))


def test_deepspeed_config_from_the_groups():
    config = deepspeed_config(DeepSpeedConfig(zero_stage=3, bf16=True, offload_optimizer=True,
                                              extra={"wall_clock_breakdown": True}), TRAINING, micro_batch=2)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 1.0
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["wall_clock_breakdown"] is True


def test_plain_engine_steps_and_follows_the_schedule():
    model = tiny_drafter()
    engine = Engine(model, TRAINING, NO_DEEPSPEED, micro_batch=2)
    generator = torch.Generator().manual_seed(0)
    sample = {"aux": torch.randn(16, 3 * HIDDEN, generator=generator), "last": torch.randn(16, HIDDEN),
              "input_ids": torch.randint(0, VOCAB - 1, (16,), generator=generator),
              "loss_mask": torch.tensor([0] * 4 + [1] * 12)}
    before = model.fc.weight.detach().clone()
    lrs = []
    for _ in range(3):
        loss, _, _ = engine.module.training_loss([sample], tiny_options())
        engine.backward_and_step(loss)
        lrs.append(engine.lr())
    assert not torch.equal(before, model.fc.weight)
    factor = lr_factor("cosine", 2, 10, 0.1)
    assert lrs == [3e-3, 3e-3 * factor(2), 3e-3 * factor(3)]


def test_plain_engine_accumulates_micro_batches_into_one_step():
    """Two micro-batches, stepping at the boundary only == one step on both samples' mean loss."""
    options = tiny_options().deterministic()
    samples = tiny_samples(2)
    accumulated, single = tiny_drafter(), tiny_drafter()
    engine = Engine(accumulated, dataclasses.replace(TRAINING, grad_accum_steps=2), NO_DEEPSPEED, micro_batch=1)
    for index, sample in enumerate(samples):
        loss, _, _ = engine.module.training_loss([sample], options)
        engine.backward_and_step(loss, boundary=index == 1)  # the engine scales by 1 / grad_accum_steps
    reference = Engine(single, TRAINING, NO_DEEPSPEED, micro_batch=2)
    losses = [reference.module.training_loss([sample], options)[0] for sample in samples]
    reference.backward_and_step((losses[0] + losses[1]) / 2)
    for (name, mine), theirs in zip(accumulated.named_parameters(), single.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-6), name
    assert not torch.equal(accumulated.fc.weight, tiny_drafter().fc.weight)


def test_ray_trains_interrupt_handler_is_put_back_and_its_exits_are_an_interrupt():
    """Ray Train installs a SIGINT handler for its fit and leaves it: Ctrl-C in later stages was swallowed, and its
    third one exited 0 from a failed job; the first one exited 1 with no line."""
    import signal

    from pipeline.training.stage import _interrupt_handler_kept

    def ours(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, ours)
    try:
        with _interrupt_handler_kept():
            signal.signal(signal.SIGINT, lambda signum, frame: None)  # what the trainer does
        assert signal.getsignal(signal.SIGINT) is ours
        with pytest.raises(KeyboardInterrupt), _interrupt_handler_kept():
            signal.signal(signal.SIGINT, lambda signum, frame: None)
            raise SystemExit(0)  # the trainer's third Ctrl-C
        assert signal.getsignal(signal.SIGINT) is ours
        with pytest.raises(KeyboardInterrupt), _interrupt_handler_kept():
            raise SystemExit(1)  # ray.get once the first Ctrl-C aborted the run: the job exited 1 with no line
        with pytest.raises(SystemExit, match="3"), _interrupt_handler_kept():
            raise SystemExit(3)  # any other exit passes as it is
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_run_stopped_short_of_max_steps_is_not_taken_as_finished():
    from pipeline.training.stage import check_run_finished

    check_run_finished({"step": 60, "train.loss": 1.0}, 60)
    check_run_finished(None, 60)  # nothing reported: the missing checkpoint is named elsewhere
    with pytest.raises(PipelineError, match=r"^train: the Ray Train run stopped at step 15 of training\.max_steps=60 "
                                            r"\(interrupted\); rerun the same command to resume it$"):
        check_run_finished({"step": 15}, 60)


def test_a_store_too_small_for_the_held_out_samples_or_the_workers_names_the_setting():
    from pipeline.training.stage import check_samples_to_train

    check_samples_to_train(8, 6, 2)
    with pytest.raises(PipelineError, match=r"^training.val_samples: 100 held out of a store of 8 samples leaves "
                                            r"none to train on$"):
        check_samples_to_train(8, 100, 2)
    with pytest.raises(PipelineError, match=r"^training.val_samples: 8 held out"):
        check_samples_to_train(8, 8, 1)
    with pytest.raises(PipelineError, match=r"^training.num_workers: 2 workers but the store has only 1 samples to "
                                            r"train on \(8 less training.val_samples=7 held out\)$"):
        check_samples_to_train(8, 7, 2)


def test_an_interrupted_job_says_so_and_exits_130(capsys):
    from pipeline.entry import INTERRUPTED, run_guarded

    def interrupted():
        raise KeyboardInterrupt

    assert run_guarded(interrupted) == INTERRUPTED == 130
    assert capsys.readouterr().err.startswith("error: interrupted (Ctrl-C); ")


def test_a_serve_job_stopped_before_it_serves_says_what_it_kept(capsys):
    """Not the stage jobs' "finished stages and checkpoints are kept": a serve job has neither."""
    from pipeline.entry import INTERRUPTED, run_guarded
    from pipeline.serving.job import STOPPED_SERVING

    def interrupted():
        raise KeyboardInterrupt

    assert run_guarded(interrupted, stopped=STOPPED_SERVING) == INTERRUPTED
    assert capsys.readouterr().err == ("error: interrupted (Ctrl-C); nothing is served; the same command starts "
                                       "serving again\n")


def test_sigterm_after_ray_starts_is_a_terminated_job_not_an_abort(capsys, monkeypatch):
    """Ray's driver left a fatal-signal handler on SIGTERM: a native stack dump and exit 134, no cleanup."""
    import os
    import signal

    from pipeline.cluster import stop_cleanly_on_signals
    from pipeline.entry import TERMINATED, run_guarded
    from pipeline.errors import Terminated

    monkeypatch.setattr("pipeline.cluster._sigterm_received", False)  # the handler sets it: put back after
    before = signal.getsignal(signal.SIGTERM)
    try:
        stop_cleanly_on_signals()
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # lets Python run the handler here
        assert run_guarded(lambda: os.kill(os.getpid(), signal.SIGTERM)) == TERMINATED == 143
        assert capsys.readouterr().err.startswith("error: terminated (SIGTERM); finished stages and checkpoints are "
                                                  "kept, and the same command resumes")

        def ray_get_after_sigterm():  # Ray's get turns the handler's Terminated into a plain KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)

        def plain_interrupt():
            try:
                ray_get_after_sigterm()
            except Terminated:
                raise KeyboardInterrupt from None

        assert run_guarded(plain_interrupt) == TERMINATED
    finally:
        signal.signal(signal.SIGTERM, before)
