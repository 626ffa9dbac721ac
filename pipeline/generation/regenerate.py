"""Self-distillation, backend-agnostic: the verifier answers every user turn of a conversation in turn.

A multi-turn chat is regenerated round by round: round r asks each conversation's r-th question, with the
verifier's own earlier answers as history, so every trained token is one the verifier itself would produce. The
sample's ids are the last round's prompt (earlier answers masked in) followed by the exact generated ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from pipeline.data.chat import TemplateNotPrefixStable, tokenize_conversation

# Fewer free positions than this after a prompt leave no room for a useful answer.
MIN_RESPONSE_ROOM = 8

# generate(prompt ids, per-prompt token budgets) -> response ids (ending with a stop id when the verifier stopped)
GenerateFn = Callable[[list[list[int]], list[int]], list[list[int]]]


@dataclass
class Limits:
    max_new_tokens: int
    max_length: int
    overlength: str  # "truncate": keep what fits; "drop": skip the sample


@dataclass
class _Conversation:
    source: list[dict[str, str]]
    turn_ends: list[int]
    history: list[dict[str, str]] = field(default_factory=list)
    consumed: int = 0
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    skip_reason: str = ""
    truncated: bool = False
    done: bool = False


def _answered_turns(conversation: _Conversation) -> int:
    return sum(1 for m in conversation.history if m["role"] == "assistant")


def _stop(conversation: _Conversation, reason: str, limits: Limits) -> None:
    """A turn does not fit: keep the earlier turns (truncate) or skip the sample (drop)."""
    conversation.done = True
    if limits.overlength == "truncate" and _answered_turns(conversation) > 0:
        conversation.truncated = True
    else:
        conversation.skip_reason = reason


def regenerate_conversations(
    conversations: list[list[dict[str, str]]], tokenizer: Any, generate: GenerateFn, limits: Limits,
    stop_token_ids: Collection[int],
) -> list[dict]:
    """One row per conversation: {messages, input_ids, loss_mask, skip_reason, truncated}.

    stop_token_ids: the ids that end the verifier's answer (generation.verifier.stop_token_ids); an answer without
    one ran out of room. A conversation whose earlier turns the chat template cannot be masked in is skipped with
    that reason; the others go on."""
    states = [_Conversation(source=list(c), turn_ends=[i + 1 for i, m in enumerate(c) if m["role"] == "user"])
              for c in conversations]
    while True:
        queued = []
        for state in states:
            if state.done:
                continue
            turn = _answered_turns(state)
            if turn >= len(state.turn_ends):
                state.done = True
                continue
            end = state.turn_ends[turn]
            history = state.history + [m for m in state.source[state.consumed:end] if m["role"] != "assistant"]
            try:
                prompt, mask = tokenize_conversation(tokenizer, history, add_generation_prompt=True)
            except TemplateNotPrefixStable as reason:
                state.done, state.skip_reason = True, str(reason)
                continue
            room = min(limits.max_new_tokens, limits.max_length - len(prompt))
            if room < MIN_RESPONSE_ROOM:
                _stop(state, f"prompt of {len(prompt)} tokens (turn {turn + 1}) leaves no room within "
                             f"generation.max_length={limits.max_length}", limits)
                continue
            queued.append((state, history, end, prompt, mask, room))
        if not queued:
            break
        responses = generate([q[3] for q in queued], [q[5] for q in queued])
        for (state, history, end, prompt, mask, room), response in zip(queued, responses):
            stopped = any(token in stop_token_ids for token in response)
            cut_by_length = room < limits.max_new_tokens and len(response) >= room and not stopped
            if cut_by_length and limits.overlength == "drop":
                state.done, state.skip_reason = True, (
                    f"the answer to turn {_answered_turns(state) + 1} does not fit in "
                    f"generation.max_length={limits.max_length}")
                continue
            text = tokenizer.decode(response, skip_special_tokens=True)
            state.history = history + [{"role": "assistant", "content": text}]
            state.consumed = end
            state.input_ids, state.loss_mask = prompt + response, mask + [1] * len(response)
            if cut_by_length:
                state.truncated, state.done = True, True
    return [_result(s) for s in states]


def _result(state: _Conversation) -> dict:
    if state.skip_reason:  # a skipped sample carries no tokens: nothing of it is trained on
        return {"messages": state.source, "input_ids": [], "loss_mask": [], "skip_reason": state.skip_reason,
                "truncated": False}
    return {"messages": state.history, "input_ids": state.input_ids, "loss_mask": state.loss_mask,
            "skip_reason": "", "truncated": state.truncated}


def keep_conversation(messages: list[dict[str, str]], tokenizer: Any, limits: Limits) -> dict:
    """`generation.responses=keep`: train on the source's own assistant turns (no verifier generation)."""
    if not any(m["role"] == "assistant" for m in messages):
        return {"messages": messages, "input_ids": [], "loss_mask": [], "truncated": False,
                "skip_reason": "no assistant turn to train on (generation.responses=keep)"}
    try:
        input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
    except TemplateNotPrefixStable as reason:
        return {"messages": messages, "input_ids": [], "loss_mask": [], "truncated": False, "skip_reason": str(reason)}
    truncated = len(input_ids) > limits.max_length
    if truncated and (limits.overlength == "drop" or sum(loss_mask[: limits.max_length]) == 0):
        return {"messages": messages, "input_ids": [], "loss_mask": [], "truncated": False,
                "skip_reason": f"{len(input_ids)} tokens exceed generation.max_length={limits.max_length}"}
    return {"messages": messages, "input_ids": input_ids[: limits.max_length],
            "loss_mask": loss_mask[: limits.max_length], "skip_reason": "", "truncated": truncated}
