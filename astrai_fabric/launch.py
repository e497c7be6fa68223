"""The command line's own launcher of a machine's ranks (``--nprocs N``), and what ends them when the run fails.

It starts ranks 1..N-1 as the same command, with the environment Lightning's launcher gives its children
(``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``), and marks itself local rank 0, so
the Fabric it builds next finds its processes created (Lightning's ``LightningEnvironment``: ``LOCAL_RANK`` set) and
joins them. The ranks behave as under Lightning's launcher; the difference is the ending. Lightning's watcher
SIGKILLs the launching process when a child dies: exit 137 and no word, whenever it polls before the launching
process has noticed the loss itself. Here:

- a rank that ends badly leaves the launching process its own moment to notice (``NOTICE_S``; over gloo a dead peer
  fails the next collective at once) and say so in its one line; failing that, the watcher says it, in the same
  words, and exits 1;
- when the launching process fails, every rank it started ends: given ``END_GRACE_S`` to finish on its own (and
  print why, when it failed first), then killed, a stopped one (SIGSTOP) included, which would otherwise outlive the
  run;
- on success it waits for its ranks to exit (they passed the run's last barrier), killing one stuck in its
  teardown after ``EXIT_S``.

Programs that call ``train.run`` keep Lightning's launcher, which starts their own script again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from lightning.fabric.plugins.environments.lightning import find_free_network_port

NOTICE_S = 10.0
"""How long a dead rank's loss is left to the launching process to notice and report before the watcher does."""
END_GRACE_S = 10.0
"""How long a failed run's other ranks get to end on their own before they are killed."""
EXIT_S = 60.0
"""How long a finished run's ranks get to exit."""
POLL_S = 0.5
RANK_VARIABLE = "LOCAL_RANK"
"""Set in every rank a launcher started (this one, torchrun, ``fabric run``): such a process launches nothing."""
ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", RANK_VARIABLE)
"""What the ranks read, set here for this process and its children (and restored when the run ends)."""


class LocalRanks:
    """The ranks this process started on its machine, watched: see the module docstring."""

    def __init__(
        self, procs: list[subprocess.Popen], report: Callable[[str], str], environment: dict[str, str | None]
    ) -> None:
        """``environment``: the variables this process had before it became rank 0, put back at the end."""
        self.procs = procs
        self._report = report
        self._environment = environment
        self._ending = threading.Event()
        threading.Thread(target=self._watch, name="astrai-fabric-rank-watcher", daemon=True).start()

    def _watch(self) -> None:
        while not self._ending.wait(POLL_S):
            ranked = enumerate(self.procs, start=1)
            lost = next(((rank, proc) for rank, proc in ranked if proc.poll() not in (None, 0)), None)
            if lost is None:
                continue
            if self._ending.wait(NOTICE_S):  # the launching process noticed, and is ending the run itself
                return
            rank, proc = lost
            print(f"astrai-fabric: error: {self._report(f'local rank {rank} {_ended(proc)}')}", file=sys.stderr)
            sys.stderr.flush()
            self._kill_all()
            os._exit(1)

    def end(self) -> None:
        """The run failed here: each rank gets ``END_GRACE_S`` (in all) to end on its own, then is killed."""
        self._ending.set()
        self._wait(END_GRACE_S)
        self._kill_all()
        self._restore()

    def join(self) -> None:
        """The run succeeded here: wait for the ranks to exit (the watcher still reports one that fails). One still
        there after ``EXIT_S`` is stuck in its teardown, its work done (every rank passed the run's last barrier):
        it is killed, and said so."""
        for rank in self._wait(EXIT_S):
            print(f"astrai-fabric: local rank {rank} still ran {EXIT_S:g} s after the run; killed", file=sys.stderr)
        self._ending.set()
        self._kill_all()
        self._restore()

    def _restore(self) -> None:
        for name, value in self._environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def _wait(self, seconds: float) -> list[int]:
        """Wait up to ``seconds`` in all for the ranks to exit; those still running."""
        deadline, running = time.monotonic() + seconds, []
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.append(rank)
        return running

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
                proc.wait()


def _ended(proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code < 0:
        return f"(pid {proc.pid}) was killed by {signal.Signals(-code).name}"
    return f"(pid {proc.pid}) exited with code {code}"


def start_local_ranks(
    num_local_ranks: int, num_nodes: int, argv: list[str], report: Callable[[str], str]
) -> LocalRanks | None:
    """Start local ranks 1..``num_local_ranks``-1 as ``python -m astrai_fabric argv`` and make this process local
    rank 0. ``argv``: the command that started the run (not ``sys.argv``, another program's where the CLI runs inside
    one); ``report(what)``: the line that says the run lost a rank, ``what`` saying which and how. None where a
    launcher started this process (it joins the others) or where it is the only rank on its machine and no other
    machine takes part (nothing to launch)."""
    if RANK_VARIABLE in os.environ or (num_local_ranks == 1 and num_nodes == 1):
        return None
    saved = {name: os.environ.get(name) for name in ENVIRONMENT}
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_network_port()))
    os.environ.setdefault("NODE_RANK", "0")
    os.environ["WORLD_SIZE"] = str(num_local_ranks * num_nodes)
    command = [sys.executable, "-m", "astrai_fabric", *argv]
    procs = [
        subprocess.Popen(command, env={**os.environ, RANK_VARIABLE: str(rank)}) for rank in range(1, num_local_ranks)
    ]
    os.environ[RANK_VARIABLE] = "0"
    return LocalRanks(procs, report, saved)
