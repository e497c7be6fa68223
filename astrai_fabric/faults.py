"""Fault injection for the crash-safety tests: ``crash_point(POINT)`` marks a place where a power cut must leave
nothing half-written. A leaf module (it imports nothing of the package), so marking a point costs its importer
nothing: ``data.prepare`` marks its own without loading the checkpoint format or the model."""

from __future__ import annotations

import os
import signal

CRASH_ENV = "ASTRAI_FABRIC_CRASH_AT"

_crash_counts: dict[str, int] = {}


def crash_point(point: str) -> None:
    """Test hook for crash safety: ``ASTRAI_FABRIC_CRASH_AT=POINT@N`` kills this process with SIGKILL, as a power
    cut would, the N-th time it reaches POINT. A checkpoint save has ``meta``, ``weights`` and ``extra`` (after
    writing those files) and ``rename`` (everything written and synced, just before the rename that completes the
    checkpoint), ``checkpoint/files.py``; ``prepare`` has, in the order a shard is published, ``prepare-shard-open``
    (its folder made), ``prepare-shard-data`` (its arrays synced), ``prepare-synced`` (a ``meta.json`` or the
    state written beside its place, not yet renamed into it), ``prepare-shard-meta`` (the shard whole, the state
    not yet saying so) and ``prepare-shard`` (the state saved), then ``prepare-output`` (the output renamed into
    place, the staging folder not yet removed), and ``prepare-worker`` in each tokenising process
    (``data/shard_writer.py``, ``data/prepare.py``, ``data/parallel.py``)."""
    wanted = os.environ.get(CRASH_ENV)
    if wanted and wanted.partition("@")[0] == point:
        _crash_counts[point] = _crash_counts.get(point, 0) + 1
        if str(_crash_counts[point]) == (wanted.partition("@")[2] or "1"):
            os.kill(os.getpid(), signal.SIGKILL)
