"""Optimizers, by ``--optimizer``: AstrAI's ``muon_adamw`` (the default), ``nora_nadamw`` and ``mano_adamw``, and
plain ``adamw``. One module each (``muon``, ``nora``, ``mano``); ``composite`` holds the parameter splits and the
composite whose ``optimizer.pt`` keeps AstrAI's ``{part: state_dict or None}`` layout. Build after
``fabric.setup``: an optimizer built before would step the pre-shard tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer

from astrai_fabric.optim.composite import CompositeOptimizer, fused_if_possible, is_matrix_param, split_by_role
from astrai_fabric.optim.mano import Mano, ManoAdamW
from astrai_fabric.optim.muon import ADAMW_BETAS, MuonAdamW, MuonNS, newton_schulz, resolve_ns_dtype
from astrai_fabric.optim.muon_owners import resolve_spread_replicated
from astrai_fabric.optim.nora import NAdamW, Nora, NoraNAdamW

__all__ = [
    "CompositeOptimizer", "Mano", "ManoAdamW", "MuonAdamW", "MuonNS", "NAdamW", "Nora", "NoraNAdamW", "OptimArgs",
    "build_optimizer", "is_matrix_param", "newton_schulz", "optimizer_groups", "optimizer_state_bytes",
    "resolve_ns_dtype", "resolve_spread_replicated",
]  # fmt: skip

OPTIMIZERS = ("muon_adamw", "adamw", "nora_nadamw", "mano_adamw")
STATE_BUFFERS = {"muon": 1, "nora": 1, "mano": 1, "adamw": 2, "nadamw": 2}
"""State tensors per parameter entry of each part: one momentum, or AdamW's two moments."""


class GroupPlan(NamedTuple):
    """One parameter group as ``build_optimizer`` makes it."""

    part: str
    params: list[Tensor]
    lr: float
    weight_decay: float


@dataclass(frozen=True)
class OptimArgs:
    """The flags the optimizer reads (``TrainArgs`` documents each under its flag name), with the defaults of
    ``--optimizer``'s parts; ``train.plan.optim_args`` takes them from the flags."""

    name: str = "muon_adamw"
    """``--optimizer``, resolved (``OPTIMIZERS``)."""
    lr: float = 3e-4
    """``--max_lr``: every group's peak learning rate but Nora's."""
    weight_decay: float = 0.1
    momentum: float = 0.95
    """``--muon_momentum``."""
    nesterov: bool = True
    """``--muon_nesterov``."""
    ns_steps: int = 5
    """``--muon_ns_steps``."""
    adjust_lr_fn: str = "match_rms_adamw"
    """``--muon_adjust_lr``."""
    ns_dtype: torch.dtype = torch.bfloat16
    """``--muon_ns_dtype``, resolved for the device (``resolve_ns_dtype``)."""
    nora_lr: float = 5e-3
    nora_weight_decay: float = 0.0
    """``--nora_weight_decay``, resolved (it follows ``weight_decay`` when not given)."""
    nora_beta: float = 0.95
    nora_momentum: float = 0.95
    mano_momentum: float = 0.95
    mano_nesterov: bool = True
    muon_spread_replicated: bool = False
    """Under DDP, each matrix orthogonalised by one rank and the results all-gathered (``MuonNS``'s
    ``spread_replicated``; ``--muon_spread_replicated`` resolved by ``resolve_spread_replicated``). FSDP's and
    HSDP's sharded matrices are spread regardless."""


def optimizer_groups(model: nn.Module, args: OptimArgs) -> list[GroupPlan]:
    """The parameter groups of ``args.name`` over ``model``'s trainable parameters, as AstrAI makes them:
    ``nora_nadamw`` and ``mano_adamw`` leave empty groups out, ``muon_adamw`` and ``adamw`` keep both of theirs. For
    the plan and the dry run's memory estimate, without building the optimizer."""
    lr, weight_decay = args.lr, args.weight_decay
    if args.name in ("muon_adamw", "adamw"):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        matrices = [p for n, p in named if is_matrix_param(n, p)]
        others = [p for n, p in named if not is_matrix_param(n, p)]
        first = "muon" if args.name == "muon_adamw" else "adamw"
        return [GroupPlan(first, matrices, lr, weight_decay), GroupPlan("adamw", others, lr, 0.0)]
    if args.name in ("nora_nadamw", "mano_adamw"):
        split = split_by_role(model)
        nora = args.name == "nora_nadamw"
        matrix_part, rest = ("nora", "nadamw") if nora else ("mano", "adamw")
        matrix_lr, matrix_decay = (args.nora_lr, args.nora_weight_decay) if nora else (lr, weight_decay)
        groups = [
            GroupPlan(matrix_part, split.matrices, matrix_lr, matrix_decay),
            GroupPlan(rest, split.decay, lr, weight_decay),
            GroupPlan(rest, split.no_decay, lr, 0.0),
        ]
        return [group for group in groups if group.params]
    raise ValueError(f"unknown optimizer {args.name!r}; choose from {list(OPTIMIZERS)}")


def build_optimizer(model: nn.Module, args: OptimArgs) -> Optimizer:
    """``args.name`` over ``model``'s trainable parameters; ``momentum``, ``nesterov``, ``ns_*`` and
    ``adjust_lr_fn`` are Muon's, ``nora_*`` Nora's, ``mano_*`` Mano's (AstrAI gives Mano Muon's two, B17)."""
    if args.name == "muon_adamw":
        return MuonAdamW(
            model.named_parameters(),
            args.lr,
            args.weight_decay,
            args.momentum,
            args.nesterov,
            args.ns_steps,
            args.adjust_lr_fn,
            args.ns_dtype,
            args.muon_spread_replicated,
        )
    if args.name == "nora_nadamw":
        return NoraNAdamW(
            model, args.lr, args.weight_decay, args.nora_lr, args.nora_weight_decay, args.nora_beta, args.nora_momentum
        )
    if args.name == "mano_adamw":
        return ManoAdamW(model, args.lr, args.weight_decay, args.mano_momentum, args.mano_nesterov)
    groups = optimizer_groups(model, args)  # adamw: decay on matrices only
    params = [p for group in groups for p in group.params]
    torch_groups = [{"params": group.params, "weight_decay": group.weight_decay} for group in groups]
    return AdamW(torch_groups, lr=args.lr, betas=ADAMW_BETAS, **fused_if_possible(params))


def optimizer_state_bytes(groups: list[GroupPlan], entry_bytes: Callable[[Tensor], int] = Tensor.element_size) -> int:
    """Bytes the optimizer's state will hold for the parameters of ``groups`` (``optimizer_groups``), all ranks
    together, each buffer in its parameter's dtype (``STATE_BUFFERS``): ``entry_bytes(param)``, by default the
    parameter's as it is."""
    return sum(
        STATE_BUFFERS[group.part] * param.numel() * entry_bytes(param) for group in groups for param in group.params
    )
