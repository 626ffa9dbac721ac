"""Token-budget batching: group samples so each verifier batch holds at most `max_tokens` (padded) tokens."""

from __future__ import annotations


def pack_by_token_budget(lengths: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Index lists over `lengths`. Longest first, so neighbours have similar lengths and padding stays small; a
    batch's cost is rows × its longest row. A sample longer than the budget gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and ((len(current) + 1) * longest > max_tokens or len(current) >= max_rows):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
