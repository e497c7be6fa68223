"""Norms of tensors spread over device meshes and process groups, the same on every rank: the gradient norm the
loop clips by and reports (``loop.step``, ``parallel.pipeline``) and GradSNR's (``metrics``). Imports only torch."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def by_device_mesh(tensors: Iterable[Tensor]) -> dict[Any, list[Tensor]]:
    """``tensors`` grouped by their device mesh (None for plain tensors): torch's norms and foreach kernels take one
    mesh at a time, and with tensor parallelism some gradients live on the 2-D mesh, the rest on the data axis."""
    groups: dict[Any, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return groups


def global_norm(
    groups: dict[Any, list[Tensor]], norm_type: float = 2.0, summed_over: Mapping[Any, Any] | None = None
) -> Tensor:
    """The ``norm_type`` norm of every entry of ``groups`` (``by_device_mesh``), the same on every rank, as a
    float32 scalar on the gradients' device (nothing read back): each mesh's norm on its own (one reduction per
    mesh; torch refuses one norm over two meshes), then those norms combined in float32. With one mesh (every
    strategy but tensor and expert parallelism) that is the mesh's norm exactly. ``summed_over``: meshes whose
    tensors are this rank's part of a larger set, by the process group holding the rest (expert parallelism's
    experts, ``expert_parallel.expert_meshes``): their norm is combined over that group as well."""
    per_mesh = {mesh: torch.nn.utils.get_total_norm(group, norm_type=norm_type) for mesh, group in groups.items()}
    return _combined(per_mesh, norm_type, summed_over)


def norm_from_norms(norms: list[Tensor], summed_over: Mapping[Any, Any] | None = None) -> Tensor:
    """The L2 norm (float32) of all entries of the (possibly sharded) tensors whose per-tensor L2 ``norms`` these
    are (GradSNR's, from norms its foreach kernels computed already): one reduction per device mesh, then
    combined, as ``global_norm`` does (``torch.nn.utils.get_total_norm`` stacks the per-tensor norms the same way)."""
    per_mesh = {mesh: torch.linalg.vector_norm(torch.stack(group)) for mesh, group in by_device_mesh(norms).items()}
    return _combined(per_mesh, 2.0, summed_over)


def _combined(norms: dict[Any, Tensor], norm_type: float, summed_over: Mapping[Any, Any] | None) -> Tensor:
    """The norm of disjoint parts from each part's norm, by mesh: each made whole (a DTensor's ``full_tensor``, one
    reduction), over ``summed_over``'s group too where it names the mesh, then combined in float32."""
    whole = []
    for mesh, norm in norms.items():
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()
        if summed_over and mesh in summed_over:
            norm = _over_group(norm, norm_type, summed_over[mesh])
        whole.append(norm)
    return torch.linalg.vector_norm(torch.stack([n.to(whole[0].device) for n in whole]), ord=norm_type)


def _over_group(norm: Tensor, norm_type: float, group: Any) -> Tensor:
    """The norm over every rank of ``group`` from each rank's ``norm`` of its own part."""
    if math.isinf(norm_type):
        total = norm.clone()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=group)
        return total
    total = norm.pow(norm_type)
    torch.distributed.all_reduce(total, group=group)
    return total.pow(1 / norm_type)
