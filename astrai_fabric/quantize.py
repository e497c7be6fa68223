"""QLoRA's frozen 4-bit base (Dettmers et al. 2023, arXiv:2305.14314): the linear weights of the transformer blocks
stored as NF4, under float32 LoRA adapters (``lora.py``). The only module that imports torchao (``.[qlora]``).

NF4 is torchao's ``NF4Tensor`` (the tensor torchtune's QLoRA uses): 4-bit NormalFloat codes in blocks of 64, each
block's absmax scale quantised again to 8 bits in blocks of 256 ("double quantisation"), about 4.13 bits a weight,
0.26 x its bfloat16 bytes. A forward dequantises each weight to the compute dtype and multiplies; nothing is stored
for the backward but the codes.

What is quantised: every ``Linear`` weight inside the transformer blocks (attention projections, the MLPs and the MoE
experts, LitGPT's choice, so the saving does not depend on ``--lora_targets``), not the MoE router (a few thousand
values that decide where each token goes), the embeddings, the norms or the head (torchtune and LitGPT keep these
too), nor Qwen2-MoE's one-row shared-expert gate. A weight whose element count is not a multiple of 64 x 256
cannot be laid out in torchao's blocks and stays in the training dtype; ``plan`` lists it.

Weights are quantised while they load (``checkpoint.load_model_weights``): each is read in the run's parameter dtype
and replaced by its NF4 form at once, so memory never holds the float model. The codes depend on that dtype (a
weight read as bfloat16 rounds differently from the same weight read as float32), so a checkpoint records it
(``QUANTIZATION_KEY``) and everything that rebuilds the model it trained (``export``, ``generate``, ``evaluate``,
a resume) quantises the base again the same way and uses the dequantised weights (``round_trip``).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from astrai_fabric import torch_private
from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.model.layers import Linear

BLOCK_SIZE = 64
"""Weights per NF4 block (one absmax scale each): QLoRA's and torchao's default."""
SCALER_BLOCK_SIZE = 256
"""Block scales per second-level block (double quantisation): torchao's default."""
QUANTIZATION_KEY = "quantization"
"""``meta.json`` key of a QLoRA checkpoint: ``{method, block_size, scaler_block_size, dtype, keys}``, what was
quantised and from which dtype, so the trained model can be rebuilt exactly."""
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
_NOT_QUANTIZED = ("router", "shared_expert_gate")
"""Linear layers never quantised, by attribute name: the MoE router and Qwen2-MoE's shared-expert gate, which
decide per token where it goes and how much of the shared expert it takes (module docstring)."""


@cache
def _nf4() -> Any:
    """torchao's NF4 module, imported once and quietly: on a CPU build of torch its import logs a warning for each
    CUDA kernel library it cannot load, and torch logs one about an enum it registers; neither concerns the user."""
    loggers = [logging.getLogger(name) for name in ("torchao", torch_private.PYTREE_LOGGER)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(_NF4_MODULE)
    except ImportError as err:
        raise UserError(
            f"quantize nf4 needs torchao ({err}); install it with: pip install 'astrai-fabric[qlora]'"
        ) from None
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def require_torchao() -> None:
    """The one-line error of a missing ``.[qlora]`` extra, raised before a run builds anything."""
    _nf4()


def is_quantized(tensor: Any) -> bool:
    """Whether ``tensor`` is an NF4 tensor, or an FSDP shard of one (without importing torchao or DTensor: a model
    that holds one has imported them)."""
    module, distributed = sys.modules.get(_NF4_MODULE), sys.modules.get("torch.distributed.tensor")
    if distributed is not None and isinstance(tensor, distributed.DTensor):
        tensor = tensor.to_local()
    return module is not None and isinstance(tensor, module.NF4Tensor)


def dequantized(tensor: Tensor) -> Tensor:
    """The float weight an NF4 tensor stands for (in the dtype it was quantised from); any other tensor as it is."""
    return tensor.get_original_weight() if is_quantized(tensor) else tensor


def fits_blocks(shape: tuple[int, ...], num_shards: int = 1) -> bool:
    """Whether a weight of ``shape`` can be laid out in NF4's blocks (element count a multiple of 64 x 256), and split
    into ``num_shards`` FSDP shards of whole blocks (its rows into equal parts, each a multiple of the blocks: torchao
    splits an NF4 tensor only so)."""
    blocks = BLOCK_SIZE * SCALER_BLOCK_SIZE * num_shards
    return len(shape) == 2 and shape[0] % num_shards == 0 and shape[0] * shape[1] % blocks == 0


BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK_SIZE + 4 / (BLOCK_SIZE * SCALER_BLOCK_SIZE)
"""An NF4 weight's bytes: its 4-bit code, its share of an 8-bit block scale and of a float32 second-level scale."""


@dataclass(frozen=True)
class QuantizationPlan:
    """Which weights of a model are stored as NF4 (``quantized``, holding ``num_quantized`` values) and which block
    linear weights stay float (``kept``: their element count does not fit the blocks), by ``state_dict`` key."""

    quantized: tuple[str, ...]
    kept: tuple[str, ...]
    num_quantized: int
    num_shards: int = 1
    """The FSDP shards each NF4 weight is split into (whole blocks in each)."""

    def describe(self, float_bytes: int) -> str:
        """The plan's ``quantize`` line; ``float_bytes``: bytes of a weight in the training dtype."""
        line = (
            f"nf4 (torchao): {len(self.quantized)} linear weights in 4 bits, "
            f"{self.num_quantized * BYTES_PER_WEIGHT / 2**20:,.1f} MiB instead of "
            f"{self.num_quantized * float_bytes / 2**20:,.1f} MiB; embeddings, norms, head and routers unquantised"
        )
        if self.kept:
            named = ", ".join(self.kept[:3]) + (", ..." if len(self.kept) > 3 else "")
            shards = f" x {self.num_shards} FSDP shards" if self.num_shards > 1 else ""
            line += (
                f"; {len(self.kept)} kept unquantised (element count not a multiple of "
                f"{BLOCK_SIZE * SCALER_BLOCK_SIZE:,}{shards}): {named}"
            )
        return line


def plan_quantization(model: nn.Module, num_shards: int = 1) -> QuantizationPlan:
    """The weights ``--quantize nf4`` stores in 4 bits: block linear weights (not routers) that fit the blocks, in
    each of ``num_shards`` FSDP shards. Only shapes are read, so a model on the meta device answers."""
    quantized, kept, num_quantized = [], [], 0
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if name.startswith("layers.") and isinstance(module, Linear) and leaf not in _NOT_QUANTIZED:
            if fits_blocks(tuple(module.weight.shape), num_shards):
                quantized.append(f"{name}.weight")
                num_quantized += module.weight.numel()
            else:
                kept.append(f"{name}.weight")
    return QuantizationPlan(tuple(quantized), tuple(kept), num_quantized, num_shards)


def to_nf4(weight: Tensor) -> Tensor:
    """``weight`` (2-D, fitting the blocks) as an NF4 tensor of its dtype."""
    return _nf4().to_nf4(weight.contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)


def quantize_weight(model: nn.Module, key: str) -> None:
    """Replace the weight ``key`` (``<layer>.weight`` of a ``Linear`` already loaded) by its NF4 form, frozen, in a
    ``QuantizedLinear`` that shares the layer's bias; the float tensor's memory is released at once, even while a
    caller (the loader's ``state_dict``) still holds the old ``Parameter``."""
    layer_name = key.removesuffix(".weight")
    parent_name, _, child = layer_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = getattr(parent, child)
    setattr(parent, child, QuantizedLinear(layer, to_nf4(layer.weight.detach())))
    layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)


class QuantizedLinear(Linear):
    """A frozen ``Linear`` whose weight is NF4 (torchao's ``F.linear`` on it dequantises, then multiplies)."""

    def __init__(self, base: Linear, weight: Tensor) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.init_std = getattr(base, "init_std", 0.02)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weight is the quantised file's."""


def hide_from_ddp(model: nn.Module) -> None:
    """Keep DDP away from ``model``'s NF4 weights: each rank quantised the same file to the same codes, and DDP's
    start-up broadcast of rank 0's parameters writes each back through ``copy_``, which torchao implements for a
    dense source by quantising it again: the dequantised values re-quantised move the block scales (measured: a
    2-rank run's first loss then differed from one process's by 3e-5). Frozen, they take no part in its gradient
    reduction either."""
    names = [name for name, param in model.named_parameters() if is_quantized(param)]
    torch_private.hide_from_ddp(model, names)


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes of the NF4 weights, elements they hold)`` in ``model``: codes, scales and their scales."""
    total = elements = 0
    for param in model.parameters():
        if is_quantized(param):
            inner, _ = param.__tensor_flatten__()
            total += sum(getattr(param, name).numel() * getattr(param, name).element_size() for name in inner)
            elements += param.numel()
    return total, elements


def quantization_entry(model: nn.Module) -> dict[str, Any]:
    """The ``meta.json`` record of a QLoRA run (``QUANTIZATION_KEY``): the NF4 weights ``model`` holds and their
    dtype."""
    quantized = {name: param for name, param in model.named_parameters() if is_quantized(param)}
    dtypes = {str(param.dtype).removeprefix("torch.") for param in quantized.values()}
    if len(dtypes) != 1:
        raise ValueError(f"expected NF4 weights of one dtype, got {sorted(dtypes) or 'none'}")
    return {
        "method": "nf4",
        "block_size": BLOCK_SIZE,
        "scaler_block_size": SCALER_BLOCK_SIZE,
        "dtype": dtypes.pop(),
        "keys": list(quantized),
    }


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_quantization_entry(entry: Any, where: str) -> tuple[torch.dtype, tuple[str, ...]]:
    """A checkpoint's ``QUANTIZATION_KEY`` record checked field by field: the dtype quantised from and the keys."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: '{QUANTIZATION_KEY}' must be an object, got {type(entry).__name__}")
    expected = {"method": "nf4", "block_size": BLOCK_SIZE, "scaler_block_size": SCALER_BLOCK_SIZE}
    if wrong := [f"{k} {entry.get(k)!r} (expected {v!r})" for k, v in expected.items() if entry.get(k) != v]:
        raise CheckpointError(f"{where}: '{QUANTIZATION_KEY}' has " + ", ".join(wrong))
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in _DTYPES:
        raise CheckpointError(
            f"{where}: '{QUANTIZATION_KEY}' dtype must be one of {list(_DTYPES)}, got {entry.get('dtype')!r}"
        )
    keys = entry.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k.endswith(".weight") for k in keys):
        raise CheckpointError(f"{where}: '{QUANTIZATION_KEY}' keys must be a list of '<layer>.weight' names")
    if not keys:  # a run quantises at least one weight (``quantization_entry``): an empty list is a damaged record
        raise CheckpointError(
            f"{where}: '{QUANTIZATION_KEY}' keys is empty, but a QLoRA run quantises its block linear weights; the "
            "adapter would be merged into a base it was not trained over"
        )
    return _DTYPES[entry["dtype"]], tuple(keys)


QUANTIZE_FLAG = "quantize"
"""``meta.json``'s copy of the run's ``--quantize`` flag (every flag is recorded there)."""


def quantization_record(meta: Mapping[str, Any], where: str) -> Any:
    """A checkpoint's ``QUANTIZATION_KEY`` record (None for an adapter trained over a base in its float dtype),
    refused where it is missing but the run's own flag in ``meta`` (``QUANTIZE_FLAG``) says the base was NF4: the
    adapter would be merged into (or resumed over) weights it was not trained over, and compute another model."""
    flag = meta.get(QUANTIZE_FLAG)
    if flag not in (None, "nf4"):
        raise CheckpointError(f"{where}: '{QUANTIZE_FLAG}' must be null or 'nf4', got {flag!r}")
    if flag is not None and QUANTIZATION_KEY not in meta:
        raise CheckpointError(
            f"{where}: '{QUANTIZE_FLAG}' is {flag!r} (the adapter was trained over the base quantised to NF4), but "
            f"the '{QUANTIZATION_KEY}' record of which weights were quantised, and from which dtype, is missing; "
            "restore it from another checkpoint of the same run"
        )
    return meta.get(QUANTIZATION_KEY)


def round_trip(state_dict: Mapping[str, Tensor], entry: Any, where: str) -> dict[str, Tensor]:
    """``state_dict`` with each weight the checkpoint's ``QUANTIZATION_KEY`` names replaced by what the run trained
    over: quantised to NF4 from the recorded dtype, then dequantised (in that dtype)."""
    dtype, keys = read_quantization_entry(entry, where)
    if absent := [k for k in keys if k not in state_dict]:
        raise CheckpointError(f"{where}: '{QUANTIZATION_KEY}' names weights the base lacks: {absent[:4]}")
    out = dict(state_dict)  # every tensor read once (a stored state dict reads a tensor each time it is indexed)
    if odd := [k for k in keys if not fits_blocks(tuple(out[k].shape))]:
        raise CheckpointError(f"{where}: '{QUANTIZATION_KEY}' names weights NF4 cannot hold: {odd[:4]}")
    for key in keys:
        out[key] = to_nf4(out[key].to(dtype)).get_original_weight()
    return out
