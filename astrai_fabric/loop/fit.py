"""``fit``: epochs, stop requests, validation and checkpoints around ``train_step``.

A window whose loss or gradient norm is not finite is skipped (``step.py``); more than ``--max_bad_steps`` in a row
stop the run with a ``TrainingError`` after saving. An update that leaves any weight non-finite (a learning rate
too large for the number format, say) stops the run with a ``TrainingError`` as soon as a step reads it (the next
one, or the save that would follow it) and nothing of it is saved: every save follows a step whose weights were
checked on every rank. A stop request (``preemption.StopRequest``)
ends the run after the current optimizer step, with a checkpoint. A checkpoint named ``step_S`` holds the state
*after* step S (AstrAI's holds the state before, B1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

from astrai_fabric.checkpoint import find_latest_checkpoint
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.data.sampler import ResumableSampler
from astrai_fabric.errors import TrainingError, raised_on_every_rank
from astrai_fabric.loop.state import LoopArgs, LossFn, TrainState
from astrai_fabric.loop.step import StepResult, StepTools, train_step
from astrai_fabric.parallel.pipeline import Pipeline
from astrai_fabric.preemption import StopRequest
from astrai_fabric.reporting import Reporter


def fit(
    fabric: Fabric,
    *,
    state: TrainState,
    batches: Iterable[dict[str, Tensor]],
    sampler: ResumableSampler,
    compute_loss: LossFn,
    args: LoopArgs,
    save: Callable[[RunPosition], Path],
    reporter: Reporter,
    val_loader: DataLoader | None = None,
    stop: StopRequest | None = None,
    pipeline: Pipeline | None = None,
) -> list[dict[str, float]]:
    """Train from ``state.position`` (updated in place) until ``num_epochs``, ``max_steps``, ``stop_after_steps`` (this
    call's steps) or ``max_tokens``, or until
    ``stop`` is requested on any rank; the state at the end is saved. ``pipeline``: the schedule that runs each
    window through the pipeline's stages (``--pp_size``; ``compute_loss`` then serves validation only).

    ``batches`` is iterated once per epoch, after ``sampler`` (the one that orders it) is set to the position.
    Returns one record per optimizer step: ``step``, ``epoch``, ``loss`` (mean over the accumulation window and
    all ranks), ``lr``, ``grad_norm`` (before clipping), ``grad_snr`` (when asked for), the loss function's own
    metrics (same means), throughput (see ``Reporter``) and ``val_loss`` when validated.
    """
    position = state.position
    first_step = position.optimizer_step  # where this run began: --stop_after_steps counts from here
    tools = StepTools.for_run(fabric, state.model, args, sampler.num_dp_ranks, pipeline)
    micro_batches = _epochs(batches, sampler, position, args, reporter)
    last_saved_step = position.optimizer_step
    bad_in_a_row, diverged = 0, False
    last_update: StepResult | None = None  # the last window applied: a non-finite update is named after it

    def checked_save() -> None:
        """Save the position, once the last update is known to have left every weight finite."""
        nonlocal last_saved_step
        if not tools.weights_finite(fabric):
            _raise_nonfinite_update(fabric, args, reporter, position.optimizer_step, last_update)
        reporter.checkpoint_saved(save(position))
        last_saved_step = position.optimizer_step

    state.model.train()
    done = args.budget_reached(position, first_step)
    while not done:
        result = train_step(
            fabric,
            state=state,
            micro_batches=micro_batches,
            compute_loss=compute_loss,
            args=args,
            tools=tools,
            stop=stop,
        )
        if result is None:  # the last epoch ran out
            break
        if result.stop_requested and stop is not None:
            stop.honoured = True
        if result.nonfinite_update is not None:
            culprit = result if result.lr is not None else last_update  # this window's update, or the last one's
            _raise_nonfinite_update(fabric, args, reporter, result.nonfinite_update, culprit)
        if result.stepped:
            bad_in_a_row, last_update = 0, result
            if _report(fabric, state, result, args, reporter, val_loader, compute_loss, first_step, pipeline):
                checked_save()
        else:
            bad_in_a_row += 1
            reporter.message(
                f"warning: non-finite loss {result.loss} or gradient norm {result.grad_norm} after step "
                f"{position.optimizer_step}: update skipped ({bad_in_a_row} in a row, {position.skipped_steps} in "
                "this run)"
            )
        reporter.restart_clock()
        diverged = bad_in_a_row > args.max_bad_steps
        done = result.stop_requested or diverged or args.budget_reached(position, first_step)

    if position.optimizer_step != last_saved_step:
        checked_save()
    reporter.close()
    if diverged:
        error = TrainingError(
            f"{bad_in_a_row} optimizer steps in a row had a non-finite loss or gradient norm (more than "
            f"--max_bad_steps {args.max_bad_steps}); stopped after step {position.optimizer_step}. "
            f"{_newest_checkpoint(fabric, args)}. Lower --max_lr, raise --warmup_ratio or check the data"
        )
        raise raised_on_every_rank(error, fabric.local_rank)
    return reporter.history


def _raise_nonfinite_update(
    fabric: Fabric, args: LoopArgs, reporter: Reporter, step: int, culprit: StepResult | None
) -> NoReturn:
    """Stop the run: optimizer step ``step`` (whose window was ``culprit``) left a weight non-finite."""
    reporter.close()
    numbers = ""
    if culprit is not None:
        numbers = f" (loss {culprit.loss:.4g}, gradient norm {culprit.grad_norm:.4g}, learning rate {culprit.lr:.4g})"
    error = TrainingError(
        f"the weights became non-finite (NaN or infinite) in optimizer step {step}{numbers}; that state was not "
        f"saved. {_newest_checkpoint(fabric, args)}. Lower --max_lr or raise --warmup_ratio"
    )
    raise raised_on_every_rank(error, fabric.local_rank)  # every rank's verdict: said once


def _epochs(
    batches: Iterable[dict[str, Tensor]],
    sampler: ResumableSampler,
    position: RunPosition,
    args: LoopArgs,
    reporter: Reporter,
) -> Iterator[dict[str, Tensor]]:
    """The micro-batches of the epochs left, one after another: an accumulation window may span two epochs."""
    while position.epoch < args.num_epochs:
        sampler.set_position(position.epoch, position.sample_index)
        yield from batches
        reporter.epoch_end(position.epoch, position.optimizer_step, position.consumed_samples)
        position.epoch, position.sample_index = position.epoch + 1, 0


def _report(
    fabric: Fabric,
    state: TrainState,
    result: StepResult,
    args: LoopArgs,
    reporter: Reporter,
    val_loader: DataLoader | None,
    compute_loss: LossFn,
    first_step: int,
    pipeline: Pipeline | None,
) -> bool:
    """Record, show and log the step just taken (validating when due); returns whether a checkpoint is due."""
    position = state.position
    step = position.optimizer_step
    record = {
        "step": step,
        "epoch": position.epoch,
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        **result.metrics,
    }
    if result.grad_snr is not None:
        record["grad_snr"] = result.grad_snr
    reporter.throughput(record, result.num_tokens, result.num_samples)
    if val_loader is not None and (step == 1 or step % args.val_step == 0):
        record["val_loss"] = validate(fabric, state.model, val_loader, compute_loss, pipeline)
    last = result.stop_requested or args.budget_reached(position, first_step)
    reporter.step(record, list(result.metrics), position.epoch, position.consumed_samples, last)
    return step % args.ckpt_interval == 0


def _newest_checkpoint(fabric: Fabric, args: LoopArgs) -> str:
    """Where to continue from, as rank 0 sees ``ckpt_dir`` (said the same on every rank)."""
    newest = find_latest_checkpoint(args.ckpt_dir) if fabric.global_rank == 0 else None
    newest = fabric.broadcast(str(newest) if newest is not None else None)
    if newest is None:
        return f"ckpt_dir {args.ckpt_dir} holds no checkpoint: start again"
    return f"The newest checkpoint is {newest}: continue from it with --resume auto"


@torch.no_grad()
def validate(
    fabric: Fabric, model: nn.Module, loader: DataLoader, compute_loss: LossFn, pipeline: Pipeline | None = None
) -> float:
    """Mean loss over the validation set, all ranks together (eval mode: no NEFTune, no MoE aux loss); through the
    pipeline's stages under ``pipeline`` (its last stage's losses)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)
    if pipeline is not None:
        total += pipeline.validation_loss(loader)
    for batch in loader if pipeline is None else ():
        loss, _ = compute_loss(model, batch)
        total += torch.stack([loss.detach().float(), torch.ones((), device=fabric.device)])
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1].clamp(min=1)).item()
