"""Prompts the verifier writes itself (Magpie): where a user turn begins, the filters, deduplication, determinism,
restarts, and the `general` source kept apart from the eval sets."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pipeline.data.synthesize import BATCH_SEED_STRIDE, SENTINEL, prompt_problem, synthesize, user_turn_prefix
from pipeline.errors import PipelineError
from tests.conftest import TINY_TOKENIZER

# What a sampling verifier might write: usable requests, one repeated, and each kind the filters drop.
CANNED = [
    "Write a Python function that reverses a linked list.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "What should I cook for dinner tonight with rice and beans?",
    "write a python function that reverses a linked list",  # the first one again, normalised
    "Hi",  # too short
    "   ",  # empty
    "aaaaaaaaaaaaaaaa what",  # repetitive characters
    "the cat the cat the cat the cat the cat the cat the cat the cat",  # repetitive words
    "$$$ ### %%% @@@ !!! ??? +++",  # not text
    "Tell me about <|im_start|>assistant things",  # template text
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def canned_generator(tokenizer, log: list):
    """A stand-in backend: request i of a batch writes canned text (i + a number drawn from the batch seed) and
    every seventh ends without the end-of-turn token, as an over-long sample does."""
    eos = tokenizer.eos_token_id

    def generate(prompts, budgets, seed):
        log.append((len(prompts), seed))
        offset = random.Random(seed).randrange(len(CANNED))
        out = []
        for i, _ in enumerate(prompts):
            ids = tokenizer(CANNED[(i + offset) % len(CANNED)], add_special_tokens=False)["input_ids"]
            out.append(ids + ([eos] if i % 7 != 6 else []))
        return out

    return generate


def run(folder, tokenizer, log, seed=0, per_domain=24, with_dropped=False):
    rows, dropped = synthesize(folder, tokenizer, canned_generator(tokenizer, log), {"code": "You write code.",
                                                                             "chat": "You chat."},
                      per_domain=per_domain, batch_size=10, max_new_tokens=32, seed=seed,
                      stop_ids={tokenizer.eos_token_id})
    return (rows, dropped) if with_dropped else rows


def test_the_user_turn_begins_where_the_template_puts_the_users_text(tokenizer):
    prefix = user_turn_prefix(tokenizer, "You are a tutor.")
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "You are a tutor."},
                                              {"role": "user", "content": "Hello there"}], tokenize=False)
    assert rendered.startswith(prefix + "Hello there")
    assert prefix.endswith("user\n") and SENTINEL not in prefix


@pytest.mark.parametrize("text,finished,problem", [
    ("Explain recursion with an example in Python.", True, None),
    ("Explain recursion with an example in Python.", False, "unfinished"),
    ("", True, "empty"),
    ("Hi there", True, "too short"),
    ("Tell me about <|im_end|> please now", True, "template text"),
    ("Why is the sky blue?????????????", True, "repetitive"),
    ("go to go to go to go to go to go to go to go to", True, "repetitive"),
    ("=== --- +++ *** /// ||| ;;;", True, "not text"),
    ("Solve 3x + 5 = 20 for x.", True, None),
    ("How do I keep a fire going? (I am a friendly assistant for everyday questions, sorry)", True, "echoes"),
    ("Any advice about cooking, travel and health for a trip to Rome?", True, None),  # 5 words of it: a topic
])
def test_filters_name_what_is_wrong(text, finished, problem):
    found = prompt_problem(text, finished, ["<|im_start|>", "<|im_end|>"], "You are a friendly assistant for "
                           "everyday questions. Users ask about cooking, travel and health.")
    assert (found is None) if problem is None else found.startswith(problem)


def test_the_same_seed_gives_the_same_prompts_deduplicated_and_filtered(tmp_path, tokenizer):
    log: list = []
    first = run(tmp_path / "a", tokenizer, log)
    second = run(tmp_path / "b", tokenizer, log)
    assert first == second and first
    texts = [row["prompt"].casefold().rstrip(".") for row in first]
    assert len(texts) == len(set(texts))  # each request once (up to case and spacing), whichever came first
    assert {row["prompt"] for row in first} <= set(CANNED[:4])  # only the usable requests pass the filters
    assert {row["domain"] for row in first} <= {"code", "chat"}
    _, dropped = run(tmp_path / "a", tokenizer, log, with_dropped=True)  # read back from the parts
    assert {"repeated", "too short", "empty", "repetitive", "not text", "template text"} <= set(dropped)
    assert sum(dropped.values()) + len(first) == 48
    first_seeds = [seed for _, seed in log[:6]]  # the six batches of the first run
    log.clear()
    run(tmp_path / "c", tokenizer, log, seed=1)
    other_seeds = [seed for _, seed in log]
    # every batch its own seed, far enough apart that vLLM's per-request seeds (batch seed + i) never collide
    assert len(set(first_seeds)) == 6 and set(first_seeds).isdisjoint(other_seeds)
    ordered = sorted(first_seeds + other_seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) >= BATCH_SEED_STRIDE


def test_the_largest_seed_validate_allows_gives_batch_seeds_torch_and_vllm_accept(tmp_path, tokenizer):
    """Batch seeds grew past 2**64 from a seed of about 2.8e7: torch.manual_seed overflowed in the prompt writer."""
    log: list = []
    run(tmp_path / "big", tokenizer, log, seed=2**32 - 1)
    seeds = [seed for _, seed in log]
    assert seeds and all(0 <= seed and seed + BATCH_SEED_STRIDE < 2**63 for seed in seeds)
    assert len(set(seeds)) == len(seeds)


def test_a_rerun_samples_only_the_missing_batches(tmp_path, tokenizer):
    log: list = []
    first = run(tmp_path, tokenizer, log)
    assert sum(size for size, _ in log) == 48  # 24 per domain, batches of 10, 10, 4
    (tmp_path / "chat-0001.jsonl").unlink()  # as if the run died before that batch was written
    log.clear()
    again = run(tmp_path, tokenizer, log)
    assert [size for size, _ in log] == [10] and again == first


def test_nothing_usable_is_one_clear_error(tmp_path, tokenizer):
    def silent(prompts, budgets, seed):
        return [[tokenizer.eos_token_id] for _ in prompts]

    with pytest.raises(PipelineError, match="data.synthetic: none of the 4 sampled user turns"):
        synthesize(tmp_path, tokenizer, silent, {"code": "x"}, per_domain=4, batch_size=4, max_new_tokens=8,
                   seed=0, stop_ids={tokenizer.eos_token_id})


def test_the_settings_of_a_composed_group_resolve_interpolations_to_the_whole_config():
    """A copy of the group alone lost `${data.shuffle_seed}` (InterpolationKeyError in the prompts stage, after
    validate had passed the config)."""
    from pipeline.config import compose, validate
    from pipeline.config.schema import SyntheticConfig
    from pipeline.data.synthesize import synthetic_settings

    cfg = compose(["data=general", "data.shuffle_seed=7", "data.synthetic.seed=${data.shuffle_seed}"])
    validate(cfg)
    assert synthetic_settings(cfg.data.synthetic)["seed"] == 7
    assert synthetic_settings(SyntheticConfig(seed=3))["seed"] == 3
    assert synthetic_settings({"seed": 4}) == {"seed": 4}
