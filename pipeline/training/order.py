"""The run's data order: which store samples every worker trains on at every step. Pure Python and torch.

Epoch e visits the samples in a permutation seeded by (seed, e). With a token budget the permuted samples are
packed, in that order, into micro-batches ("units") of at most `token_budget` tokens; without one every sample is
its own unit. Optimizer step s consumes the global batch of units [s*G, (s+1)*G) of the endless epoch-after-epoch
stream, and worker r's micro-batch m is a fixed slice of it. The order depends only on (samples, seed, budget, G),
never on the world size, so a resumed run (on any world size that divides G) continues the exact same stream.
"""

from __future__ import annotations

import torch


def pack_to_token_budget(order: list[int], lengths: list[int], token_budget: int) -> list[list[int]]:
    """Consecutive runs of `order` whose lengths add up to at most `token_budget` (a longer sample goes alone)."""
    units: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        if current and used + lengths[index] > token_budget:
            units.append(current)
            current, used = [], 0
        current.append(index)
        used += lengths[index]
    if current:
        units.append(current)
    return units


class GlobalOrder:
    def __init__(self, lengths: list[int], global_batch: int, seed: int, token_budget: int = 0):
        self.lengths, self.global_batch, self.seed, self.token_budget = lengths, global_batch, seed, token_budget
        self._epochs: dict[int, list[list[int]]] = {}
        self._counts: list[int] = []  # units per epoch, kept for every epoch seen (the units only for recent ones)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def units(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s units (lists of sample indices) in training order."""
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            permutation = torch.randperm(self.num_samples, generator=generator).tolist()
            units = (pack_to_token_budget(permutation, self.lengths, self.token_budget) if self.token_budget
                     else [[i] for i in permutation])
            self._epochs = {e: u for e, u in self._epochs.items() if e >= epoch - 1}  # keep memory flat
            self._epochs[epoch] = units
        return self._epochs[epoch]

    def _units_in(self, epoch: int) -> int:
        if not self.token_budget:
            return self.num_samples
        while len(self._counts) <= epoch:
            self._counts.append(len(self.units(len(self._counts))))
        return self._counts[epoch]

    def _locate(self, position: int) -> tuple[int, int]:
        """(epoch, offset) of unit `position` of the stream."""
        if not self.token_budget:
            return divmod(position, self.num_samples)
        epoch = 0
        while position >= self._units_in(epoch):
            position -= self._units_in(epoch)
            epoch += 1
        return epoch, position

    def epoch(self, step: int) -> int:
        """The epoch of the first unit of 0-based optimizer step `step`."""
        return self._locate(step * self.global_batch)[0]

    def micro_batch(self, step: int, micro: int, accum: int, rank: int, world: int) -> list[int]:
        """Sample indices of worker `rank`'s micro-batch `micro` at 0-based optimizer step `step`."""
        per_worker = self.global_batch // (accum * world)
        start = step * self.global_batch + (micro * world + rank) * per_worker
        indices = []
        for position in range(start, start + per_worker):
            epoch, offset = self._locate(position)
            indices += self.units(epoch)[offset]
        return indices
