"""Every drafter on CPU: shapes, no information leak (by perturbation), loss falls and weights move, drafting
equals the training forward, DFlash's block mask vs brute force, DSpark's truncation, vocabulary pruning."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from pipeline.drafters import DRAFTERS
from pipeline.drafters.dflash.blocks import block_attention_allowed, position_decay, sample_anchors
from pipeline.drafters.dspark.model import keep_count
from pipeline.drafters.vocab import d2t_offsets, ids_from_d2t, most_frequent_tokens, t2d_mask
from pipeline.errors import PipelineError
from tests.unit.tiny_drafters import ALGORITHMS, HIDDEN, VOCAB, tiny_drafter, tiny_options, tiny_samples

BLOCK_FAMILY = ["dflash", "dspark"]


def _context(length, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, length, 3 * HIDDEN, generator=generator),
            torch.randint(0, VOCAB - 1, (1, length), generator=generator))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_draft_shape_and_target_ids(algorithm):
    model = tiny_drafter(algorithm)
    aux, next_ids = _context(9, 1)
    drafts = model.draft(aux, next_ids, 4)
    assert drafts.shape == (4,) and drafts.dtype == torch.long and ((0 <= drafts) & (drafts < VOCAB)).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("count", [0, -1])
def test_a_draft_count_below_one_is_refused(algorithm, count):
    """A slice by 0 or -1 drafts would quietly return no drafts or all but the last."""
    model = tiny_drafter(algorithm)
    aux, next_ids = _context(9, 1)
    with pytest.raises(ValueError, match=rf"draft: num_speculative_tokens must be >= 1, got {count}"):
        model.draft(aux, next_ids, count)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_loss_positions_all_trains_the_prompt_positions_too(algorithm):
    """training.loss_positions=all: every drafter reads the widened mask, so its loss covers more draft targets
    (the prompt's) than the stored assistant-only mask gives; `response` leaves the samples as stored."""
    from pipeline.training.feed import with_loss_positions

    samples = tiny_samples(prompt=12)
    assert with_loss_positions(samples, "response") is samples
    widened = with_loss_positions(samples, "all")
    assert all(bool(s["loss_mask"].all()) for s in widened)
    assert all(int(s["loss_mask"].sum()) == 12 for s in samples)  # the stored samples are not changed
    # every anchor, so the counts compare the masks, not a sample of anchors
    options = tiny_options(algorithm, max_anchors=None)
    model = tiny_drafter(algorithm)
    _, _, response = model.training_loss(samples, options, torch.Generator().manual_seed(0))
    _, _, everywhere = model.training_loss(widened, options, torch.Generator().manual_seed(0))
    assert everywhere[0] > response[0], (everywhere, response)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_loss_falls_and_only_trainable_weights_move(algorithm):
    model = tiny_drafter(algorithm)
    samples = tiny_samples()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(40):
        loss, correct, total = model.training_loss(samples, tiny_options(algorithm),
                                                   torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    after = model.state_dict()
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])  # the verifier's head stays frozen
    assert torch.equal(before["embed_tokens.weight"], after["embed_tokens.weight"])
    assert correct.shape == total.shape == (4,) and total.sum() > 0 and (correct <= total).all()
    if algorithm == "peagle":
        assert not torch.equal(before["mask_hidden"], after["mask_hidden"])
    if algorithm == "dspark":
        assert not torch.equal(before["markov_head.markov_w2.weight"], after["markov_head.markov_w2.weight"])
        assert not torch.equal(before["confidence_head.proj.weight"], after["confidence_head.proj.weight"])


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_a_trained_embedding_moves_and_travels_in_checkpoint_and_export(algorithm, tmp_path):
    """drafter.embed_requires_grad (speculators' embed_requires_grad): the embedding trains, the training
    checkpoint holds it (the frozen head stays out), and the export carries the trained rows, not the verifier's."""
    from safetensors.torch import load_file

    from pipeline.checkpoint import WEIGHTS_FILE, load_trainable_weights, save_checkpoint
    from pipeline.export.speculators_format import export_speculators

    frozen = tiny_drafter(algorithm)
    assert "embed_tokens.weight" not in frozen.trainable_state_dict()
    model = tiny_drafter(algorithm, embed_requires_grad=True)
    verifier_embedding = model.embed_tokens.weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(3):
        loss, _, _ = model.training_loss(tiny_samples(), tiny_options(algorithm), torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trained = model.embed_tokens.weight.detach()
    assert not torch.equal(trained, verifier_embedding)
    assert set(model.trainable_state_dict()) - set(frozen.trainable_state_dict()) == {"embed_tokens.weight"}

    save_checkpoint(tmp_path / "checkpoint", model, {"step": 3})
    assert "lm_head.weight" not in load_file(str(tmp_path / "checkpoint" / WEIGHTS_FILE))
    restored = tiny_drafter(algorithm, embed_requires_grad=True)
    load_trainable_weights(restored, tmp_path / "checkpoint")
    assert torch.equal(restored.embed_tokens.weight, trained)
    save_checkpoint(tmp_path / "frozen", frozen, {"step": 0})
    with pytest.raises(PipelineError, match="missing.*embed_tokens"):  # a frozen embedding's checkpoint lacks it
        load_trainable_weights(tiny_drafter(algorithm, embed_requires_grad=True), tmp_path / "frozen")

    export_speculators(model, tmp_path / "export", dtype=torch.float32)
    assert torch.equal(load_file(str(tmp_path / "export" / "model.safetensors"))["embed_tokens.weight"], trained)


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_eagle_family_changing_a_future_token_never_changes_earlier_rows(algorithm):
    from pipeline.drafters.chains import sample_training_rows

    model = tiny_drafter(algorithm)
    aux, next_ids = _context(10, 2)
    anchors, depths, _ = sample_training_rows(torch.ones(11, dtype=torch.long), 4, 1.0,
                                              torch.Generator().manual_seed(0))
    valid = torch.ones(1, anchors.shape[0], dtype=torch.bool)
    base = model(aux, next_ids, anchors[None], depths[None], valid)[0]
    for position in (3, 6):
        aux2, ids2 = aux.clone(), next_ids.clone()
        aux2[0, position] += 5.0
        ids2[0, position] = (ids2[0, position] + 7) % (VOCAB - 1)
        changed = model(aux2, ids2, anchors[None], depths[None], valid)[0]
        # P-EAGLE's row (a, d) reads features and tokens at <= a; EAGLE-3's also the teacher-forced tokens <= a + d
        unaffected = (anchors + (depths if algorithm == "eagle3" else 0)) < position
        assert torch.allclose(base[unaffected], changed[unaffected], atol=1e-5)
        assert not torch.allclose(base[~unaffected], changed[~unaffected], atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True}, {"norm_before_fc": True, "norm_output": True}])
def test_eagle3_draft_equals_its_training_forward_fed_its_own_drafts(options):
    model = tiny_drafter("eagle3", **options)
    with torch.no_grad():  # every trained tensor off its init, so a norm applied in one path only shows
        for tensor in model.parameters():
            if tensor.requires_grad:
                tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(7)) * 0.3)
    for seed in range(4):
        aux, next_ids = _context(9, seed)
        drafts = model.draft(aux, next_ids, 4)
        tokens = torch.cat([next_ids, drafts[None, :3]], dim=1)  # the TTT rows read the drafted tokens
        anchors = torch.cat([torch.arange(9), torch.full((3,), 8)])
        depths = torch.cat([torch.zeros(9, dtype=torch.long), torch.arange(1, 4)])
        hidden = model(aux, tokens, anchors[None], depths[None], torch.ones(1, 12, dtype=torch.bool))[0]
        assert torch.equal(model.lm_head(hidden[[8, 9, 10, 11]]).argmax(-1), drafts), seed


def test_eagle3_chain_rows_read_the_drafted_tokens_past_the_verified_context():
    """At inference the tokens run past the verifier's features by the drafts made so far: chain row (T-1, d) must
    embed draft d (as vLLM feeds it), not the last verified token that clamping to the features would give."""
    model = tiny_drafter("eagle3")
    aux, next_ids = _context(9, 4)
    tokens = torch.cat([next_ids, torch.tensor([[11, 12, 13]])], dim=1)
    embedded, features = model.real_row_inputs(aux, tokens, torch.tensor([[7, 8, 9, 10, 11]]))
    assert torch.equal(embedded[0], model.embed_tokens(tokens[0, [7, 8, 9, 10, 11]]))
    assert torch.equal(features[0], aux[0, [7, 8, 8, 8, 8]])  # the chain reuses the last verified features


@pytest.mark.parametrize("algorithm", BLOCK_FAMILY)
def test_block_drafter_never_sees_the_future_or_another_block(algorithm):
    model = tiny_drafter(algorithm)
    aux, ids = _context(16, 5)
    anchors = torch.tensor([[3, 7, 11]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    bs = model.block_size
    base = model(aux, ids, anchors, valid)[0].view(3, bs, -1)
    # a later context position (8) or a later anchor token (11) never changes the blocks anchored before it
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[0, 8] += 5.0
    ids2[0, 11] = (ids2[0, 11] + 3) % (VOCAB - 1)
    changed = model(aux2, ids2, anchors, valid)[0].view(3, bs, -1)
    assert torch.allclose(base[:2], changed[:2], atol=1e-5)
    assert not torch.allclose(base[2], changed[2], atol=1e-5)
    # the anchor position itself is not context: the verifier has not processed token p yet
    aux3 = aux.clone()
    aux3[0, 7] += 5.0
    assert torch.allclose(model(aux3, ids, anchors, valid)[0].view(3, bs, -1)[1], base[1], atol=1e-5)
    # a block alone equals the same block among others
    alone = model(aux, ids, anchors[:, 1:2], valid[:, 1:2])[0]
    assert torch.allclose(alone, base[1], atol=1e-5)


def _brute_force_block_mask(context_length, anchors, block_size, causal):
    slots = len(anchors) * block_size
    allowed = torch.zeros(slots, context_length + slots, dtype=torch.bool)
    for q, k in itertools.product(range(slots), range(context_length + slots)):
        block, slot = divmod(q, block_size)
        if k < context_length:
            allowed[q, k] = k < anchors[block]
        else:
            k_block, k_slot = divmod(k - context_length, block_size)
            allowed[q, k] = k_block == block and (not causal or k_slot <= slot)
    return allowed


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_block_mask_matches_brute_force(causal, seed):
    generator = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(14, generator=generator) < 0.8).long()
    anchors = sample_anchors(loss_mask, 1, 3, generator)
    got = block_attention_allowed(14, anchors[None], torch.ones(1, len(anchors), dtype=torch.bool), 4, causal)[0]
    assert torch.equal(got, _brute_force_block_mask(14, anchors.tolist(), 4, causal))


def test_causal_block_option_makes_slots_blind_to_later_slots():
    aux, ids = _context(12, 6)
    anchors, valid = torch.tensor([[6]]), torch.ones(1, 1, dtype=torch.bool)
    bidirectional, causal = tiny_drafter("dflash"), tiny_drafter("dflash", causal_block=True)
    # slot 0 holds the anchor token: only a bidirectional block lets the mask slots change what slot 0 computes
    ids2 = ids.clone()
    causal.spec.mask_token_id = bidirectional.spec.mask_token_id = 5
    base_b, base_c = bidirectional(aux, ids, anchors, valid)[0], causal(aux, ids, anchors, valid)[0]
    causal.spec.mask_token_id = bidirectional.spec.mask_token_id = 6
    new_b, new_c = bidirectional(aux, ids2, anchors, valid)[0], causal(aux, ids2, anchors, valid)[0]
    assert torch.allclose(base_c[0], new_c[0], atol=1e-6)
    assert not torch.allclose(base_b[0], new_b[0], atol=1e-6)


def test_anchors_are_sorted_inside_the_response_and_capped():
    loss_mask = torch.tensor([0] * 10 + [1] * 30)
    anchors = sample_anchors(loss_mask, 1, 8, torch.Generator().manual_seed(0))
    assert anchors.numel() == 8 and torch.equal(anchors, anchors.sort().values)
    assert (loss_mask[anchors + 1] == 1).all() and (anchors >= 1).all()
    assert torch.allclose(position_decay(3, 2.0), torch.tensor([1.0, 0.6065, 0.3679]), atol=1e-4)


def test_dspark_truncates_by_cumulative_confidence():
    # survival products: 0.9, 0.72, 0.36, 0.324
    assert keep_count(torch.tensor([0.9, 0.8, 0.5, 0.9]), 0.3) == 4
    assert keep_count(torch.tensor([0.9, 0.8, 0.5, 0.9]), 0.35) == 3
    assert keep_count(torch.tensor([0.9, 0.8, 0.5, 0.9]), 0.4) == 2
    assert keep_count(torch.tensor([0.1, 0.9]), 0.5) == 1  # always at least one draft
    assert keep_count(torch.tensor([0.1, 0.1]), 0.0) == 2


def test_dspark_draft_uses_the_confidence_head():
    model = tiny_drafter("dspark", confidence_threshold=0.0)
    aux, ids = _context(9, 7)
    drafts, confidences = model.draft_with_confidence(aux, ids, 4)
    assert torch.equal(model.draft(aux, ids, 4), drafts)
    with torch.no_grad():
        model.confidence_head.proj.bias.fill_(-3.0)  # confident in nothing: the block is cut to one draft
    model.set_decoding_options(confidence_threshold=0.5)
    assert torch.equal(model.draft(aux, ids, 4), drafts[:1])


@pytest.mark.parametrize("name", ["eagle3", "peagle", "dflash", "dflash2", "dspark"])
def test_a_decoding_option_a_drafter_does_not_have_is_refused_by_name(name):
    """The decoding options a measurement passes are the drafter schema's (pipeline.paths.decoding_options); a name
    the drafter does not decode with is an error, not a setting silently ignored."""
    model = tiny_drafter(name)
    with pytest.raises(TypeError, match="no decoding option markov_threshold"):
        model.set_decoding_options(markov_threshold=0.5)
    if name != "dspark":
        with pytest.raises(TypeError, match="no decoding option confidence_threshold"):
            model.set_decoding_options(confidence_threshold=0.5)


def test_dspark_markov_bias_conditions_each_draft_on_the_previous_one():
    model = tiny_drafter("dspark")
    aux, ids = _context(9, 8)
    plain, _ = model.draft_with_confidence(aux, ids, 4)
    with torch.no_grad():
        model.markov_head.markov_w2.weight.normal_(std=5.0)
    biased, _ = model.draft_with_confidence(aux, ids, 4)
    assert not torch.equal(plain, biased)


def test_vocabulary_pruning_maps_like_vllm():
    streams = [torch.tensor([5, 5, 5, 9, 9, 2, 7]), torch.tensor([9, 40])]
    ids = most_frequent_tokens(streams, VOCAB, 3, always_keep=[49])
    assert ids == [5, 9, 49]
    d2t = d2t_offsets(ids)
    assert (torch.arange(3) + d2t).tolist() == ids  # vLLM: target = draft + d2t[draft]
    assert t2d_mask(ids, VOCAB).nonzero().squeeze(1).tolist() == ids and ids_from_d2t(d2t) == ids


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pruned_drafter_drafts_only_kept_tokens_and_counts_misses(algorithm):
    kept = list(range(0, VOCAB, 2))
    if algorithm == "dflash2":  # its selector's codebooks index the full vocabulary (speculators and vLLM alike)
        with pytest.raises(ValueError, match="full vocabulary"):
            tiny_drafter(algorithm, draft_token_ids=kept)
        return
    model = tiny_drafter(algorithm, draft_token_ids=kept)
    assert model.lm_head.weight.shape == (len(kept), HIDDEN)
    assert torch.equal(model.lm_head.weight, model.verifier_head[kept])
    aux, ids = _context(9, 9)
    assert all(t in kept for t in model.draft(aux, ids, 4).tolist())
    options = tiny_options(algorithm)
    loss, correct, total = model.training_loss(tiny_samples(), options, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and total.sum() > 0


def test_eagle3_ttt_does_not_depend_on_the_rows_being_ordered_by_depth():
    """The TTT forward runs step s on the leading rows only; a row order not sorted by depth must give the same
    outputs (it then just runs more rows)."""
    from pipeline.drafters.chains import inference_rows

    model = tiny_drafter("eagle3", 4)
    anchors, depths = inference_rows(12, 4)
    shuffled = torch.cat([torch.arange(12), torch.tensor([14, 12, 13])])  # depth 3 before depths 1 and 2
    aux = torch.randn(1, 12, 3 * HIDDEN, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(1, 15, dtype=torch.bool)
    ordered = model(aux, ids, anchors[None], depths[None], valid)
    unordered = model(aux, ids, anchors[shuffled][None], depths[shuffled][None], valid)
    torch.testing.assert_close(unordered, ordered[:, shuffled], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("distill_target", ["distribution", "argmax"])
@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_a_pruned_drafter_has_the_same_loss_and_gradients_without_counting_matches(algorithm, distill_target):
    """Training steps that log nothing skip the verifier's full-vocabulary logits: the loss and its gradients are
    the same as with the counts (the draft vocabulary's teacher logits are the frozen head's rows), for either
    target; the counts come back as zeros."""
    kept = list(range(0, VOCAB, 2))
    options = tiny_options(algorithm, distill_target=distill_target)
    results = []
    for count_matches in (True, False):
        model = tiny_drafter(algorithm, draft_token_ids=kept)
        loss, correct, total = model.training_loss(tiny_samples(), options,
                                                   torch.Generator().manual_seed(3), count_matches=count_matches)
        loss.backward()
        results.append((loss.detach(), model.fc.weight.grad.clone(), correct, total))
    (loss, grad, correct, total), (fast_loss, fast_grad, fast_correct, fast_total) = results
    torch.testing.assert_close(fast_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_grad, grad, rtol=1e-4, atol=1e-7)
    assert total.sum() > 0 and fast_total.sum() == 0 and fast_correct.sum() == 0


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_an_eagle_drafters_distill_target_changes_its_loss_not_its_counts(algorithm):
    """drafter.distill_target=argmax reaches the chain's loss (cross-entropy on the verifier's greedy token, pinned
    in test_losses): the loss changes, the same model's greedy-match counts do not."""
    losses, counts = {}, {}
    for target in ("distribution", "argmax"):
        model = tiny_drafter(algorithm)
        loss, correct, total = model.training_loss(tiny_samples(), tiny_options(algorithm, distill_target=target),
                                                   torch.Generator().manual_seed(3))
        losses[target], counts[target] = loss.item(), (correct.tolist(), total.tolist())
    assert abs(losses["argmax"] - losses["distribution"]) > 1e-3
    assert counts["argmax"] == counts["distribution"]


def test_dpace_weights_each_draft_by_the_acceptance_it_can_still_add():
    """One block of K=3 with the greedy token's probability q = 1, 0.5, 0.25 (alpha 0): P(accepted through
    draft i) = 1, 0.5, 0.125, so the weights are the tail sums 1.625, 0.625, 0.125. A second block misses its
    middle draft (outside the answer): it counts as certain and gets no weight."""
    import math

    from pipeline.drafters.dflash.blocks import acceptance_weights

    q = torch.tensor([1.0, 0.5, 0.25, 0.5, 0.5])
    losses = -torch.log(q)
    block = torch.tensor([0, 0, 0, 1, 1])
    draft = torch.tensor([0, 1, 2, 0, 2])
    weights = acceptance_weights(losses, block, draft, num_blocks=2, num_speculative_tokens=3, alpha=0.0)
    assert torch.allclose(weights, torch.tensor([1.625, 0.625, 0.125, 0.75, 0.25]), atol=1e-6)
    smoothed = acceptance_weights(losses, block, draft, num_blocks=2, num_speculative_tokens=3, alpha=0.5)
    assert math.isclose(float(smoothed[2]), 1.0 * 0.75 * 0.625, rel_tol=1e-6)  # s = 0.5 q + 0.5


@pytest.mark.parametrize("target", ["argmax", "distribution"])
def test_dpace_weights_read_each_rows_kl_to_its_target(target):
    """D-PACE's weight function gets KL(target || drafter) per row: the cross-entropy on the greedy token for the
    argmax target, and the soft cross-entropy less the verifier's entropy for the distribution target."""
    from pipeline.losses.distill import distill_hidden_rows

    model = tiny_drafter("dflash")
    generator = torch.Generator().manual_seed(1)
    hidden, teacher = torch.randn(6, HIDDEN, generator=generator), torch.randn(3, VOCAB, generator=generator) * 2
    teacher_rows = torch.tensor([0, 0, 1, 2, 2, 1])
    seen = []

    def record(kl: torch.Tensor) -> torch.Tensor:
        seen.append(kl.clone())
        return torch.ones_like(kl)
    distill_hidden_rows(model, hidden, teacher, torch.tensor([0, 1, 0, 0, 1, 2]), record, teacher_rows,
                        target=target)
    log_q = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)  # [6, V]
    log_p = torch.log_softmax(teacher, dim=-1)[teacher_rows]
    if target == "argmax":
        expected = -log_q.gather(1, log_p.argmax(dim=-1, keepdim=True))[:, 0]
    else:
        expected = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    assert torch.allclose(seen[0], expected, atol=1e-4), (seen[0], expected)
    assert bool((expected > 0.05).all())  # not a degenerate check


@pytest.mark.parametrize("target", ["argmax", "distribution"])
def test_dflash_trains_with_dpace_weights(target):
    """D-PACE weights with either target (speculators' DFlash loss is argmax + dpace; ours distribution + dpace):
    the loss falls and it is not the decay-weighted loss."""
    model = tiny_drafter("dflash")
    samples = tiny_samples()
    options = tiny_options("dflash", distill_target=target, position_weighting="dpace", dpace_alpha=0.5)
    default = model.training_loss(samples, tiny_options("dflash", distill_target=target, position_weighting="decay"),
                                  torch.Generator().manual_seed(0))[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(40):
        loss = model.training_loss(samples, options, torch.Generator().manual_seed(step))[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert not torch.isclose(torch.tensor(losses[0]), default.detach(), rtol=1e-3)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_every_registered_drafter_meets_the_drafter_protocol():
    """The contract pipeline/drafters/protocol.py states, checked on each registered class and a built instance."""
    from dataclasses import fields

    from pipeline.drafters.protocol import Drafter

    for name, cls in DRAFTERS.items():
        assert cls.algorithm == name and cls.config_class.name == name
        own = {spec.name for spec in fields(cls.config_class)}
        assert set(cls.extra_keys) <= own, (name, set(cls.extra_keys) - own)  # spec.extra comes from its options
        assert isinstance(tiny_drafter(name), Drafter)


def test_training_loss_refuses_options_that_are_not_its_own_schema():
    """training_loss reads its own config_class, typed: a dict, or a neighbour's schema (DSpark's extends DFlash's,
    P-EAGLE's extends EAGLE-3's family schema) is refused naming both, never read for a default it lacks."""
    samples = tiny_samples(1)
    for algorithm, wrong in [("dflash", tiny_options("dspark")), ("eagle3", tiny_options("peagle")),
                             ("peagle", {"max_anchors": 8})]:
        own = DRAFTERS[algorithm].config_class.__name__
        with pytest.raises(TypeError, match=f"{algorithm}: training_loss needs {own} options, got "):
            tiny_drafter(algorithm).training_loss(samples, wrong)


def test_deterministic_options_train_every_anchor_at_every_depth():
    """options.deterministic() (what the validation loss reads) draws nothing: no anchor cap and, for P-EAGLE,
    every depth kept; the other options are the run's own."""
    peagle = tiny_options("peagle", depth_keep_decay=0.5, mask_token_id=3)
    full = peagle.deterministic()
    assert (full.max_anchors, full.depth_keep_decay, full.mask_token_id) == (None, 1.0, 3)
    assert (peagle.max_anchors, peagle.depth_keep_decay) == (8, 0.5)  # the run's options are left as they were
    assert tiny_options("eagle3").depth_keep_decay == 1.0  # EAGLE-3 trains every depth unless told otherwise
    dspark = tiny_options("dspark", markov_rank=16).deterministic()
    assert type(dspark) is DRAFTERS["dspark"].config_class and (dspark.max_anchors, dspark.markov_rank) == (None, 16)
    model = tiny_drafter("peagle")
    losses = {model.training_loss(tiny_samples(), full, torch.Generator().manual_seed(seed))[0].item()
              for seed in range(3)}
    assert len(losses) == 1


def test_eagle3_sparsified_depths_train_fewer_deep_rows_and_its_default_trains_every_depth():
    """drafter.depth_keep_decay is the whole EAGLE family's: EAGLE-3 at 1.0 (its default) trains depth d on every
    anchor whose target exists; below 1.0 the deeper depths train on fewer anchors, depth 0 on all of them."""
    model, samples = tiny_drafter("eagle3"), tiny_samples(2, length=48)
    options = tiny_options("eagle3", max_anchors=None)
    _, _, every = model.training_loss(samples, options, torch.Generator().manual_seed(0))
    _, _, sparse = model.training_loss(samples, replace(options, depth_keep_decay=0.5),
                                       torch.Generator().manual_seed(0))
    # a chain starts at an anchor whose first target (anchor + 2) is an assistant token and reaches depth d while
    # its target anchor + 2 + d is still in the sequence (the tiny samples' answers run to the end)
    targets_at_depth = [sum(int(s["loss_mask"][2:len(s["loss_mask"]) - d].sum()) for s in samples) for d in range(4)]
    assert every.tolist() == targets_at_depth
    assert sparse[0] == every[0] and all(sparse[d] < every[d] for d in range(1, 4))
    with pytest.raises(PipelineError, match=r"drafter\.depth_keep_decay"):
        tiny_options("eagle3", depth_keep_decay=0.0).validate()
