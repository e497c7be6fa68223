"""What the loop carries from step to step: ``TrainState`` (the model, optimizer, schedule and ``RunPosition``) and
``LoopArgs``, the slice of the training flags the loop reads (built by ``train.common.loop_args``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from astrai_fabric.checkpoint.position import RunPosition

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
"""``(model, batch) -> (loss, metrics)``: the mean loss of one micro-batch and detached extras to log."""
REUSED = "reused"
"""Batch key, True on a micro-batch trained again (online grpo's ``--grpo_num_iterations``): its samples were counted
(``RunPosition.sample_index``, ``consumed_samples``) when it was first trained."""


@dataclass
class TrainState:
    """What training changes: the (Fabric-wrapped) model, its optimizer and schedule, and the position, all
    updated in place by ``train_step`` and ``fit``."""

    model: nn.Module
    optimizer: Optimizer
    scheduler: Any
    """The learning-rate schedule (``schedule.py``), stepped once per optimizer step."""
    position: RunPosition


@dataclass(frozen=True)
class LoopArgs:
    """The flags ``fit`` and ``train_step`` read (``TrainArgs`` documents each; ``train.common.loop_args`` takes them
    from it, with what the caller knows of the Fabric)."""

    num_epochs: int
    """The epochs the loop passes through (``StepPlan.num_epochs``: ``--n_epoch``, or as many as ``--max_steps``
    takes)."""
    batch_per_device: int
    grad_accum_steps: int
    max_steps: int | None
    stop_after_steps: int | None
    max_tokens: int | None
    max_grad_norm: float
    max_bad_steps: int
    val_step: int
    ckpt_interval: int
    ckpt_dir: str
    random_seed: int
    grad_snr: bool
    """Whether ``grad_snr`` is among ``--metrics`` (it costs two gradient-sized buffers)."""
    skip_sync: bool
    """Reduce gradients only at a window's last micro-batch (AstrAI's gate, ``accumulation.backward_sync``): every
    strategy but FSDP asked for ``--fsdp_sync_each_micro_batch`` (reducing each micro-batch keeps the gradients
    sharded, an FSDP choice)."""
    dp_rank: int
    """This process's data-parallel rank (NEFTune's noise is seeded by it)."""
    check_weights_each_step: bool = False
    """Read whether each update left the weights finite at the end of its step (a second read from the device),
    not with the next step's numbers: the batches are made by the live model between steps (online GRPO)."""

    def budget_reached(self, position: RunPosition, first_step: int) -> bool:
        """``max_steps``, ``max_tokens`` or, for a run that began after step ``first_step``, ``stop_after_steps``
        reached."""
        step = position.optimizer_step
        return (
            (self.max_steps is not None and step >= self.max_steps)
            or (self.stop_after_steps is not None and step - first_step >= self.stop_after_steps)
            or (self.max_tokens is not None and position.num_tokens >= self.max_tokens)
        )
