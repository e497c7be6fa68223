"""A rank's tensor memory at its peak, measured as the plan counts it (``footprint``: parameters, gradients,
optimizer state, activations, the head and loss), for the line a run ends with.

On CUDA it is the allocator's peak (``torch.cuda.max_memory_allocated``) since the model was placed. On CPU torch keeps
no allocator statistics, and the process's resident memory holds the interpreter and its libraries too, so the peak
is the bytes the rank's model holds when training starts plus how far the process's resident memory rose above what
it was then: Linux's high-water mark (``VmHWM``), reset at the start by writing 5 to ``/proc/self/clear_refs``. Where
that reset is refused (another kernel, a sandbox), an earlier peak could hide in the mark, so nothing is measured.
The CPU figure also holds what the allocator keeps freed and the data loader's batches: an upper bound, close
where tensors dominate.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK = "5"
"""What ``clear_refs`` takes to reset the high-water mark (Linux 4.0 and later: ``man 5 proc``)."""


class PeakMemory:
    """Started when the model is in place (``start``); ``measured()`` at the end: bytes, or None where this machine
    cannot tell."""

    def __init__(self, device: torch.device, held_bytes: int, base_bytes: int | None) -> None:
        self.device, self.held_bytes, self.base_bytes = device, held_bytes, base_bytes

    @classmethod
    def start(cls, device: torch.device, model: nn.Module) -> PeakMemory:
        """From now, on ``device``; ``model``: the rank's part (its tensors are resident already)."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(device, 0, 0)
        # This rank's own bytes: a sharded parameter (a DTensor: FSDP, tensor parallelism) counts its local part.
        local = (t.to_local() if isinstance(t, DTensor) else t for t in (*model.parameters(), *model.buffers()))
        held = sum(t.numel() * t.element_size() for t in local if not t.is_meta)
        base = _status_bytes("VmRSS") if _reset_peak() else None
        return cls(device, held, base)

    def measured(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        peak = _status_bytes("VmHWM") if self.base_bytes is not None else None
        return None if peak is None else self.held_bytes + max(0, peak - self.base_bytes)

    @property
    def how(self) -> str:
        """Where the figure comes from, for the line that shows it."""
        if self.device.type == "cuda":
            return "the CUDA allocator's peak"
        return "the model's bytes and the process's resident growth since it was built"


def _reset_peak() -> bool:
    try:
        CLEAR_REFS.write_text(RESET_PEAK)
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` in bytes, or None off Linux."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return None
