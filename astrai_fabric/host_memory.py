"""Host memory that tensors free, kept by glibc's malloc for the next ones (``--reuse_freed_memory``).

A training step frees and allocates the same tensors every step (activations, gradients, the loss's buffers). Left
to itself, glibc's malloc hands the top of its heap back to the system whenever more than its trim threshold lies
free there, and serves blocks above its mmap threshold with mappings of their own, unmapped when freed; either way
the next step's tensors land on fresh pages, which the kernel faults in and zeroes one 4 KiB page at a time. Its
adaptive thresholds (the mmap threshold rises to the largest mapping freed so far, up to 32 MiB, the trim threshold
to twice that) stay below one step's churn: the 5M-parameter model of ``bench/step_overhead.py`` took 2,300-3,700
page faults a step, 0.3-1% of its step on CPU (docs/performance.md); with the thresholds set here, 86.

The cost: memory freed below the mmap threshold stays in the process, up to ``TRIM_THRESHOLD_BYTES`` at the heap's
top, so its resident size after a peak (loading a checkpoint, say) does not fall back. Only the command line sets it,
as it sets ``--num_threads``: a program that calls ``run`` or ``train`` keeps its own allocator's settings.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h)."""
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""Blocks from 32 MiB up still get mappings of their own, given back when freed: glibc's own ceiling for its
adaptive threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``). Setting it fixes the threshold there at once,
where glibc would raise it only as mappings are freed, and stops the adaptation, which would lower the trim
threshold again."""
TRIM_THRESHOLD_BYTES = 2**30
"""Free memory up to 1 GiB stays at the heap's top: more than one step's tensors below the mmap threshold need."""


def glibc() -> ctypes.CDLL | None:
    """The C library this process runs on where it is glibc, else None (musl and others: ``mallopt``'s parameters
    are glibc's)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def reuse_freed_memory() -> bool:
    """Keep freed host memory for reuse (the module docstring): returns whether the allocator took the setting,
    False where the C library is not glibc (nothing is changed there)."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
