"""P-EAGLE on CPU: mask construction vs brute force, chain isolation, shapes, row sampling."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.drafters.chains import attention_allowed, inference_rows, sample_training_rows
from tests.unit.tiny_drafters import HIDDEN, VOCAB, tiny_drafter


def brute_force_allowed(anchors, depths):
    n = len(anchors)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q, k in itertools.product(range(n), range(n)):
        sees_context = depths[k] == 0 and anchors[k] <= anchors[q]
        sees_own_chain = depths[k] > 0 and anchors[k] == anchors[q] and depths[k] <= depths[q]
        allowed[q, k] = bool(sees_context or sees_own_chain)
    return allowed


@pytest.mark.parametrize("seed", range(5))
def test_attention_mask_matches_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(12, generator=generator) < 0.7).long()
    anchors, depths, _ = sample_training_rows(loss_mask, 4, 0.7, generator)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    got = attention_allowed(anchors[None], depths[None], valid[None])[0]
    assert torch.equal(got, brute_force_allowed(anchors.tolist(), depths.tolist()))


def test_padding_rows_see_only_themselves_and_are_never_seen():
    anchors, depths = torch.tensor([[0, 1, 2, 0]]), torch.tensor([[0, 0, 0, 0]])
    valid = torch.tensor([[True, True, True, False]])
    allowed = attention_allowed(anchors, depths, valid)[0]
    assert allowed[3].tolist() == [False, False, False, True]
    assert not allowed[:3, 3].any()


def test_sampled_chains_are_nested_and_decay_with_depth():
    loss_mask = torch.ones(400, dtype=torch.long)
    anchors, depths, has_target = sample_training_rows(loss_mask, 5, 0.6, torch.Generator().manual_seed(0))
    per_depth = [int((depths == d).sum()) for d in range(5)]
    assert per_depth == sorted(per_depth, reverse=True) and per_depth[4] > 0
    kept = set(zip(anchors.tolist(), depths.tolist()))
    for anchor, depth in kept:
        assert all((anchor, d) in kept for d in range(depth)), "a chain row without its parents"
    # every drafted token is inside the sequence: anchor + 2 + depth < length for rows with a target
    assert ((anchors + 2 + depths)[has_target] < 400).all()


def test_no_target_rows_outside_the_loss_mask():
    loss_mask = torch.tensor([0] * 10 + [1] * 6)
    anchors, depths, has_target = sample_training_rows(loss_mask, 3, 1.0, torch.Generator().manual_seed(0))
    drafted = (anchors + 2 + depths)[has_target]
    assert (loss_mask[drafted] == 1).all()
    assert (depths[~has_target] == 0).all()


def _inputs(length, generator):
    aux = torch.randn(1, length, 3 * HIDDEN, generator=generator)
    next_ids = torch.randint(0, VOCAB - 1, (1, length), generator=generator)
    return aux, next_ids


def test_shapes_of_forward_and_draft():
    model = tiny_drafter()
    aux, next_ids = _inputs(7, torch.Generator().manual_seed(1))
    anchors, depths = inference_rows(7, 4)
    hidden = model(aux, next_ids, anchors[None], depths[None], torch.ones(1, 10, dtype=torch.bool))
    assert hidden.shape == (1, 7 + 3, HIDDEN)
    assert model.draft(aux, next_ids, 4).shape == (4,)


def test_one_chain_never_sees_another():
    model = tiny_drafter()
    aux, next_ids = _inputs(8, torch.Generator().manual_seed(3))
    # two chains (anchors 3 and 5) in one forward vs each alone: identical rows
    anchors = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 3, 3, 5, 5])
    depths = torch.tensor([0] * 8 + [1, 2, 1, 2])
    valid = torch.ones(1, 12, dtype=torch.bool)
    together = model(aux, next_ids, anchors[None], depths[None], valid)[0]
    keep = torch.tensor([True] * 8 + [True, True, False, False])
    alone = model(aux, next_ids, anchors[keep][None], depths[keep][None], valid[:, keep])[0]
    assert torch.allclose(together[keep], alone, atol=1e-5)


def test_draft_equals_the_parallel_rows_of_a_training_forward():
    model = tiny_drafter()
    aux, next_ids = _inputs(9, torch.Generator().manual_seed(4))
    drafts = model.draft(aux, next_ids, 4)
    anchors = torch.cat([torch.arange(9), torch.full((3,), 8)])
    depths = torch.cat([torch.zeros(9, dtype=torch.long), torch.arange(1, 4)])
    hidden = model(aux, next_ids, anchors[None], depths[None], torch.ones(1, 12, dtype=torch.bool))[0]
    assert torch.equal(model.lm_head(hidden[[8, 9, 10, 11]]).argmax(-1), drafts)


@pytest.mark.parametrize("layers,expected", [(30, [2, 15, 27]), (8, [2, 4, 5]), (6, [1, 3, 5]), (4, [1, 2, 3])])
def test_default_aux_layers_are_eagle3s_and_always_distinct(layers, expected):
    from pipeline.drafters.build import default_aux_layer_ids

    assert default_aux_layer_ids("peagle", layers) == default_aux_layer_ids("eagle3", layers) == expected
