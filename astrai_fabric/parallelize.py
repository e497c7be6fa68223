"""FSDP2 sharding for ``ModelParallelStrategy``: the only module that imports ``fully_shard``.

Every decoder block is its own FSDP unit, and the root is one too: it holds the embedding, final norm and
``lm_head``, so a tied embedding stays one parameter (AstrAI shards ``embed_tokens`` and ``lm_head`` apart and
unties them, B4), and every parameter is a DTensor, which gradient clipping needs (P4). Parameters stay gathered
between forward and backward (``reshard_after_forward=False``), AstrAI's choice: more memory, less communication.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def parallelize(model: nn.Module, device_mesh: DeviceMesh, reshard_after_forward: bool = False) -> nn.Module:
    """Shard ``model`` over the mesh's ``data_parallel`` axis (called by Fabric in ``setup_module``).

    A frozen model that only runs forward (a reference model) passes ``reshard_after_forward=True``: with no
    backward to reshard it, it would otherwise stay gathered after its first forward.
    """
    mesh = device_mesh["data_parallel"]
    for block in model.decoder_blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())
