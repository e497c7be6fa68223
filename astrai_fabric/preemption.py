"""Stopping on request: SIGTERM (SLURM, Kubernetes, ``docker stop``) or SIGINT (Ctrl-C) ends a run cleanly.

The handler only records the signal. ``fit`` shares the record with every rank in the collective it already runs
at each optimizer step, so a signal to any one rank stops all of them after the same step; then the run saves a
checkpoint and exits 0. A second Ctrl-C stops at once. AstrAI stops before the next micro-batch instead, leaving an
accumulation window half done; we finish the optimizer step, so the checkpoint is an ordinary one.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """``with StopRequest() as stop:`` installs the handlers (main thread only) and restores the previous ones."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        """The signal this process received."""
        self.honoured = False
        """Set by ``fit`` when a request on any rank ended the run."""
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # a second Ctrl-C: the user will not wait for the step to finish
        self.signal_name = signal.Signals(signum).name


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """``worker_init_fn`` of the data loaders: workers leave SIGTERM/SIGINT to the training process, which shuts
    them down after its final checkpoint (a worker killed by a job-wide SIGTERM would fail the run instead)."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
