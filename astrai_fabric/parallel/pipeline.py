"""``Pipeline``: one accumulation window through torch's pipelining schedules (``--pp_size``); the only importer of
``torch.distributed.pipelining``.

A window's ``grad_accum_steps`` micro-batches are the pipeline's micro-batches: the first stage is given them
stacked, the schedule splits them back (each is padded to ``batch_per_device`` rows first, the padding weighing 0,
so every micro-batch has one shape: stages allocate their receive buffers once, from the shapes given), runs each
stage's forwards and backwards in its order and sends activations forward and their gradients back between
neighbouring stages. One stage per rank: GPipe (every forward, then every backward) or 1F1B (one of each once the
pipeline is full). Several per rank (``--pp_stages_per_rank``, looped: ``model.pipeline``): interleaved 1F1B (1F1B
over the rank's stages, the earlier micro-batch first: a smaller bubble, (P-1)/(V M + P-1) of the step for P ranks
of V stages and M micro-batches) or looped BFS (each stage every micro-batch before the next stage).

How the loop's semantics map onto it:

- the loss: the last stage's forward returns each position's cross-entropy (``model.pipeline``); the schedule's loss
  function weighs it by the run's per-token weights (``losses.token_nll_weights``: seq's mean over the micro-batch,
  sft's over its trained tokens) and divides by the micro-batches, as ``train_step`` divides each micro-batch's loss
  by ``grad_accum_steps`` (AstrAI's scaling): so the schedule does not scale the gradients again;
- the gate (DESIGN's decision 2): the schedule turns FSDP's gradient reduction off for every micro-batch's backward
  and reduces once after the last (torch's ``perform_reduce_grad``): AstrAI's no-sync gating, per stage;
- a tied embedding: its two copies' gradients (first and last stage) are summed over the pair's group, so both
  apply the same update; the gradient norm counts the first stage's copy only, each stage's norm combined over the
  pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from astrai_fabric.config.pipeline import INTERLEAVED_SCHEDULES
from astrai_fabric.errors import ConfigError, keep_traceback
from astrai_fabric.losses import token_nll_weights
from astrai_fabric.model.pipeline import PipelineRankLM, StageLoss
from astrai_fabric.model.transformer import LM_HEAD_KEY
from astrai_fabric.norms import by_device_mesh, global_norm

SCHEDULE_LOGGER = "torch.distributed.pipelining.schedules"
"""The logger torch's schedules report a failed step on: the exception, then the whole schedule as a table, one line
per action (30 and more), before the exception reaches the run's one line."""
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}


class Pipeline:
    """The schedule of one rank's stages, built at the first window (its shapes come from the run's flags)."""

    def __init__(
        self,
        fabric: Fabric,
        model: nn.Module,
        schedule: str,
        num_micro_batches: int,
        batch_per_device: int,
        compute_dtype: torch.dtype,
        loss: StageLoss,
        crash_log_dir: Path,
    ) -> None:
        """``model``: the Fabric-wrapped rank's part (a ``PipelineRankLM``, its stages under FSDP);
        ``compute_dtype``: the hidden states' dtype between stages (the run's parameter dtype, or FSDP's
        ``param_dtype``); ``crash_log_dir``: where the schedule's report of a failed step goes (the run's
        ``ckpt_dir``), not stderr (``SCHEDULE_LOGGER``)."""
        _divert_schedule_reports(crash_log_dir)
        self.fabric, self.schedule_name = fabric, schedule
        self.module: PipelineRankLM = getattr(model, "module", model)
        self.place = self.module.place
        if len(self.place.stages) > 1 and schedule not in INTERLEAVED_SCHEDULES:
            raise ConfigError(
                f"pp_schedule {schedule} runs one stage per rank, and this model holds {len(self.place.stages)}: "
                f"use one of {', '.join(INTERLEAVED_SCHEDULES)}"
            )
        for module in self.module.stage_modules:  # this run's token losses and recomputation, set on the rank's model
            module.stage_loss, module.gradient_checkpointing = loss, self.module.gradient_checkpointing
        self.num_micro_batches, self.batch_per_device = num_micro_batches, batch_per_device
        self.compute_dtype = compute_dtype
        self._schedule = None
        _divert_schedule_reports(crash_log_dir)

    def window(self) -> PipelineWindow:
        """The next accumulation window, trained through the schedule (``loop.step.Window``)."""
        return PipelineWindow(self)

    def train_window(self, batches: Sequence[dict[str, Tensor]]) -> Tensor:
        """Forward and backward of the window's micro-batches through every stage; returns the sum of their losses
        on the last stage's ranks, times the pipeline's ranks (so that the mean over every rank, the others giving
        0, is the last stage's: ``train_step`` takes that mean), and 0 elsewhere. Then a tied embedding's gradients
        summed."""
        losses = self._run(batches, len(batches), train=True)
        self._sum_tied_gradients()
        if not self.place.holds_last:
            return torch.zeros((), device=self.fabric.device)
        return torch.stack(losses).detach().sum() * self.num_micro_batches * self.place.num_ranks

    @torch.no_grad()
    def validation_loss(self, batches: Iterable[dict[str, Tensor]]) -> Tensor:
        """``[sum of the micro-batches' losses, their count]`` over ``batches``, forward only through the stages
        (the schedule's micro-batches at a time; the last group filled with copies weighing 0, not counted), on the
        last stage's ranks; 0 elsewhere (so a sum over every rank is the last stage's)."""
        total = torch.zeros(2, device=self.fabric.device)
        group: list[dict[str, Tensor]] = []
        for batch in [*batches, None]:
            if batch is not None:
                group.append(batch)
            if group and (len(group) == self.num_micro_batches or batch is None):
                real = len(group)
                losses = self._run(group + [group[-1]] * (self.num_micro_batches - real), real, train=False)
                if self.place.holds_last:
                    total[0] += torch.stack(losses[:real]).sum() * self.num_micro_batches
                    total[1] += real
                group = []
        return total

    def _run(self, batches: Sequence[dict[str, Tensor]], real: int, train: bool) -> list[Tensor]:
        """The schedule's step (``train``) or its forward-only ``eval`` over ``batches`` (the first ``real`` of them
        weighing what they weigh, the rest 0); the last stage's per-micro-batch losses (divided by the
        micro-batches), nothing elsewhere."""
        device = self.fabric.device
        ids, targets, positions, weights = _stacked(batches, self.batch_per_device, real, device)
        schedule = self._schedule or self._build(ids.size(1), positions is not None)
        run = schedule.step if train else schedule.eval
        inputs = (ids, targets) + ((positions,) if positions is not None else ())
        losses: list[Tensor] = []
        # The first stage's rank gives the inputs, the last stage's the loss's targets (the first stage is on the
        # pipeline's first rank, the last on its last, however many stages a rank holds).
        given = dict(target=weights, losses=losses) if self.place.holds_last else {}
        with self.fabric.autocast():
            run(*(inputs if self.place.holds_first else ()), **given)
        return losses

    def norm_over_stages(self, norm: Tensor) -> Tensor:
        """The gradient norm of the whole model from this rank's (each pipeline rank's of its own stages): summed in
        squares over the pipeline."""
        total = norm.float().pow(2)
        dist.all_reduce(total, group=self.place.group)
        return total.sqrt()

    def counted(self, name: str) -> bool:
        """Whether parameter ``name`` (the rank's, or the Fabric-wrapped rank's) enters the gradient norm: all but
        the last stage's copy of a tied embedding."""
        return not (self.module.config.tied and self.place.holds_last and name.endswith(LM_HEAD_KEY))

    def grad_snr_options(self) -> dict[str, Any]:
        """``GradSNR``'s arguments for a pipeline rank: its own parameters, its norms made the whole model's."""
        return dict(counted=self.counted, over_stages=self.norm_over_stages)

    def _build(self, seq_len: int, with_positions: bool):
        """The stages and their schedule, with every shape given (torch's shape inference would run the last stage's
        loss on uninitialised targets)."""
        config, rows = self.module.config, self.batch_per_device

        def meta(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        hidden = meta(rows, seq_len, config.hidden_size, dtype=self.compute_dtype).requires_grad_()
        carried = (meta(rows, seq_len),) + ((meta(rows, seq_len),) if with_positions else ())
        stages = []
        for module in self.module.stage_modules:
            stage = module.stage
            inputs = ((meta(rows, seq_len),) if stage.is_first else (hidden,)) + carried
            outputs = meta(rows, seq_len, dtype=torch.float32) if stage.is_last else (hidden, *carried)
            stages.append(
                PipelineStage(
                    module,
                    stage.index,
                    stage.num_stages,
                    self.fabric.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.place.group,
                )
            )
        num_micro_batches = self.num_micro_batches

        def weighted_loss(token_nll: Tensor, weights: Tensor) -> Tensor:
            return (token_nll * weights).sum() / num_micro_batches

        multi_stage = self.schedule_name in INTERLEAVED_SCHEDULES  # these take the list of the rank's stages
        self._schedule = SCHEDULES[self.schedule_name](
            stages if multi_stage else stages[0], num_micro_batches, loss_fn=weighted_loss, scale_grads=False
        )
        return self._schedule

    def _sum_tied_gradients(self) -> None:
        if not self.module.config.tied or self.place.ends_group is None:
            return
        weight = self.module.embed_tokens.weight if self.place.holds_first else self.module.lm_head.weight
        grad = weight.grad
        if grad is None:  # frozen (LoRA): nothing to sum
            return
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=self.place.ends_group)


class _ToCrashLog(logging.Handler):
    """Appends each record to this process's crash log in ``directory`` (``errors.keep_traceback``)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def emit(self, record: logging.LogRecord) -> None:
        keep_traceback(self.format(record) + "\n", self.directory, "crash", "torch's pipeline schedule reported")


def _divert_schedule_reports(directory: Path) -> None:
    """Send ``SCHEDULE_LOGGER``'s records to the crash log in ``directory`` alone (once per process): a peer that
    dies mid-step then shows as the run's one line, its schedule kept for whoever debugs it."""
    logger = logging.getLogger(SCHEDULE_LOGGER)
    logger.handlers = [handler for handler in logger.handlers if not isinstance(handler, _ToCrashLog)]
    logger.addHandler(_ToCrashLog(Path(directory)))
    logger.propagate = False  # torch's own handler, on an ancestor, prints them on stderr


def _stacked(
    batches: Sequence[dict[str, Tensor]], rows: int, real: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The window's input ids, targets, position ids (sft's packed documents; None for seq) and per-token loss
    weights, each micro-batch padded to ``rows`` rows (copies of its first, weighing 0) and stacked; the micro-batches
    after the first ``real`` weigh 0."""

    def padded(tensor: Tensor) -> Tensor:
        short = rows - tensor.size(0)
        return tensor if not short else torch.cat([tensor, tensor[:1].expand(short, *tensor.shape[1:])])

    ids, targets, positions, weights = [], [], [], []
    for index, batch in enumerate(batches):
        weight = token_nll_weights(batch["target_ids"], batch.get("loss_mask")) * (index < real)
        ids.append(padded(batch["input_ids"]))
        targets.append(padded(batch["target_ids"]))
        weights.append(torch.cat([weight, weight.new_zeros(rows - weight.size(0), weight.size(1))]))
        if "position_ids" in batch:
            positions.append(padded(batch["position_ids"]))
    stack = lambda parts: torch.cat(parts).to(device).contiguous()  # noqa: E731
    return stack(ids), stack(targets), stack(positions) if positions else None, stack(weights)


class PipelineWindow:
    """A window's micro-batches gathered, then trained through the pipeline's schedule at once (``loop.step.Window``):
    its loss, seq's and sft's only metric (``losses.with_moe_aux_loss``), is the last stage's, spread so that the
    mean over every rank is it (``Pipeline.train_window``); the gradient norm each stage's, summed over the stages."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.batches: list[dict[str, Tensor]] = []

    def add(self, batch: dict[str, Tensor], last: bool) -> None:
        self.batches.append(batch)

    def result(self) -> tuple[Tensor, dict[str, Tensor]]:
        loss = self.pipeline.train_window(self.batches)
        return loss, {"task_loss": loss}

    def grad_norm(self, model: nn.Module, grads: dict) -> Tensor:  # its own stages' without a tied head's copy
        named = model.named_parameters()
        counted = by_device_mesh(p.grad for n, p in named if p.grad is not None and self.pipeline.counted(n))
        return self.pipeline.norm_over_stages(global_norm(counted))
