"""Speculation profile: acceptance and measured cost for K = 1..K_max, the speedup they predict, the best K.

Each K decodes the same prompts one at a time (batch 1, as one request sees it), with K = 0 (plain decoding
through the same code path) as the baseline. The cost model: a verify step costs c_draft(K) + c_verify(K) and
emits tau(K) tokens, a plain step costs c_plain and emits one, so predicted speedup(K) = tau(K) * c_plain /
(c_draft(K) + c_verify(K)). Our drafters recompute their context every step (vLLM keeps a drafter KV cache), so
c_draft here is an upper bound of vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection

from pipeline.metrics import AcceptanceCounts

log = logging.getLogger(__name__)


def _decode_one_at_a_time(decoder: Any, prompts: list[list[int]], max_new_tokens: int,
                          stop_token_ids: Collection[int]) -> tuple[AcceptanceCounts, int]:
    total, new_tokens = AcceptanceCounts(decoder.num_speculative_tokens), 0
    for prompt in prompts:
        tokens, counts = decoder.generate(prompt, max_new_tokens, stop_token_ids)
        total, new_tokens = total.merge(counts), new_tokens + len(tokens)
    return total, new_tokens


def speculation_profile(make_decoder: Callable[[int], Any], prompts: list[list[int]], max_new_tokens: int,
                        stop_token_ids: Collection[int], num_speculative_tokens: int) -> dict:
    """`make_decoder(k)` gives a fresh SpeculativeDecoder with k drafts per step (k = 0: plain decoding)."""
    plain = make_decoder(0)
    _decode_one_at_a_time(plain, prompts, max_new_tokens, stop_token_ids)
    plain_step = plain.timing.verify_seconds / max(plain.timing.verify_calls, 1)
    rows = []
    for k in range(1, num_speculative_tokens + 1):
        decoder = make_decoder(k)
        counts, new_tokens = _decode_one_at_a_time(decoder, prompts, max_new_tokens, stop_token_ids)
        steps = max(decoder.timing.verify_calls, 1)
        draft_step = decoder.timing.draft_seconds / steps
        verify_step = decoder.timing.verify_seconds / steps
        rows.append({
            "k": k, "tau": counts.tau, "verify_steps": counts.steps, "new_tokens": new_tokens,
            "draft_ms_per_step": 1000 * draft_step, "verify_ms_per_step": 1000 * verify_step,
            "predicted_speedup": counts.tau * plain_step / (draft_step + verify_step),
            # the first token of each prompt comes from its prefill, outside both cost models
            "measured_speedup": (new_tokens - len(prompts)) * plain_step
            / (decoder.timing.draft_seconds + decoder.timing.verify_seconds),
        })
        log.info("profile: K=%d tau %.3f, draft %.1f ms + verify %.1f ms per step, predicted speedup %.2f", k,
                 counts.tau, 1000 * draft_step, 1000 * verify_step, rows[-1]["predicted_speedup"])
    best = max(rows, key=lambda row: row["predicted_speedup"])
    return {"num_prompts": len(prompts), "plain_ms_per_token": 1000 * plain_step, "per_k": rows,
            "recommended_k": best["k"]}
