"""Gradient accumulation with AstrAI's ``GradientState`` counter semantics (AstrAI's
``astrai/parallel/executor.py`` and ``astrai/trainer/trainer.py``).

AstrAI counts micro-batches in one process-wide counter, never reset at epoch boundaries (so an accumulation
window may span two epochs), and syncs when ``count % grad_accum_steps == 0``. Leftover micro-batches at the end
of training are backpropagated but never stepped. The counter restarts at 0 on resume.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from lightning.fabric import Fabric
from torch import nn


class GradientState:
    """Counts micro-batches; ``advance()`` says whether the one just started ends an accumulation window."""

    def __init__(self, grad_accum_steps: int) -> None:
        self.grad_accum_steps = max(grad_accum_steps, 1)
        self.num_micro_batches = 0

    def advance(self) -> bool:
        self.num_micro_batches += 1
        return self.num_micro_batches % self.grad_accum_steps == 0


def backward_sync(
    fabric: Fabric, model: nn.Module, is_accumulating: bool, skip_sync: bool = True
) -> AbstractContextManager:
    """Context for one micro-batch's forward and backward.

    While accumulating (and ``skip_sync``), gradients are not synchronised across ranks (DDP ``no_sync``, FSDP2
    ``set_requires_gradient_sync(False)``); the window's last micro-batch synchronises. Only ``enabled=True`` is
    ever passed to Fabric: its FSDP context leaves sync switched *off* after an ``enabled=False`` block
    (Lightning 2.6), whereas an ``enabled=True`` block restores it on exit. ``skip_sync=False`` makes every micro-batch
    reduce, which under FSDP keeps gradients sharded (less memory, more communication).
    """
    if is_accumulating and skip_sync:
        return fabric.no_backward_sync(model, enabled=True)
    return nullcontext()
