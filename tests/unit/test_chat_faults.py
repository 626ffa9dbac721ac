"""Chat faults seen when the verifier family changes (issue: Qwen3, Qwen3-MoE and Gemma verifiers): a template that
is not prefix-stable, several end-of-turn ids, a template that writes the BOS itself. Each of them once aborted a
stage or trained on the wrong tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, GenerationConfig

from pipeline.data.chat import TemplateNotPrefixStable, prompt_ids, tokenize_conversation
from pipeline.generation.regenerate import Limits, keep_conversation, regenerate_conversations
from pipeline.verifier import cut_after_stop, stop_token_ids, verifier_stop_token_ids

TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tiny-tokenizer"

# ChatML that, like Qwen3's template, drops the reasoning of every assistant turn before the last user turn.
DROPS_EARLIER_REASONING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
# A template that leaves earlier assistant turns out altogether: nothing of them can be located.
DROPS_EARLIER_ANSWERS = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}"
    "{%- for m in messages -%}"
    "{%- if not (m.role == 'assistant' and loop.index0 < ns.last_user) -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif -%}"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
# Gemma-style: the template writes the BOS itself.
WRITES_BOS = ("{{ bos_token }}{%- for m in messages -%}"
              "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
              "{% endfor -%}{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}")


def tokenizer_with(template: str):
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.chat_template = template
    return tokenizer


def trained_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


THINKING_CHAT = [
    {"role": "user", "content": "first question"},
    {"role": "assistant", "content": "<think>\nsecret plan\n</think>\n\nanswer one"},
    {"role": "user", "content": "second question"},
    {"role": "assistant", "content": "<think>\nmore thought\n</think>\n\nanswer two"},
]


def test_a_template_dropping_earlier_reasoning_is_masked_against_the_final_rendering():
    tokenizer = tokenizer_with(DROPS_EARLIER_REASONING)
    ids, mask = tokenize_conversation(tokenizer, THINKING_CHAT)  # refused as not prefix-stable before
    assert "secret plan" not in tokenizer.decode(ids)  # the template really dropped it
    assert trained_text(tokenizer, ids, mask) == (
        "answer one<|im_end|>\n<think>\nmore thought\n</think>\n\nanswer two<|im_end|>\n")
    # every masked token is one of the final rendering's, in place: the mask and the ids have one length
    assert len(mask) == len(ids) and ids == tokenizer.apply_chat_template(THINKING_CHAT, tokenize=True)["input_ids"]


def scripted(tokenizer, answers: list[str], stop: int):
    def generate(prompts, budgets):
        answer = answers[generate.calls]
        generate.calls += 1
        return [(tokenizer.encode(answer) + [stop])[:budget] for budget in budgets]

    generate.calls = 0
    return generate


def test_regeneration_with_a_thinking_template_keeps_the_multi_turn_sample():
    tokenizer = tokenizer_with(DROPS_EARLIER_REASONING)
    answers = ["<think>\nsecret plan\n</think>\n\nanswer one", "<think>\nmore\n</think>\n\nanswer two"]
    eos = tokenizer.eos_token_id
    [row] = regenerate_conversations([THINKING_CHAT], tokenizer, scripted(tokenizer, answers, eos),
                                     Limits(64, 512, "truncate"), (eos,))
    assert row["skip_reason"] == ""
    trained = trained_text(tokenizer, row["input_ids"], row["loss_mask"])
    assert trained.startswith("answer one<|im_end|>") and "secret plan" not in trained
    assert row["input_ids"][-1] == eos and trained.endswith("answer two<|im_end|>")


def test_a_turn_that_cannot_be_located_skips_that_sample_with_a_reason_not_the_stage():
    tokenizer = tokenizer_with(DROPS_EARLIER_ANSWERS)
    with pytest.raises(TemplateNotPrefixStable, match="an assistant turn"):
        tokenize_conversation(tokenizer, THINKING_CHAT)
    eos = tokenizer.eos_token_id
    single = [{"role": "user", "content": "only question"}]
    rows = regenerate_conversations([THINKING_CHAT, single], tokenizer,
                                    scripted(tokenizer, ["answer one", "answer two", "answer three"], eos),
                                    Limits(64, 512, "truncate"), (eos,))
    assert "not prefix-stable" in rows[0]["skip_reason"] and rows[0]["input_ids"] == []
    assert rows[1]["skip_reason"] == "" and rows[1]["input_ids"][-1] == eos
    kept = keep_conversation(THINKING_CHAT, tokenizer, Limits(64, 512, "truncate"))
    assert "not prefix-stable" in kept["skip_reason"]


def test_a_template_writing_the_bos_gives_one_bos():
    tokenizer = tokenizer_with(WRITES_BOS)
    bos = tokenizer.bos_token_id
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for ids in (prompt_ids(tokenizer, chat[:1]), tokenize_conversation(tokenizer, chat)[0]):
        assert ids[0] == bos and ids[1] != bos


def test_stop_ids_are_the_tokenizer_eos_and_every_generation_config_eos(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    eos = tokenizer.eos_token_id
    assert stop_token_ids(tokenizer) == (eos,)
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=[eos, 7, 9])) == (eos, 7, 9)
    assert stop_token_ids(tokenizer, GenerationConfig(eos_token_id=7)) == (eos, 7)
    folder = tmp_path / "verifier"
    shutil.copytree(TINY_TOKENIZER, folder)
    assert verifier_stop_token_ids(str(folder), tokenizer) == (eos,)  # no generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 5]}))
    assert verifier_stop_token_ids(str(folder), tokenizer) == (eos, 5)
    assert cut_after_stop([3, 4, 5, 6, eos], (eos, 5)) == [3, 4, 5]


@pytest.fixture
def two_stop_verifier(tiny_verifier_path, tmp_path):
    """The tiny verifier with a generation config that lists a second end-of-turn id: the token its greedy answer
    to PROMPT gives fourth (and not before)."""
    from pipeline.evaluation.reference_decoder import verifier_greedy
    from pipeline.verifier import load_verifier

    verifier, tokenizer = load_verifier(tiny_verifier_path)
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": "Tell me a story."}])
    answer = verifier_greedy(verifier, prompt, 12, (tokenizer.eos_token_id,))
    stop = next(t for i, t in enumerate(answer) if i >= 3 and t not in answer[:i] and t != tokenizer.eos_token_id)
    folder = tmp_path / "two-stops"
    shutil.copytree(tiny_verifier_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, stop]}))
    return str(folder), prompt, answer, stop


def test_every_decoder_stops_on_every_listed_stop_id(two_stop_verifier):
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder, greedy_mismatches, verifier_greedy
    from pipeline.generation.hf_backend import HFVerifier
    from tests.unit.test_reference_decoder import drafter_for

    path, prompt, answer, stop = two_stop_verifier
    expected = answer[: answer.index(stop) + 1]
    backend = HFVerifier(path, "float32", threads=1)
    stops = backend.stop_token_ids
    assert stop in stops
    assert backend.generate([prompt], [12], temperature=0.0, top_p=1.0, seed=0) == [expected]
    assert verifier_greedy(backend.model, prompt, 12, stops) == expected
    drafter = drafter_for(path, backend.model, backend.tokenizer)
    tokens, _ = SpeculativeDecoder(backend.model, drafter, 4).generate(prompt, 12, stops)
    assert tokens == expected
    assert greedy_mismatches(backend.model, [prompt], [expected], 12, stops) == []
    # with the tokenizer's eos alone the same output looks cut short: the fault this fixes
    assert greedy_mismatches(backend.model, [prompt], [expected], 12, (backend.tokenizer.eos_token_id,)) == [0]
