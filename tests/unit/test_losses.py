"""The blockwise head loss equals the materialised one: loss, gradient to the hidden states and greedy picks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pipeline.losses.blockwise import DraftHead, blockwise_soft_cross_entropy
from pipeline.losses.distill import distill_hidden_rows, distill_rows, pad_stack, soft_cross_entropy, teacher_targets


def _problem(rows=37, teachers=11, hidden=16, vocab=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, hidden, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator) * 0.5
    teacher_probs = F.softmax(torch.randn(teachers, vocab, generator=generator) * 3, dim=-1)
    teacher_rows = torch.randint(0, teachers, (rows,), generator=generator)
    row_weights = torch.rand(rows, generator=generator) + 0.1
    return student, weight, teacher_probs, teacher_rows, row_weights


@pytest.mark.parametrize("block_rows", [1, 8, 37, 64])
@pytest.mark.parametrize("weighted", [False, True])
def test_blockwise_equals_the_materialised_loss_gradient_and_argmax(block_rows, weighted):
    student, weight, teacher_probs, teacher_rows, row_weights = _problem()
    weights = row_weights if weighted else None
    logits = student @ weight.t()
    expected = soft_cross_entropy(logits, teacher_probs[teacher_rows], weights)
    (expected_grad,) = torch.autograd.grad(expected, student)
    loss, drafted, acceptance = blockwise_soft_cross_entropy(student, weight, teacher_probs, teacher_rows, weights,
                                                             block_rows=block_rows)
    (grad,) = torch.autograd.grad(loss * 2.5, student)  # an outer factor reaches the hidden states' gradient
    assert torch.allclose(loss, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(grad, 2.5 * expected_grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(drafted, logits.argmax(dim=-1)) and acceptance is None


@pytest.mark.parametrize("block_rows", [5, 64])
def test_a_trainable_logit_bias_gets_its_gradient_and_the_acceptance_is_one_minus_tv(block_rows):
    """DSpark's Markov bias: logits = hidden W^T + bias, the bias trains; acceptance = 1 - TV(student, teacher)."""
    student, weight, teacher_probs, teacher_rows, row_weights = _problem(seed=4)
    bias = torch.randn(teacher_probs.shape[0], weight.shape[0], generator=torch.Generator().manual_seed(9),
                       requires_grad=True)  # one per teacher row, shared by that teacher's rows
    logits = student @ weight.t() + bias[teacher_rows]
    expected = soft_cross_entropy(logits, teacher_probs[teacher_rows], row_weights)
    expected_grads = torch.autograd.grad(expected, (student, bias))
    tv = 0.5 * (F.softmax(logits, dim=-1) - teacher_probs[teacher_rows]).abs().sum(dim=-1)
    loss, drafted, acceptance = blockwise_soft_cross_entropy(student, weight, teacher_probs, teacher_rows,
                                                             row_weights, block_rows, bias, with_acceptance=True)
    grads = torch.autograd.grad(loss, (student, bias))
    assert torch.allclose(loss, expected, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert torch.equal(drafted, logits.argmax(dim=-1))
    assert torch.allclose(acceptance, 1.0 - tv.detach(), atol=1e-5)


def test_a_head_that_trains_is_refused():
    student, weight, teacher_probs, teacher_rows, _ = _problem()
    with pytest.raises(ValueError, match="must be frozen"):
        blockwise_soft_cross_entropy(student, weight.requires_grad_(True), teacher_probs, teacher_rows)


def test_draft_head_is_a_linear_layer_without_a_teacher():
    head = DraftHead(16, 300, bias=False)
    hidden = torch.randn(5, 16)
    assert torch.equal(head(hidden), F.linear(hidden, head.weight))


def _drafter_with_head(weight, draft_ids):
    """What distill_hidden_rows reads of a drafter: a frozen head over the draft vocabulary `draft_ids` and the maps
    between it and the verifier's vocabulary (K = 3)."""
    head = DraftHead(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
    head.weight.copy_(weight)
    return SimpleNamespace(
        lm_head=head, spec=SimpleNamespace(num_speculative_tokens=3),
        to_draft_vocab=lambda logits: logits[..., draft_ids], to_target_ids=lambda ids: draft_ids[ids])


@pytest.mark.parametrize("pruned", [False, True])
def test_distill_hidden_rows_equals_distill_rows_on_the_heads_logits(pruned):
    student, weight, _, teacher_rows, row_weights = _problem(vocab=300)
    generator = torch.Generator().manual_seed(3)
    teacher_full = torch.randn(11, 400, generator=generator)  # the verifier's 400-token vocabulary
    draft_ids = torch.randperm(400, generator=generator)[:300].sort().values if pruned else torch.arange(300)
    model = _drafter_with_head(weight, draft_ids)
    depths = torch.arange(student.shape[0]) % 3
    with torch.no_grad():  # the verifier agrees with the student's greedy pick on the first rows
        picks = draft_ids[(student[:6] @ weight.t()).argmax(dim=-1)]
        teacher_full[teacher_rows[:6], picks] += 100.0
    expected = distill_rows(model, model.lm_head(student), teacher_full, depths, row_weights, teacher_rows)
    (expected_grad,) = torch.autograd.grad(expected[0], student)
    got = distill_hidden_rows(model, student, teacher_full, depths, row_weights, teacher_rows)[:3]
    (grad,) = torch.autograd.grad(got[0], student)
    assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.allclose(grad, expected_grad, atol=1e-6)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    assert expected[1].sum() > 0  # some rows match, so equal counts say something


@pytest.mark.parametrize("block_rows", [5, 64])
def test_weights_from_the_losses_equal_those_weights_given_up_front(block_rows):
    """D-PACE's weights depend on every row's loss: applied after the rows are scored, the loss and the gradient
    are those of the same weights passed as a tensor (the weights themselves carry no gradient)."""
    student, weight, teacher_probs, teacher_rows, _ = _problem(seed=6)
    per_row = -(teacher_probs[teacher_rows] * F.log_softmax(student @ weight.t(), dim=-1)).sum(dim=-1)  # [N]

    def from_losses(losses):
        return torch.exp(-losses) + 0.25  # any function of the losses

    expected_weights = from_losses(per_row.detach())
    expected = blockwise_soft_cross_entropy(student, weight, teacher_probs, teacher_rows, expected_weights)[0]
    (expected_grad,) = torch.autograd.grad(expected, student)
    loss = blockwise_soft_cross_entropy(student, weight, teacher_probs, teacher_rows, from_losses,
                                        block_rows=block_rows)[0]
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.allclose(loss, expected, atol=1e-5) and torch.allclose(grad, expected_grad, atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="bias"):
        blockwise_soft_cross_entropy(student, weight, teacher_probs, teacher_rows, from_losses,
                                     bias=torch.zeros(teacher_probs.shape))


def test_the_argmax_target_is_cross_entropy_on_the_verifiers_greedy_draft_token():
    student, weight, _, teacher_rows, row_weights = _problem(vocab=300)
    generator = torch.Generator().manual_seed(8)
    teacher_full = torch.randn(11, 400, generator=generator)
    draft_ids = torch.randperm(400, generator=generator)[:300].sort().values
    model = _drafter_with_head(weight, draft_ids)
    depths = torch.arange(student.shape[0]) % 3
    labels = teacher_full[:, draft_ids].argmax(dim=-1)[teacher_rows]  # the greedy token inside the draft vocabulary
    per_row = F.cross_entropy(student @ weight.t(), labels, reduction="none")
    expected = (per_row * row_weights).sum() / row_weights.sum()
    got = distill_hidden_rows(model, student, teacher_full, depths, row_weights, teacher_rows, target="argmax")[0]
    assert torch.allclose(got, expected, atol=1e-5)
    soft = distill_hidden_rows(model, student, teacher_full, depths, row_weights, teacher_rows)[0]
    assert not torch.allclose(soft, expected, atol=1e-3)  # the default distils the whole distribution


@pytest.mark.parametrize("target", ["ARGMAX", "hard", ""])
def test_an_unknown_distill_target_is_refused_not_read_as_the_distribution(target):
    with pytest.raises(ValueError, match=rf"distill target: '{target}' is not one of \('distribution', 'argmax'\)"):
        teacher_targets(torch.randn(3, 5), target)


def test_pad_stack_pads_at_the_end_and_refuses_nothing_to_stack():
    stacked = pad_stack([torch.tensor([1, 2, 3]), torch.tensor([4])], -1)
    assert stacked.tolist() == [[1, 2, 3], [4, -1, -1]]
    with pytest.raises(ValueError, match="pad_stack: no tensors to stack"):
        pad_stack([], 0)
