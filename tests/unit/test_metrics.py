"""The metric spec against hand-computed cases."""

import pytest

from pipeline.metrics import AcceptanceCounts, expected_tau, per_request_tau, pooled_tau


def counts(steps, k=3):
    c = AcceptanceCounts(k)
    for accepted in steps:
        c.add_step(accepted)
    return c


def test_pooled_tau_counts_the_bonus_token():
    c = counts([3, 0, 1, 2])  # 6 accepted over 4 steps
    assert c.tau == pytest.approx(1 + 6 / 4)


def test_conditional_and_cumulative_acceptance_by_hand():
    c = counts([3, 0, 1, 2])
    # position 1 reached 4 times, accepted 3; position 2 reached 3, accepted 2; position 3 reached 2, accepted 1
    assert c.conditional_acceptance == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert c.cumulative_acceptance == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert expected_tau(c.conditional_acceptance) == pytest.approx(c.tau)


def test_pooled_and_per_request_tau_differ_as_defined():
    long_request, short_request = counts([3] * 9), counts([0])
    assert pooled_tau([long_request, short_request]) == pytest.approx(1 + 27 / 10)
    assert per_request_tau([long_request, short_request]) == pytest.approx((4 + 1) / 2)


def test_truncated_proposals_count_only_what_was_proposed():
    c = AcceptanceCounts(4)
    c.add_step(1, proposed=2)
    assert c.reached == [1, 1, 0, 0] and c.accepted_at == [1, 0, 0, 0]


def test_impossible_step_is_refused():
    with pytest.raises(ValueError):
        AcceptanceCounts(2).add_step(3)
