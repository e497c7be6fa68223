"""What every optimizer here shares: AstrAI's two parameter splits, the composite that steps several torch
optimizers as one (``optimizer.pt`` is ``{part: state_dict or None}``, AstrAI's layout), and the rule for updates
whose reductions run along one dimension of a sharded (DTensor) matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement
from torch.optim import Optimizer

from astrai_fabric.errors import CheckpointError
from astrai_fabric.lora import LoRALinear
from astrai_fabric.model.layers import Embedding, Linear, RMSNorm

HEAD_NAMES = ("lm_head", "score")
"""The output heads (a language model's, a reward model's): AdamW's, as embeddings are, never a matrix optimizer's."""
NON_MATRIX_NAME_PARTS = ("norm", "bias", "embed", *HEAD_NAMES)


def is_matrix_param(name: str, param: Tensor) -> bool:
    """``muon_adamw``'s split, by name (wrapper prefixes such as ``_orig_mod.`` do not change the answer)."""
    return param.dim() >= 2 and not any(part in name for part in NON_MATRIX_NAME_PARTS)


@dataclass(frozen=True)
class RoleSplit:
    """``nora_nadamw``'s and ``mano_adamw``'s split, by module role (AstrAI's ``partition_optimizer_parameters``);
    each list in ``model.parameters()`` order, a tied embedding once."""

    matrices: list[Tensor]
    """2-D weights of ``Linear`` layers other than the heads (``lm_head``, ``score``): Nora or Mano."""
    decay: list[Tensor]
    """Other parameters with two or more dimensions: (N)AdamW with ``--weight_decay``. Empty for every model this
    package builds (AstrAI's too), which is why ``--weight_decay`` never reached a parameter under AstrAI's
    ``nora_nadamw`` (B18)."""
    no_decay: list[Tensor]
    """Embeddings, norms, biases, the heads, LoRA layers' own parameters, anything 1-D: (N)AdamW without decay."""


def split_by_role(model: nn.Module) -> RoleSplit:
    """Trainable parameters of ``model`` by the module that owns them (see ``RoleSplit``)."""
    matrix_ids: set[int] = set()
    no_decay_ids: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear | Embedding | RMSNorm):  # LoRALinear before Linear: it is one
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, Linear):
            if module.bias is not None:
                no_decay_ids.add(id(module.bias))
            head = module_name.rsplit(".", 1)[-1] in HEAD_NAMES
            (no_decay_ids if head else matrix_ids).add(id(module.weight))
    split = RoleSplit([], [], [])
    for param in model.parameters():  # deduplicated by torch: a tied weight is met once, as the embedding
        if not param.requires_grad:
            continue
        if id(param) in no_decay_ids or param.dim() <= 1:
            split.no_decay.append(param)
        elif id(param) in matrix_ids:
            split.matrices.append(param)
        else:
            split.decay.append(param)
    return split


def decay_groups(split: RoleSplit, weight_decay: float) -> list[dict[str, Any]]:
    """The (N)AdamW groups of a role split: decay, then no decay, each only when it has parameters (AstrAI's
    layout: ``optimizer.pt`` indexes parameters across the groups in this order)."""
    groups = [{"params": split.decay, "weight_decay": weight_decay}, {"params": split.no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """``Optimizer.step``'s closure contract: evaluated once, with gradients on, before any update."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def fused_if_possible(params: list[Tensor]) -> dict[str, bool]:
    """Fused AdamW where torch supports it for these tensors (plain tensors on CPU or CUDA), else foreach."""
    plain = params and not any(isinstance(p, DTensor) for p in params)
    floating = all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    return {"fused": True} if plain and floating else {}


class AlongDim:
    """Sums and norms along one dimension of a matrix whose rows or columns may be split across ranks: each rank
    reduces its own block, then one all-reduce per mesh dimension that splits ``dim`` completes the sum, so a
    sharded update equals the single-process one within float32 reduction order, with no matrix gathered.

    With no ``groups`` (a plain tensor, or shards that keep ``dim`` whole) these are torch's own ``sum`` and
    ``norm``, so one process computes exactly what it always did."""

    def __init__(self, dim: int, groups: Sequence[dist.ProcessGroup] = ()) -> None:
        self.dim = dim
        self.groups = tuple(groups)

    def sum(self, tensor: Tensor) -> Tensor:
        total = tensor.sum(dim=self.dim, keepdim=True)
        for group in self.groups:
            dist.all_reduce(total, group=group)
        return total

    def norm(self, tensor: Tensor) -> Tensor:
        if not self.groups:
            return tensor.norm(dim=self.dim, keepdim=True)
        return self.sum(tensor.square()).sqrt()


def mesh_dims_splitting(placements: Sequence[Placement], dim: int, ndim: int) -> list[int]:
    """The mesh dimensions whose placements split tensor dimension ``dim``: ``Shard(dim)`` and the strided shard
    FSDP2 lays over tensor parallelism's (torch's ``_StridedShard``, which is not a ``Shard`` and answers False to
    ``is_shard``; both carry the ``dim`` they split, ``Replicate`` and ``Partial`` none)."""
    return [
        mesh_dim
        for mesh_dim, placement in enumerate(placements)
        if getattr(placement, "dim", None) is not None and placement.dim % ndim == dim % ndim
    ]


def along_dim(fn: Callable[[Tensor, Tensor, AlongDim], Tensor], dim: int, update: Tensor, param: Tensor) -> Tensor:
    """``fn(update, param, along)`` for an ``fn`` whose reductions along ``dim`` all go through ``along``
    (``AlongDim``), on plain tensors or DTensors.

    A DTensor computes on its local block; where its placements split ``dim`` (FSDP's row shards for a
    column-wise update, tensor parallelism's column shards for a row-wise one) ``along`` all-reduces the partial
    sums over those mesh dimensions: a vector per matrix crosses the ranks, where gathering the update and the
    parameter whole on every rank (the earlier path) moved both matrices.
    """
    if not isinstance(update, DTensor):
        return fn(update, param, AlongDim(dim))
    mesh, placements = param.device_mesh, param.placements
    if update.placements != placements:
        update = update.redistribute(mesh, placements)
    groups = [mesh.get_group(mesh_dim) for mesh_dim in mesh_dims_splitting(placements, dim, param.dim())]
    local = fn(update.to_local(), param.to_local(), AlongDim(dim, groups))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


class CompositeOptimizer(Optimizer):
    """Named torch optimizers stepped as one, each over its own parameters; a part without parameters is None.

    ``state_dict()`` is ``{part: part.state_dict() or None}``, AstrAI's ``optimizer.pt`` layout, each part indexed
    by position over its own groups. ``param_groups`` is every part's groups in part order (one list, so
    schedulers, clipping and the logged ``lr``, AstrAI's ``param_groups[-1]``, see all of them).
    """

    name: ClassVar[str]
    """The ``--optimizer`` this composite is, for messages."""

    def __init__(self, parts: dict[str, Optimizer | None]) -> None:
        self.parts = parts
        groups = self._joined_groups()
        if not groups:
            raise ValueError(f"{self.name}: the model has no trainable parameters")
        super().__init__([p for group in groups for p in group["params"]], {"lr": groups[0]["lr"]})
        self.param_groups = groups

    def _joined_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts.values() if part is not None for group in part.param_groups]

    @property
    def sub_optimizers(self) -> dict[str, Optimizer | None]:
        return self.parts

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = evaluate_closure(closure)
        for part in self.parts.values():
            if part is not None:
                part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            if part is not None:
                part.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() if part is not None else None for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.parts):
            raise CheckpointError(
                f"optimizer state has keys {sorted(state_dict)}, but {self.name} saves {sorted(self.parts)}: the "
                "checkpoint was trained with another optimizer (set --optimizer to match)"
            )
        for name, part in self.parts.items():
            if (part is None) != (state_dict[name] is None):
                holds = "no" if state_dict[name] is None else "some"
                raise CheckpointError(
                    f"optimizer state holds {holds} {name!r} parameters, but this run's model has "
                    f"{'none' if part is None else 'some'}: the checkpoint was trained on another model"
                )
            if part is not None:
                part.load_state_dict(state_dict[name])
        self.param_groups = self._joined_groups()
