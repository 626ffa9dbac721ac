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
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos]:  # a template writing {{ bos_token }} and a tokenizer adding it
        ids = ids[1:]
    return ids


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


class TemplateNotPrefixStable(PipelineError):
    """An assistant turn cannot be found in the conversation's final rendering: the sample is skipped (the message
    is its counted reason), never trained on with a wrong mask."""


# Appended to an assistant turn to find where its content ends; two, in case a turn ends like one of them.
_END_PROBES = (" \u2042", " \u2063\u2042")


def _common_suffix(a: list[int], b: list[int]) -> int:
    count = 0
    while count < min(len(a), len(b)) and a[-1 - count] == b[-1 - count]:
        count += 1
    return count


def _content_end(tokenizer: Any, messages: list[dict[str, str]], index: int, add_generation_prompt: bool,
                 rendered: list[int]) -> int:
    """Position in `rendered` (messages rendered in full) just after assistant turn `index`'s content: everything
    after it renders alike when only that content changes."""
    suffixes = []
    for probe in _END_PROBES:
        changed = [*messages[:index], {**messages[index], "content": messages[index]["content"] + probe},
                   *messages[index + 1:]]
        suffixes.append(_common_suffix(rendered, _template_ids(tokenizer, changed, add_generation_prompt)))
    return len(rendered) - min(suffixes)


def _assistant_span(tokenizer: Any, messages: list[dict[str, str]], index: int, add_generation_prompt: bool,
                    rendered: list[int]) -> tuple[int, int]:
    """[start, end) of assistant turn `index` (its content and end marker) in `rendered`, the whole conversation's
    rendering. A prefix-stable template renders the turn as it does when the turn comes last (ChatML, Llama 3).
    Others render earlier turns differently (Qwen3 drops the reasoning of turns before the last user turn): then
    the turn is located in the final rendering itself, its end marker being what follows its content when it
    comes last. Raises TemplateNotPrefixStable when it cannot be located."""
    prompt = _template_ids(tokenizer, messages[:index], add_generation_prompt=True)
    start = len(prompt)
    as_last = _template_ids(tokenizer, messages[: index + 1], add_generation_prompt=False)
    if rendered[: len(as_last)] == as_last and as_last[:start] == prompt:
        return start, len(as_last)
    end_marker = as_last[_content_end(tokenizer, messages[: index + 1], index, False, as_last):]
    content_end = _content_end(tokenizer, messages, index, add_generation_prompt, rendered)
    located = rendered[:start] == prompt and content_end >= start
    if not located or rendered[content_end: content_end + len(end_marker)] != end_marker:
        # one reason for every turn and sample, so the skipped samples are counted together
        raise TemplateNotPrefixStable("the chat template renders an assistant turn differently later in the "
                                      "conversation, where it cannot be located (not prefix-stable)")
    return start, content_end + len(end_marker)


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss_mask = 1 on every assistant turn's tokens (content and end marker), as the
    conversation renders in full (`_assistant_span`).

    With add_generation_prompt the ids end with the assistant prompt, ready for the verifier to answer: the mask
    then marks the earlier assistant turns of a multi-turn conversation. Raises PipelineError without a chat
    template or, without add_generation_prompt, an assistant turn; TemplateNotPrefixStable when a turn cannot be
    located.
    """
    if not add_generation_prompt and not any(m["role"] == "assistant" for m in messages):
        raise PipelineError("conversation has no assistant turn to train on")
    if tokenizer.chat_template is None:
        raise PipelineError("verifier: the tokenizer has no chat template")
    input_ids = _template_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    loss_mask = [0] * len(input_ids)
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = _assistant_span(tokenizer, messages, index, add_generation_prompt, input_ids)
            loss_mask[start:end] = [1] * (end - start)
    return input_ids, loss_mask
