"""``nora_nadamw`` (AstrAI's): Nora for the ``Linear`` matrices, Nesterov AdamW for the rest (``RoleSplit``).

Nora (normalised orthogonal row alignment) keeps an EMA of the gradient, mixes it with the gradient Nesterov's
way, projects each row of that update onto the tangent space of its (normalised) parameter row and scales it to
unit norm: ``p <- p * (1 - lr * wd) - lr * sqrt(max(1, rows / cols)) * direction``. NAdamW is AdamW with the
Nesterov first moment ``(beta1 * m + (1 - beta1) * g) / (1 - beta1^t)``. Group keys and state keys are AstrAI's
(``momentum_buffer``; ``step`` as an int, ``m``, ``v``), so ``optimizer.pt`` crosses both ways.

Departure: AstrAI's ``nora_weight_decay`` defaults to 0.0 and its ``--weight_decay`` reaches only a NAdamW group
that is empty for every built-in model, so its default run decays nothing (B18); here the Nora matrices' decay
defaults to ``--weight_decay`` (``TrainArgs.resolved_nora_weight_decay``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from astrai_fabric.optim.composite import (
    AlongDim,
    CompositeOptimizer,
    along_dim,
    decay_groups,
    evaluate_closure,
    split_by_role,
)

NORA_EPS = 1e-10
NADAMW_BETAS = (0.9, 0.999)
NADAMW_EPS = 1e-8


def unit_rows(matrix: Tensor, along: AlongDim, eps: float) -> Tensor:
    return matrix / along.norm(matrix).clamp(min=eps)


def nora_direction(update: Tensor, param: Tensor, along: AlongDim, eps: float = NORA_EPS) -> Tensor:
    """Each row of ``update`` minus its component along the parameter's row, scaled to unit norm (in float32);
    ``along`` reduces along the rows (``AlongDim(-1)``)."""
    rows = unit_rows(param.float(), along, eps)
    update32 = update.float()
    tangent = update32 - along.sum(update32 * rows) * rows
    return unit_rows(tangent, along, eps).to(update.dtype)


class Nora(Optimizer):
    """Nora over 2-D matrices (see the module's docstring); ``momentum`` is the Nesterov mix, ``beta`` the EMA."""

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 5e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        beta: float = 0.95,
        nesterov: bool = True,
        eps: float = NORA_EPS,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "beta": beta,
            "nesterov": nesterov,
            "eps": eps,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, direction_of = group["lr"], partial(nora_direction, eps=group["eps"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"].lerp_(grad, 1 - group["beta"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                direction = along_dim(direction_of, -1, update, param)  # rows: whole under FSDP; TP's sums all-reduced
                rows, cols = param.shape  # global shape for a DTensor
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(direction, alpha=-lr * max(1.0, rows / cols) ** 0.5)
        return loss


class NAdamW(Optimizer):
    """AdamW with a Nesterov first moment (see the module's docstring)."""

    def __init__(
        self,
        params: list[dict[str, Any]],
        lr: float = 3e-4,
        betas: tuple[float, float] = NADAMW_BETAS,
        eps: float = NADAMW_EPS,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            (beta1, beta2), lr = group["betas"], group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if not state:
                    state.update(step=0, m=torch.zeros_like(param), v=torch.zeros_like(param))
                state["step"] += 1
                state["m"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                nesterov = (state["m"] * beta1 + grad * (1 - beta1)) / (1 - beta1 ** state["step"])
                denominator = (state["v"] / (1 - beta2 ** state["step"])).sqrt().add_(group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.addcdiv_(nesterov, denominator, value=-lr)
        return loss


class NoraNAdamW(CompositeOptimizer):
    """Nora for the ``Linear`` matrices, NAdamW for the rest (AstrAI's ``nora_nadamw``)."""

    name = "nora_nadamw"

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float = 0.1,
        nora_lr: float = 5e-3,
        nora_weight_decay: float = 0.0,
        nora_beta: float = 0.95,
        nora_momentum: float = 0.95,
    ) -> None:
        split = split_by_role(model)
        nora = (
            Nora(split.matrices, lr=nora_lr, weight_decay=nora_weight_decay, momentum=nora_momentum, beta=nora_beta)
            if split.matrices
            else None
        )
        groups = decay_groups(split, weight_decay)
        super().__init__({"nora": nora, "nadamw": NAdamW(groups, lr=lr) if groups else None})
