"""The device mesh: one layout for every parallel dimension, and the one place that builds meshes from it.

Dimensions, outer to inner in torchtitan's order: pipeline stages (``--pp_size``), data replicate (HSDP's
replicas), data shard (FSDP's shards), context (``--cp_size``), tensor (``--tp_size``). A rank's place is row-major
over them, ``rank = (((stage * replicas + replica) * shards + shard) * cp + context) * tp + tensor``, which is also
the order of Lightning's own 2-D mesh (``data_parallel`` x ``tensor_parallel``, ``data_parallel`` being stages x
replicas x shards x cp for it), so a rank keeps its place in both.

Who uses which dimension:

- FSDP shards each parameter over shard x context and replicates it over replicate, as torchtitan does: the ranks
  of one context group hold different shards, not copies, and their gradients are averaged with the rest;
- tensor parallelism splits heads and widths over tensor;
- the context group exchanges sequence for heads inside attention (``parallel.context``);
- expert parallelism (``--ep_size``) deals each MoE layer's routed experts out over ep consecutive ranks of the
  data shards (as torchtitan carves its expert ranks from the data ranks), and FSDP shards the experts over what is
  left, shards / ep, replicated over replicate: ``rank``'s shard index is ``expert_shard * ep + expert``;
- pipeline parallelism gives each stage's ranks a slice of the decoder blocks (``model.pipeline``); every other
  dimension lives inside a stage, the same for every stage, and the ranks of one place in the stage's layout form
  a pipeline, exchanging activations and gradients with their neighbours;
- the sampler: the data-parallel rank is ``replica * shards + shard`` of ``replicas * shards``; the ranks of one
  context, tensor or pipeline group read the same samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from astrai_fabric.config.combinations import pair_problem
from astrai_fabric.errors import ConfigError


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the mesh's dimensions. One replica is plain FSDP, more is HSDP; DDP and one process have no
    mesh of ours (their layout is ``replicas`` = world size of one shard each, for the sampler's arithmetic)."""

    replicas: int
    """Groups holding the same shards (HSDP); 1 for plain FSDP."""
    shards: int
    """Data ranks each parameter is sharded over (``--fsdp_shard_size``), context ranks not counted."""
    cp: int = 1
    """Ranks of a context group: each holds 1/cp of every window's tokens (``--cp_size``)."""
    tp: int = 1
    """Ranks of a tensor-parallel group (``--tp_size``)."""
    ep: int = 1
    """Ranks of an expert group, carved from the data shards: each holds 1/ep of the routed experts
    (``--ep_size``)."""
    pp: int = 1
    """Pipeline stages (``--pp_size``), each a group of ``ranks_per_stage`` ranks holding a slice of the blocks."""

    @property
    def ranks_per_stage(self) -> int:
        return self.replicas * self.shards * self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.ranks_per_stage

    @property
    def num_dp_ranks(self) -> int:
        """Ranks that read different samples."""
        return self.replicas * self.shards

    @property
    def num_fsdp_shards(self) -> int:
        """Ranks one parameter's FSDP shards are spread over: data shards x context."""
        return self.shards * self.cp

    @property
    def num_expert_shards(self) -> int:
        """Ranks one expert's FSDP shards are spread over: the data shards an expert group leaves."""
        return self.shards // self.ep

    def dp_rank(self, rank: int) -> int:
        """``rank``'s index among the data-parallel ranks (the sampler's)."""
        return rank % self.ranks_per_stage // (self.cp * self.tp)

    def stage(self, rank: int) -> int:
        """``rank``'s pipeline stage."""
        return rank // self.ranks_per_stage

    def describe(self) -> str:
        """``2 replica(s) x 2 shard(s) x 2 context x 2 tensor-parallel``, for the plan (a dimension of 1 left out,
        except replicas and shards); with context parallelism, FSDP's group as shard x cp. Pipeline ranks are
        ``2-way pipeline``: a rank may hold several stages (``--pp_stages_per_rank``, the plan's pipeline line)."""
        text = f"{self.replicas} replica(s) x {self.shards} shard(s)"
        if self.pp > 1:
            text = f"{self.pp}-way pipeline x {text}"
        if self.cp > 1:
            text += f" x {self.cp} context"
        if self.tp > 1:
            text += f" x {self.tp} tensor-parallel"
        if self.cp > 1:
            text += f"; FSDP shards over {self.shards} x {self.cp} = {self.num_fsdp_shards} rank(s)"
        if self.ep > 1:
            text += f"; experts over {self.ep} expert-parallel x {self.num_expert_shards} FSDP shard(s)"
        return text


def mesh_layout(
    world_size: int,
    tp_size: int | None = None,
    fsdp_shard_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    pp_size: int | None = None,
) -> MeshLayout:
    """The layout ``--pp_size``, ``--tp_size``, ``--cp_size``, ``--fsdp_shard_size`` and ``--ep_size`` ask of
    ``world_size`` ranks under FSDP, checked: one line naming the sizes that do not divide (None: the default, 1 for
    pp, tp, cp and ep, every data rank for the shard size)."""
    pp_size = pp_size or 1
    if world_size % pp_size:
        raise ConfigError(f"pp_size {pp_size} must divide the world size {world_size}")
    if problem := pair_problem(dict(pp=pp_size, cp=cp_size, ep=ep_size, tp=tp_size)):
        raise ConfigError(problem)
    layout = _stage_layout(world_size // pp_size, tp_size, fsdp_shard_size, cp_size, ep_size)
    return dataclasses.replace(layout, pp=pp_size)


def _stage_layout(
    world_size: int, tp_size: int | None, fsdp_shard_size: int | None, cp_size: int | None, ep_size: int | None
) -> MeshLayout:
    """The layout of one pipeline stage's ``world_size`` ranks (``mesh_layout``)."""
    tp_size, cp_size = tp_size or 1, cp_size or 1
    if world_size % (tp_size * cp_size):
        named = " x ".join(f"{name} {size}" for name, size in (("cp_size", cp_size), ("tp_size", tp_size)) if size > 1)
        raise ConfigError(f"{named} must divide the world size {world_size}")
    data_ranks = world_size // (tp_size * cp_size)
    shards = fsdp_shard_size or data_ranks
    if data_ranks % shards:
        others = "".join(f" / {name} {size}" for name, size in (("cp_size", cp_size), ("tp_size", tp_size)) if size > 1)
        raise ConfigError(
            f"fsdp_shard_size {shards} must divide the data-parallel size {data_ranks} (world size {world_size}"
            f"{others}); the ranks per node is the usual choice"
        )
    ep_size = ep_size or 1
    if shards % ep_size:
        raise ConfigError(
            f"ep_size {ep_size} must divide the FSDP shards ({shards}: fsdp_shard_size, or the data-parallel size "
            f"{data_ranks}); expert ranks are carved from them"
        )
    return MeshLayout(data_ranks // shards, shards, cp_size, tp_size, ep_size)


class Meshes(NamedTuple):
    """What ``parallelize`` applies each dimension over."""

    fsdp: DeviceMesh
    """1-D over shard x context, or 2-D (replicate, shard x context): HSDP."""
    tensor: DeviceMesh
    context: DeviceMesh | None
    """None without context parallelism."""
    experts: DeviceMesh | None = None
    """What FSDP shards the routed experts over: 1-D over the expert shards, or 2-D (replicate, expert shard);
    None without expert parallelism."""
    expert_group: DeviceMesh | None = None
    """The expert group's ranks (``parallel.expert``); None without expert parallelism."""
    pipeline: DeviceMesh | None = None
    """The ranks of this rank's pipeline, one per stage, in stage order; None without pipeline parallelism."""


PIPELINE, REPLICATE, SHARD, CONTEXT, TENSOR = "pipeline", "replicate", "shard", "context", "tensor_parallel"
EXPERT_SHARD, EXPERT = "expert_shard", "expert"


def build_meshes(lightning_mesh: DeviceMesh, layout: MeshLayout) -> Meshes:
    """The meshes of ``layout`` (``mesh_layout`` of the same sizes) over the ranks of Lightning's mesh
    (``data_parallel`` x ``tensor_parallel``): its
    own axes when they already are plain FSDP's and tensor parallelism's, else new meshes over the same ranks in the
    same row-major order (collective: every rank must call it). Context parallelism gets a mesh of its own whose
    middle axis is the context group; FSDP's is ``(replicate, shard x context, tensor)``, so that FSDP and tensor
    parallelism share one root mesh, as FSDP2 requires of 2-D parameters. (``DeviceMesh._flatten`` would give one
    root for all, but it is private.)"""
    if layout.pp > 1:  # without context and expert parallelism (``mesh_layout``)
        shape = (layout.pp, layout.replicas, layout.shards, layout.tp)
        mesh = init_device_mesh(lightning_mesh.device_type, shape, mesh_dim_names=(PIPELINE, REPLICATE, SHARD, TENSOR))
        fsdp = mesh[SHARD] if layout.replicas == 1 else mesh[(REPLICATE, SHARD)]
        return Meshes(fsdp, mesh[TENSOR], None, pipeline=mesh[PIPELINE])
    experts = expert_group = None
    if layout.ep > 1:  # without tensor and context parallelism (``mesh_layout``): a shard is a rank
        shape = (layout.replicas, layout.num_expert_shards, layout.ep)
        expert_mesh = init_device_mesh(
            lightning_mesh.device_type, shape, mesh_dim_names=(REPLICATE, EXPERT_SHARD, EXPERT)
        )
        experts = expert_mesh[EXPERT_SHARD] if layout.replicas == 1 else expert_mesh[(REPLICATE, EXPERT_SHARD)]
        expert_group = expert_mesh[EXPERT]
    if layout.replicas == 1 and layout.cp == 1:
        return Meshes(lightning_mesh["data_parallel"], lightning_mesh["tensor_parallel"], None, experts, expert_group)
    device_type = lightning_mesh.device_type
    shape = (layout.replicas, layout.num_fsdp_shards, layout.tp)
    fsdp_tp = init_device_mesh(device_type, shape, mesh_dim_names=(REPLICATE, SHARD, TENSOR))
    fsdp = fsdp_tp[SHARD] if layout.replicas == 1 else fsdp_tp[(REPLICATE, SHARD)]
    context = None
    if layout.cp > 1:
        shape = (layout.num_dp_ranks, layout.cp, layout.tp)
        context = init_device_mesh(device_type, shape, mesh_dim_names=("data", CONTEXT, TENSOR))[CONTEXT]
    # Row-major like Lightning's: a rank's data-parallel index there is replica * shards * cp + the FSDP index.
    assert fsdp_tp[REPLICATE].get_local_rank() * layout.num_fsdp_shards + fsdp_tp[SHARD].get_local_rank() == (
        lightning_mesh["data_parallel"].get_local_rank()
    )
    assert fsdp_tp[TENSOR].get_local_rank() == lightning_mesh["tensor_parallel"].get_local_rank()
    return Meshes(fsdp, fsdp_tp[TENSOR], context, experts, expert_group)
