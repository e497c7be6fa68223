"""``--profile_steps A:B``: a torch.profiler trace of optimizer steps A to B and, on CUDA, a memory snapshot.

The profiler wraps the training batches (``StepProfiler.steps_of``), so the loop itself carries no profiling code:
optimizer step S is the span from fetching its first micro-batch to fetching the next step's, and holds its data
loading, forward and backward passes, optimizer step, logging and any checkpoint. Each span is marked in the
trace as ``optimizer_step S``. A run without ``--profile_steps`` creates no profiler and wraps nothing.

Files, one per rank, under ``ckpt_dir/profile/steps_A-B/`` (the layout TensorBoard's profiler plugin reads: one
run per folder, ``<worker>.pt.trace.json`` per worker):

- ``rank{R}.pt.trace.json``: Chrome trace format, for https://ui.perfetto.dev, ``chrome://tracing`` or
  ``tensorboard --logdir ckpt_dir/profile`` with the ``torch-tb-profiler`` plugin;
- ``rank{R}.memory.pickle`` (CUDA only): the allocator's history, for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from torch.profiler import ProfilerActivity, profile, record_function

from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.torch_private import dump_memory_snapshot, record_memory_history, stop_memory_history

PROFILE_DIR = "profile"
"""Where traces go, under ``ckpt_dir``."""
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events the CUDA memory snapshot keeps (the newest ones; torch's example uses the same)."""


def describe_profiling(steps: tuple[int, int] | None, ckpt_dir: str, last_step: int | None = None) -> str | None:
    """The plan's line on profiling optimizer ``steps`` ``(first, last)`` (``--profile_steps``); None when off.
    With the run's ``last_step`` (``StepPlan.last_step``, else ``--max_steps``), a range the run never reaches says
    so, rather than profiling nothing in silence."""
    if steps is None:
        return None
    first, last = steps
    what = "a torch.profiler trace per rank (and on CUDA a memory snapshot)"
    line = f"steps {first} to {last}: {what} in {profile_dir(steps, ckpt_dir)}"
    if last_step is None:  # the dry run could not count the steps
        return line
    if first > last_step:
        line += (
            f"\nwarning: steps {first} to {last} are past this run's last step {last_step}: nothing will be profiled"
        )
    elif last > last_step:
        missed = f"step {last}" if last == last_step + 1 else f"steps {last_step + 1} to {last}"
        line += f"\nwarning: this run's last step is {last_step}: {missed} will not be profiled"
    return line


def profile_dir(steps: tuple[int, int] | None, ckpt_dir: str) -> Path:
    first, last = steps or (0, 0)
    return Path(ckpt_dir).resolve() / PROFILE_DIR / f"steps_{first}-{last}"


class StepProfiler:
    """Profiles optimizer steps ``first`` to ``last`` (inclusive) of the batches it wraps; ``position`` is the run's
    live position (the loop updates ``optimizer_step`` in place), which says which step a fetched batch starts."""

    def __init__(self, fabric: Fabric, steps: tuple[int, int], ckpt_dir: str, position: RunPosition) -> None:
        self.first, self.last = steps
        self.fabric = fabric
        self.position = position
        self.directory = profile_dir(steps, ckpt_dir)
        self.cuda = fabric.device.type == "cuda"
        self._profiler: profile | None = None
        self._marker: tuple[int, Any] | None = None  # (step, its open record_function)
        self._done = False

    @classmethod
    def for_run(
        cls, fabric: Fabric, steps: tuple[int, int] | None, ckpt_dir: str, position: RunPosition
    ) -> StepProfiler | None:
        """A profiler when ``--profile_steps`` asks for one (``steps``: ``(first, last)``, else None), else None."""
        return cls(fabric, steps, ckpt_dir, position) if steps is not None else None

    def steps_of(self, batches: Iterable[Any]) -> Iterable[Any]:
        """``batches``, iterable once per epoch like them, with the profiled steps recorded."""
        return _Profiled(self, batches)

    def before_fetch(self) -> None:
        """Called before each micro-batch is fetched: ends the step that finished, starts the one that begins."""
        if self._done:
            return
        finished = self.position.optimizer_step
        if self._marker is not None and finished >= self._marker[0]:
            self._end_marker()
        if finished >= self.last:
            self.close()
        elif self._marker is None and finished + 1 >= self.first:
            if self._profiler is None:
                self._start()
            step = finished + 1
            marker = record_function(f"optimizer_step {step}")
            marker.__enter__()
            self._marker = (step, marker)

    def close(self) -> None:
        """Stop and write the files (also when the run ended before ``last``); later calls do nothing."""
        if self._done:
            return
        self._done = True
        if self._profiler is None:
            return
        if self._marker is not None:  # the run ended inside the step
            self._end_marker()
        self._profiler.stop()
        rank = self.fabric.global_rank
        self.directory.mkdir(parents=True, exist_ok=True)
        self._profiler.export_chrome_trace(str(self.directory / f"rank{rank}.pt.trace.json"))
        if self.cuda:
            dump_memory_snapshot(str(self.directory / f"rank{rank}.memory.pickle"))
            stop_memory_history()
        self._profiler = None
        self.fabric.print(
            f"profile: {self.directory} (rank*.pt.trace.json{', rank*.memory.pickle' if self.cuda else ''})"
        )

    def _end_marker(self) -> None:
        self._marker[1].__exit__(None, None, None)
        self._marker = None

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            record_memory_history(MEMORY_HISTORY_ENTRIES)
        self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.start()


class _Profiled:
    """The wrapped batches: a new pass over the inner iterable per epoch, as the loop expects of a loader."""

    def __init__(self, profiler: StepProfiler, batches: Iterable[Any]) -> None:
        self.profiler, self.batches = profiler, batches

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batches)
        while True:
            self.profiler.before_fetch()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
