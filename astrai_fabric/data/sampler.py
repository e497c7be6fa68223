"""``ResumableSampler``: AstrAI's distributed sampler order, resumable at any sample
(AstrAI's ``astrai/dataset/sampler.py``).

Epoch ``e`` shuffles with ``randperm(N, seed + e)``, pads by wrapping around to a multiple of the data-parallel
ranks ``R``, and gives rank ``r`` the positions ``r, r + R, r + 2R, ...`` (``torch.utils.data.DistributedSampler``'s
order). So ``R`` ranks with ``B`` samples each see, step by step, the same samples as one rank with ``R * B``:
changing the number of ranks does not change the data stream. ``set_position(epoch, index)`` resumes mid-epoch; the
rank, number of ranks and seed are explicit, not read from a process group.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, rank: int = 0, num_dp_ranks: int = 1, seed: int = 0, shuffle: bool = True):
        self.num_samples, self.rank, self.num_dp_ranks = num_samples, rank, num_dp_ranks
        self.seed, self.shuffle = seed, shuffle
        self.samples_per_rank = math.ceil(num_samples / num_dp_ranks)
        self.epoch, self.index = 0, 0

    def set_position(self, epoch: int, index: int = 0) -> None:
        """Start epoch ``epoch`` at this rank's ``index``-th sample (0 = the beginning)."""
        if not 0 <= index <= self.samples_per_rank:
            raise ValueError(f"index {index} outside [0, {self.samples_per_rank}]")
        self.epoch, self.index = epoch, index

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's whole epoch, in order."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.samples_per_rank * self.num_dp_ranks
        order += (order * math.ceil(total / max(len(order), 1)))[: total - len(order)]  # wrap-around padding
        return order[self.rank : total : self.num_dp_ranks]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices(self.epoch)[self.index :])

    def __len__(self) -> int:
        return self.samples_per_rank - self.index
