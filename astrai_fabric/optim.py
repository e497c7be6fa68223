"""Optimizers: AstrAI's ``muon_adamw`` (the default) and plain ``adamw`` (AstrAI's ``astrai/optim``).

``muon_adamw`` splits parameters by name, as AstrAI does: a parameter is a *matrix* when it has at least two
dimensions and its name contains none of ``norm``, ``bias``, ``embed``, ``lm_head``. Matrices go to
``torch.optim.Muon`` (weight decay ``--weight_decay``), everything else to AdamW (betas 0.9/0.95, no decay).
``optimizer.pt`` keeps AstrAI's layout ``{"muon": ..., "adamw": ...}``, each a standard torch state dict
indexed in ``named_parameters()`` order.

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
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import AdamW, Muon, Optimizer

from astrai_fabric.errors import CheckpointError

ADAMW_BETAS = (0.9, 0.95)
NON_MATRIX_NAME_PARTS = ("norm", "bias", "embed", "lm_head")


def is_matrix_param(name: str, param: Tensor) -> bool:
    """AstrAI's Muon/AdamW split (names may carry wrapper prefixes; they do not change the answer)."""
    return param.dim() >= 2 and not any(part in name for part in NON_MATRIX_NAME_PARTS)


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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)  # torch's: creates momentum buffers exactly as torch does
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


class MuonAdamW(Optimizer):
    """Muon for matrices plus AdamW for the rest, stepped together (AstrAI's ``muon_adamw``)."""

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
        self.muon = MuonNS(
            matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
        )  # fmt: skip
        self.adamw = AdamW(
            [{"params": others, "weight_decay": 0.0}], lr=lr, betas=ADAMW_BETAS, **_fused_if_possible(others)
        )
        super().__init__([p for _, p in named], {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups  # one list, so schedulers see both

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise CheckpointError(
                f"optimizer state has keys {sorted(state_dict)}, but muon_adamw saves {{'muon', 'adamw'}}: the "
                "checkpoint was trained with another optimizer (set --optimizer to match)"
            )
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @property
    def sub_optimizers(self) -> dict[str, Optimizer]:
        return {"muon": self.muon, "adamw": self.adamw}


def _fused_if_possible(params: list[Tensor]) -> dict[str, bool]:
    """Fused AdamW where torch supports it for these tensors (plain tensors on CPU or CUDA), else foreach."""
    plain = params and not any(isinstance(p, DTensor) for p in params)
    floating = all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    return {"fused": True} if plain and floating else {}


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    adjust_lr_fn: str = "match_rms_adamw",
    ns_dtype: torch.dtype = torch.bfloat16,
) -> Optimizer:
    """``muon_adamw`` or ``adamw`` over ``model``'s trainable parameters (build after ``fabric.setup``)."""
    named = list(model.named_parameters())
    if name == "muon_adamw":
        return MuonAdamW(named, lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn, ns_dtype)
    if name == "adamw":
        decay = [p for n, p in named if p.requires_grad and is_matrix_param(n, p)]
        no_decay = [p for n, p in named if p.requires_grad and not is_matrix_param(n, p)]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return AdamW(groups, lr=lr, betas=ADAMW_BETAS, **_fused_if_possible(decay + no_decay))
    raise ValueError(f"unknown optimizer {name!r}")


def optimizer_state_bytes(model: nn.Module, name: str) -> int:
    """Bytes the optimizer's state will hold for ``model``'s trainable parameters, all ranks together: AdamW keeps
    two moments per entry, Muon one momentum per matrix entry, each in the parameter's dtype."""
    total = 0
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            buffers = 1 if name == "muon_adamw" and is_matrix_param(param_name, param) else 2
            total += buffers * param.numel() * param.element_size()
    return total
