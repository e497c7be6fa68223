"""Model parallelism for ``ModelParallelStrategy``: tensor parallelism, then FSDP2. The only ``fully_shard`` importer.

Fabric's mesh has two axes, ``data_parallel`` x ``tensor_parallel``. With ``fsdp_shard_size`` S below the
data-parallel size D, the model gets a mesh of three instead, ``replicate`` (D/S) x ``shard`` (S) x
``tensor_parallel``, and FSDP2 shards over ``shard`` and replicates over ``replicate`` (HSDP, torch's
``fully_shard`` on a 2-D mesh). On the tensor axis (``--tp_size``) each decoder block's attention splits its heads
(q/k/v, the gate, MLA's ``kv_b_proj`` column-wise; ``o_proj`` row-wise) and the dense MLP splits its width
(``up``/``gate`` column-wise, ``down`` row-wise); embeddings, norms, the head and MoE experts stay whole (the
per-head q/k norms too, their gradients summed over the ranks' heads, and MLA's shared RoPE key head, each rank
taking its heads' share and the backward pass summing all of theirs). On the data axis every decoder block is an
FSDP unit, and so is the root: it holds the embedding, final norm and ``lm_head``, so a tied embedding stays one
parameter (AstrAI shards ``embed_tokens`` and ``lm_head`` apart and unties them, B4), and every parameter is a
DTensor: torch's gradient clipping refuses plain tensors and DTensors mixed.

The HSDP mesh is a new ``init_device_mesh`` over the same ranks in the same row-major order as Fabric's (which
builds its own the same way), so a rank's data-parallel index ``replica * S + shard`` is the one Fabric's sampler
arguments report. Unflattening Fabric's ``data_parallel`` axis (``DeviceMesh._unflatten``, torch 2.13) would keep
one root mesh, but it is private and missing from older torch versions this package supports (>= 2.9).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from astrai_fabric.errors import ConfigError
from astrai_fabric.model.attention import MLA
from astrai_fabric.model.ffn import MLP

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parallelize(
    model: nn.Module,
    device_mesh: DeviceMesh,
    reshard_after_forward: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
    fsdp_shard_size: int | None = None,
) -> nn.Module:
    """Apply tensor parallelism and FSDP2 to ``model`` (called by Fabric in ``setup_module``).

    FSDP knobs: ``reshard_after_forward`` frees gathered parameters after each block's forward (less memory, one
    more all-gather in backward; AstrAI keeps them, False); ``param_dtype``/``reduce_dtype`` set FSDP2's
    mixed-precision policy (e.g. bfloat16 compute with float32 gradient reduction over float32 master weights);
    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state in CPU memory; ``fsdp_shard_size``:
    ranks each parameter is sharded over (default: all data-parallel ranks), replicated over the rest (HSDP).
    """
    fsdp_mesh, tp_mesh = split_mesh(device_mesh, fsdp_shard_size)
    if tp_mesh.size() > 1:
        apply_tensor_parallel(model, tp_mesh)
    options = dict(
        mesh=fsdp_mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES.get(param_dtype), reduce_dtype=DTYPES.get(reduce_dtype)),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for block in model.decoder_blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


FSDP_DIMS = ("replicate", "shard")
"""HSDP's mesh axes, outer to inner: a parameter is replicated over the first and sharded over the second."""


def split_mesh(device_mesh: DeviceMesh, fsdp_shard_size: int | None) -> tuple[DeviceMesh, DeviceMesh]:
    """FSDP's mesh and the tensor-parallel one. Fabric's own axes when every data-parallel rank holds one shard
    (``fsdp_shard_size`` None or D); otherwise those of a new ``(replicate, shard, tensor_parallel)`` mesh over
    the same ranks, ``data_parallel`` split into D/S replicas of S shards (collective: every rank must call it)."""
    data_parallel = device_mesh["data_parallel"].size()
    if fsdp_shard_size is None or fsdp_shard_size == data_parallel:
        return device_mesh["data_parallel"], device_mesh["tensor_parallel"]
    if data_parallel % fsdp_shard_size:
        raise ConfigError(f"fsdp_shard_size {fsdp_shard_size} must divide the data-parallel size {data_parallel}")
    shape = (data_parallel // fsdp_shard_size, fsdp_shard_size, device_mesh["tensor_parallel"].size())
    mesh = init_device_mesh(device_mesh.device_type, shape, mesh_dim_names=(*FSDP_DIMS, "tensor_parallel"))
    # Row-major like Fabric's, so a rank has the same place in both: its data-parallel index (the sampler's) is
    # replica * S + shard, and its tensor-parallel group, which must read the same samples, is Fabric's.
    replica, shard = (mesh[name].get_local_rank() for name in FSDP_DIMS)
    assert replica * fsdp_shard_size + shard == device_mesh["data_parallel"].get_local_rank()
    assert mesh["tensor_parallel"].get_local_rank() == device_mesh["tensor_parallel"].get_local_rank()
    return mesh[FSDP_DIMS], mesh["tensor_parallel"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split attention heads and dense MLP width over ``tp_mesh`` (see the module docstring)."""
    config, size = model.config, tp_mesh.size()
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    widths = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": kv_heads}
    if any(config.ffn_type_of_layer(i) == "mlp" for i in range(config.num_hidden_layers)):
        widths["intermediate_size"] = config.intermediate_size
    uneven = [f"{name} ({value})" for name, value in widths.items() if value % size]
    if uneven:
        raise ConfigError(f"tp_size {size} must divide {', '.join(uneven)}")
    if config.qk_norm_over_projection:
        raise ConfigError(
            f"tp_size {size} cannot split qk_norm_over_projection: its RMS spans every head of a "
            "token (OLMo 2), and tensor parallelism gives each rank some heads only"
        )
    for block in model.decoder_blocks:
        attention = block.attention
        names = ["q_proj", "kv_b_proj"] if isinstance(attention, MLA) else ["q_proj", "k_proj", "v_proj"]
        plan = {name: ColwiseParallel() for name in names} | {"o_proj": RowwiseParallel()}
        if attention.gate is not None:  # multiplies the attention output column for column: split it the same way
            plan["gate"] = ColwiseParallel()
        if getattr(attention, "rope_key_heads", None) is not None:
            # MLA's one shared RoPE key head, broadcast to every head: each rank keeps its heads' share, and the
            # backward pass gathers every head's gradient so the one head (and kv_a_proj) sums them all.
            plan["rope_key_heads"] = PrepareModuleInputOutput(
                input_layouts=Replicate(),
                desired_input_layouts=Replicate(),
                output_layouts=Replicate(),
                desired_output_layouts=Shard(2),
            )
        if attention.q_norm is not None:
            # One weight for every head, each rank normalising its own heads ([B, S, heads, D], split on dim 2):
            # replicated, its gradient summed over the ranks' heads (left alone, each rank's copy would learn from
            # its heads only and the copies would drift apart).
            plan |= {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in ("q_norm", "k_norm")}
        parallelize_module(attention, tp_mesh, plan)
        if isinstance(block.mlp, MLP):
            plan = {"up": ColwiseParallel(), "gate": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(block.mlp, tp_mesh, plan)
