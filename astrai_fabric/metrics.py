"""What a run measures and records: gradient SNR, MoE routing diagnostics, throughput and MFU, and AstrAI's
``metric.jsonl`` (AstrAI's ``astrai/trainer/train_callback.py``).

``metric.jsonl`` has one JSON object per line, ``{"type": "step"|"validation"|"epoch", "timestamp", "epoch",
"step", "consumed_samples", ...}``: step entries carry the loss function's own metrics (``task_loss``, ``dpo_loss``,
...) plus the names asked for with ``--metrics``; validation entries carry ``val_loss``. Every checkpoint holds the
whole history. Departure from AstrAI: a resumed run continues the history of the checkpoint it resumed (AstrAI
starts a new one), so the latest checkpoint always holds the complete run.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import UserError
from astrai_fabric.metric_entries import metric_entry_problem, metric_lines
from astrai_fabric.model import count_parameters
from astrai_fabric.norms import norm_from_norms
from astrai_fabric.parallel.expert import expert_meshes
from astrai_fabric.torch_private import foreach_add_, foreach_norm, foreach_sub

METRIC_FILE = "metric.jsonl"


class MetricLog:
    """AstrAI's cumulative metric log; rank 0 keeps it and every checkpoint gets a copy."""

    def __init__(self, names: list[str], entries: list[dict[str, Any]] | None = None) -> None:
        self.names = [n for n in names if n != "val_loss"]
        self.entries = list(entries or [])

    @classmethod
    def resumed(cls, names: list[str], checkpoint_dir: Path | None) -> MetricLog:
        """The log of the checkpoint a run resumes from (empty for a fresh run or a checkpoint without one)."""
        path = checkpoint_dir / METRIC_FILE if checkpoint_dir is not None else None
        if path is None or not os.path.lexists(path):  # anything there (a FIFO, a link) is read, or refused by name
            return cls(names)
        entries = []
        try:
            for line_no, line in metric_lines(path, within=checkpoint_dir):
                try:
                    entry = json.loads(line)
                except (ValueError, RecursionError):
                    entry = None
                if not isinstance(entry, dict):
                    warnings.warn(
                        f"{path}:{line_no}: not a JSON object; this metric history line is dropped", stacklevel=2
                    )
                elif problem := metric_entry_problem(entry):  # what plot reads of it: the new history plots whole
                    warnings.warn(
                        f"{path}:{line_no}: not a metric entry ({problem}); this metric history line is dropped",
                        stacklevel=2,
                    )
                else:
                    entries.append(entry)
        except UserError as err:  # the run has begun writing: it goes on, with the history it could read
            warnings.warn(f"{err}; the metric history is carried on from the lines before it", stacklevel=2)
        return cls(names, entries)

    def add(self, kind: str, epoch: int, step: int, consumed_samples: int, **values: float) -> None:
        entry = {"type": kind, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "epoch": epoch, "step": step}
        self.entries.append({**entry, "consumed_samples": consumed_samples, **values})

    def add_step(self, record: dict[str, Any], loss_metrics: list[str], epoch: int, consumed_samples: int) -> None:
        """A step entry: the loss function's metrics, then the requested names the record has (AstrAI's choice)."""
        chosen = [*loss_metrics, *(n for n in self.names if n not in loss_metrics)]
        values = {n: record[n] for n in chosen if n in record and record[n] is not None}
        self.add("step", epoch, record["step"], consumed_samples, **values)

    def text(self) -> str:
        return "".join(json.dumps(entry) + "\n" for entry in self.entries)


BLOCK_NUMEL = 1 << 16
"""Gradient entries ``GradSNR`` updates together: a block's gradients, EMAs and differences (256 KiB each in
float32) stay in a core's L2 cache across the four passes over them, instead of streaming from memory four times;
on the 5M-parameter bench model this takes the update from ~10 to ~6 ms on one thread. A larger tensor is a
block of its own."""


class GradSNR:
    """AstrAI's gradient signal-to-noise ratio in dB: ``10 log10(sum m^2 / sum(v - m^2))`` over all gradient
    entries, with ``m``/``v`` EMAs (beta 0.999) of ``g`` and ``g^2``.

    Departure from AstrAI's computation (not its formula): ``v`` is never stored. Its only use is the total
    ``N = sum(v - m^2)``, and with ``d = g - m`` (``m`` before the update) each entry's ``v - m^2`` becomes
    ``beta (v - m^2 + (1 - beta) d^2)`` exactly, so ``N`` is one float updated from ``sum d^2``. That keeps one
    gradient-sized buffer instead of two, makes 4 operations over the gradients a step instead of 8, and
    sums non-negative terms where AstrAI subtracts two float32 EMAs that agree to a few digits at high SNR (its
    clamp at 0 hides the cancellation): this is the exact formula to ~1e-7, where the float32 difference is off by
    ~1e-4 at 50 dB (tests/test_reporting.py). Sharded gradients give the same value as unsharded ones: each sum
    takes one reduction per device mesh.

    A second departure, where AstrAI's and ours could not agree anyway: the one noise total belongs to one set of
    parameters, so when the parameters that have gradients change (a parameter a step did not use; AstrAI keeps
    its stale moments and updates the rest), the EMAs start again from that step, with a warning. The models this
    package builds give every parameter a gradient every step (MoE experts run on empty slices, model/ffn.py).

    The loop folds a step's gradients in before it reads whether they are finite (``update_on_device``: nothing is
    read back, the step reads the totals with its other numbers and ``value`` makes the dB), so after a skipped
    step, whose gradients were not finite, it starts the averages again (``restart``). The same pass gives the
    step its gradient norm (``grad_norm``): each block's gradients are in cache for their norms, where
    ``global_norm`` would read every gradient from memory once more, and the value is ``global_norm``'s to the
    last bit (the same per-tensor norms, combined in the same order: tests/test_reporting.py)."""

    def __init__(
        self,
        beta: float = 0.999,
        eps: float = 1e-8,
        counted: Callable[[str], bool] | None = None,
        over_stages: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """``counted`` and ``over_stages`` (pipeline parallelism, ``parallel.pipeline``): which of a stage's parameters
        (by name) are its own (a tied head's copy is the first stage's), and a stage's norm made the whole model's."""
        self.beta, self.eps = beta, eps
        self.counted, self.over_stages = counted, over_stages
        self.first: list[Tensor] = []
        self.noise: Tensor | float = 0.0
        """``sum(v - m^2)`` over all entries (float64, on the gradients' device): 0 after the first step, where
        AstrAI's ``v`` and ``m^2`` are both ``g^2``."""
        self.blocks: list[list[int]] = []
        self.with_grads: list[int] = []
        """Which of the model's parameters (by position) the EMAs are of."""
        self.grad_norm: Tensor | None = None
        """The last update's gradient norm (``global_norm`` of the gradients it folded in), on the device."""

    @torch.no_grad()
    def update(self, model: nn.Module) -> float:
        """Fold in the current gradients and return the SNR (collective under FSDP/TP: every rank calls it)."""
        return self.value(self.update_on_device(model))

    @torch.no_grad()
    def update_on_device(self, model: nn.Module) -> Tensor:
        """``update`` without reading anything back: the float64 pair (signal, noise) on the gradients' device,
        for ``value`` once the step reads its numbers together (``loop.step``)."""
        parameters = [p for name, p in model.named_parameters() if self.counted is None or self.counted(name)]
        with_grads = [i for i, p in enumerate(parameters) if p.grad is not None]
        grads_as_they_are = [parameters[i].grad.detach() for i in with_grads]
        grads = [g.float() for g in grads_as_they_are]  # the same tensors where they are float32
        if self.first and with_grads != self.with_grads:
            warnings.warn(
                "grad_snr: the parameters that have gradients changed; its averages start again here", stacklevel=3
            )
            self.restart()
        first_norms: list[Tensor] = []
        delta_norms: list[Tensor] = []
        grad_norms: list[Tensor] = []
        if not self.first:
            self.with_grads = with_grads
            self.first = [g.clone() for g in grads]
            self.blocks = _blocks(grads)
            for block in self.blocks:
                grad_norms += foreach_norm([grads_as_they_are[i] for i in block])
                first_norms += foreach_norm([self.first[i] for i in block])
        else:
            for block in self.blocks:
                block_grads, block_first = [grads[i] for i in block], [self.first[i] for i in block]
                grad_norms += foreach_norm([grads_as_they_are[i] for i in block])  # while the block is in cache
                deltas = foreach_sub(block_grads, block_first)  # d = g - m
                delta_norms += foreach_norm(deltas)
                foreach_add_(block_first, deltas, alpha=1 - self.beta)  # m <- m + (1 - beta) d
                first_norms += foreach_norm(block_first)
        summed_over = expert_meshes(model)  # expert parallelism: a rank's norms are of its own experts
        whole = self.over_stages or (lambda norm: norm)

        def norm_of(norms: list[Tensor]) -> Tensor:
            return whole(norm_from_norms(norms, summed_over))

        self.grad_norm = norm_of(grad_norms)
        signal = norm_of(first_norms).double() ** 2
        if delta_norms:
            delta = norm_of(delta_norms).double() ** 2
            self.noise = self.beta * (self.noise + (1 - self.beta) * delta)
        else:
            self.noise = torch.zeros_like(signal)
        return torch.stack([signal, self.noise])

    def value(self, signal_and_noise: Tensor | list[float]) -> float:
        """The SNR in dB from ``update_on_device``'s pair (the same float64 arithmetic AstrAI does in Python)."""
        signal, noise = (float(x) for x in signal_and_noise)
        return 10.0 * math.log10(max(signal / (noise + self.eps), self.eps))

    def restart(self) -> None:
        """Forget the averages: the next update starts them again from its gradients."""
        self.first, self.noise = [], 0.0


def _blocks(tensors: list[Tensor]) -> list[list[int]]:
    """Consecutive indices grouped into blocks of at most ``BLOCK_NUMEL`` entries (or one larger tensor), each on
    one device mesh (torch's foreach norm takes one mesh at a time; tensor parallelism puts some on another)."""
    blocks: list[list[int]] = []
    numel, mesh = 0, None
    for index, tensor in enumerate(tensors):
        tensor_mesh = getattr(tensor, "device_mesh", None)
        if not blocks or numel + tensor.numel() > BLOCK_NUMEL or tensor_mesh != mesh:
            blocks.append([])
            numel, mesh = 0, tensor_mesh
        blocks[-1].append(index)
        numel += tensor.numel()
    return blocks


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` for the weights plus ``12 L H S`` for attention (the PaLM paper's count;
    MoE layers count all experts, so MFU is an upper bound there)."""
    num_parameters = count_parameters(config)  # from the config: nothing built
    return 6 * num_parameters + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_flops(device: torch.device, precision: str, given: float | None) -> float | None:
    """Peak FLOP/s of one device: ``--peak_flops`` when given, Lightning's table for known CUDA devices, else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    # Deferred: plot.py imports this module (METRIC_FILE) and must not import Lightning (~17 s here).
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    return get_available_flops(device, dtype)
