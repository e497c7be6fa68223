"""Training entry point: arguments → Fabric → the train type's ``main``.

``execute(args)`` is the one dispatch, what ``astrai-fabric seq|sft|dpo|kto|grpo|reward_model`` and ``run(args)``
both call once ``args`` is validated: a dry run prints the plan (``dry_run.py``); otherwise it builds the Fabric (the
only launch decision is here: the CLI launches its own ranks, but under ``fabric run``, torchrun or SLURM the processes
exist already) and runs the train type's ``main(fabric, args)`` on every rank. Programs that own a launched Fabric call
``train(fabric, args)``.

Each ``main`` then reads downward: ``start.resolve_start`` (where the run starts), the train type's dataset and
loss (handed over as a ``common.TrainTask``), ``common.train_on`` (model, optimizer, loaders, saver), ``loop.fit``
(epochs) and ``loop.train_step`` (one optimizer step).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from lightning.fabric import Fabric

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.config.train_types import TRAIN_TYPES
from astrai_fabric.errors import ConfigError, TrainingError
from astrai_fabric.host_memory import reuse_freed_memory
from astrai_fabric.launch import start_local_ranks
from astrai_fabric.loggers import closing_loggers
from astrai_fabric.strategy import (
    FabricArgs,
    build_fabric,
    check_layout_flags,
    resolve_topology,
    set_cpu_threads,
)
from astrai_fabric.train import dpo, grpo, kto, lm, reward_model
from astrai_fabric.train.checks import check_processes_fit
from astrai_fabric.train.dry_run import dry_run

TRAIN_MODULES = dict(zip(TRAIN_TYPES, (lm, lm, dpo, kto, grpo, reward_model), strict=True))
"""Each train type's module (``config.train_types``' order): ``build_dataset(args, start)`` and
``main(fabric, args)``."""


def run(args: TrainArgs) -> list[dict] | None:
    """Validate ``args``, build the Fabric, launch its ranks and train (what ``astrai-fabric seq|sft|dpo|...``
    does); a dry run prints the plan and returns ``[]``.

    Returns the per-step records of ``loop.fit`` (rank 0's when this process launched the ranks).
    """
    args.validate()
    return execute(args)[1]


def execute(
    args: TrainArgs, *, own_process: bool = False, command: list[str] | None = None
) -> tuple[int, list[dict] | None]:
    """Run validated ``args``: print the plan (``--dry_run``; status 0, or 2 when the run could not start, and no
    records) or launch the ranks and train (status 0 and the records ``run`` returns). ``own_process``: the command
    line's run, whose process settings are its own: ``--num_threads`` first, to this process and the ranks it
    launches (``strategy.set_cpu_threads``), and before training ``--reuse_freed_memory`` (``host_memory``; each
    rank the launcher starts runs the command line again); a program calling ``run`` keeps its own settings.
    ``command``: the command line's arguments (``seq ...``), which the ranks ``--nprocs`` asks for run too, started
    and ended with the run by ``launch``; None: Lightning's launcher, which starts the calling program again."""
    if own_process:
        set_cpu_threads(args.num_threads)
    if args.dry_run:
        return dry_run(args, TRAIN_MODULES[args.train_type].build_dataset), []
    if own_process and args.reuse_freed_memory:
        reuse_freed_memory()
    if not (topology := resolve_topology(args.nprocs, args.num_nodes)).launched_externally:
        check_processes_fit(topology.devices)  # before starting them
    fabric = build_run_fabric(args)
    ranks = None
    if command is not None and not topology.launched_externally:  # the CLI's launcher: its ranks end with the run
        report = functools.partial(_lost_ranks, 0, args)
        ranks = start_local_ranks(topology.devices, topology.num_nodes, command, report)
    try:
        with closing_loggers(fabric):
            if os.environ.get("LT_CLI_USED") == "1":  # under `fabric run` the Fabric joined its group already
                records = _train(fabric, args)
            else:  # starts a program's local ranks (Lightning's launcher), or joins the ranks started already
                records = fabric.launch(_train, args)
    except BaseException:
        if ranks is not None:
            ranks.end()
        raise
    if ranks is not None:
        ranks.join()
    return 0, records


def train(fabric: Fabric, args: TrainArgs) -> list[dict]:
    """Train with a Fabric you built and launched: its strategy, devices, precision and loggers are used as they
    are, and nothing is launched. The flags that choose those (``parallel_mode``, ``nprocs``, ``num_nodes``,
    ``device_type``, ``backend``, ``precision``, ``tp_size``, ``fsdp_*``) are then ignored, except
    ``fsdp_sync_each_micro_batch``: the loop honours it when the Fabric's strategy is ``ModelParallelStrategy``;
    and ``fsdp_shard_size``, ``cp_size``, ``ep_size`` and ``pp_size`` (with its stages per rank), refused unless
    the strategy applies them. Returns the per-step records of ``loop.fit``; every rank must call it."""
    args.validate()
    check_layout_flags(fabric, args.fsdp_shard_size, args.cp_size, args.ep_size, args.pp_size, args.num_stages_per_rank)
    return _train(fabric, args)


def build_run_fabric(args: TrainArgs) -> Fabric:
    """The Fabric the flags ask for (``strategy.build_fabric``), over the ranks the launcher or ``--nprocs`` and
    ``--num_nodes`` give; not launched."""
    return build_fabric(fabric_args(args), resolve_topology(args.nprocs, args.num_nodes))


def fabric_args(args: TrainArgs) -> FabricArgs:
    """The flags of ``args`` that ``strategy.build_fabric`` reads, each field of ``FabricArgs`` the flag (or the
    resolved value, ``num_stages_per_rank``) of its name (the loggers also get the recipe's values)."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(FabricArgs) if f.name != "logged_config"}
    return FabricArgs(**flags | {"loggers": tuple(args.loggers)}, logged_config=args.recipe_values())


def _train(fabric: Fabric, args: TrainArgs) -> list[dict]:
    """``train`` on validated ``args`` (every rank ``execute`` launches runs this)."""
    if args.train_type not in TRAIN_MODULES:
        raise ConfigError(f"train_type must be one of {sorted(TRAIN_MODULES)}, got {args.train_type!r}")
    try:
        return TRAIN_MODULES[args.train_type].main(fabric, args)
    except RuntimeError as err:
        if fabric.world_size == 1 or not _is_collective_failure(err):
            raise
        silent = f"one died or did not answer within --dist_timeout {args.dist_timeout:g} s"
        raise TrainingError(
            f"{_lost_ranks(fabric.global_rank, args, silent)} [{str(err).splitlines()[0][:200]}]"
        ) from None


def _lost_ranks(rank: int, args: TrainArgs, what: str) -> str:
    """The line of a rank whose peers are gone, ``what`` saying which or how."""
    return (
        f"rank {rank} lost the other ranks: {what} (its own output says why). Checkpoints in {args.ckpt_dir} are "
        "intact; --resume auto continues from the newest."
    )


def _is_collective_failure(err: RuntimeError) -> bool:
    """A collective that failed because a peer is gone or silent (gloo and NCCL raise plain RuntimeErrors)."""
    markers = ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out")
    return isinstance(err, torch.distributed.DistError) or any(marker in str(err) for marker in markers)
