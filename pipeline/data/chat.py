"""Chat templating with the verifier's own template, and loss masks on assistant tokens."""

from __future__ import annotations

import hashlib
from typing import Any

from pipeline.errors import PipelineError


def chat_template_hash(tokenizer: Any) -> str:
    template = tokenizer.chat_template or ""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]


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


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask = 1 on every assistant turn's tokens (content and end marker).

    Each assistant turn's span is found by rendering the prefixes, which requires a prefix-stable template
    (ChatML, Llama 3, Qwen are); anything else is refused rather than masked wrongly.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise PipelineError("conversation has no assistant turn to train on")
    input_ids = _template_ids(tokenizer, messages, add_generation_prompt=False)
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
