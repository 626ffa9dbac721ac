"""val.tau's helpers: the prompt of a store sample, and how well the proxy ranked the checkpoints."""

from __future__ import annotations

import pytest
import torch

from pipeline.training.val_tau import prompt_of, proxy_agreement


def test_the_prompt_is_everything_before_the_first_trained_token():
    sample = {"input_ids": torch.tensor([5, 6, 7, 8, 9, 10]), "loss_mask": torch.tensor([0, 0, 0, 1, 1, 0])}
    assert prompt_of(sample) == [5, 6, 7]


def test_agreement_reports_the_rank_correlation_and_both_choices():
    points = [{"step": 2, "val.proxy_tau": 1.9, "val.tau": 1.2},
              {"step": 4, "val.proxy_tau": 2.1, "val.tau": 1.3},
              {"step": 6, "val.proxy_tau": 2.3, "val.tau": 1.25}]
    agreement = proxy_agreement(points)
    assert agreement["train.proxy_tau_spearman"] == pytest.approx(0.5)
    assert agreement["train.best_step_by_proxy_tau"] == 6 and agreement["train.best_step_by_val_tau"] == 4
    assert agreement["train.val_tau_at_proxy_choice"] == 1.25 and agreement["train.best_val_tau"] == 1.3


def test_too_few_or_constant_points_log_no_correlation_rather_than_a_made_up_zero():
    two = [{"step": 1, "val.proxy_tau": 1.0, "val.tau": 1.0}, {"step": 2, "val.proxy_tau": 2.0, "val.tau": 1.5}]
    assert "train.proxy_tau_spearman" not in proxy_agreement(two)
    flat = two + [{"step": 3, "val.proxy_tau": 3.0, "val.tau": 1.0}]
    flat = [{**p, "val.tau": 1.0} for p in flat]
    agreement = proxy_agreement(flat)
    assert "train.proxy_tau_spearman" not in agreement and agreement["train.best_step_by_proxy_tau"] == 3


def test_a_tie_goes_to_the_later_step_as_ray_train_keeps_it():
    """Tied at val.tau 1.0 (two short prompts), the first checkpoint was picked; Ray Train ranks the later of tied
    checkpoints higher and deletes the earlier one first, so the pick must be the later one to exist."""
    from pipeline.training.val_tau import ranking

    tied = [{"step": 3, "val.proxy_tau": 1.1, "val.tau": 1.0}, {"step": 6, "val.proxy_tau": 1.4, "val.tau": 1.0},
            {"step": 9, "val.proxy_tau": 1.2, "val.tau": 1.0}]
    assert max(tied, key=lambda m: ranking(m, "val.tau"))["step"] == 9
    assert proxy_agreement(tied)["train.best_step_by_val_tau"] == 9
    assert proxy_agreement(tied)["train.best_step_by_proxy_tau"] == 6
    level = [{**m, "val.proxy_tau": 1.0} for m in tied]
    assert max(level, key=lambda m: ranking(m, "val.proxy_tau"))["step"] == 9
