"""A lossless speculative decoder in plain PyTorch: the verifier (HF, KV cache) checks a chain of K drafts.

At temperature 0 its output must equal ``verifier.generate(do_sample=False)`` token for token; at T > 0 its
tokens are distributed as the verifier's own samples (exact rejection sampling). Acceptance is counted with the
metric spec's :class:`AcceptanceCounts`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline.evaluation.metrics import AcceptanceCounts
from pipeline.evaluation.sampling import rejection_sample, verifier_probs


class SpeculativeDecoder:
    """Chain speculative decoding. temperature 0: greedy verification (drafts kept while they equal the verifier's
    argmax). temperature > 0: exact rejection sampling (`sampling.rejection_sample`), seeded by `seed`."""

    def __init__(self, verifier: Any, drafter: Any, num_drafts: int, temperature: float = 0.0, seed: int = 0):
        self.verifier, self.drafter, self.num_drafts = verifier, drafter, num_drafts
        self.aux_layer_ids = list(drafter.spec.aux_layer_ids)
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)

    def _verifier_step(self, input_ids: list[int], cache: Optional[Any]):
        out = self.verifier(input_ids=torch.tensor([input_ids], device=self.verifier.device), past_key_values=cache,
                            use_cache=True, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0] for i in self.aux_layer_ids], dim=-1).float()  # [N, A*H]
        return out.logits[0], features, out.past_key_values

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

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, eos_token_id: Optional[int]):
        """(new tokens, AcceptanceCounts) for one prompt."""
        logits, features, cache = self._verifier_step(prompt, None)
        tokens = list(prompt) + [self._first_token(logits[-1])]  # always one the verifier has not processed yet
        counts = AcceptanceCounts(self.num_drafts)
        while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] != eos_token_id:
            remaining = max_new_tokens - (len(tokens) - len(prompt))
            budget = min(self.num_drafts, remaining - 1)  # the bonus token always comes on top
            drafts = self._draft(features, tokens, budget)
            proposed = len(drafts)  # DSpark may send fewer than asked (confidence truncation)
            logits, new_features, cache = self._verifier_step([tokens[-1]] + drafts, cache)
            accepted, next_token = self._verify(logits, drafts)
            # Counted even when no draft fits before max_new_tokens: vLLM still runs (and counts) that draft step.
            counts.add_step(accepted, proposed)
            # Keep the verifier's state for the last token and the accepted drafts; drop the rejected tail.
            if proposed > accepted:
                cache.crop(accepted - proposed)
            features = torch.cat([features, new_features[: accepted + 1]])
            tokens += drafts[:accepted] + [next_token]
        generated = tokens[len(prompt):][:max_new_tokens]
        if eos_token_id in generated:
            generated = generated[: generated.index(eos_token_id) + 1]
        return generated, counts

    def _draft(self, features: torch.Tensor, tokens: list[int], proposed: int) -> list[int]:
        if proposed == 0:
            return []
        next_ids = torch.tensor([tokens[1:]], device=features.device)  # [1, T]: token t + 1 paired with the features at t
        return self.drafter.draft(features[None], next_ids, proposed).tolist()[:proposed]


@torch.no_grad()
def verifier_greedy(verifier: Any, prompt: list[int], max_new_tokens: int, eos_token_id: Optional[int]) -> list[int]:
    ids = torch.tensor([prompt], device=verifier.device)
    out = verifier.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                            pad_token_id=eos_token_id)
    return out[0, len(prompt):].tolist()
