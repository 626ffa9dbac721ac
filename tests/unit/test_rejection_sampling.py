"""At T > 0 speculative decoding must emit exactly the verifier's distribution (chi-square tests, fixed seeds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from pipeline.evaluation.reference_decoder import SpeculativeDecoder
from pipeline.evaluation.sampling import rejection_sample

VOCAB = 12
PROMPT = [3, 7, 1, 5]


def chi_square_p_value(observed: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Goodness of fit, pooling the cells expected fewer than 5 times into one."""
    expected = probabilities.double() / probabilities.double().sum() * observed.sum()
    small = expected < 5
    observed_cells = torch.cat([observed[~small].double(), observed[small].double().sum().reshape(1)])
    expected_cells = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected_cells > 0
    return float(chisquare(observed_cells[keep].numpy(), expected_cells[keep].numpy()).pvalue)


@pytest.mark.parametrize("drafter_kind", ["greedy (one-hot q)", "sampled from q"])
def test_one_verification_emits_the_verifiers_distribution(drafter_kind):
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, VOCAB, generator=generator) * 2, dim=-1)  # one draft position + the bonus
    q = torch.softmax(torch.randn(1, VOCAB, generator=generator) * 2, dim=-1)
    counts, accepted_total = torch.zeros(VOCAB), 0
    for _ in range(20_000):
        if drafter_kind.startswith("greedy"):
            draft, draft_q = int(p[0].argmax()), None  # a good greedy draft: accepted about p_max of the time
        else:
            draft, draft_q = int(torch.multinomial(q[0], 1, generator=generator)), q
        accepted, token = rejection_sample(p, [draft], draft_q, generator)
        first = draft if accepted else token  # the token emitted at the draft's position
        counts[first] += 1
        accepted_total += accepted
    assert 0.02 < accepted_total / 20_000 < 0.98  # both the accept and the resample branch ran
    assert chi_square_p_value(counts, p[0]) > 1e-3


class OracleDrafter:
    """Drafts the verifier's greedy continuation: drafts are often but not always accepted at T = 1."""

    def __init__(self, verifier):
        self.verifier, self.spec = verifier, SimpleNamespace(aux_layer_ids=[1])

    @torch.no_grad()
    def draft(self, aux_hidden, next_ids, num_speculative_tokens):
        sequence = [PROMPT[0]] + next_ids[0].tolist()
        drafts = []
        for _ in range(num_speculative_tokens):
            drafts.append(int(self.verifier(input_ids=torch.tensor([sequence + drafts])).logits[0, -1].argmax()))
        return torch.tensor(drafts)


@pytest.fixture(scope="module")
def small_verifier():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
                         max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def exact_marginals(verifier, depth: int) -> list[torch.Tensor]:
    """The verifier's exact distribution of new token 1..depth (summed over every earlier choice)."""
    prefixes, weights, marginals = [list(PROMPT)], torch.ones(1, dtype=torch.float64), []
    for _ in range(depth):
        logits = verifier(input_ids=torch.tensor(prefixes)).logits[:, -1]
        probs = torch.softmax(logits.double(), dim=-1)  # [prefixes, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        prefixes = [prefix + [token] for prefix in prefixes for token in range(VOCAB)]
        weights = joint.flatten()
    return marginals


def test_the_speculative_decoder_samples_as_the_verifier_does_at_temperature_one(small_verifier):
    decoder = SpeculativeDecoder(small_verifier, OracleDrafter(small_verifier), num_speculative_tokens=2,
                                 temperature=1.0, seed=0)
    runs = 1500  # enough for a chi-square test to catch a wrong acceptance rule at p < 1e-3 at each position
    counts = torch.zeros(3, VOCAB)
    decoder_counts = None
    for _ in range(runs):
        tokens, step_counts = decoder.generate(PROMPT, max_new_tokens=3, stop_token_ids=())
        for position in range(3):
            counts[position, tokens[position]] += 1
        decoder_counts = step_counts if decoder_counts is None else decoder_counts.merge(step_counts)
    assert 0.05 < decoder_counts.accepted_tokens / decoder_counts.proposed_tokens < 0.95  # both branches ran
    for position, exact in enumerate(exact_marginals(small_verifier, 3)):
        assert chi_square_p_value(counts[position], exact) > 1e-3, (position, counts[position], exact)
