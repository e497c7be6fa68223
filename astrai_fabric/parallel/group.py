"""A process group and this rank's place in it: what the model's seams (``ContextGroup``, ``ExpertGroup``) are filled
with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import torch.distributed as dist


@dataclass(frozen=True)
class RanksOf:
    """The ranks of ``group``: how many, and this rank's index among them."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Self:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))
