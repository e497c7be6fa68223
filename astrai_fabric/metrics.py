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
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from astrai_fabric.config.model import ModelConfig

METRIC_FILE = "metric.jsonl"
KNOWN_METRICS = (
    "loss", "lr", "grad_norm", "grad_snr", "val_loss", "moe_aux_loss", "router_entropy", "dead_expert_fraction",
    "load_imbalance_mean", "load_imbalance_max", "tokens_per_sec", "samples_per_sec", "mfu",
)  # fmt: skip
"""Names ``--metrics`` accepts: AstrAI's, plus throughput (``tokens_per_sec``, ``samples_per_sec``, ``mfu``)."""


class MetricLog:
    """AstrAI's cumulative metric log; rank 0 keeps it and every checkpoint gets a copy."""

    def __init__(self, names: list[str], entries: list[dict[str, Any]] | None = None) -> None:
        self.names = [n for n in names if n != "val_loss"]
        self.entries = list(entries or [])

    @classmethod
    def resumed(cls, names: list[str], checkpoint_dir: Path | None) -> MetricLog:
        """The log of the checkpoint a run resumes from (empty for a fresh run or a checkpoint without one)."""
        path = checkpoint_dir / METRIC_FILE if checkpoint_dir is not None else None
        if path is None or not path.is_file():
            return cls(names)
        entries = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                entry = None
            if isinstance(entry, dict):
                entries.append(entry)
            else:
                warnings.warn(f"{path}:{line_no}: not a JSON object; this metric history line is dropped", stacklevel=2)
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
    takes one reduction per device mesh."""

    def __init__(self, beta: float = 0.999, eps: float = 1e-8) -> None:
        self.beta, self.eps = beta, eps
        self.first: list[Tensor] = []
        self.noise = 0.0
        """``sum(v - m^2)`` over all entries: 0 after the first step, where AstrAI's ``v`` and ``m^2`` are both
        ``g^2``."""
        self.blocks: list[list[int]] = []

    @torch.no_grad()
    def update(self, model: nn.Module) -> float:
        """Fold in the current gradients and return the SNR (collective under FSDP/TP: every rank calls it)."""
        grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
        first_norms: list[Tensor] = []
        delta_norms: list[Tensor] = []
        if not self.first:
            self.first = [g.clone() for g in grads]
            self.blocks = _blocks(grads)
            for block in self.blocks:
                first_norms += torch._foreach_norm([self.first[i] for i in block])
        else:
            for block in self.blocks:
                block_grads, block_first = [grads[i] for i in block], [self.first[i] for i in block]
                deltas = torch._foreach_sub(block_grads, block_first)  # d = g - m
                delta_norms += torch._foreach_norm(deltas)
                torch._foreach_add_(block_first, deltas, alpha=1 - self.beta)  # m <- m + (1 - beta) d
                first_norms += torch._foreach_norm(block_first)
        in_order = [grads[i] for block in self.blocks for i in block]  # the order the norms are in
        if delta_norms:
            self.noise = self.beta * (self.noise + (1 - self.beta) * _sum_of_squares(delta_norms, in_order))
        signal = _sum_of_squares(first_norms, in_order)
        return 10.0 * math.log10(max(signal / (self.noise + self.eps), self.eps))


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


def _sum_of_squares(norms: list[Tensor], tensors: list[Tensor]) -> float:
    """The sum of squares of all entries of (possibly sharded) ``tensors``, from their per-tensor L2 ``norms``:
    one reduction per device mesh (torch's ``get_total_norm`` combines sharded norms the same way)."""
    by_mesh: dict[object, list[Tensor]] = {}
    for norm, tensor in zip(norms, tensors, strict=True):
        by_mesh.setdefault(getattr(tensor, "device_mesh", None), []).append(norm)
    total = 0.0
    for group in by_mesh.values():
        norm = torch.linalg.vector_norm(torch.stack(group))
        total += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    return total


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` for the weights plus ``12 L H S`` for attention (the PaLM paper's count;
    MoE layers count all experts, so MFU is an upper bound there)."""
    return 6 * num_parameters(config) + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def num_parameters(config: ModelConfig) -> int:
    """Parameters of the model ``config`` describes, counted on the meta device (nothing is allocated)."""
    from astrai_fabric.model import AutoRegressiveLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoRegressiveLM(config).parameters())


def peak_flops(device: torch.device, precision: str, given: float | None) -> float | None:
    """Peak FLOP/s of one device: ``--peak_flops`` when given, Lightning's table for known CUDA devices, else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    return get_available_flops(device, dtype)
