"""What a resume needs, moved between live (possibly sharded) training objects and AstrAI's checkpoint files.

Saving: every rank takes part in gathering (a DTensor's ``full_tensor()`` is a collective); rank 0 keeps full
CPU tensors and writes AstrAI's directory, so ``model.safetensors`` and ``optimizer.pt`` are the same whether the
run was one process or FSDP over many (AstrAI saves rank 0's optimizer shard only, B6). Loading: every rank reads
the full state and keeps its own shard. The data position goes to ``meta.json`` under ``resume_position``; AstrAI
ignores that key and uses its own ``epoch``/``consumed_samples``, which we write as AstrAI counts them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from astrai_fabric.checkpoint import Checkpoint, load_model_weights, save_checkpoint
from astrai_fabric.errors import CheckpointError

RESUME_KEY = "resume_position"


@dataclass
class RunPosition:
    """Where a run is: counters of the loop, enough to continue exactly."""

    epoch: int = 0
    """Epoch of the next sample (0-based)."""
    sample_index: int = 0
    """Samples each rank has consumed in ``epoch``."""
    world_size: int = 1
    """Ranks that consumed them (the global position is ``sample_index * world_size``)."""
    optimizer_step: int = 0
    """Optimizer steps taken since the run began (global, never reset per epoch)."""
    num_tokens: int = 0
    """Input tokens trained on, all ranks together."""
    consumed_samples: int = 0
    """AstrAI's counter: ``batch_per_device * world_size`` per micro-batch, short batches included."""

    @property
    def last_epoch(self) -> int:
        """Epoch of the last sample consumed (names the checkpoint, AstrAI's ``epoch``); ``epoch`` is the next one's."""
        return self.epoch - 1 if self.sample_index == 0 and self.epoch > 0 else self.epoch

    def rescaled(self, world_size: int, samples_per_rank: int) -> tuple[RunPosition, bool]:
        """The same global position for ``world_size`` ranks; False when it falls between two samples."""
        global_index = self.sample_index * self.world_size
        index, exact = global_index // world_size, global_index % world_size == 0
        position = RunPosition(**{**asdict(self), "sample_index": index, "world_size": world_size})
        if position.sample_index >= samples_per_rank:  # the epoch was complete
            position.epoch, position.sample_index = position.epoch + 1, 0
        return position, exact


def gather_full(obj: Any, keep: bool) -> Any:
    """``obj`` with every tensor replaced by a full CPU copy (``keep``) or dropped (other ranks).

    Collective when ``obj`` holds DTensors: every rank must call it with the same structure.
    """
    if isinstance(obj, DTensor):
        full = obj.full_tensor()
        return full.cpu() if keep else None
    if isinstance(obj, Tensor):
        return obj.detach().cpu() if keep else None
    if isinstance(obj, dict):
        return {k: gather_full(v, keep) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(gather_full(v, keep) for v in obj)
    return obj


def optimizer_parts(optimizer: Optimizer) -> dict[str | None, Optimizer]:
    """The torch optimizers inside (``muon``/``adamw`` for ``MuonAdamW``; the optimizer itself otherwise)."""
    return getattr(optimizer, "sub_optimizers", {None: optimizer})


def save_training_checkpoint(
    fabric: Fabric,
    directory: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any,
    position: RunPosition,
    config: dict[str, Any],
    meta: dict[str, Any],
    files: dict[str, Any],
) -> None:
    """Write ``directory`` on rank 0 with the state after the last optimizer step (all ranks must call)."""
    keep = fabric.global_rank == 0
    weights = gather_full(model.state_dict(), keep)
    optimizer_state = gather_full(optimizer.state_dict(), keep)
    rng = _gather_rng_states(fabric.world_size)
    if keep:
        save_checkpoint(
            directory,
            weights,
            config,
            epoch=position.last_epoch,
            consumed_samples=position.consumed_samples,
            meta={**meta, RESUME_KEY: asdict(position)},
            extra={"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": {"torch": rng}},
            files=files,
            overwrite=True,  # a same-step save replaces only after the new directory is complete
        )
    fabric.barrier()


def _gather_rng_states(world_size: int) -> Tensor:
    """Every rank's torch RNG state, one row per rank (collective)."""
    state = torch.get_rng_state()
    if world_size == 1:
        return state.unsqueeze(0)
    states = [None] * world_size
    torch.distributed.all_gather_object(states, state)
    return torch.stack(states)


def load_weights(model: nn.Module, ckpt: Checkpoint) -> None:
    """Weights into an unsharded model, before ``fabric.setup`` shards it."""
    load_model_weights(model, ckpt.state_dict, source=ckpt.path / "model.safetensors")


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any], source: Path) -> None:
    """A full optimizer state into a live optimizer, each tensor sharded like its parameter."""
    parts = optimizer_parts(optimizer)
    if None in parts:
        states = {None: state}
    elif isinstance(state, dict) and set(state) == set(parts):
        states = state
    else:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{source}: optimizer state has keys {found}, but this run's optimizer saves {sorted(parts)}: the "
            "checkpoint was trained with another --optimizer"
        )
    for name, part in parts.items():
        params = [p for group in part.param_groups for p in group["params"]]
        sub_state = states[name]
        if not isinstance(sub_state, dict):
            raise CheckpointError(f"{source}: the optimizer state of {name!r} is missing")
        if any(isinstance(v, DTensor) for entry in sub_state.get("state", {}).values() for v in entry.values()):
            raise CheckpointError(
                f"{source}: holds sharded (DTensor) optimizer state: AstrAI's FSDP saves only rank 0's shard (its "
                "bug B6), which cannot restore the optimizer. To continue from this checkpoint's weights, schedule "
                "and data position with a fresh optimizer, add --resume_optimizer false"
            )
        if len(sub_state.get("state", {})) > len(params):
            raise CheckpointError(f"{source}: optimizer state covers more parameters than the model has")
        for index, entry in sub_state.get("state", {}).items():
            param = params[index]
            for key, value in entry.items():
                if isinstance(value, Tensor) and isinstance(param, DTensor) and value.shape == param.shape:
                    value = value.to(device=param.device, dtype=param.dtype)
                    entry[key] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    optimizer.load_state_dict(state)


def restore_rng(rng: dict[str, Tensor] | None, rank: int, world_size: int) -> bool:
    """This rank's torch RNG state, when the checkpoint has one saved by the same number of ranks."""
    if not rng or "torch" not in rng or rng["torch"].size(0) != world_size:
        return False
    torch.set_rng_state(rng["torch"][rank].to(torch.uint8).clone())  # own storage: a row view crashes it
    return True
