"""Training entry point: arguments → Fabric → the train type's ``main``.

``run(args)`` is what the CLI calls: it validates, builds the Fabric (the only launch decision is here: the CLI
launches its own ranks, but under ``fabric run``, torchrun or SLURM the processes exist already), and runs the
train type's ``main(fabric, args)`` on every rank. Programs that own a launched Fabric call ``main`` directly.
"""

from __future__ import annotations

import os

import torch
from lightning.fabric import Fabric

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import ConfigError, TrainingError
from astrai_fabric.strategy import build_fabric, check_fsdp_shard_size, closing_loggers, resolve_topology
from astrai_fabric.train import dpo, grpo, lm
from astrai_fabric.train.dry_run import dry_run

TRAIN_TYPES = {"seq": lm, "sft": lm, "dpo": dpo, "grpo": grpo}
"""Each train type's module: ``build_dataset(args, start)`` and ``main(fabric, args)``."""


def run(args: TrainArgs) -> list[dict] | None:
    """Build the Fabric from ``args``, launch its ranks and train (what ``astrai-fabric seq|sft|dpo|grpo`` does).

    Returns the per-step records of ``loop.fit`` (rank 0's when this process launched the ranks).
    """
    args.validate()
    if args.dry_run:
        dry_run(args, TRAIN_TYPES[args.train_type].build_dataset)
        return []
    fabric = build_fabric(args, resolve_topology(args))
    with closing_loggers(fabric):
        if os.environ.get("LT_CLI_USED") == "1":
            return train(fabric, args)  # under `fabric run` the Fabric joined the group already (launching raises)
        return fabric.launch(train, args)  # starts the local ranks, or just runs where torchrun/SLURM started them


def train(fabric: Fabric, args: TrainArgs) -> list[dict]:
    """Train with a Fabric you built and launched: its strategy, devices, precision and loggers are used as they
    are, and nothing is launched. The flags that choose those (``parallel_mode``, ``nprocs``, ``num_nodes``,
    ``device_type``, ``backend``, ``precision``, ``tp_size``, ``fsdp_*``) are then ignored, except
    ``fsdp_sync_each_micro_batch``: the loop honours it when the Fabric's strategy is ``ModelParallelStrategy``;
    and ``fsdp_shard_size``, refused unless the strategy shards that way. Returns the per-step records of
    ``loop.fit``; every rank must call it."""
    args.validate()
    check_fsdp_shard_size(fabric, args)
    if args.train_type not in TRAIN_TYPES:
        raise ConfigError(f"train_type must be one of {sorted(TRAIN_TYPES)}, got {args.train_type!r}")
    try:
        return TRAIN_TYPES[args.train_type].main(fabric, args)
    except RuntimeError as err:
        if fabric.world_size == 1 or not _is_collective_failure(err):
            raise
        raise TrainingError(
            f"rank {fabric.global_rank} lost the other ranks: one died or did not answer within --dist_timeout "
            f"{args.dist_timeout:g} s (its own output says why). Checkpoints in {args.ckpt_dir} are intact; "
            f"--resume auto continues from the newest. [{str(err).splitlines()[0][:200]}]"
        ) from None


def _is_collective_failure(err: RuntimeError) -> bool:
    """A collective that failed because a peer is gone or silent (gloo and NCCL raise plain RuntimeErrors)."""
    markers = ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out")
    return isinstance(err, torch.distributed.DistError) or any(marker in str(err) for marker in markers)
