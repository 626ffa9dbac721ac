"""Held-out validation during training: the same drafter loss and per-position accuracy, on store samples that
are never trained on, scored by the proxy tau that picks the best checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import cast

import torch

from pipeline.config.schema import DrafterConfig
from pipeline.drafters.protocol import Drafter
from pipeline.metrics import expected_tau
from pipeline.training import dist


def split_validation(samples: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): the `count` held-out samples are picked by a seeded hash of their ids, so every world size
    and every resume holds out the same ones; the training samples keep their store order."""
    if count <= 0:
        return samples, []
    ranked = sorted(samples, key=lambda s: hashlib.sha256(f"{seed}:{s['sample_id']}".encode()).hexdigest())
    held_out = {s["sample_id"] for s in ranked[:count]}
    return [s for s in samples if s["sample_id"] not in held_out], ranked[:count]


def validation_share(held_out: list[dict], rank: int, world: int) -> list[tuple[dict, bool]]:
    """Rank `rank`'s (sample, counted) pairs. Every rank runs the same number of forwards (ZeRO-3 gathers the
    parameters collectively), so short ranks repeat a sample that is then not counted."""
    per_rank = math.ceil(len(held_out) / world)
    return [(held_out[(rank + world * i) % len(held_out)], rank + world * i < len(held_out))
            for i in range(per_rank)]


def validate(model: torch.nn.Module, share: list[tuple[dict, bool]], options: DrafterConfig,
             autocast) -> dict[str, float]:
    """val.loss (mean over held-out samples), val.accuracy_pos{k} and val.proxy_tau, reduced over every rank. The loss
    draws nothing at random (options.deterministic(): every anchor at every depth)."""
    drafter = cast(Drafter, model)
    options = options.deterministic()
    sums = None  # [loss, counted samples, correct per position..., total per position...]
    model.eval()
    with torch.no_grad(), autocast or contextlib.nullcontext():
        for sample, is_counted in share:
            loss, correct, total = drafter.training_loss([sample], options,
                                                       torch.Generator().manual_seed(0))
            row = torch.cat([torch.stack([loss.double().cpu(), torch.tensor(1.0, dtype=torch.float64)]),
                             correct.double().cpu(), total.double().cpu()]) * float(is_counted)
            sums = row if sums is None else sums + row
    model.train()
    if sums is None:
        raise ValueError("validate: this rank's share of the held-out samples is empty")
    sums = dist.all_reduce_sum(sums)
    k = (sums.numel() - 2) // 2
    accuracy = [(c / t).item() if t > 0 else 0.0 for c, t in zip(sums[2:2 + k], sums[2 + k:])]
    metrics = {"val.loss": sums[0].item() / max(sums[1].item(), 1.0), "val.proxy_tau": expected_tau(accuracy)}
    metrics.update({f"val.accuracy_pos{i + 1}": a for i, a in enumerate(accuracy)})
    return metrics
