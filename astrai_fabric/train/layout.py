"""The mesh a run's flags ask for: ``--pp_size``, ``--tp_size``, ``--fsdp_shard_size``, ``--cp_size`` and
``--ep_size`` over its ranks, for the plan, the checks and the footprint alike."""

from __future__ import annotations

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout


def layout_of_flags(args: TrainArgs, world_size: int) -> MeshLayout:
    """The layout ``args``' flags ask of ``world_size`` ranks under FSDP (``mesh.mesh_layout``: a ``ConfigError``
    naming the sizes that do not divide)."""
    return mesh_layout(world_size, args.tp_size, args.fsdp_shard_size, args.cp_size, args.ep_size, args.pp_size)
