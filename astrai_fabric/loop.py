"""``fit()``: the one training loop for step-based training (seq, sft, dpo). No callbacks, no hooks.

Per micro-batch: forward and backward inside the accumulation context, loss divided by ``grad_accum_steps``.
Per optimizer step (the window's last micro-batch): clip (the logged norm is this step's, pre-clip; AstrAI logs
the previous one, B7), step the optimizer, zero the gradients, step the schedule, then log, validate and
checkpoint. A checkpoint named ``step_S`` holds the state *after* step S (AstrAI's holds the state before, B1).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from astrai_fabric.accumulation import GradientState, backward_sync
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.sampler import ResumableSampler
from astrai_fabric.schedule import StepPlan
from astrai_fabric.training_state import RunPosition

LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
"""``(model, batch) -> (loss, metrics)``: the mean loss of one micro-batch and detached extras to log."""


def fit(
    fabric: Fabric,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any,
    train_loader: DataLoader,
    sampler: ResumableSampler,
    compute_loss: LossFn,
    args: TrainArgs,
    plan: StepPlan,
    position: RunPosition,
    save: Callable[[RunPosition], None],
    val_loader: DataLoader | None = None,
) -> list[dict[str, float]]:
    """Train from ``position`` (updated in place) until ``n_epoch``, ``max_steps`` or ``max_tokens``.

    Returns one record per optimizer step: ``step``, ``epoch``, ``loss`` (mean over the accumulation window and
    all ranks), ``lr``, ``grad_norm`` (before clipping), ``tokens_per_sec``, the loss function's own metrics
    (same means), and ``val_loss`` when validated.
    """
    grad_state = GradientState(args.grad_accum_steps)
    skip_sync = not (args.fsdp_sync_each_micro_batch and args.parallel_mode == "fsdp")
    world_size = plan.world_size  # data-parallel ranks (tensor-parallel ranks share their samples)
    log_every = max(1, plan.total_steps // 20)
    last_saved_step = position.optimizer_step
    first_step = position.optimizer_step + 1  # always logged, whatever the cadence
    window_loss = torch.zeros((), device=fabric.device)
    window_metrics: dict[str, Tensor] = {}
    window_tokens, window_start = 0, time.perf_counter()
    history: list[dict[str, float]] = []
    model.train()

    done = _budget_reached(position, args)
    while position.epoch < args.n_epoch and not done:
        sampler.set_position(position.epoch, position.sample_index)
        for batch in train_loader:
            is_accumulating = not grad_state.advance()
            with backward_sync(fabric, model, is_accumulating, skip_sync):
                loss, metrics = compute_loss(model, batch)
                fabric.backward(loss / args.grad_accum_steps)
            window_loss += loss.detach()
            for name, value in metrics.items():
                window_metrics[name] = window_metrics.get(name, 0.0) + value.float()
            num_tokens = _num_tokens(batch) * world_size
            window_tokens += num_tokens
            position.sample_index += batch["input_ids"].size(0)
            position.consumed_samples += args.batch_per_device * world_size
            position.num_tokens += num_tokens
            if is_accumulating:
                continue

            # --- optimizer step: the accumulation window is complete --------------------------------------------
            grad_norm = _clip_gradients(model, args.max_grad_norm)
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                warnings.warn(
                    f"step {position.optimizer_step + 1}: gradient norm is {grad_norm}; update skipped", stacklevel=2
                )
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[-1]["lr"]  # the rate this step used (AstrAI logs the AdamW group's)
            scheduler.step()
            position.optimizer_step += 1
            step = position.optimizer_step

            # Means over the window's micro-batches and all ranks, in one collective.
            names = sorted(window_metrics)
            window = torch.stack([window_loss, *(window_metrics[n] for n in names)]) / args.grad_accum_steps
            means = fabric.all_reduce(window, reduce_op="mean").tolist()
            record = {
                "step": step,
                "epoch": position.epoch,
                "loss": means[0],
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_sec": window_tokens / max(time.perf_counter() - window_start, 1e-9),
                **dict(zip(names, means[1:], strict=True)),
            }
            window_loss.zero_()
            window_metrics.clear()
            if val_loader is not None and (step == 1 or step % args.val_step == 0):
                record["val_loss"] = validate(fabric, model, val_loader, compute_loss)
            history.append(record)
            fabric.log_dict({k: v for k, v in record.items() if k != "step"}, step=step)  # the Fabric's loggers
            if step in (first_step, plan.total_steps) or step % log_every == 0 or "val_loss" in record:
                fabric.print(_format(record, plan.total_steps))
            window_tokens, window_start = 0, time.perf_counter()

            if step % args.ckpt_interval == 0:
                save(position)
                last_saved_step = step
            if _budget_reached(position, args):
                done = True
                break
        else:  # the epoch ran out
            position.epoch, position.sample_index = position.epoch + 1, 0

    if position.optimizer_step != last_saved_step:
        save(position)
    for logger in fabric.loggers:
        logger.save()  # flush what buffering loggers (CSV) hold; closing them is their owner's call
    return history


SHOWN_METRICS = ("reward", "reward_accuracy", "reward_margin", "kl_loss", "val_loss")
"""Train-type metrics worth a place on the log line when a loss function reports them."""


def _format(record: dict[str, float], total_steps: int) -> str:
    line = (
        f"step {record['step']}/{total_steps} | epoch {record['epoch']} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.3e} | grad_norm {record['grad_norm']:.4f} | {record['tokens_per_sec']:,.0f} tokens/s"
    )
    return line + "".join(f" | {name} {record[name]:.4f}" for name in SHOWN_METRICS if name in record)


def _num_tokens(batch: dict[str, Tensor]) -> int:
    """Real (unpadded) tokens of a micro-batch on this rank."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return batch["input_ids"].numel()


def _budget_reached(position: RunPosition, args: TrainArgs) -> bool:
    return (args.max_steps is not None and position.optimizer_step >= args.max_steps) or (
        args.max_tokens is not None and position.num_tokens >= args.max_tokens
    )


def _clip_gradients(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm``; return the norm before clipping (the same on every rank).

    Torch's ``clip_grad_norm_`` (and Fabric's) needs every gradient on one device mesh; with tensor parallelism
    some live on the 2-D mesh and the rest on the data axis only (P4), so each mesh's norm is taken on its own and
    the parts combined.
    """
    grads_by_mesh: dict[Any, list[Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            grads_by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    norms = []
    for grads in grads_by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = float(torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms])))
    coef = min(1.0, max_norm / (total + 1e-6))  # torch's formula; a float works for plain and DTensor gradients
    if coef < 1.0:
        for grads in grads_by_mesh.values():
            torch._foreach_mul_(grads, coef)
    return total


@torch.no_grad()
def validate(fabric: Fabric, model: nn.Module, loader: DataLoader, compute_loss: LossFn) -> float:
    """Mean loss over the validation set, all ranks together (eval mode: no NEFTune, no MoE aux loss)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)
    for batch in loader:
        loss, _ = compute_loss(model, batch)
        total += torch.stack([loss.detach().float(), torch.ones((), device=fabric.device)])
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1].clamp(min=1)).item()
