"""Held-out validation: which samples are held out, how they are shared over ranks, and what is measured."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.validation import split_validation, validate, validation_share
from tests.unit.tiny_drafters import tiny_drafter, tiny_options, tiny_samples


def with_ids(count: int) -> list[dict]:
    return [{**sample, "sample_id": f"s{i}"} for i, sample in enumerate(tiny_samples(count))]


def test_the_held_out_samples_depend_on_ids_and_seed_only():
    samples = with_ids(10)
    train, held_out = split_validation(samples, 3, seed=0)
    again_train, again_held_out = split_validation(list(reversed(samples)), 3, seed=0)
    assert [s["sample_id"] for s in held_out] == [s["sample_id"] for s in again_held_out]
    assert {s["sample_id"] for s in train} == {s["sample_id"] for s in again_train}
    assert len(held_out) == 3 and not {s["sample_id"] for s in train} & {s["sample_id"] for s in held_out}
    held_out_ids = {s["sample_id"] for s in held_out}
    assert [s["sample_id"] for s in train] == [s["sample_id"] for s in samples if s["sample_id"] not in held_out_ids]
    assert {s["sample_id"] for s in split_validation(samples, 3, seed=1)[1]} != held_out_ids
    assert split_validation(samples, 0, seed=0)[0] is samples


@pytest.mark.parametrize("count,world", [(4, 1), (4, 2), (5, 2), (2, 3)])
def test_every_held_out_sample_is_counted_once_and_every_rank_runs_as_many_forwards(count, world):
    held_out = with_ids(count)
    shares = [validation_share(held_out, rank, world) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1
    counted = sorted(sample["sample_id"] for share in shares for sample, is_counted in share if is_counted)
    assert counted == sorted(s["sample_id"] for s in held_out)


def test_validation_measures_the_training_loss_with_every_anchor_and_leaves_the_model_in_training():
    model = tiny_drafter("peagle")
    held_out = with_ids(3)
    metrics = validate(model, validation_share(held_out, 0, 1), tiny_options(), None)
    full = tiny_options(max_anchors=None, depth_keep_decay=1.0)
    with torch.no_grad():
        losses = [model.training_loss([s], full, torch.Generator().manual_seed(0))[0].item() for s in held_out]
    assert metrics["val.loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)
    assert 1.0 <= metrics["val.proxy_tau"] <= 1.0 + 4 and model.training
    # a repeat that is not counted changes nothing
    padded = validation_share(held_out, 0, 1) + [(held_out[0], False)]
    assert validate(model, padded, tiny_options(), None) == pytest.approx(metrics)
