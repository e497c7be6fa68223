"""``train_step``: one optimizer step from one accumulation window.

Per micro-batch: the model's noise generators reseeded from the position (``randomness.ModuleNoise``), forward and
backward inside the accumulation context (``accumulation.py``), loss divided by ``grad_accum_steps``, the position
advanced by the micro-batch's samples (once: a batch trained again, ``state.REUSED``, was counted already). Then one
collective gives the window's means over its micro-batches and all ranks, whether any rank was asked to stop, and
whether the previous update left a weight non-finite on any rank; the step reads those, the gradient norm, the
window's tokens and the gradient SNR back to the host in one fetch, its only wait for the device. A finite loss and
gradient norm: clip (the logged norm is this step's, pre-clip; AstrAI logs the previous one, B7), step the
optimizer, zero the gradients, step the schedule. Otherwise the update is skipped: gradients zeroed, the window's
samples consumed, the step counter and the schedule stand still (AstrAI applies it, and one bad batch can destroy the
weights).

Whether the update left every weight finite is computed at once on the device and read with the next step's
numbers (``StepTools.unchecked_weights``): a non-finite update is reported one step later, and nothing trusts those
weights before that read. ``fit`` reads the check before every save (``StepTools.weights_finite``), and a run whose
batches are made by the live model between steps (online GRPO's rollouts) reads it at the end of each step
(``LoopArgs.check_weights_each_step``): a second fetch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from astrai_fabric.accumulation import GradientState, backward_sync
from astrai_fabric.loop.state import REUSED, LoopArgs, LossFn, TrainState
from astrai_fabric.losses import moe_load_metrics
from astrai_fabric.metrics import GradSNR
from astrai_fabric.norms import by_device_mesh, global_norm
from astrai_fabric.parallel.expert import expert_meshes
from astrai_fabric.parallel.pipeline import Pipeline
from astrai_fabric.preemption import StopRequest
from astrai_fabric.quantize import is_quantized
from astrai_fabric.randomness import ModuleNoise
from astrai_fabric.torch_private import foreach_mul_


@dataclass
class StepTools:
    """What every step of a run reuses, built once by ``fit`` (``for_run``)."""

    grad_state: GradientState
    """AstrAI's process-wide micro-batch counter: a window may span two epochs."""
    noise: ModuleNoise
    """NEFTune's noise, seeded by position only: seed, data-parallel rank, step, micro-batch (see randomness)."""
    grad_snr: GradSNR | None
    num_dp_ranks: int
    pipeline: Pipeline | None = None
    """The schedule that runs a window's micro-batches through the pipeline's stages (``--pp_size``), else None."""
    unchecked_weights: Tensor | None = None
    """1 where this rank's weights, as the last update left them, hold a NaN or infinity, else 0 (on the device);
    None once read."""

    @classmethod
    def for_run(
        cls, fabric: Fabric, model: nn.Module, args: LoopArgs, num_dp_ranks: int, pipeline: Pipeline | None = None
    ) -> StepTools:
        return cls(
            grad_state=GradientState(args.grad_accum_steps),
            noise=ModuleNoise(getattr(model, "module", model), args.random_seed, args.dp_rank, fabric.device),
            grad_snr=GradSNR(**pipeline.grad_snr_options() if pipeline else {}) if args.grad_snr else None,
            num_dp_ranks=num_dp_ranks,
            pipeline=pipeline,
        )

    def window(self, fabric: Fabric, model: nn.Module, compute_loss: LossFn, args: LoopArgs, step: int) -> Window:
        """How the next window's micro-batches are trained: through the pipeline's schedule, or one at a time."""
        if self.pipeline is not None:
            return self.pipeline.window()
        return EagerWindow(fabric, model, compute_loss, args, self, step)

    def weights_finite(self, fabric: Fabric) -> bool:
        """Whether the last update left every weight finite on every rank, read now (True when read already).
        Collective: every rank calls it at the same step."""
        if self.unchecked_weights is None:
            return True
        flag, self.unchecked_weights = self.unchecked_weights, None
        return fabric.all_reduce(flag, reduce_op="max").item() == 0


class Window(Protocol):
    """One accumulation window's micro-batches trained, as ``train_step`` drives them (``EagerWindow``, or the
    pipeline's schedule: ``parallel.pipeline.PipelineWindow``)."""

    def add(self, batch: dict[str, Tensor], last: bool) -> None:
        """Take the window's next micro-batch (``last``: the window's last)."""

    def result(self) -> tuple[Tensor, dict[str, Tensor]]:
        """This rank's sum of the window's losses and of each metric, its gradients accumulated."""

    def grad_norm(self, model: nn.Module, grads: dict) -> Tensor:
        """The whole model's gradient norm, the same on every rank (``grads``: this rank's, ``by_device_mesh``)."""


@dataclass
class EagerWindow:
    """A window's micro-batches trained as they come: each one's noise reseeded from the position, its forward and
    its backward (the gradients synchronised at the window's last only, ``accumulation.backward_sync``), the loss
    divided by ``grad_accum_steps``; the losses and metrics summed."""

    fabric: Fabric
    model: nn.Module
    compute_loss: LossFn
    args: LoopArgs
    tools: StepTools
    step: int
    """The optimizer steps taken before this window's (the noise's seed)."""
    loss: Tensor = field(init=False)
    """The window's losses summed, on the device."""
    metrics: dict[str, Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.loss = torch.zeros((), device=self.fabric.device)

    def add(self, batch: dict[str, Tensor], last: bool) -> None:
        grad_state = self.tools.grad_state
        self.tools.noise.reseed(self.step + 1, (grad_state.num_micro_batches - 1) % grad_state.grad_accum_steps)
        with backward_sync(self.fabric, self.model, not last, self.args.skip_sync):
            loss, metrics = self.compute_loss(self.model, batch)
            self.fabric.backward(loss / self.args.grad_accum_steps)
        self.loss += loss.detach()
        for name, value in metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + value.float()

    def result(self) -> tuple[Tensor, dict[str, Tensor]]:
        return self.loss, self.metrics

    def grad_norm(self, model: nn.Module, grads: dict) -> Tensor:
        return global_norm(grads, summed_over=expert_meshes(model))


@dataclass
class StepResult:
    """One accumulation window's outcome (the means are over its micro-batches and all ranks)."""

    loss: float
    metrics: dict[str, float]
    """The loss function's own metrics, by name (sorted)."""
    grad_norm: float
    """The global gradient norm before clipping."""
    stop_requested: bool
    """Whether any rank was asked to stop (``preemption.StopRequest``)."""
    num_tokens: int
    num_samples: int
    """Real tokens and samples of the window, all ranks together."""
    stepped: bool = False
    """False: the update was skipped (a loss or gradient norm that was not finite) or not taken (see
    ``nonfinite_update``)."""
    nonfinite_update: int | None = None
    """The optimizer step whose update left a weight non-finite, when this step found out: the previous one (read
    with this window's numbers; this window is not applied) or, with ``check_weights_each_step``, this one (the
    schedule and the step counter did not advance)."""
    lr: float | None = None
    """The learning rate the step used (AstrAI logs the AdamW group's: the last one)."""
    grad_snr: float | None = None


def train_step(
    fabric: Fabric,
    *,
    state: TrainState,
    micro_batches: Iterator[dict[str, Tensor]],
    compute_loss: LossFn,
    args: LoopArgs,
    tools: StepTools,
    stop: StopRequest | None = None,
) -> StepResult | None:
    """Take the next accumulation window from ``micro_batches`` and make one optimizer step of it (or skip it,
    see the module docstring). Returns None when ``micro_batches`` ran out first (the run's last, incomplete window:
    backpropagated, never stepped, as AstrAI does)."""
    model, position = state.model, state.position
    window = tools.window(fabric, model, compute_loss, args, position.optimizer_step)
    window_tokens = torch.zeros((), dtype=torch.long, device=fabric.device)  # this rank's, on the device
    num_samples = 0
    is_accumulating = True
    while is_accumulating:
        batch = next(micro_batches, None)
        if batch is None:
            position.num_tokens += int(window_tokens) * tools.num_dp_ranks  # the run's end: read once
            return None
        is_accumulating = not tools.grad_state.advance()
        window.add(batch, last=not is_accumulating)
        window_tokens += _num_tokens(batch)
        num_samples += batch["input_ids"].size(0) * tools.num_dp_ranks
        if not batch.get(REUSED, False):  # the position counts samples consumed, not micro-batches trained
            position.sample_index += batch["input_ids"].size(0)
            position.consumed_samples += args.batch_per_device * tools.num_dp_ranks
    window_loss, window_metrics = window.result()

    # One collective: the window's means over its micro-batches and all ranks, whether any rank was asked to stop
    # (a signal to one rank stops all after this same step), and whether the last update left any rank's weights
    # non-finite (the mean of 0/1 flags is positive when one is 1).
    metric_names = sorted(window_metrics)
    parts = [window_loss, *(window_metrics[n] for n in metric_names)]  # a metric may be a tensor
    window = torch.cat([p.reshape(-1) for p in parts])
    flags = torch.stack(
        [
            torch.tensor(float(stop is not None and stop.requested), device=fabric.device),
            tools.unchecked_weights if tools.unchecked_weights is not None else torch.zeros((), device=fabric.device),
        ]
    )
    tools.unchecked_weights = None
    reduced = fabric.all_reduce(torch.cat([window / args.grad_accum_steps, flags]), reduce_op="mean")
    # The means back in their shapes; the experts' load from the window's counts on every rank, not one rank's.
    loss_mean, *metric_means, flags = reduced.split([p.numel() for p in parts] + [len(flags)])
    metrics = {n: m.view_as(p) for n, m, p in zip(metric_names, metric_means, parts[1:], strict=True)}
    metrics = moe_load_metrics(metrics)
    names = sorted(metrics)
    grads = by_device_mesh(p.grad for p in model.parameters() if p.grad is not None)
    # GradSNR takes in the gradients before the step knows they are finite (unclipped, as AstrAI): a skipped step
    # starts its averages again below. Its pass over the gradients gives their norm as well (the same value).
    snr = tools.grad_snr.update_on_device(model) if tools.grad_snr is not None else None
    grad_norm = tools.grad_snr.grad_norm if tools.grad_snr is not None else window.grad_norm(model, grads)
    # The step's one read from the device, in float64 (exact for the float32 values and the token count).
    means = torch.cat([loss_mean, *(metrics[n].reshape(1) for n in names), flags])
    numbers = [means.double(), grad_norm.double().reshape(1), window_tokens.double().reshape(1)]
    numbers = torch.cat([*numbers, *([snr] if snr is not None else [])]).tolist()
    count = len(names) + 1
    means, (stop_flag, nonfinite_weights, norm, local_tokens) = numbers[:count], numbers[count : count + 4]
    num_tokens = int(local_tokens) * tools.num_dp_ranks
    position.num_tokens += num_tokens
    result = StepResult(
        means[0], dict(zip(names, means[1:], strict=True)), norm, stop_flag > 0, num_tokens, num_samples
    )
    if nonfinite_weights > 0:
        result.nonfinite_update = position.optimizer_step
        return result
    if not (math.isfinite(result.loss) and math.isfinite(norm)):
        state.optimizer.zero_grad(set_to_none=True)  # no update: the step counter and the schedule stand still
        position.skipped_steps += 1
        if tools.grad_snr is not None:
            tools.grad_snr.restart()
        return result
    result.grad_snr = tools.grad_snr.value(numbers[count + 4 :]) if tools.grad_snr is not None else None
    _clip(grads, norm, args.max_grad_norm)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    result.lr = state.optimizer.param_groups[-1]["lr"]
    tools.unchecked_weights = _nonfinite_flag(model)  # read with the next step's numbers, or before a save
    if args.check_weights_each_step and not tools.weights_finite(fabric):
        result.nonfinite_update = position.optimizer_step + 1
        return result
    result.stepped = True
    state.scheduler.step()
    position.optimizer_step += 1
    return result


def weights_are_finite(fabric: Fabric, model: nn.Module) -> bool:
    """Whether every parameter is finite on every rank (each rank checks its own shards: one reduction, read)."""
    return fabric.all_reduce(_nonfinite_flag(model), reduce_op="max").item() == 0


def _nonfinite_flag(model: nn.Module) -> Tensor:
    """1.0 when this rank's parameters (its shards) hold a NaN or infinity, else 0.0, on the device: nothing read.

    A sum is non-finite when any element is NaN or infinite, and costs an eighth of an abs-max here (0.3 ms for the
    1M-parameter model on CPU); finite weights could only sum past float's range at magnitudes near 1e32. A QLoRA
    base's NF4 weights are skipped: frozen 4-bit codes, which no step changes (and which have no sum)."""
    local = [
        (p.to_local() if isinstance(p, DTensor) else p).detach() for p in model.parameters() if not is_quantized(p)
    ]
    return torch.stack([p.sum() for p in local]).isfinite().all().logical_not().float()


def _num_tokens(batch: dict[str, Tensor]) -> Tensor | int:
    """Real (unpadded) tokens of a micro-batch on this rank (counted on the device when padding is masked)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return batch["input_ids"].numel()


def _clip(grads_by_mesh: dict[Any, list[Tensor]], norm: float, max_norm: float) -> None:
    """Scale the gradients so their global norm is at most ``max_norm`` (torch's formula)."""
    coef = min(1.0, max_norm / (norm + 1e-6))  # a float works for plain and DTensor gradients alike
    if coef < 1.0:
        for grads in grads_by_mesh.values():
            foreach_mul_(grads, coef)
