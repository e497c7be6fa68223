"""What a run writes in ``ckpt_dir`` and how it guards it: the lock and ownership check held for the whole run
(``hold_ckpt_dir``, applying ``checkpoint/ownership.py``), the refusal to overwrite another run's checkpoints
(``refuse_to_overwrite``), and ``make_saver``'s ``save(position)`` writing ``epoch_E_step_S``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from torch import nn

from astrai_fabric.checkpoint import (
    LORA_BASE_KEY,
    checkpoints_after,
    hf,
    lora_base_entry,
    prune_checkpoints,
)
from astrai_fabric.checkpoint.gather import whole_names
from astrai_fabric.checkpoint.ownership import check_owned, lock_ckpt_dir
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.checkpoint.state import save_training_checkpoint
from astrai_fabric.config.train import RECIPE_FILE, RECIPE_HEADER, TrainArgs, resolved_recipe
from astrai_fabric.errors import CheckpointError, raised_on_every_rank
from astrai_fabric.loggers import LOG_DIR
from astrai_fabric.metrics import METRIC_FILE, MetricLog
from astrai_fabric.plot import PLOT_FILE
from astrai_fabric.profiling import PROFILE_DIR
from astrai_fabric.quantize import QUANTIZATION_KEY, quantization_entry
from astrai_fabric.train.models import lora_spec
from astrai_fabric.train.start import Start


def written_names(args: TrainArgs) -> list[str]:
    """The top-level names a run writes in ``ckpt_dir`` besides its checkpoints (guarded by ``hold_ckpt_dir``)."""
    names = [RECIPE_FILE, PLOT_FILE] + ([LOG_DIR] if args.loggers else [])
    return names + ([PROFILE_DIR] if args.profile_steps else [])


@contextmanager
def hold_ckpt_dir(fabric: Fabric, args: TrainArgs) -> Iterator[None]:
    """For the whole run, rank 0 holds the lock on ``ckpt_dir`` (``checkpoint/ownership.py``) and makes sure the
    names the run writes there (``written_names``) are free or a run's: checked before anything is created, and
    again under the lock. A refusal is raised on every rank; the lock is released on the way out, exceptions
    included."""
    lock, refusal = None, None
    if fabric.global_rank == 0:
        legacy = (RECIPE_FILE, RECIPE_HEADER)
        try:
            check_owned(args.ckpt_dir, written_names(args), legacy)  # nothing created yet
            lock = lock_ckpt_dir(args.ckpt_dir)
            check_owned(args.ckpt_dir, written_names(args), legacy)  # and no other run in between
        except CheckpointError as err:
            refusal = str(err)
            if lock is not None:
                lock.release()
    refusal = fabric.broadcast(refusal)
    if refusal is not None:
        raise raised_on_every_rank(CheckpointError(refusal), fabric.local_rank)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def refuse_to_overwrite(fabric: Fabric, ckpt_dir: str, step: int) -> None:
    """Refuse to start a run that would replace checkpoints of another one: ``ckpt_dir`` must hold none saved
    after the run's first step (rank 0 looks; every rank raises)."""
    later = checkpoints_after(ckpt_dir, step) if fabric.global_rank == 0 else None
    names = fabric.broadcast([path.name for path in later] if later is not None else None)
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        message = (
            f"ckpt_dir {ckpt_dir}: already holds {shown}, past this run's start (step {step}), which it would "
            "overwrite; continue the newest with --resume auto, or choose a new --ckpt_dir"
        )
        raise raised_on_every_rank(CheckpointError(message), fabric.local_rank)


def make_saver(
    fabric: Fabric,
    model: nn.Module,
    optimizer: Any,
    scheduler: Any,
    start: Start,
    args: TrainArgs,
    metric_log: MetricLog,
    extra_meta: dict[str, Any] | None = None,
    memory: Callable[[], dict[str, int]] | None = None,
):
    """``save(position)`` writing ``{ckpt_dir}/epoch_{E}_step_{S}`` (all ranks call it; rank 0 writes) and
    returning its path; each checkpoint also gets the run's metric log so far, with ``memory()``'s figures as a
    ``memory`` entry (the peak so far; every rank calls it)."""
    config = dataclasses.replace(start.model_config, neftune_alpha=args.neftune_alpha).to_dict()
    meta = {"train_type": args.train_type, **{k: v for k, v in args.to_dict().items() if k != "train_type"}}
    meta.update(extra_meta or {})
    if start.source is not None:
        meta[hf.SOURCE_KEY] = start.source.to_meta()
    tokenizer_files = start.tokenizer.files if start.tokenizer is not None else {}  # a run without one writes none
    files: dict[str, Any] = {**tokenizer_files, RECIPE_FILE: resolved_recipe(args)}
    raw_model = getattr(model, "module", model)  # the module Fabric wraps: clean keys, no `_orig_mod.`

    spec = lora_spec(args)

    def save(position: RunPosition) -> Path:
        path = Path(args.ckpt_dir) / f"epoch_{position.last_epoch}_step_{position.optimizer_step}"
        if memory is not None and (figures := memory()):
            metric_log.add("memory", position.last_epoch, position.optimizer_step, position.consumed_samples, **figures)
        files[METRIC_FILE] = metric_log.text()
        if spec is not None:  # a pointer to the base weights, relative to this checkpoint, instead of a copy
            meta[LORA_BASE_KEY] = lora_base_entry(start.lora_base, path, start.lora_digests)
        if args.quantize is not None:  # which base weights the adapter was trained over in NF4, and from what dtype
            entry = quantization_entry(raw_model)  # this rank's NF4 weights: under --ep_size, every rank's experts'
            meta[QUANTIZATION_KEY] = entry | {"keys": whole_names(raw_model, entry["keys"])}
        save_training_checkpoint(
            fabric,
            path,
            raw_model,
            optimizer.optimizer,
            scheduler,
            position,
            config,
            meta,
            files,
            args.sharded_checkpoint,
            spec,
            args.lora_save_full,
        )
        if args.keep_last_k is not None and fabric.global_rank == 0:
            prune_checkpoints(args.ckpt_dir, args.keep_last_k)  # only now: the new checkpoint is complete
        return path

    return save
