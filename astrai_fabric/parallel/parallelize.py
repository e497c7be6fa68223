"""Model parallelism for ``ModelParallelStrategy``: a rank's pipeline stages kept, tensor parallelism, then FSDP2. The
only ``fully_shard`` importer.

The meshes come from ``mesh.build_meshes`` (one layout for every dimension). With ``pp_size`` the model is first cut to
this rank's pipeline stages (``model.pipeline.keep_stages``), and everything below applies to the rank's part as it
would to a whole model, except that each stage module is an FSDP root of its own (torch's pipelining turns each stage's
gradient reduction off and on per micro-batch, and a rank may run several stages). FSDP2 shards over the data ranks
(``fsdp_shard_size`` of them, times the context ranks) and replicates over the rest (HSDP, torch's ``fully_shard`` on a
2-D mesh); with ``cp_size`` the attention modules exchange sequence for heads over the context group
(``parallel.context``); with ``ep_size`` each MoE layer's routed experts are dealt out over an expert group
(``parallel.expert``), FSDP sharding them over the data shards left. On the tensor axis (``--tp_size``) each
decoder block's attention splits its heads (q/k/v, the gate, MLA's ``kv_b_proj`` column-wise; ``o_proj`` row-wise) and
the dense MLP splits its width (``up``/``gate`` column-wise, ``down`` row-wise); embeddings, norms, the head and MoE
experts stay whole (the per-head q/k norms too, their gradients summed over the ranks' heads, and MLA's shared RoPE key
head, each rank taking its heads' share and the backward pass summing all of theirs). On the data axis every decoder
block is an FSDP unit (its routed experts one of their own under expert parallelism), and so is the root: it holds the
embedding, final norm and ``lm_head``, so a tied embedding stays one parameter (AstrAI shards ``embed_tokens`` and
``lm_head`` apart and unties them, B4), and every parameter is a DTensor: torch's gradient clipping refuses plain
tensors and DTensors mixed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError
from astrai_fabric.model.attention import MLA
from astrai_fabric.model.expert_parallel import moe_layers
from astrai_fabric.model.ffn import MLP
from astrai_fabric.model.pipeline import keep_stages
from astrai_fabric.parallel.context import check_context_parallel, enable_context_parallel
from astrai_fabric.parallel.expert import check_expert_parallel, shard_experts
from astrai_fabric.parallel.mesh import MeshLayout, build_meshes, mesh_layout
from astrai_fabric.quantize import is_quantized

APPLIED_LAYOUT = "applied_layout"
"""The attribute ``parallelize`` leaves on the model it returns: the ``MeshLayout`` it applied, which
``strategy.check_applied_layout`` compares with what the Fabric says."""

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parallelize(
    model: nn.Module,
    device_mesh: DeviceMesh,
    reshard_after_forward: bool = False,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    cpu_offload: bool = False,
    fsdp_shard_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    pp_size: int | None = None,
    pp_stages_per_rank: int = 1,
) -> nn.Module:
    """Apply tensor parallelism and FSDP2 to ``model`` (called by Fabric in ``setup_module``).

    FSDP knobs: ``reshard_after_forward`` frees gathered parameters after each block's forward (less memory, one
    more all-gather in backward; AstrAI keeps them, False); ``param_dtype``/``reduce_dtype`` set FSDP2's
    mixed-precision policy (e.g. bfloat16 compute with float32 gradient reduction over float32 master weights);
    ``cpu_offload`` keeps sharded parameters, gradients and optimizer state in CPU memory; ``fsdp_shard_size``:
    data ranks each parameter is sharded over (default: all data-parallel ranks), replicated over the rest (HSDP);
    ``cp_size``: ranks of a context group, each holding 1/cp of every window's tokens (``parallel.context``),
    FSDP sharding over them too; ``ep_size``: ranks of an expert group, each holding 1/ep of every MoE layer's routed
    experts (``parallel.expert``), which FSDP shards over the data shards the groups leave; ``pp_size``:
    pipeline ranks, ``model`` cut to this rank's ``pp_stages_per_rank`` stages (``model.pipeline.keep_stages``)
    before the rest is applied within them.
    """
    tp_size = device_mesh["tensor_parallel"].size()
    layout = mesh_layout(device_mesh.size(), tp_size, fsdp_shard_size, cp_size, ep_size, pp_size)
    meshes = build_meshes(device_mesh, layout)
    if meshes.pipeline is not None:
        model = keep_stages(model, meshes.pipeline.get_local_rank(), layout.pp, pp_stages_per_rank)
        model.place = dataclasses.replace(
            model.place, group=meshes.pipeline.get_group(), ends_group=_first_and_last_stage_group(layout)
        )
    if meshes.tensor.size() > 1:
        apply_tensor_parallel(model, meshes.tensor)
    if meshes.context is not None:
        check_context_parallel(model.config, layout.cp, layout.tp)
        enable_context_parallel(model, meshes.context.get_group())
    if meshes.expert_group is not None:
        check_expert_parallel(model.config, layout.ep)
        if reduce_dtype == "float16" and layout.num_expert_shards == 1:
            raise ConfigError(
                f"ep_size {layout.ep} with fsdp_reduce_dtype float16 where each expert is on one rank: torch "
                f"{torch.__version__.split('+')[0]} would divide its gradient twice; reduce in bfloat16 or float32"
            )
        shard_experts(model, meshes.expert_group.get_group())
    options = dict(
        mesh=meshes.fsdp,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES.get(param_dtype), reduce_dtype=DTYPES.get(reduce_dtype)),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    # QLoRA's 4-bit experts stay whole on their expert rank, outside FSDP: torch 2.13 cannot gather an NF4 tensor
    # over a one-rank shard group (its single-rank path copies one all-gather input, torchao's gather has three),
    # and frozen, they need no gradient reduction. Each rank holds 1/ep of them, at an eighth of float32's bytes.
    if meshes.experts is not None:
        frozen = {p for layer in moe_layers(model) for p in layer.routed_experts.parameters() if is_quantized(p)}
        options["ignored_params"] = frozen or None
    for block in model.decoder_blocks:
        if meshes.experts is not None and hasattr(block.mlp, "routed_experts"):
            # Each expert rank's experts over the shards its group leaves; the gradient averaged over every data
            # rank, as the rest of the model's is (the mesh's own average would divide by its size alone, and the
            # experts already hold the sum over their group's tokens). FSDP reduces with a pre-multiplied sum
            # for a factor of its own, which gloo lacks: there it sums, then divides. Not where an expert has one
            # shard: torch 2.13 then divides in place of the reduce-scatter and again after a plain sum (its
            # ``foreach_reduce``), which is why float16 reductions, always summed plainly, are refused there.
            experts = block.mlp.routed_experts
            fully_shard(experts, **options | dict(mesh=meshes.experts))
            experts.set_gradient_divide_factor(layout.num_dp_ranks)
            experts.set_force_sum_reduction_for_comms(
                meshes.experts.device_type == "cpu" and layout.num_expert_shards > 1
            )
        fully_shard(block, **options)
    # A pipeline rank's stages are roots of their own (their ends: the embedding, the norm and head); the rank's
    # model holds the same tensors, as DTensors, for the optimizer and checkpoints.
    for root in getattr(model, "stage_modules", [model]):
        fully_shard(root, **options)
    setattr(model, APPLIED_LAYOUT, layout)
    return model


def _first_and_last_stage_group(layout: MeshLayout) -> dist.ProcessGroup | None:
    """This rank's group of the first and last stage's ranks at its place in the stage, None on a rank that holds
    neither (collective: every rank makes every pair's): a tied embedding's two copies sum their gradients over
    it. The first stage is on pipeline rank 0, the last on the last, however many stages a rank holds."""
    last = (layout.pp - 1) * layout.ranks_per_stage
    pairs = [[place, last + place] for place in range(layout.ranks_per_stage)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """``ConfigError`` unless tensor parallelism over ``size`` ranks splits this model's heads, key/value heads and
    dense MLP width evenly (and it has no norm over a whole projection): the run's check, which the preflight and
    its dry run make too."""
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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split attention heads and dense MLP width over ``tp_mesh`` (see the module docstring)."""
    config, size = model.config, tp_mesh.size()
    check_tensor_parallel(config, size)
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
