"""Real multi-process runs on CPU/gloo inside pytest: the spawn + environment pattern.

Each worker process sets the variables a launcher would (``LOCAL_RANK`` among them), so Lightning sees processes
that already exist and ``fabric.launch()`` runs the function in place instead of re-executing pytest
(Lightning's launcher re-runs ``sys.argv``).
A failing assertion or exception in any worker fails ``run_ranks``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    fn(*args)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes forming one gloo group; ``fn`` must be importable."""
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, start_method="spawn")
