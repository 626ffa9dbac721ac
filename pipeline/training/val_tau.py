"""Real acceptance during training: `val.tau`, measured at a checkpoint by the lossless reference decoder.

The proxy (`val.proxy_tau`, from teacher-forced accuracy) misleads: on the default run it read 1.94 where decoding
gave 1.39. So at each checkpoint rank 0 decodes the prompts of a few validation samples (held out of training, the
same samples val.proxy_tau scores) with the verifier and the checkpoint's drafter, loaded from the checkpoint's own
files and rounded as the export stores it: exactly what the evaluate stage measures on that checkpoint.
val.tau is the pooled τ of the metric spec (pipeline/metrics.py: tokens per verifier forward over all
requests), greedy, at K = evaluation.num_speculative_tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.evaluation.measured_drafter import decoding_drafter
from pipeline.metrics import merged

METRICS = ("val.tau", "val.alpha_pos1")


def prompt_of(sample: dict) -> list[int]:
    """The tokens before a store sample's first trained (loss-masked) token: its first user turn, templated."""
    mask = sample["loss_mask"].tolist()
    first = mask.index(1) if 1 in mask else len(mask)
    return sample["input_ids"][:first].tolist()


class AcceptanceProbe:
    """val.tau and val.alpha_pos1 of a checkpoint on fixed prompts (token ids, [num_prompts][prompt_len]).

    The verifier (an HF folder, loaded in `compute_dtype` on first use) stays in memory between checkpoints.
    max_new_tokens: the decode length of each prompt; batch_size: prompts decoded together, as the evaluate stage
    batches them (greedy τ can differ by a near-tie between batchings)."""

    def __init__(self, verifier_path: str, compute_dtype: str, prompts: list[list[int]], num_speculative_tokens: int,
                 max_new_tokens: int, batch_size: int, decoding: Optional[dict[str, Any]] = None):
        self.verifier_path, self.compute_dtype = verifier_path, compute_dtype
        self.prompts, self.num_speculative_tokens, self.max_new_tokens = prompts, num_speculative_tokens, max_new_tokens
        self.batch_size, self.decoding = batch_size, dict(decoding or {})
        self._verifier, self._stop_token_ids = None, ()

    def _load(self):
        if self._verifier is None:
            from pipeline.verifier import load_verifier, stop_token_ids

            self._verifier, tokenizer = load_verifier(self.verifier_path, self.compute_dtype)
            self._stop_token_ids = stop_token_ids(tokenizer, self._verifier.generation_config)
        return self._verifier

    @torch.no_grad()
    def measure(self, checkpoint: Path) -> dict[str, float]:
        """{val.tau, val.alpha_pos1} of the drafter saved in `checkpoint` (a folder with spec.json and weights)."""
        from pipeline.evaluation.reference_decoder import SpeculativeDecoder

        verifier = self._load()
        # this rank's own checkpoint, not yet sealed (no integrity record to verify against)
        drafter = decoding_drafter(checkpoint, self.decoding, verified=False).to(verifier.device)
        decoder = SpeculativeDecoder(verifier, drafter, self.num_speculative_tokens)
        counts = []
        for start in range(0, len(self.prompts), self.batch_size):
            counts += [c for _, c in decoder.generate_batch(self.prompts[start:start + self.batch_size],
                                                            self.max_new_tokens, self._stop_token_ids)]
        total = merged(counts)
        return {"val.tau": total.tau, "val.alpha_pos1": total.conditional_acceptance[0]}


def ranking(metrics: dict, select_by: str) -> tuple[float, float]:
    """How a checkpoint's reported `metrics` rank it by `select_by` (higher is better): a tie (a few short prompts
    often tie at val.tau) goes to the later step, as Ray Train ranks tied checkpoints when it decides which
    `training.keep_checkpoints` to keep; any other rule could pick one Ray Train deleted."""
    return metrics[select_by], metrics.get("step", 0)


def proxy_agreement(points: list[dict[str, float]]) -> dict[str, float]:
    """How well val.proxy_tau predicts val.tau across checkpoints ([{step, val.proxy_tau, val.tau}]): Spearman's
    rank correlation (scipy; left out where it is undefined: fewer than 3 checkpoints or a constant series) and
    the step each would pick (as `ranking` picks)."""
    from scipy.stats import spearmanr

    by_proxy = max(points, key=lambda p: ranking(p, "val.proxy_tau"))
    by_tau = max(points, key=lambda p: ranking(p, "val.tau"))
    agreement = {"train.best_step_by_proxy_tau": by_proxy["step"], "train.best_step_by_val_tau": by_tau["step"],
                 "train.val_tau_at_proxy_choice": by_proxy["val.tau"], "train.best_val_tau": by_tau["val.tau"]}
    proxies, taus = [p["val.proxy_tau"] for p in points], [p["val.tau"] for p in points]
    if len(points) >= 3 and len(set(proxies)) > 1 and len(set(taus)) > 1:
        agreement["train.proxy_tau_spearman"] = float(spearmanr(proxies, taus).statistic)
    return agreement
