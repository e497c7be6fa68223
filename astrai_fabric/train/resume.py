"""Resuming a run: which checkpoint ``--resume`` names (``resume_checkpoint``), whether it belongs to this run
(the same model, train type and LoRA adapter, a readable position and RNG state: ``check_resume``), and the loop
position it continues at (``start_position``: ours exactly, AstrAI's from its counters).
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning.fabric import Fabric

from astrai_fabric.checkpoint import Checkpoint, find_latest_checkpoint, load_checkpoint
from astrai_fabric.checkpoint.position import RESUME_KEY, RunPosition
from astrai_fabric.checkpoint.state import check_rng_state, restore_rng
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import CheckpointError
from astrai_fabric.quantize import quantization_record, read_quantization_entry
from astrai_fabric.schedule import StepPlan
from astrai_fabric.train.models import lora_spec


def resume_checkpoint(args: TrainArgs, param_path: Path) -> Checkpoint | None:
    if args.resume is False or args.resume == "false":
        return None
    if args.resume is True or args.resume == "true":
        path = param_path  # AstrAI's meaning: param_path is the checkpoint
    elif args.resume == "auto":
        path = find_latest_checkpoint(args.ckpt_dir)
        if path is None:
            return None  # nothing saved yet: a fresh start from param_path
    else:
        path = Path(args.resume)
    if not os.path.lexists(path / "meta.json"):  # one there that is no file is refused by name when read
        raise CheckpointError(
            f"--resume: {path} is not a training checkpoint (no meta.json); to start from its weights, pass it as "
            "--param_path without --resume"
        )
    # A LoRA checkpoint resumes on its base alone, the adapter loaded into the injected layers (never merged).
    return load_checkpoint(path, skip=() if args.resume_optimizer else ("optimizer",), merge_lora=False)


def check_resume(ckpt: Checkpoint, model_config: ModelConfig, args: TrainArgs) -> None:
    """Refuse a checkpoint that is not this run's to continue, before any of it is applied: another model or train
    type, an unreadable position, RNG state or reference record, or a LoRA adapter that does not match the run's."""
    _check_resume_matches(ckpt, model_config, args)
    _check_resume_state(ckpt)
    _check_resume_lora(ckpt, args)


def _check_resume_matches(ckpt: Checkpoint, model_config: ModelConfig, args: TrainArgs) -> None:
    ours, theirs = model_config.to_dict(), ckpt.model_config().to_dict()
    keys = [*ours, *(k for k in theirs if k not in ours)]  # extension fields appear only where not at default
    differ = [
        f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here"
        for k in keys
        if k != "neftune_alpha" and ours.get(k) != theirs.get(k)
    ]
    if differ:
        raise CheckpointError(f"--resume: {ckpt.path} holds a different model than param_path: " + "; ".join(differ))
    trained_as = ckpt.meta.get("train_type")
    if trained_as is not None and trained_as != args.train_type:
        raise CheckpointError(
            f"--resume: {ckpt.path} was written by a {trained_as} run, this is {args.train_type}; to start "
            f"{args.train_type} from its weights, pass it as --param_path without --resume"
        )


def _check_resume_state(ckpt: Checkpoint) -> None:
    """What a resume applies, checked before any of it is: the position, the RNG states, the reference's record."""
    if RESUME_KEY in ckpt.meta:
        RunPosition.from_meta(ckpt.meta[RESUME_KEY], ckpt.path / "meta.json")
    if "rng" in ckpt.extra:
        check_rng_state(ckpt.extra["rng"], ckpt.path / "rng.pt")
    reference = ckpt.meta.get("reference", {"param_path": None, "random_seed": 0})
    if not (
        isinstance(reference, dict)
        and isinstance(reference.get("param_path"), str | None)
        and isinstance(reference.get("random_seed"), int)
    ):
        raise CheckpointError(
            f"{ckpt.path / 'meta.json'}: 'reference' must be {{param_path, random_seed}}, got {reference!r}"
        )


def _check_resume_lora(ckpt: Checkpoint, args: TrainArgs) -> None:
    """A LoRA checkpoint resumes only as the same LoRA run, and a full one only without LoRA."""
    spec = lora_spec(args)
    if ckpt.lora is None and spec is None:
        return
    if ckpt.lora is None:
        raise CheckpointError(
            f"--resume: {ckpt.path} holds no LoRA adapter, but this run has --lora_r {args.lora_r}; to train an "
            "adapter on its weights, pass it as --param_path without --resume"
        )
    if spec is None:
        raise CheckpointError(
            f"--resume: {ckpt.path} is a LoRA run (r={ckpt.lora.spec.r}); resume it with the same --lora_r, "
            "--lora_alpha and --lora_targets, or pass it as --param_path without --resume to train from its merged "
            "weights"
        )
    ours, theirs = (spec.r, spec.alpha, spec.targets), (ckpt.lora.spec.r, ckpt.lora.spec.alpha, ckpt.lora.spec.targets)
    if ours != theirs:
        raise CheckpointError(
            f"--resume: {ckpt.path} holds an adapter with r={theirs[0]}, alpha={theirs[1]}, targets "
            f"{list(theirs[2])}; this run asks for r={ours[0]}, alpha={ours[1]}, targets {list(ours[2])}"
        )
    record = quantization_record(ckpt.meta, str(ckpt.path / "meta.json"))
    if record is not None:
        read_quantization_entry(record, str(ckpt.path / "meta.json"))
    if (record is not None) != (args.quantize is not None):  # the adapter goes on over the base it was trained over
        trained_over, resume_with = (
            ("NF4", "with --quantize nf4") if record else ("its float dtype", "without --quantize")
        )
        raise CheckpointError(
            f"--resume: {ckpt.path} holds an adapter trained over the base in {trained_over}; resume it {resume_with}"
        )


def check_position(ckpt: Checkpoint, plan: StepPlan) -> None:
    """A checkpoint of ours must stop inside an epoch of this run's data (``start_position`` continues from it)."""
    if RESUME_KEY not in ckpt.meta:
        return
    saved = RunPosition.from_meta(ckpt.meta[RESUME_KEY], ckpt.path / "meta.json")
    if saved.sample_index * saved.world_size > plan.samples_per_rank * plan.num_dp_ranks:
        raise CheckpointError(
            f"--resume: {ckpt.path} stopped {saved.sample_index * saved.world_size:,} samples into epoch "
            f"{saved.epoch}, but an epoch of this data has {plan.samples_per_rank * plan.num_dp_ranks:,}: resume "
            "with the data it was trained on"
        )


def start_position(fabric: Fabric, ckpt: Checkpoint | None, args: TrainArgs, plan: StepPlan) -> RunPosition:
    """The loop position to start from (``planned_position``). A resume also restores the RNG states (or reseeds
    where it holds none)."""
    position, warning = planned_position(ckpt, args, plan)
    if warning is not None:
        fabric.print(f"warning: {warning}")
    if ckpt is None:
        return position
    if not restore_rng(ckpt.extra.get("rng"), fabric.global_rank, fabric.world_size):
        fabric.seed_everything(args.random_seed + position.optimizer_step, verbose=False)
    return position


def planned_position(ckpt: Checkpoint | None, args: TrainArgs, plan: StepPlan) -> tuple[RunPosition, str | None]:
    """Where a run starts: the resumed checkpoint's position (``ckpt``), AstrAI's ``start_epoch`` and
    ``start_samples`` for a fresh run, or zero; and a warning when the checkpoint's position falls between samples
    for this run's ranks. Reads nothing but its arguments (the dry run plans with it too)."""
    num_dp_ranks = plan.num_dp_ranks  # the ones that consume different samples
    if ckpt is None:
        # AstrAI's manual offsets for a fresh run; start_samples counts samples per rank.
        epoch = args.start_epoch + args.start_samples // plan.samples_per_rank
        index = args.start_samples % plan.samples_per_rank
        return RunPosition(epoch=epoch, sample_index=index, world_size=num_dp_ranks), None
    if RESUME_KEY in ckpt.meta:  # ours: exact (``check_position`` passed: the run's preflight)
        saved = RunPosition.from_meta(ckpt.meta[RESUME_KEY], ckpt.path / "meta.json")
        position, exact = saved.rescaled(num_dp_ranks, plan.samples_per_rank)
        if exact:
            return position, None
        return position, (
            f"the checkpoint's position ({saved.sample_index} samples on each of {saved.world_size} ranks) falls "
            f"between samples for {num_dp_ranks} ranks; up to {num_dp_ranks - 1} sample(s) repeat"
        )
    # Written by AstrAI: AstrAI's meta semantics (train_context.py), floor to a whole optimizer step.
    per_step = plan.global_batch_size
    consumed = ckpt.consumed_samples // per_step * per_step
    offset = consumed // num_dp_ranks
    position = RunPosition(
        epoch=offset // plan.samples_per_rank,
        sample_index=offset % plan.samples_per_rank,
        world_size=num_dp_ranks,
        optimizer_step=consumed // per_step,
        consumed_samples=consumed,
    )
    return position, None
