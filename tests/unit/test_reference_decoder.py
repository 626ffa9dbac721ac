"""The reference speculative decoder is lossless: its greedy output equals verifier.generate token for token."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafters.build import build_drafter, default_mask_token_id, make_spec
from pipeline.evaluation.reference_decoder import SpeculativeDecoder, greedy_mismatches, verifier_greedy
from pipeline.verifier import load_verifier

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Explain recursion in one sentence.",
    "Sort [3, 1, 2] in Python.",
]


def drafter_for(verifier_path, verifier, tokenizer, num_speculative_tokens=4, seed=0, algorithm="peagle", **overrides):
    from pipeline.drafters import drafter_config

    torch.manual_seed(seed)
    cfg = drafter_config(algorithm, num_speculative_tokens=num_speculative_tokens, **overrides)
    spec = make_spec(cfg, verifier.config, "v", verifier_path, default_mask_token_id(tokenizer))
    return build_drafter(spec).eval()


class OracleDrafter:
    """Drafts exactly what the verifier would say: every draft must be accepted."""

    def __init__(self, spec, continuation, prompt_length):
        self.spec, self.continuation, self.prompt_length = spec, continuation, prompt_length

    def draft(self, aux_hidden, next_ids, num_speculative_tokens):
        done = next_ids.shape[1] + 1 - self.prompt_length  # tokens generated so far
        k = num_speculative_tokens
        return torch.tensor(self.continuation[done:done + k] + [0] * k)[:k]


def prompt_tokens(tokenizer, text):
    from pipeline.data.chat import prompt_ids

    return prompt_ids(tokenizer, [{"role": "user", "content": text}])


@pytest.mark.parametrize("algorithm,num_speculative_tokens", [("peagle", 1), ("peagle", 3), ("peagle", 5),
                                                                ("eagle3", 4), ("dflash", 4), ("dspark", 4),
                                                                ("dflash2", 4)])
def test_random_drafter_is_lossless_on_a_tiny_verifier(tiny_verifier_path, algorithm, num_speculative_tokens):
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    # DSpark truncates with a threshold: blocks of varying length must stay lossless too
    drafter = drafter_for(tiny_verifier_path, verifier, tokenizer, 5, algorithm=algorithm)
    drafter.confidence_threshold = 0.3
    decoder = SpeculativeDecoder(verifier, drafter, num_speculative_tokens)
    for text in PROMPTS:
        prompt = prompt_tokens(tokenizer, text)
        tokens, counts = decoder.generate(prompt, 20, (tokenizer.eos_token_id,))
        assert tokens == verifier_greedy(verifier, prompt, 20, (tokenizer.eos_token_id,))
        assert counts.steps > 0


def test_oracle_drafts_are_all_accepted(tiny_verifier_path):
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    inner = drafter_for(tiny_verifier_path, verifier, tokenizer)
    prompt = prompt_tokens(tokenizer, PROMPTS[0])
    reference = verifier_greedy(verifier, prompt, 21, ())
    oracle = OracleDrafter(inner.spec, reference, len(prompt))
    tokens, counts = SpeculativeDecoder(verifier, oracle, 4).generate(prompt, 21, ())
    assert tokens == reference
    assert counts.steps == 4 and counts.tau == pytest.approx(5.0)  # 1 + 4 steps x (4 drafts + bonus) = 21
    assert counts.conditional_acceptance == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("algorithm", ["peagle", "dflash"])
def test_lossless_on_smollm2_with_eos(smollm2_path, algorithm):
    verifier, tokenizer = load_verifier(smollm2_path)
    decoder = SpeculativeDecoder(verifier, drafter_for(smollm2_path, verifier, tokenizer, algorithm=algorithm), 4)
    for text in PROMPTS[:2]:
        prompt = prompt_tokens(tokenizer, text)
        tokens, _ = decoder.generate(prompt, 40, (tokenizer.eos_token_id,))
        assert tokens == verifier_greedy(verifier, prompt, 40, (tokenizer.eos_token_id,))


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3", "dflash", "dspark"])
def test_a_batch_of_prompts_decodes_as_each_prompt_alone(tiny_verifier_path, algorithm):
    """Prompts of different lengths, accepting different numbers of drafts and stopping at different steps: the
    batched decoder gives every prompt verifier.generate's own tokens and the acceptance it gets decoded alone."""
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    drafter = drafter_for(tiny_verifier_path, verifier, tokenizer, 4, algorithm=algorithm)
    drafter.confidence_threshold = 0.3
    decoder = SpeculativeDecoder(verifier, drafter, 4)
    prompts = [prompt_tokens(tokenizer, text) for text in PROMPTS]
    eos = (tokenizer.eos_token_id,)
    batched = decoder.generate_batch(prompts, 24, eos)
    for prompt, (tokens, counts) in zip(prompts, batched):
        assert tokens == verifier_greedy(verifier, prompt, 24, eos)
        alone_tokens, alone_counts = decoder.generate(prompt, 24, eos)
        assert tokens == alone_tokens
        assert (counts.steps, counts.accepted_at) == (alone_counts.steps, alone_counts.accepted_at)


def test_a_batch_with_an_oracle_row_accepts_everything_there(tiny_verifier_path):
    """One row accepts every draft while the other rejects: the masked-out rejected slots of one row must not
    leak into the other's attention."""
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    inner = drafter_for(tiny_verifier_path, verifier, tokenizer)
    prompt = prompt_tokens(tokenizer, PROMPTS[0])
    reference = verifier_greedy(verifier, prompt, 21, ())
    oracle = OracleDrafter(inner.spec, reference, len(prompt))
    results = SpeculativeDecoder(verifier, oracle, 4).generate_batch([prompt, prompt_tokens(tokenizer, "Hi")], 21,
                                                                     ())
    assert results[0][0] == reference and results[0][1].tau == pytest.approx(5.0)
    assert results[1][0] == verifier_greedy(verifier, prompt_tokens(tokenizer, "Hi"), 21, ())


def own_samples(verifier, tokenizer, aux_layer_ids, texts, new_tokens=24) -> list[dict]:
    """Training samples as the store holds them, captured from the verifier's own greedy answers."""
    samples = []
    for text in texts:
        prompt = prompt_tokens(tokenizer, text)
        ids = torch.tensor([prompt + verifier_greedy(verifier, prompt, new_tokens, ())])
        with torch.no_grad():
            hidden = verifier(input_ids=ids, output_hidden_states=True).hidden_states
        samples.append({"aux": torch.cat([hidden[i][0] for i in aux_layer_ids], dim=-1), "last": hidden[-1][0],
                        "input_ids": ids[0],
                        "loss_mask": torch.tensor([0] * len(prompt) + [1] * (ids.shape[1] - len(prompt)))})
    return samples


@pytest.mark.parametrize("algorithm", ["peagle", "eagle3", "dflash", "dspark"])
def test_trained_drafters_stay_lossless(tiny_verifier_path, algorithm):
    """Drafters trained on the verifier's own answers (their loss falls) decode losslessly on many prompts, batched."""
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    drafter = drafter_for(tiny_verifier_path, verifier, tokenizer, 4, algorithm=algorithm).train()
    drafter.confidence_threshold = 0.3
    samples = own_samples(verifier, tokenizer, drafter.spec.aux_layer_ids, PROMPTS)
    options = type(drafter).config_class().deterministic()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(25):
        loss = drafter.training_loss(samples, options, generator)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses[::5]
    drafter.eval()
    prompts = [prompt_tokens(tokenizer, text) for text in PROMPTS + ["Tell me a joke.", "def add(a, b):"]]
    results = SpeculativeDecoder(verifier, drafter, 4).generate_batch(prompts, 24, (tokenizer.eos_token_id,))
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == verifier_greedy(verifier, prompt, 24, (tokenizer.eos_token_id,))


def test_the_teacher_forced_check_accepts_greedy_outputs_and_flags_every_kind_of_deviation(tiny_verifier_path):
    """greedy_mismatches (one forward per request) agrees with a second greedy decode: it passes generate's own
    outputs, and flags a changed token, an output cut short before eos, and one running on past eos."""
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    eos = (tokenizer.eos_token_id,)
    prompts = [prompt_tokens(tokenizer, text) for text in PROMPTS[:4]]
    outputs = [verifier_greedy(verifier, prompt, 16, eos) for prompt in prompts]
    assert greedy_mismatches(verifier, prompts, outputs, 16, eos, batch_size=3) == []

    changed = [list(o) for o in outputs]
    changed[1][5] = (changed[1][5] + 1) % verifier.config.vocab_size
    cut_short = [list(o) for o in outputs]
    cut_short[2] = cut_short[2][:-1]
    assert greedy_mismatches(verifier, prompts, changed, 16, eos, batch_size=3) == [1]
    assert greedy_mismatches(verifier, prompts, cut_short, 16, eos, batch_size=3) == [2]
    # an end-of-sequence token inside the output that decoding went past: greedy stops there
    first_new = next(i for i in range(1, 16) if outputs[0][i] not in outputs[0][:i])
    stop = outputs[0][first_new]
    assert greedy_mismatches(verifier, prompts[:1], [outputs[0][:first_new + 1]], 16, (stop,)) == []
    assert greedy_mismatches(verifier, prompts[:1], [outputs[0][:first_new + 2]], 16, (stop,)) == [0]


class _FixedLogits(torch.nn.Module):
    """A verifier whose next-token logits are the same row at every position: token 2 wins over token 1 by
    `margin` at a logit of 28 (fp32's rounding step there is 2**-19, about 1.9e-6)."""

    def __init__(self, margin: float):
        super().__init__()
        self.row = torch.tensor([0.0, 28.0 - margin, 28.0, 1.0])

    def forward(self, input_ids, attention_mask=None):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.row.expand(*input_ids.shape, 4).clone())

    @property
    def device(self):
        return torch.device("cpu")


@pytest.mark.parametrize("margin, steps, faults", [
    (1.9e-6, 4.0, []),  # one rounding step: numerics another kernel shape may flip (the gemma4 tiny verifier's)
    (1.9e-6, 0.0, [0]),  # no tolerance: any token but the argmax is a fault
    (0.5, 4.0, [0]),  # far from a tie: a wrong token, a lossless fault
])
def test_a_near_tie_with_the_argmax_is_numerics_and_anything_else_a_fault(margin, steps, faults):
    verifier = _FixedLogits(margin)
    # prompt [0], output [1, 2, 2]: the first output token is the runner-up, then the argmax twice (no stop id)
    assert greedy_mismatches(verifier, [[0]], [[1, 2, 2]], 3, (3,), near_tie_steps=steps) == faults
