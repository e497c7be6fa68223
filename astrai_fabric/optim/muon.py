"""``muon_adamw``, AstrAI's default: ``torch.optim.Muon`` for matrices, AdamW for the rest.

The split is by name (``composite.is_matrix_param``): matrices go to Muon (weight decay ``--weight_decay``),
everything else to AdamW (betas 0.9/0.95, no decay). ``optimizer.pt`` is ``{"muon": ..., "adamw": ...}``.

Muon's Newton-Schulz iteration: torch runs it in bfloat16, which on CPUs without bf16 matrix units is ~37x
slower than float32. ``MuonNS`` is ``torch.optim.Muon`` with the iteration's dtype as a per-instance setting; in
bfloat16 it *is* torch's step, and torch's Muon is untouched for any other code in the process. Under FSDP the
momentum-updated matrix is gathered once, orthogonalised whole, and sliced back to the local shard, so the update
equals the single-process one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import AdamW, Muon

from astrai_fabric.optim.composite import CompositeOptimizer, evaluate_closure, fused_if_possible, is_matrix_param
from astrai_fabric.torch_private import muon_init_group

ADAMW_BETAS = (0.9, 0.95)
"""AdamW's betas in ``muon_adamw`` and ``mano_adamw`` (torch's default second beta is 0.999)."""


def resolve_ns_dtype(ns_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 elsewhere (torch's and AstrAI's choice)."""
    if ns_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[ns_dtype]


def newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation (Muon), torch's algorithm with the working ``dtype`` a parameter."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    transposed = matrix.size(0) > matrix.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


class MuonNS(Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype`` (state and groups unchanged)."""

    def __init__(self, params: Iterable[Tensor], *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype  # an attribute, not a group key: optimizer.pt stays exactly torch's layout

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        has_dtensor = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        if self.ns_dtype == torch.bfloat16 and not has_dtensor:
            return super().step(closure)  # exactly torch's (and AstrAI's) update
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            muon_init_group(self, group, params, grads, buffers)  # torch's: creates momentum buffers as torch does
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buf in zip(params, grads, buffers, strict=True):
                # Torch's Muon step, with the orthogonalisation below as the only change.
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self._orthogonalise(update, group)
                rows, cols = param.shape[:2]
                if group["adjust_lr_fn"] == "match_rms_adamw":
                    adjusted_lr = lr * 0.2 * max(rows, cols) ** 0.5
                else:
                    adjusted_lr = lr * max(1.0, rows / cols) ** 0.5
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr)
        return loss

    def _orthogonalise(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        if not isinstance(update, DTensor):
            return newton_schulz(update, *args).to(update.dtype)
        # The iteration needs the whole matrix: gather it, orthogonalise it on every rank, keep the local shard.
        full = newton_schulz(update.full_tensor(), *args).to(update.dtype)
        return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(CompositeOptimizer):
    """Muon for matrices plus AdamW for the rest, stepped together (AstrAI's ``muon_adamw``)."""

    name = "muon_adamw"

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        matrices = [p for n, p in named if is_matrix_param(n, p)]
        others = [p for n, p in named if not is_matrix_param(n, p)]
        muon = MuonNS(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
        )
        adamw = AdamW([{"params": others, "weight_decay": 0.0}], lr=lr, betas=ADAMW_BETAS, **fused_if_possible(others))
        super().__init__({"muon": muon, "adamw": adamw})

    @property
    def muon(self) -> MuonNS:
        return self.parts["muon"]

    @property
    def adamw(self) -> AdamW:
        return self.parts["adamw"]
