"""Training entry point: arguments → Fabric → the train type's ``main``.

``run(args)`` is what the CLI calls: it validates, builds the Fabric (the only launch decision is here: the CLI
launches its own ranks, but under ``fabric run``, torchrun or SLURM the processes exist already), and runs the
train type's ``main(fabric, args)`` on every rank. Programs that own a launched Fabric call ``main`` directly.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lightning.fabric import Fabric

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import ConfigError
from astrai_fabric.strategy import build_fabric, resolve_topology
from astrai_fabric.train import dpo, grpo, lm

MAINS: dict[str, Callable[[Fabric, TrainArgs], list[dict]]] = {
    "seq": lm.main,
    "sft": lm.main,
    "dpo": dpo.main,
    "grpo": grpo.main,
}


def run(args: TrainArgs) -> list[dict] | None:
    """Train; returns the per-step records of ``loop.fit`` (rank 0's when this process launched the ranks)."""
    args.validate()
    if args.train_type not in MAINS:
        raise ConfigError(f"train_type {args.train_type!r} is not available yet; choose one of {sorted(MAINS)}")
    fabric = build_fabric(args, resolve_topology(args))
    main = MAINS[args.train_type]
    if os.environ.get("LT_CLI_USED") == "1":
        return main(
            fabric, args
        )  # under `fabric run` the Fabric joined the process group already; launch() would raise (P8)
    else:
        return fabric.launch(main, args)  # starts the local ranks, or just runs where torchrun/SLURM started them
