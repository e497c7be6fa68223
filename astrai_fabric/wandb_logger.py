"""``--loggers wandb``: a Fabric logger over the ``wandb`` package (the optional ``astrai-fabric[wandb]`` extra).

Lightning's ``WandbLogger`` (in ``lightning.pytorch``, Fabric has none) is built for the Trainer: it joins whatever
W&B run is active in the process (a second run in one process would log into the first), and under ``spawn`` starts
its run while being pickled, before the run has checked ``ckpt_dir``. This logger instead:

- starts its W&B run on rank 0 at the first logged step, after ``ckpt_dir`` has been checked and locked, with
  ``dir=ckpt_dir/logs`` (W&B's files go to ``ckpt_dir/logs/wandb``, never the working directory) and the resolved
  recipe as the run's config;
- keeps one W&B run per training run: the id is written to ``ckpt_dir/logs/wandb_run_id``, and a run that continues
  from a checkpoint (its first step is past 1: ``--resume``) continues the W&B run of that id; a run starting at
  step 1 is a new run with a new id;
- leaves the rest to W&B's environment variables (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_ENTITY``,
  ``WANDB_NAME``, ``WANDB_API_KEY``).
"""

from __future__ import annotations

import os
import secrets
import string
from argparse import Namespace
from pathlib import Path
from typing import Any

import wandb
from lightning.fabric.loggers.logger import Logger, rank_zero_experiment
from lightning.fabric.utilities.rank_zero import rank_zero_only

RUN_ID_FILE = "wandb_run_id"
"""The W&B run id of the run writing ``ckpt_dir``, under its ``logs`` folder."""
DEFAULT_PROJECT = "astrai-fabric"
"""The W&B project when ``WANDB_PROJECT`` is not set (W&B's own default would be ``uncategorized``)."""


class WandbLogger(Logger):
    """Logs each step's metrics to one W&B run; ``log_dir`` is ``ckpt_dir/logs`` (W&B adds its ``wandb`` folder)."""

    def __init__(self, log_dir: str | Path, config: dict[str, Any]) -> None:
        super().__init__()
        self._log_dir = Path(log_dir)
        self._config = config
        self._run: Any = None  # wandb.Run, started by the first logged step

    @property
    def name(self) -> str:
        return os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT)

    @property
    def version(self) -> str | None:
        return self._run.id if self._run is not None else None

    @property
    def log_dir(self) -> str:
        return str(self._log_dir)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The W&B run (started as a new run if nothing was logged yet); a no-op stand-in on other ranks."""
        return self._start(continues_a_run=False)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        run = self._start(continues_a_run=step is not None and step > 1)
        run.log(metrics, step=step)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        values = vars(params) if isinstance(params, Namespace) else params
        self.experiment.config.update(values, allow_val_change=True)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """End the W&B run (``status`` other than ``success`` marks it failed); a later step would continue it."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "success" else 1)
            self._run = None

    def _start(self, continues_a_run: bool) -> Any:
        if self._run is not None:
            return self._run
        id_file = self._log_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if continues_a_run and id_file.is_file() else _new_run_id()
        self._log_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            dir=self._log_dir,
            project=self.name,
            id=run_id,
            resume="allow",  # the same id continues that run (W&B appends the steps after its last one)
            reinit="create_new",  # this object's own run, whatever else the process has open
        )
        # Set after init so a resumed run takes the new recipe (a raised max_steps, say) without W&B refusing it.
        self._run.config.update(self._config, allow_val_change=True)
        return self._run


def _new_run_id() -> str:
    """Eight characters from W&B's alphabet for ids, as W&B makes its own (its generator is not public API)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
