"""``mano_adamw`` (AstrAI's): Mano for the ``Linear`` matrices, AdamW for the rest (``RoleSplit``).

Mano (manifold-normalised optimisation, arXiv 2601.23000) replaces Muon's Newton-Schulz iteration with a
projection and a normalisation along one dimension, alternating between columns (dim 0) and rows (dim 1) from
one step to the next: ``u = g + momentum * buf`` (Nesterov; ``buf = momentum * buf + g``), ``t = u - sum(u * p,
dim) * p``, ``p <- p * (1 - lr * wd) - 0.2 * lr * sqrt(shape[dim]) * t / (|t|_dim + eps)``. As in AstrAI the
parameter is not normalised before the projection, and the step counter that picks the dimension is a group key
(``steps``), so it is saved in ``optimizer.pt`` and the alternation continues across a resume.

Departure: AstrAI passes ``--muon_momentum``/``--muon_nesterov`` to Mano and drops ``--mano_*`` (B17); here
``--mano_momentum``/``--mano_nesterov`` are Mano's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer

from astrai_fabric.optim.composite import (
    AlongDim,
    CompositeOptimizer,
    along_dim,
    decay_groups,
    evaluate_closure,
    fused_if_possible,
    split_by_role,
)
from astrai_fabric.optim.muon import ADAMW_BETAS

MANO_EPS = 1e-8


def mano_direction(update: Tensor, param: Tensor, along: AlongDim, eps: float = MANO_EPS) -> Tensor:
    """``update`` minus its projection on ``param`` along ``along.dim``, normalised along it (eps added)."""
    tangent = update - along.sum(update * param) * param
    return tangent / (along.norm(tangent) + eps)


class Mano(Optimizer):
    """Mano over 2-D matrices (see the module's docstring)."""

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        eps: float = MANO_EPS,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "eps": eps,
            "steps": 0,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, momentum, dim = group["lr"], group["momentum"], group["steps"] % 2
            direction_of = partial(mano_direction, eps=group["eps"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"].mul_(momentum).add_(grad)
                update = grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
                direction = along_dim(direction_of, dim, update, param)  # dim 0's sums all-reduced under FSDP
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(direction, alpha=-lr * 0.2 * param.shape[dim] ** 0.5)
            group["steps"] += 1
        return loss


class ManoAdamW(CompositeOptimizer):
    """Mano for the ``Linear`` matrices, AdamW (betas 0.9/0.95) for the rest (AstrAI's ``mano_adamw``)."""

    name = "mano_adamw"

    def __init__(
        self, model: nn.Module, lr: float, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True
    ) -> None:
        split = split_by_role(model)
        mano = (
            Mano(split.matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
            if split.matrices
            else None
        )
        groups = decay_groups(split, weight_decay)
        others = split.decay + split.no_decay
        adamw = AdamW(groups, lr=lr, betas=ADAMW_BETAS, **fused_if_possible(others)) if groups else None
        super().__init__({"mano": mano, "adamw": adamw})
