"""``--reuse_freed_memory`` (host_memory.py): the command line's training keeps freed host memory, so a step's
tensors need no fresh pages; ``--reuse_freed_memory false`` and a program calling ``run`` keep glibc's own policy.

The process-wide allocator setting is observed where it acts: in a fresh Python process that trained one step, the
minor page faults of a step-like churn, 80 blocks of 1 MiB from malloc (what torch's CPU tensors come from) written
and freed, five rounds. glibc's own adaptive thresholds end at 32 MiB for a mapping and 64 MiB free at the heap's
top, so the 80 MiB go back to the system every round (20,480 pages faulted in again); kept, they fault nothing after
the first round. The blocks come from ``malloc`` itself, not from tensors: a tensor's own small allocations, made
between the large ones, can hold the heap's top in place and hide glibc's policy.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from astrai_fabric.host_memory import glibc

CHURN_PAGES = 80 * 2**20 // 4096
"""The pages one round of the churn touches."""

PROGRAM = """
import ctypes, resource, sys

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def churn_faults():
    per_round = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(2**20) for _ in range(80)]
        for block in blocks:
            libc.memset(block, 1, 2**20)
        for block in reversed(blocks):
            libc.free(block)
        per_round.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(per_round[1:])  # the first round maps the memory in either way

how, flags = sys.argv[1], sys.argv[2:]
if how == "command line":
    from astrai_fabric.cli import main
    assert main(["seq", *flags]) == 0
else:  # a program of its own
    from astrai_fabric.cli import parse_train_args
    from astrai_fabric.train import run
    run(parse_train_args("seq", flags)[0])
print(churn_faults())
"""


@pytest.mark.skipif(glibc() is None, reason="the setting is glibc's malloc's (elsewhere it does nothing)")
@pytest.mark.parametrize(
    "how, extra, kept",
    [("command line", [], True), ("command line", ["--reuse_freed_memory", "false"], False), ("program", [], False)],
)
def test_the_command_line_keeps_freed_memory_for_the_next_tensors(tmp_path, how, extra, kept):
    flags = [
        *("--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--ckpt_dir", str(tmp_path)),
        *("--parallel_mode", "none", "--num_workers", "0", "--max_steps", "1", "--window_size", "16", *extra),
    ]
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, how, *flags],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    faults = int(done.stdout.splitlines()[-1])
    if kept:
        assert faults <= CHURN_PAGES // 100, faults
    else:  # glibc's own policy gives the churn back every round
        assert faults >= CHURN_PAGES // 2, faults
