"""The Fabric's loggers, under ``ckpt_dir/logs``: CSV, TensorBoard and Weights & Biases (``wandb_logger.py``), the
only place their packages are imported; the optional ones (``.[tensorboard]``, ``.[wandb]``) refused in one line
when missing."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

from astrai_fabric.errors import ConfigError

LOG_DIR = "logs"
"""Where the loggers write, under ``ckpt_dir``."""


def build_loggers(names: Sequence[str], ckpt_dir: str, config: dict[str, Any]) -> list:
    """The loggers ``names`` (``--loggers``), writing under ``ckpt_dir/logs`` (created on first use, by rank 0), all
    into the same ``version_N`` folder (each would otherwise take the next free one for itself); ``config``: the
    recipe's values, W&B's record of the run's config."""
    loggers: list = []
    version = None
    if "csv" in names:
        # Written when the Reporter flushes (every FLUSH_SECONDS, at checkpoints and at the end), not by step count:
        # Lightning's every 100 steps is hours of a slow run lost to a crash, and a fraction of a step for a fast one.
        loggers.append(CSVLogger(ckpt_dir, name=LOG_DIR, flush_logs_every_n_steps=sys.maxsize))
        version = loggers[-1].version  # the next free version_N
    if "tensorboard" in names:
        try:
            loggers.append(TensorBoardLogger(ckpt_dir, name=LOG_DIR, version=version))
        except ModuleNotFoundError as err:
            raise _missing_extra("tensorboard", err) from None
    if "wandb" in names:
        try:  # here, not at the top: wandb is an optional extra (and takes ~2 s to import)
            from astrai_fabric.wandb_logger import WandbLogger
        except ModuleNotFoundError as err:
            raise _missing_extra("wandb", err) from None
        loggers.append(WandbLogger(Path(ckpt_dir) / LOG_DIR, config=config))
    return loggers


def _missing_extra(package: str, err: ModuleNotFoundError) -> ConfigError:
    """The one line for ``--loggers PACKAGE`` without its package (the extra of the same name installs it)."""
    return ConfigError(
        f"loggers {package} needs the {package} package ({err}): pip install 'astrai-fabric[{package}]' "
        f"(or pip install {package})"
    )


@contextmanager
def closing_loggers(fabric: Fabric) -> Iterator[None]:
    """Around a run on a Fabric built here: end what its loggers hold open (a W&B run, TensorBoard's writer) when
    the run ends, as ``failed`` when it raised. A Fabric the user built keeps its loggers open: they are theirs."""
    status = "failed"
    try:
        yield
        status = "success"
    finally:
        for logger in fabric.loggers:
            logger.finalize(status)
