"""Torch's private APIs, in one place: the only module of the package that touches a name torch keeps private (a
leading underscore in its module path or attribute). Each is wrapped below with what it is, why no public API does,
and where it is used; all were read in, and tested with, the torch versions in ``CHECKED_TORCH``.
tests/test_torch_private.py fails when another module touches a private torch name, when a wrapped API is missing
or takes other arguments, and, with a message naming it, when the installed torch is not one of those versions.

Light to import: torch only; the distributed and compile internals are imported on use, as their callers did
(``torch.distributed.tensor`` costs 0.7-4 s that ``generate`` and ``export`` never pay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

CHECKED_TORCH = ("2.13",)
"""The torch minor versions in which every API below was read and the tests passed. To add one: read each of
``PRIVATE_APIS`` in that version's source, run tests/test_torch_private.py and the tests of the call sites."""

PRIVATE_APIS = (
    "torch._foreach_norm",
    "torch._foreach_sub",
    "torch._foreach_add_",
    "torch._foreach_mul_",
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.memory._dump_snapshot",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset",
    "torch.optim.Muon._init_group",
    "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
    "torch.utils.data.DataLoader._iterator",
    "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers",
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
    "torch.utils._pytree",
    "torch._grouped_mm",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.serialization._get_layout",
)
"""Every private torch name used here, by its path (an attribute set in ``__init__`` named after its class)."""

PYTREE_LOGGER = "torch.utils._pytree"
"""The logger of torch's private pytree module. Importing torchao registers an enum with it, which it logs as a
warning that does not concern the user: ``quantize`` lowers this logger around that import."""


def foreach_norm(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``torch._foreach_norm``: each tensor's 2-norm, one kernel per device and dtype rather than one per tensor
    (``clip_grad_norm_``'s own way); the gradient SNR's norms (``metrics.GradSNR``)."""
    return torch._foreach_norm(tensors)


def foreach_sub(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> list[Tensor]:
    """``torch._foreach_sub``: ``a - b`` pairwise over two lists, batched as ``foreach_norm`` (``metrics.GradSNR``)."""
    return torch._foreach_sub(tensors, others)


def foreach_add_(tensors: Sequence[Tensor], others: Sequence[Tensor], alpha: float) -> None:
    """``torch._foreach_add_``: ``a += alpha * b`` in place pairwise, batched as ``foreach_norm`` (the SNR's moving
    average, ``metrics.GradSNR``)."""
    torch._foreach_add_(tensors, others, alpha=alpha)


def foreach_mul_(tensors: Sequence[Tensor], scalar: float) -> None:
    """``torch._foreach_mul_``: every tensor scaled in place, batched as ``foreach_norm``; plain and DTensor
    gradients alike (gradient clipping, ``loop.step``; torch's ``clip_grads_with_norm_`` does the same)."""
    torch._foreach_mul_(tensors, scalar)


def record_memory_history(max_entries: int) -> None:
    """``torch.cuda.memory._record_memory_history``: start recording the CUDA allocator's events, the last
    ``max_entries`` kept, for a snapshot that https://pytorch.org/memory_viz reads. Torch documents it ("Understanding
    CUDA Memory Usage") but has no public name for it (``--profile_steps``, ``profiling``)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    """``torch.cuda.memory._record_memory_history(enabled=None)``: stop recording (``profiling``)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """``torch.cuda.memory._dump_snapshot``: the recorded history as a pickle at ``path`` (``profiling``)."""
    torch.cuda.memory._dump_snapshot(path)


def local_shape_and_global_offset(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> tuple[Any, Any]:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: the shape of this rank's part of a
    DTensor and where it starts in the whole, so each rank reads only its own box of a file
    (``checkpoint.weights``). Torch's distributed checkpointing computes its boxes with it; DTensor has no public
    method for it. Imported on use: see the module docstring."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def mesh_block(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[Any, Any]:
    """``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``: ``local_shape_and_global_offset``
    for any coordinate of a mesh, not only this rank's, and without a process group, so every rank derives where
    every other rank's part of a matrix lies from shapes alone (``optim.muon_owners.layout_from_mesh``: Muon's
    owners gather exactly those parts). The public function computes only the calling rank's; this is what it
    calls. Imported on use: see the module docstring."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)


def muon_init_group(optimizer: torch.optim.Muon, group: dict[str, Any], params: list, grads: list, bufs: list) -> None:
    """``torch.optim.Muon._init_group``: collect a group's parameters with gradients, their gradients and momentum
    buffers, creating missing buffers exactly as torch's step does, so ``optim.muon.MuonNS``'s own step keeps
    ``optimizer.pt`` torch's (every torch optimizer's step starts with its ``_init_group``)."""
    optimizer._init_group(group, params, grads, bufs)


def grouped_mm(inputs: Tensor, weights: Tensor, ends: Tensor) -> Tensor:
    """``torch._grouped_mm``: ``inputs [N, K]``'s rows in consecutive groups, group ``g`` ending at row ``ends[g]``
    (int32, on the inputs' device; a group may be empty), each multiplied by ``weights[g] [K, M]``, in one call:
    ``[N, M]``. A mixture of experts' tokens sorted by expert against the experts' stacked weights, without the host
    reading where each group ends (``model.ffn.run_experts``). Torch has no public grouped matmul. Its CPU kernel
    takes float32, bfloat16 and float16, and wants the row strides of both operands and of the output in multiples
    of 16 bytes (``grouped_mm_fits``); its backward fails on an expanded gradient (``y.sum().backward()`` gives one),
    so the output's gradient is made contiguous first."""
    outputs = torch._grouped_mm(inputs, weights, offs=ends)
    if outputs.requires_grad:
        outputs.register_hook(Tensor.contiguous)
    return outputs


def grouped_mm_fits(dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``grouped_mm`` takes operands of ``dtype`` whose rows are ``dims`` elements long (its kernel's
    16-byte stride rule, measured in torch 2.13: a 5-wide float32 row is refused)."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16) and all(
        dim * dtype.itemsize % 16 == 0 for dim in dims
    )


def hide_from_ddp(model: nn.Module, names: list[str]) -> None:
    """``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: the named parameters are left out
    of DDP's start-up broadcast and its gradient reduction (``quantize.hide_from_ddp`` says why); DDP has no public
    way to exclude parameters."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def shut_down_loader_workers(loader: Any) -> None:
    """Stop a torch ``DataLoader``'s worker processes now (its ``_iterator``'s ``_shutdown_workers``, which torch
    calls itself when the iterator is collected); no-op without workers or for anything else, ``None`` included.
    Torch has no public way to stop persistent workers (``train.loaders.shut_down_workers`` says why it is needed)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), or ``module`` if not compiled: the
    model whose parameter names the checkpoint uses. Torch has no public accessor."""
    return getattr(module, "_orig_mod", module)


def checkpoint_metadata_globals() -> dict[tuple[str, str], Any]:
    """What torch's distributed checkpoint pickles into a ``state/.metadata``, by ``(module, name)``: its public
    dataclasses (``Metadata``, ``TensorStorageMetadata``, ...), two private classes (``filesystem._StorageInfo``,
    each entry's file, offset and length; ``metadata._MEM_FORMAT_ENCODING``, a tensor's memory format),
    ``serialization._get_layout`` (a ``torch.layout`` rebuilt from its name), ``pathlib.PosixPath``, ``torch.Size``
    and every ``torch`` dtype. Torch's own reader unpickles the file whole, so anything a file names would run; the
    restricted reader (``checkpoint.sharded_state``) admits these alone. Read in torch 2.13's ``FileSystemWriter``
    and ``metadata.py``: nothing else appears in the files it writes. Imported on use: see the module docstring."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    classes = [
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
    ]
    allowed = {(metadata.__name__, name): getattr(metadata, name) for name in classes}
    allowed[(metadata.__name__, "_MEM_FORMAT_ENCODING")] = metadata._MEM_FORMAT_ENCODING
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("torch", "Size")] = torch.Size
    dtypes = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    return allowed | {("torch", name): dtype for name, dtype in dtypes.items()}
