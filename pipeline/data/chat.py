"""Chat templating with the verifier's own template, and loss masks on assistant tokens."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.errors import PipelineError


def chat_template_hash(tokenizer: Any) -> str:
    template = tokenizer.chat_template or ""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of the vocabulary, special tokens and chat template: equal fingerprints tokenize text identically."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    text = json.dumps([vocabulary, special, tokenizer.chat_template or ""], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def turn_prompts(messages: list[dict[str, str]]) -> list[int]:
    """Indexes at which the verifier answers: after every user turn (a multi-turn chat is regenerated turn by turn).
    Assistant turns of the source are dropped; only the verifier's own answers are trained on."""
    return [index + 1 for index, message in enumerate(messages) if message["role"] == "user"]


def _template_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    # transformers 5 returns a BatchEncoding for tokenize=True; older versions a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation without its trailing assistant turns: what the verifier is asked to answer."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation followed by the assistant generation prompt."""
    if tokenizer.chat_template is None:
        raise PipelineError("verifier: the tokenizer has no chat template")
    return _template_ids(tokenizer, messages, add_generation_prompt=True)


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask = 1 on every assistant turn's tokens (content and end marker).

    With add_generation_prompt the ids end with the assistant prompt, ready for the verifier to answer: the mask
    then marks the earlier assistant turns of a multi-turn conversation. Each assistant turn's span is found by
    rendering the prefixes, which requires a prefix-stable template (ChatML, Llama 3, Qwen are); anything else is
    refused rather than masked wrongly.
    """
    if not add_generation_prompt and not any(m["role"] == "assistant" for m in messages):
        raise PipelineError("conversation has no assistant turn to train on")
    if tokenizer.chat_template is None:
        raise PipelineError("verifier: the tokenizer has no chat template")
    input_ids = _template_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    loss_mask = [0] * len(input_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:index], add_generation_prompt=True))
        upto = _template_ids(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if input_ids[: len(upto)] != upto:
            raise PipelineError("verifier: its chat template is not prefix-stable; cannot mask assistant turns")
        for position in range(start, len(upto)):
            loss_mask[position] = 1
    return input_ids, loss_mask
