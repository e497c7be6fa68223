"""The pipeline's schedules by what they run on a rank (no torch: the flags are checked before it is imported)."""

from __future__ import annotations

INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "looped_bfs")
"""Schedules that run several stages on each rank (``--pp_stages_per_rank``); the others run one."""


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """The stages each pipeline rank holds: ``requested`` (``--pp_stages_per_rank``), else 2 under an interleaved
    schedule (the fewest it interleaves) and 1 under any other."""
    if requested is not None:
        return requested
    return 2 if schedule in INTERLEAVED_SCHEDULES else 1


def stages_of_rank(rank: int, num_ranks: int, stages_per_rank: int) -> range:
    """The stages pipeline rank ``rank`` of ``num_ranks`` holds, looped as torch's multi-stage schedules place them
    (stage s on rank s mod num_ranks): ``rank``, ``rank + num_ranks``, ... of ``num_ranks`` x ``stages_per_rank``."""
    return range(rank, num_ranks * stages_per_rank, num_ranks)
