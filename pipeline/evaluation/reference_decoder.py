"""A lossless speculative decoder in plain PyTorch: the verifier (HF, KV cache) checks a chain of K drafts.

At temperature 0 its output must equal ``verifier.generate(do_sample=False)`` token for token; at T > 0 its
tokens are distributed as the verifier's own samples (exact rejection sampling). Acceptance is counted with the
metric spec's :class:`AcceptanceCounts`. Several prompts decode together: one batched verifier forward per step
(the expensive part), the drafter per sequence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

import torch
from transformers import DynamicCache

from pipeline.evaluation.sampling import rejection_sample, verifier_probs
from pipeline.families import uses_sliding_window
from pipeline.metrics import AcceptanceCounts
from pipeline.verifier import cut_after_stop

log = logging.getLogger(__name__)


@dataclass
class StepTiming:
    """Wall time spent drafting and verifying, for the speculation profile's cost model."""

    draft_seconds: float = 0.0
    draft_calls: int = 0
    verify_seconds: float = 0.0  # decode steps only: the prompt's prefill is counted apart
    verify_calls: int = 0
    prefill_seconds: float = 0.0


class BatchedVerifier:
    """The verifier's KV cache for a batch of sequences that advance by different amounts each step.

    Every step appends the same number of cache slots to every row (the longest row's input; shorter rows are
    padded). Slots that hold padding or rejected drafts stay in the cache but are masked out of attention for
    good, so no row's cache ever has to be cropped on its own; position ids count only a row's kept tokens. A
    batch of one crops its rejected tail, so the speculation profile times the cache a single request has.
    """

    def __init__(self, verifier: Any, aux_layer_ids: list[int], batch_size: int):
        self.verifier, self.aux_layer_ids = verifier, aux_layer_ids
        self.device = verifier.device
        # Full-attention layers for every layer, even sliding-window ones (a plain DynamicCache), so a cache can be
        # cropped after rejected drafts: the sliding window is then applied by the attention mask alone.
        self.cache: Any = DynamicCache()
        self.slot_mask = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)  # 1 = attended slot
        self.kept_tokens = [0] * batch_size  # tokens each row has in the cache = its next position id
        self.last_widths = [0] * batch_size

    def forward(self, inputs: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run each row's new tokens (a row may have none); returns per row its logits [n, V] and its aux-layer
        features [n, A*H]. Every new slot counts as kept until `keep` says otherwise."""
        width = max(len(row) for row in inputs)
        ids = torch.zeros(len(inputs), width, dtype=torch.long)
        valid = torch.zeros(len(inputs), width, dtype=torch.long)
        positions = torch.zeros(len(inputs), width, dtype=torch.long)
        for index, row in enumerate(inputs):
            ids[index, :len(row)] = torch.tensor(row, dtype=torch.long)
            valid[index, :len(row)] = 1
            positions[index] = self.kept_tokens[index] + torch.arange(width).clamp(max=max(len(row) - 1, 0))
        self.slot_mask = torch.cat([self.slot_mask, valid.to(self.device)], dim=1)
        out = self.verifier(input_ids=ids.to(self.device), attention_mask=self.slot_mask,
                            position_ids=positions.to(self.device), past_key_values=self.cache, use_cache=True,
                            output_hidden_states=True)
        self.cache = out.past_key_values
        features = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1).float()  # [B, W, A*H]
        for index, row in enumerate(inputs):
            self.kept_tokens[index] += len(row)
            self.last_widths[index] = len(row)
        return ([out.logits[i, :len(row)] for i, row in enumerate(inputs)],
                [features[i, :len(row)] for i, row in enumerate(inputs)])

    def keep(self, row: int, kept: int) -> None:
        """Keep only the first `kept` of `row`'s slots from the last forward (the rest were rejected drafts)."""
        dropped = self.last_widths[row] - kept
        if dropped <= 0:
            return
        self.kept_tokens[row] -= dropped
        if self.slot_mask.shape[0] == 1:  # alone, the rejected slots are the cache's tail: crop them instead
            self.cache.crop(-dropped)  # a negative count drops that many slots off the tail
            self.slot_mask = self.slot_mask[:, :-dropped]
            return
        end = self.slot_mask.shape[1] - (max(self.last_widths) - self.last_widths[row])
        self.slot_mask[row, end - dropped:end] = 0


@dataclass
class _Sequence:
    prompt: list[int]
    counts: AcceptanceCounts
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last one is not in the cache yet
    features: Optional[torch.Tensor] = None  # aux features of every token in the cache, [len(tokens) - 1, A*H]
    stopped: bool = False  # an end-of-sequence token was emitted (possibly inside the accepted drafts)

    def cached_features(self) -> torch.Tensor:
        """features [len(tokens) - 1, A*H], which the prefill sets before any draft or verification step reads
        them. Raises RuntimeError when read before the prefill."""
        if self.features is None:
            raise RuntimeError("reference decoder: a sequence was read before its prefill")
        return self.features

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


class SpeculativeDecoder:
    """Chain speculative decoding. temperature 0: greedy verification (drafts kept while they equal the verifier's
    argmax). temperature > 0: exact rejection sampling (`sampling.rejection_sample`), seeded by `seed`."""

    def __init__(self, verifier: Any, drafter: Any, num_speculative_tokens: int, temperature: float = 0.0,
                 seed: int = 0):
        self.verifier, self.drafter, self.num_speculative_tokens = verifier, drafter, num_speculative_tokens
        self.aux_layer_ids = list(drafter.spec.aux_layer_ids)
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.timing = StepTiming()

    def _first_token(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(verifier_probs(logits, self.temperature).cpu(), 1, generator=self.generator))

    def _verify(self, logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
        """(accepted drafts, the verifier's token after them) from the logits at [last token, drafts...]."""
        if self.temperature > 0:
            return rejection_sample(verifier_probs(logits, self.temperature), drafts, None, self.generator)
        greedy = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        return accepted, greedy[accepted]

    def _timed_forward(self, batch: BatchedVerifier, inputs: list[list[int]], prefill: bool = False):
        started = time.perf_counter()
        result = batch.forward(inputs)
        if prefill:
            self.timing.prefill_seconds += time.perf_counter() - started
        else:
            self.timing.verify_seconds += time.perf_counter() - started
            self.timing.verify_calls += 1
        return result

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_token_ids: Collection[int]):
        """(new tokens, AcceptanceCounts) for one prompt."""
        return self.generate_batch([prompt], max_new_tokens, stop_token_ids)[0]

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int,
                       stop_token_ids: Collection[int]) -> list[tuple[list[int], AcceptanceCounts]]:
        """(new tokens, AcceptanceCounts) for each prompt, in prompt order, decoded together: one batched verifier
        forward per step, the drafter per sequence.

        prompts: B non-empty lists of the verifier's token ids (different lengths are fine). max_new_tokens: the most
        tokens a sequence keeps. stop_token_ids: the ids that end a sequence, usually
        `pipeline.verifier.verifier_stop_token_ids` (every id vLLM stops on). Returns per prompt its new token ids
        (list[int], at most max_new_tokens, cut after the first stop id, which is kept) and the AcceptanceCounts of
        its verify steps (K = num_speculative_tokens drafts proposed per step, fewer where DSpark truncates). The
        verifier runs in its own dtype on its device, its features go to the drafter as float32 [1, T, A*H]. A
        sliding-window verifier decodes the prompts one at a time. Raises nothing of its own; a token id outside the
        verifier's vocabulary, or an empty prompt, fails in torch (IndexError / RuntimeError)."""
        if len(prompts) > 1 and uses_sliding_window(self.verifier.config):
            # a batch leaves masked slots inside the window of sliding-window layers: decode one prompt at a time
            return [self.generate_batch([prompt], max_new_tokens, stop_token_ids)[0] for prompt in prompts]
        sequences = [_Sequence(list(p), AcceptanceCounts(self.num_speculative_tokens)) for p in prompts]
        batch = BatchedVerifier(self.verifier, self.aux_layer_ids, len(prompts))
        logits, features = self._timed_forward(batch, [s.prompt for s in sequences], prefill=True)
        for sequence, row_logits, row_features in zip(sequences, logits, features):
            sequence.tokens = sequence.prompt + [self._first_token(row_logits[-1])]
            sequence.features = row_features
            sequence.stopped = sequence.tokens[-1] in stop_token_ids

        def active(sequence: _Sequence) -> bool:
            return sequence.generated < max_new_tokens and not sequence.stopped

        while any(active(s) for s in sequences):
            # Always K drafts, as vLLM does, even where they run past max_new_tokens: vLLM counts the drafts it
            # accepts there too, and `_finish` cuts the output back to max_new_tokens.
            drafts = [self._draft(s, self.num_speculative_tokens) if active(s) else None for s in sequences]
            logits, features = self._timed_forward(
                batch, [[s.tokens[-1]] + d if d is not None else [] for s, d in zip(sequences, drafts)])
            for row, (sequence, row_drafts) in enumerate(zip(sequences, drafts)):
                if row_drafts is not None:
                    self._advance(sequence, row_drafts, logits[row], features[row], batch, row,
                                  stop_token_ids)
        return [self._finish(s, max_new_tokens, stop_token_ids) for s in sequences]

    def _advance(self, sequence: _Sequence, drafts: list[int], logits: torch.Tensor, features: torch.Tensor,
                 batch: BatchedVerifier, row: int, stop_token_ids: Collection[int]) -> None:
        accepted, next_token = self._verify(logits, drafts)
        sequence.counts.add_step(accepted, len(drafts))  # DSpark may propose fewer than K (confidence truncation)
        batch.keep(row, accepted + 1)  # the last token and the accepted drafts; the rejected tail is masked out
        sequence.features = torch.cat([sequence.cached_features(), features[: accepted + 1]])
        emitted = drafts[:accepted] + [next_token]
        sequence.tokens += emitted
        sequence.stopped = any(token in stop_token_ids for token in emitted)

    @staticmethod
    def _finish(sequence: _Sequence, max_new_tokens: int, stop_token_ids: Collection[int]):
        generated = cut_after_stop(sequence.tokens[len(sequence.prompt):][:max_new_tokens], stop_token_ids)
        return generated, sequence.counts

    def _draft(self, sequence: _Sequence, proposed: int) -> list[int]:
        if proposed <= 0:
            return []
        started = time.perf_counter()
        features = sequence.cached_features()
        next_ids = torch.tensor([sequence.tokens[1:]], device=features.device)  # token t + 1 paired with features t
        drafts = self.drafter.draft(features[None], next_ids, proposed).tolist()[:proposed]
        self.timing.draft_seconds += time.perf_counter() - started
        self.timing.draft_calls += 1
        return drafts


@torch.no_grad()
def verifier_greedy(verifier: Any, prompt: list[int], max_new_tokens: int,
                    stop_token_ids: Collection[int]) -> list[int]:
    """verifier.generate(do_sample=False) of one prompt: new token ids, ending at the first stop id."""
    ids = torch.tensor([prompt], device=verifier.device)
    stops = list(stop_token_ids)
    out = verifier.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops or None,
                            pad_token_id=stops[0] if stops else None)
    return cut_after_stop(out[0, len(prompt):].tolist(), stop_token_ids)


@torch.no_grad()
def greedy_mismatches(verifier: Any, prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int,
                      stop_token_ids: Collection[int], batch_size: int = 8, near_tie_steps: float = 0.0) -> list[int]:
    """Indices of the outputs that greedy decoding would not produce, checked in one teacher-forced forward.

    An output equals ``verifier.generate(do_sample=False)`` exactly when every output token is the verifier's argmax
    after the prompt and the output tokens before it, and it ends where greedy decoding ends: at the first
    stop token (stop_token_ids) or after ``max_new_tokens``. One forward over prompt + output checks all of that at
    once, so the lossless check costs a prefill per request instead of a second decode. prompts/outputs: token ids.
    An output token that is not the argmax but whose logit lies within `near_tie_steps` rounding steps of the
    dtype the verifier computes in (at the winning logit's magnitude; pipeline/evaluation/divergence.py) is a
    near-tie the decoder's other kernel shapes may flip, not a fault: the same rule vLLM's output is judged by.
    """
    failed = []
    for start in range(0, len(prompts), batch_size):
        rows = [p + o for p, o in zip(prompts[start:start + batch_size], outputs[start:start + batch_size])]
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):  # right padding: no real position sees the padding after it
            ids[index, :len(row)] = torch.tensor(row, dtype=torch.long)
            attention[index, :len(row)] = 1
        logits = verifier(input_ids=ids.to(verifier.device), attention_mask=attention.to(verifier.device)).logits
        greedy = logits.argmax(dim=-1).cpu()  # [B, width]: the argmax after each prefix
        for offset, (prompt, output) in enumerate(zip(prompts[start:start + batch_size],
                                                      outputs[start:start + batch_size])):
            near_tie_greedy = _with_near_ties(greedy[offset], logits[offset], len(prompt), output, near_tie_steps)
            if not _is_greedy_output(near_tie_greedy, len(prompt), output, max_new_tokens, stop_token_ids):
                failed.append(start + offset)
    return failed


def _with_near_ties(greedy: torch.Tensor, logits: torch.Tensor, prompt_length: int, output: list[int],
                    near_tie_steps: float) -> torch.Tensor:
    """greedy [width] with each output position whose token is within near_tie_steps rounding steps of the argmax's
    logit (logits [width, V], the verifier's dtype) taken as that token: a near-tie counts as greedy."""
    from pipeline.evaluation.divergence import near_tie_tolerance

    if near_tie_steps <= 0 or not output:
        return greedy
    accepted = greedy.clone()
    for index, token in enumerate(output):
        position = prompt_length - 1 + index
        if position >= len(greedy) or int(greedy[position]) == token:
            continue
        row = logits[position]
        best, chosen = float(row.max()), float(row[token])
        if best - chosen <= near_tie_tolerance(row.dtype, best, near_tie_steps):
            log.info("greedy check: output token %d at position %d is a near-tie with the argmax %d (margin %.3g)",
                     token, index, int(greedy[position]), best - chosen)
            accepted[position] = token
    return accepted


def _is_greedy_output(greedy: torch.Tensor, prompt_length: int, output: list[int], max_new_tokens: int,
                      stop_token_ids: Collection[int]) -> bool:
    """greedy [width]: argmax after each position of prompt + output."""
    if not output:
        return max_new_tokens == 0
    expected = greedy[prompt_length - 1: prompt_length - 1 + len(output)].tolist()
    if expected != output:
        return False
    if any(token in stop_token_ids for token in output[:-1]):
        return False  # greedy decoding stops at the first stop token
    return output[-1] in stop_token_ids or len(output) == max_new_tokens
