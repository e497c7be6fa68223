"""What every train type shares: where a run starts (fresh, weights, or resume), the model, the optimizer and
schedule, and how checkpoints are written. Each train type's ``main`` calls these in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, random_split

from astrai_fabric import assets, lora
from astrai_fabric.checkpoint import (
    ADAPTER_FILE,
    CONFIG_FILE,
    LORA_BASE_KEY,
    META_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    Checkpoint,
    checkpoints_after,
    empty_model,
    find_latest_checkpoint,
    hf,
    load_checkpoint,
    lora_base_entry,
    prune_checkpoints,
    read_model_config,
    remove_stale_staging,
    weight_digests,
)
from astrai_fabric.checkpoint.ownership import check_owned, check_writable, lock_ckpt_dir, record_written
from astrai_fabric.checkpoint.state import (
    RESUME_KEY,
    STATE_DIR,
    RunPosition,
    check_rng_state,
    load_optimizer_state,
    load_sharded_optimizer_state,
    load_weights,
    restore_rng,
    save_training_checkpoint,
)
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler
from astrai_fabric.data.dataset_config import DatasetConfig, read_dataset_config
from astrai_fabric.data.storage import detect_format
from astrai_fabric.errors import CheckpointError, ConfigError, UserError, raised_on_every_rank
from astrai_fabric.loop import LossFn, fit
from astrai_fabric.metrics import METRIC_FILE, MetricLog, flops_per_token, peak_flops
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import build_optimizer, optimizer_groups, optimizer_state_bytes, resolve_ns_dtype
from astrai_fabric.plot import PLOT_FILE, plot_runs
from astrai_fabric.preemption import StopRequest, ignore_stop_signals
from astrai_fabric.profiling import PROFILE_DIR, StepProfiler, describe_profiling
from astrai_fabric.randomness import derive_seed
from astrai_fabric.reporting import Reporter
from astrai_fabric.schedule import StepPlan, build_scheduler
from astrai_fabric.strategy import (
    LOG_DIR,
    data_parallel,
    describe_cpu_threads,
    is_fsdp,
    local_ranks,
    precision_of,
    resolve_num_workers,
    setup_frozen,
)
from astrai_fabric.tokenizer import TOKENIZER_FILE, Tokenizer

RECIPE_FILE = "recipe.yaml"
RECIPE_HEADER = "# Resolved recipe; rerun with: astrai-fabric"
"""How ``recipe.yaml`` begins: in a ``ckpt_dir`` without a manifest (an older run's) it marks the files as ours."""


@dataclass
class Start:
    """Where a run starts: the model's config, the weights (if any), the tokenizer and, when resuming, the
    checkpoint."""

    model_config: ModelConfig
    weights: Checkpoint | None
    """Weights to start from: the resume checkpoint, else ``param_path`` if it has any, else None (fresh)."""
    resume: Checkpoint | None
    tokenizer: Tokenizer | None
    """None only where the default tokenizer directory (``param_path``) holds none: AstrAI's ``save_pretrained``
    writes only config.json and model.safetensors, and seq/sft on bin shards need no tokenizer."""
    no_tokenizer: str | None = None
    """Why there is no tokenizer (the loader's own message), raised by ``need_tokenizer``."""
    dataset_config: DatasetConfig | None = None
    """AstrAI's ``dataset_config.json`` of a JSONL data directory, checked (``data/dataset_config.py``)."""
    lora_base: Path | None = None
    """LoRA runs: the directory of the frozen base weights, and the sha256 of its weight files (checkpoints point
    to it rather than copy it)."""
    lora_digests: dict[str, str] | None = None
    source: hf.HFSource | None = None
    """The Hugging Face architecture the model came from (a Hugging Face ``param_path``, or the ``source`` of the
    checkpoint started or resumed from): recorded in every checkpoint's ``meta.json`` for ``export --format hf``."""

    def need_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer, or the one-line error saying ``what`` needs one and why there is none."""
        if self.tokenizer is None:
            raise UserError(f"{what} needs a tokenizer: {self.no_tokenizer}")
        return self.tokenizer


T = TypeVar("T")


def read_on_rank_zero(fabric: Fabric, read: Callable[[], T], paths: Iterable[Path]) -> T:
    """``read()`` on every rank when every rank sees ``paths``, else on rank 0 only, its result sent to the others
    (so a resume needs no shared filesystem). A mistake found while reading is raised on every rank, and shown once
    when every rank found it (``raised_on_every_rank``)."""
    if fabric.world_size == 1:
        return read()
    visible = all(Path(p).exists() for p in paths)
    if fabric.all_reduce(torch.tensor(float(visible), device=fabric.device), reduce_op="min").item() == 1:
        try:
            value, error = read(), None
        except UserError as err:
            value, error = None, err
        failed = fabric.all_reduce(torch.tensor(float(error is not None), device=fabric.device), reduce_op="sum")
        if error is not None:  # shown once when every rank found it, by each rank that did otherwise
            raise raised_on_every_rank(error, fabric.local_rank) if failed.item() == fabric.world_size else error
        if failed.item() > 0:
            raise UserError(f"{int(failed.item())} other rank(s) could not read {', '.join(map(str, paths))} (their "
                            "messages say why)")  # fmt: skip
        return value
    outcome = None
    if fabric.global_rank == 0:
        try:
            outcome = ("value", read())
        except UserError as err:
            outcome = ("error", err)
    kind, value = fabric.broadcast(outcome)
    if kind == "error":
        raise raised_on_every_rank(value, fabric.local_rank)
    return value


def resolve_start(fabric: Fabric, args: TrainArgs) -> Start:
    """The start of the run, read where the files are (see ``read_on_rank_zero``)."""
    paths = [assets.resolve(args.param_path)]
    if isinstance(args.resume, str) and args.resume not in ("auto", "true", "false"):
        paths.append(Path(args.resume))
    return read_on_rank_zero(fabric, partial(read_start, args), paths)


def read_start(args: TrainArgs) -> Start:
    """Read ``param_path`` and find the checkpoint to resume from, checking they belong together."""
    check_writable(args.ckpt_dir)
    param_path = assets.resolve(args.param_path)
    if not param_path.exists():
        raise UserError(f"param_path {param_path}: not found (expected a model or checkpoint directory)")
    if not (param_path / CONFIG_FILE).is_file():
        raise UserError(f"param_path {param_path}: no config.json (expected a model or checkpoint directory)")
    model_config = read_model_config(param_path)  # AstrAI's config.json, or a Hugging Face one mapped
    model_config.check_buildable(source=str(param_path / CONFIG_FILE))
    if args.window_size is not None and args.window_size > model_config.max_position_embeddings:
        raise ConfigError(
            f"window_size {args.window_size} exceeds max_position_embeddings {model_config.max_position_embeddings} "
            f"of {param_path / CONFIG_FILE}: the model has no position past it; lower --window_size"
        )
    if args.lora_r:
        meta_model(model_config, args)  # every target names a layer of this model, checked before anything is read
    resume = _resume_checkpoint(args, param_path)
    lora_base = lora_digests = None
    if resume is not None:
        _check_resume_matches(resume, model_config, args)
        _check_resume_state(resume)
        _check_resume_lora(resume, args)
        weights = resume
        if resume.lora is not None:
            lora_base, lora_digests = resume.lora.base, resume.meta[LORA_BASE_KEY]["sha256"]
    elif any((param_path / name).exists() for name in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE, ADAPTER_FILE)):
        weights = load_checkpoint(param_path, load_extra=False)  # a LoRA checkpoint: its adapter merged
        if args.lora_r:
            lora_base, lora_digests = param_path, weight_digests(param_path)
    else:
        weights = None
    if args.lora_r and weights is None:
        raise UserError(
            f"lora_r {args.lora_r}: param_path {param_path} has no weights to adapt (LoRA trains adapters on a "
            "trained model; pass a directory with model.safetensors)"
        )
    dataset_config = read_dataset_config(assets.resolve(args.data_root_path), args.train_type)
    tokenizer, no_tokenizer = _run_tokenizer(args, param_path)
    if dataset_config is not None and dataset_config.tokenizer_dir is not None:
        tokenizer, no_tokenizer = _data_tokenizer(dataset_config, tokenizer), None
    # Larger models pad vocab_size; a smaller one cannot work.
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer.directory} has {tokenizer.vocab_size:,} ids, but the model's vocab_size is "
            f"{model_config.vocab_size:,} ({param_path / CONFIG_FILE}): pass the tokenizer the model was built for"
        )
    origin = resume or weights
    source = None
    if origin is not None:
        source = hf.source_of(origin.source, origin.meta, model_config, str(origin.path / META_FILE))
    return Start(
        model_config, weights, resume, tokenizer, no_tokenizer, dataset_config, lora_base, lora_digests, source
    )


def meta_model(config: ModelConfig, args: TrainArgs) -> nn.Module:
    """The run's model on the meta device (nothing allocated), adapters injected: for counting and checking."""
    with torch.device("meta"):
        model = AutoRegressiveLM(config)
    if (spec := lora_spec(args)) is not None:
        lora.inject(model, spec, args.random_seed)
    return model


def lora_spec(args: TrainArgs) -> lora.LoRASpec | None:
    """The run's adapter, or None when ``lora_r`` is 0."""
    if not args.lora_r:
        return None
    return lora.LoRASpec(args.lora_r, args.lora_alpha, tuple(args.lora_targets), args.lora_dropout, args.lora_init)


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


def _run_tokenizer(args: TrainArgs, param_path: Path) -> tuple[Tokenizer | None, str | None]:
    """The run's tokenizer: ``--tokenizer_path``, else ``param_path``'s. A ``param_path`` without ``tokenizer.json``
    gives none (with the reason) rather than an error: AstrAI trains seq/sft on bin shards from such a directory.
    A named ``--tokenizer_path`` without one, or a tokenizer that is there but broken, is an error at once."""
    if args.tokenizer_path:
        return Tokenizer.from_dir(assets.resolve(args.tokenizer_path)), None
    try:
        return Tokenizer.from_dir(param_path), None
    except UserError as err:
        if (param_path / TOKENIZER_FILE).exists():
            raise  # there, but broken
        return None, str(err)


def _data_tokenizer(config: DatasetConfig, run_tokenizer: Tokenizer | None) -> Tokenizer:
    """The tokenizer AstrAI tokenises a ``dataset_config.json`` route with; it must be the run's (the one checkpoints
    carry and the model was built for) where the run has one."""
    directory = assets.resolve(str(config.tokenizer_dir))
    data_tokenizer = Tokenizer.from_dir(directory)
    if run_tokenizer is None:
        return data_tokenizer

    def contents(tokenizer: Tokenizer) -> dict[str, bytes]:
        return {name: path.read_bytes() for name, path in tokenizer.files.items()}

    if contents(data_tokenizer) != contents(run_tokenizer):
        raise ConfigError(
            f"{config.path}: its records are tokenised with {directory} (AstrAI's rule: the file's tokenizer_path, "
            f"else the data directory), which differs from the run's tokenizer {run_tokenizer.directory}; pass "
            f"--tokenizer_path {directory}, or make the two the same"
        )
    return run_tokenizer


def _resume_checkpoint(args: TrainArgs, param_path: Path) -> Checkpoint | None:
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
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"--resume: {path} is not a training checkpoint (no meta.json); to start from its weights, pass it as "
            "--param_path without --resume"
        )
    # A LoRA checkpoint resumes on its base alone, the adapter loaded into the injected layers (never merged).
    return load_checkpoint(path, skip=() if args.resume_optimizer else ("optimizer",), merge_lora=False)


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
        raise CheckpointError(f"{ckpt.path / 'meta.json'}: 'reference' must be {{param_path, random_seed}}, got "
                              f"{reference!r}")  # fmt: skip


def require_jsonl(path: Path, train_type: str) -> Path:
    """Record-based train types read JSONL (AstrAI's bin output for them has no record offsets either)."""
    if detect_format(path) != "jsonl":
        raise UserError(f"data_root_path {path}: {train_type} reads JSONL records, not bin shards")
    return path


def initial_model(fabric: Fabric, config: ModelConfig, weights: Checkpoint | None, seed: int) -> nn.Module:
    """A model initialised from ``seed`` (identically on every rank, AstrAI's init) or from ``weights``.

    From weights nothing is initialised: the tensors are allocated empty in the run's parameter dtype (what Fabric's
    precision would cast them to) and each is read from the memory-mapped files straight into its place
    (``checkpoint.load_model_weights``), so memory never holds the model twice, nor at a wider dtype. Under FSDP the
    model is built on the meta device instead and stays there: Fabric shards it, materialises only each rank's
    shards on its device, and ``load_sharded_weights`` fills them. Nothing after the model draws from the global
    generator, so skipping the initialisation changes no later random number.
    """
    fabric.seed_everything(seed, verbose=False)
    if weights is None:
        return AutoRegressiveLM(config)
    if is_fsdp(fabric):
        with torch.device("meta"):
            return fabric.strategy.precision.convert_module(AutoRegressiveLM(config))
    model = empty_model(config)
    load_weights(model, weights, dtype=fabric.strategy.precision.convert_module(nn.Linear(1, 1)).weight.dtype)
    return model


def load_sharded_weights(
    model: nn.Module, weights: Checkpoint | None, adapter: dict[str, Tensor] | None = None
) -> None:
    """Under FSDP, ``weights`` into a sharded, materialised model (no-op without weights).

    Each rank reads its own slice of every tensor from the memory-mapped files (``weights._read_into``) rather
    than rank 0 reading everything and sending each rank its part: no collective per tensor, each rank touches
    only its 1/N of the bytes, and a rank's memory peaks at its shards plus one chunk, where a broadcast from rank
    0 needs a full-size receive buffer per tensor on every rank and N times the traffic from one process. It needs
    the files visible to every rank; where they are not (``read_on_rank_zero``), rank 0 has already read the whole
    state and sent it, as before, and each rank copies its part from that.
    """
    if weights is not None:
        load_weights(model, weights, adapter=adapter)


def build_model(fabric: Fabric, start: Start, args: TrainArgs) -> nn.Module:
    """The trained model, handed to Fabric (which shards it under FSDP and casts it to the run's precision)."""
    config = dataclasses.replace(start.model_config, neftune_alpha=args.neftune_alpha)
    model = initial_model(fabric, config, start.weights, args.random_seed)
    adapter = None
    if (spec := lora_spec(args)) is not None:
        lora.inject(model, spec, args.random_seed)  # base frozen, adapters float32 (lora.py)
        if start.resume is not None:
            adapter = dict(start.resume.lora.state_dict)
            lora.load_adapter(model, adapter, str(start.resume.path / ADAPTER_FILE))  # no-op on the meta device
        else:
            adapter = lora.initial_adapter_state(model, spec, args.random_seed)
    model.gradient_checkpointing = args.gradient_checkpointing
    if args.compile:
        model = torch.compile(model, mode=args.compile)
    module = fabric.setup_module(model)  # under FSDP on the meta device: sharded, then materialised on the device
    if is_fsdp(fabric):
        raw = module.module  # Fabric's wrapper, then torch.compile's: the model whose names the file uses
        load_sharded_weights(getattr(raw, "_orig_mod", raw), start.weights, adapter)
    return module


def build_optimizer_and_schedule(fabric: Fabric, model: nn.Module, start: Start, args: TrainArgs, plan: StepPlan):
    """Optimizer and schedule; a resume restores both (the checkpoint's schedule wins unless
    ``--resume_schedule false``). Also returns the plan's note on the schedule (see ``build_schedule``).

    Built after sharding: an optimizer built before would step the pre-shard tensors, silently.
    """
    optimizer = build_optimizer(
        model, args.resolved_optimizer, args.max_lr, args.weight_decay, momentum=args.muon_momentum,
        nesterov=args.muon_nesterov, ns_steps=args.muon_ns_steps, adjust_lr_fn=args.muon_adjust_lr,
        ns_dtype=resolve_ns_dtype(args.muon_ns_dtype, fabric.device), nora_lr=args.nora_lr,
        nora_weight_decay=args.resolved_nora_weight_decay, nora_beta=args.nora_beta,
        nora_momentum=args.nora_momentum, mano_momentum=args.mano_momentum, mano_nesterov=args.mano_nesterov,
    )  # fmt: skip
    if start.resume is not None and args.resume_optimizer:
        if (start.resume.path / STATE_DIR).is_dir():
            load_sharded_optimizer_state(optimizer, start.resume.path / STATE_DIR)
        elif "optimizer" in start.resume.extra:
            load_optimizer_state(optimizer, start.resume.extra["optimizer"], start.resume.path / "optimizer.pt")
        else:
            raise CheckpointError(
                f"--resume: {start.resume.path} has no optimizer.pt (add --resume_optimizer false to start a fresh one)"
            )
    elif start.resume is not None:
        fabric.print("optimizer: starting fresh (--resume_optimizer false)")
    optimizer = fabric.setup_optimizers(optimizer)  # after loading: Fabric copies the optimizer's param groups
    scheduler, note = build_schedule(optimizer.optimizer, args, plan, start.resume)
    return optimizer, scheduler, note


def build_schedule(optimizer: Any, args: TrainArgs, plan: StepPlan, resume: Checkpoint | None):
    """The learning-rate schedule: this run's, or on a resume the checkpoint's (AstrAI's rule) unless
    ``--resume_schedule false`` rebuilds it for this run's length from the checkpoint's step. Returns it and a note
    for the plan (or None): the checkpoint's schedule ends before this run does, or it was rebuilt."""

    def fresh():
        return build_scheduler(
            optimizer, args.schedule_type, plan.total_steps, plan.warmup_steps, args.min_rate, args.cycle_length,
            args.t_mult, args.stable_steps, args.decay_steps,
        )  # fmt: skip

    scheduler = fresh()
    if resume is None or "scheduler" not in resume.extra:
        return scheduler, None
    try:
        scheduler.load_state_dict(resume.extra["scheduler"])
    except UserError as err:
        raise CheckpointError(f"{resume.path / 'scheduler.pt'}: {err}") from None
    step = scheduler.last_epoch
    if not args.resume_schedule:
        scheduler = fresh()
        scheduler.continue_at(step)
        return scheduler, (
            f"schedule: rebuilt for this run's {plan.total_steps} steps (--resume_schedule false), continuing at step "
            f"{step}"
        )
    end = getattr(scheduler, "total_steps", None)  # cosine and wsd end; sgdr restarts
    if end is not None and end < plan.total_steps:
        return scheduler, (
            f"note: the checkpoint's schedule ends at step {end}, before this run's {plan.total_steps} steps: steps "
            f"{max(end, step) + 1}-{plan.total_steps} run at the floor ({scheduler.min_rate:g} x max_lr); "
            f"--resume_schedule false rebuilds the schedule for {plan.total_steps} steps"
        )
    return scheduler, None


def start_position(fabric: Fabric, start: Start, args: TrainArgs, plan: StepPlan) -> RunPosition:
    """The loop position to start from: a resume's, AstrAI's ``start_epoch``/``start_samples``, or zero."""
    world_size = plan.world_size  # data-parallel ranks: the ones that consume different samples
    ckpt = start.resume
    if ckpt is None:
        # AstrAI's manual offsets for a fresh run; start_samples counts samples per rank.
        epoch = args.start_epoch + args.start_samples // plan.samples_per_rank
        index = args.start_samples % plan.samples_per_rank
        return RunPosition(epoch=epoch, sample_index=index, world_size=world_size)
    if RESUME_KEY in ckpt.meta:  # ours: exact
        saved = RunPosition.from_meta(ckpt.meta[RESUME_KEY], ckpt.path / "meta.json")
        if saved.sample_index * saved.world_size > plan.samples_per_rank * world_size:
            raise CheckpointError(
                f"--resume: {ckpt.path} stopped {saved.sample_index * saved.world_size:,} samples into epoch "
                f"{saved.epoch}, but an epoch of this data has {plan.samples_per_rank * world_size:,}: resume with the "
                "data it was trained on"
            )
        position, exact = saved.rescaled(world_size, plan.samples_per_rank)
        if not exact:
            fabric.print(
                f"warning: the checkpoint's position ({saved.sample_index} samples on each of {saved.world_size} "
                f"ranks) falls between samples for {world_size} ranks; up to {world_size - 1} sample(s) repeat"
            )
    else:  # written by AstrAI: AstrAI's meta semantics (train_context.py), floor to a whole optimizer step
        per_step = plan.global_batch_size
        consumed = ckpt.consumed_samples // per_step * per_step
        offset = consumed // world_size
        position = RunPosition(
            epoch=offset // plan.samples_per_rank,
            sample_index=offset % plan.samples_per_rank,
            world_size=world_size,
            optimizer_step=consumed // per_step,
            consumed_samples=consumed,
        )
    if not restore_rng(ckpt.extra.get("rng"), fabric.global_rank, fabric.world_size):
        fabric.seed_everything(args.random_seed + position.optimizer_step, verbose=False)
    return position


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


def written_names(args: TrainArgs) -> list[str]:
    """The top-level names a run writes in ``ckpt_dir`` besides its checkpoints (guarded by ``hold_ckpt_dir``)."""
    names = [RECIPE_FILE, PLOT_FILE] + ([LOG_DIR] if args.loggers else [])
    return names + ([PROFILE_DIR] if args.profile_steps else [])


@contextmanager
def hold_ckpt_dir(fabric: Fabric, args: TrainArgs) -> Iterator[None]:
    """For the whole run, rank 0 holds the lock on ``ckpt_dir`` (``ownership.py``) and makes sure the names the run
    writes there (``written_names``) are free or a run's: checked before anything is created, and again under the
    lock. A refusal is raised on every rank; the lock is released on the way out, exceptions included."""
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


def resolved_recipe(args: TrainArgs) -> str:
    """The run's full configuration as a flat recipe that ``--config`` accepts."""
    header = f"{RECIPE_HEADER} {args.train_type} --config {RECIPE_FILE}\n"
    return header + yaml.safe_dump(args.recipe_values(), sort_keys=False)


def reference_model(fabric: Fabric, start: Start, args: TrainArgs) -> tuple[nn.Module | None, dict[str, Any]]:
    """The frozen reference of dpo/grpo: the run's *starting* policy, rebuilt the same way on a resume.

    With LoRA there is no second model: the reference is the trained network with its adapters off (the frozen
    base, ``lora.adapters_off``), returned as None. AstrAI builds a reference without adapters and then loads the
    LoRA policy's keys into it strictly, which fails (its B13).

    Fresh runs copy the starting weights (or the seeded initialisation). A resume of one of our checkpoints rebuilds
    the reference its run started from (``meta.json`` says where: ``reference``); AstrAI re-copies the resumed
    policy instead, so its reference drifts at every resume, and an AstrAI checkpoint resumes that way here too.
    ``--reference_path`` overrides all of these. Returns the model and the ``meta.json`` entry describing it.
    """
    if args.lora_r:
        fabric.print("reference model: the base weights (the trained network with its LoRA adapters off)")
        return None, {"param_path": str(start.lora_base.resolve()), "random_seed": args.random_seed,
                      "adapters_off": True}  # fmt: skip
    if args.reference_path is not None:
        path, seed = str(assets.resolve(args.reference_path).resolve()), args.random_seed
    elif start.resume is not None and "reference" in start.resume.meta:
        path, seed = start.resume.meta["reference"]["param_path"], start.resume.meta["reference"]["random_seed"]
    elif start.resume is not None:
        fabric.print(f"reference model: the resumed policy ({start.resume.path}), as AstrAI does")
        path, seed = str(start.resume.path.resolve()), args.random_seed
    else:
        path = str(start.weights.path.resolve()) if start.weights is not None else None
        seed = args.random_seed
    weights = None
    if path is not None:
        weights = read_on_rank_zero(fabric, partial(_read_reference, Path(path)), [Path(path)])
    model = initial_model(fabric, start.model_config, weights, seed)
    model = setup_frozen(fabric, model)
    if is_fsdp(fabric) and weights is not None:  # sharded on the meta device: materialise, then read the shards
        model.to_empty(device=fabric.device)
        model.rotary_embedding.reset_parameters(device=fabric.device)
        load_sharded_weights(model, weights)
    return model, {"param_path": path, "random_seed": seed}


def _read_reference(path: Path) -> Checkpoint:
    if not path.is_dir():
        raise UserError(f"reference model {path}: not found (pass the starting weights as --reference_path)")
    return load_checkpoint(path, load_extra=False)


def make_saver(fabric: Fabric, model: nn.Module, optimizer: Any, scheduler: Any, start: Start, args: TrainArgs,
               metric_log: MetricLog, extra_meta: dict[str, Any] | None = None):  # fmt: skip
    """``save(position)`` writing ``{ckpt_dir}/epoch_{E}_step_{S}`` (all ranks call it; rank 0 writes) and
    returning its path; each checkpoint also gets the run's metric log so far."""
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
        files[METRIC_FILE] = metric_log.text()
        if spec is not None:  # a pointer to the base weights, relative to this checkpoint, instead of a copy
            meta[LORA_BASE_KEY] = lora_base_entry(start.lora_base, path, start.lora_digests)
        save_training_checkpoint(
            fabric, path, raw_model, optimizer.optimizer, scheduler, position, config, meta, files,
            args.sharded_checkpoint, spec, args.lora_save_full,
        )  # fmt: skip
        if args.keep_last_k is not None and fabric.global_rank == 0:
            prune_checkpoints(args.ckpt_dir, args.keep_last_k)  # only now: the new checkpoint is complete
        return path

    return save


def describe_parameters(model: nn.Module, args: TrainArgs) -> tuple[str, dict[str, int]]:
    """The plan's line on what trains (total and trainable parameters, the optimizer and its state's memory, the
    adapters), and the same numbers for ``metric.jsonl``."""
    trainable, total = lora.parameter_counts(model)  # a DTensor's numel is the global one
    state = optimizer_state_bytes(model, args.resolved_optimizer)
    line = f"{total:,} parameters"
    if trainable != total:
        line += f", {trainable:,} trainable ({trainable / total:.2%})"
    groups = optimizer_groups(
        model, args.resolved_optimizer, args.max_lr, args.weight_decay, args.nora_lr, args.resolved_nora_weight_decay
    )
    described = ", ".join(
        f"{g.part} {len(g.params)} tensors (lr {g.lr:g}, decay {g.weight_decay:g})" for g in groups if g.params
    )
    line += f"; optimizer {args.resolved_optimizer}: {described}; state {state / 2**20:,.1f} MiB (all ranks together)"
    if (spec := lora_spec(args)) is not None:
        layers = len(lora.lora_layers(getattr(model, "module", model)))
        line += (
            f"\nlora: r={spec.r}, alpha={spec.alpha}, dropout {spec.dropout}, init {spec.init}, on "
            f"{','.join(spec.targets)} ({layers} linear layers); base weights frozen, adapters float32"
        )
        if args.resolved_optimizer == "muon_adamw":
            line += "; note: Muon on LoRA's r x d factors is untested (adamw is the LoRA default)"
    counts = {"trainable_parameters": trainable, "total_parameters": total, "optimizer_state_bytes": state}
    return line, counts


def split_validation(dataset: Dataset, val_split: float | None, seed: int) -> tuple[Dataset, Dataset | None]:
    """AstrAI's split: ``max(1, int(len * val_split))`` samples, chosen by ``random_split`` seeded with ``seed``."""
    if val_split is None:
        return dataset, None
    num_val = max(1, int(len(dataset) * val_split))
    train, val = random_split(dataset, [len(dataset) - num_val, num_val], generator=torch.Generator().manual_seed(seed))
    return train, val


class SeededLoader(DataLoader):
    """A ``DataLoader`` that never draws from the global RNG (a plain one draws its workers' base seed there at
    every ``iter()``, so a resume would shift the global stream): the base seed comes from the loader's own
    generator, reseeded at each ``iter()`` from (seed, data-parallel rank, epoch) of its ``ResumableSampler``.
    Persistent workers keep the seeds of the first epoch this process iterates."""

    def __iter__(self):  # noqa: ANN204 - DataLoader's signature
        sampler = self.sampler
        self.generator.manual_seed(derive_seed(sampler.seed, "loader", sampler.rank, sampler.epoch))
        return super().__iter__()


def make_loader(
    fabric: Fabric, dataset: Dataset, args: TrainArgs, shuffle: bool, collate: Callable | None = None
) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(len(dataset), *data_parallel(fabric), args.random_seed, shuffle)
    num_workers = resolve_num_workers(args.num_workers, local_ranks(fabric))[0]
    loader = SeededLoader(
        dataset,
        batch_size=args.batch_per_device,
        sampler=sampler,
        generator=torch.Generator(),
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=args.pin_memory and fabric.device.type == "cuda",
        persistent_workers=args.persistent_workers and num_workers > 0,
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
    )
    # Our sampler already shards by rank in AstrAI's order; Fabric must not replace it.
    return fabric.setup_dataloaders(loader, use_distributed_sampler=False), sampler


def shut_down_workers(*loaders: DataLoader | None) -> None:
    """Stop the loaders' worker processes now, whatever ended the loop. A loader with persistent workers keeps them
    alive while it is referenced, and after an exception its traceback references it until the interpreter exits,
    where multiprocessing joins them: they ignore SIGTERM (``ignore_stop_signals``), so that join would never end."""
    for loader in loaders:
        iterator = getattr(getattr(loader, "_dataloader", loader), "_iterator", None)  # Fabric's wrapper, then torch's
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def train_on(
    fabric: Fabric,
    args: TrainArgs,
    start: Start,
    dataset: Dataset,
    data_summary: str,
    compute_loss: LossFn,
    collate: Callable | None = None,
    extra_meta: dict[str, Any] | None = None,
    make_batches: Callable[[nn.Module, Iterable, RunPosition], Iterable] | None = None,
) -> list[dict[str, float]]:
    """Everything after the data is read, for every train type: split, plan, model, optimizer, resume, loop.

    ``make_batches(model, loader, position)`` turns the loader's batches into training batches with the live
    model (online GRPO samples its responses there); by default the loader's batches are trained on as they are.
    """
    train_set, val_set = split_validation(dataset, args.val_split, args.random_seed)
    data_parallel_size = data_parallel(fabric)[1]
    plan = StepPlan(
        len(train_set),
        data_parallel_size,
        args.batch_per_device,
        args.grad_accum_steps,
        args.n_epoch,
        args.warmup_ratio,
    )
    plan.check()

    with hold_ckpt_dir(fabric, args):  # before anything is written there, until the end
        model = build_model(fabric, start, args)
        optimizer, scheduler, schedule_note = build_optimizer_and_schedule(fabric, model, start, args, plan)
        position = start_position(fabric, start, args, plan)
        refuse_to_overwrite(fabric, args.ckpt_dir, position.optimizer_step)
        train_loader, sampler = make_loader(fabric, train_set, args, shuffle=True, collate=collate)
        val_loader = None
        if val_set is not None:
            val_loader = make_loader(fabric, val_set, args, shuffle=False, collate=collate)[0]
        batches = make_batches(model, train_loader, position) if make_batches is not None else train_loader
        profiler = StepProfiler.for_run(fabric, args, position)  # None unless --profile_steps
        batches = profiler.steps_of(batches) if profiler is not None else batches

        parameters, counts = describe_parameters(model, args)
        parameters, _, lora_line = parameters.partition("\n")
        held_out = f", {len(val_set):,} held out" if val_set is not None else ""
        threads = describe_cpu_threads(torch.get_num_threads(), args.num_threads is not None)
        fabric.print(
            f"{args.train_type}: {parameters} | {len(train_set):,} training samples: {data_summary}"
            f"{held_out}"
            + (f"\n{lora_line}" if lora_line else "")
            + f"\n{plan.describe()}\nschedule: {scheduler.describe()}, peak {args.max_lr}"
            + (f"\n{schedule_note}" if schedule_note else "")
            + f"\nloader: {resolve_num_workers(args.num_workers, local_ranks(fabric))[1]}"
            + (f"\ncpu threads: {threads}" if fabric.device.type == "cpu" else "")
            + f"\noutputs: {Path(args.ckpt_dir).resolve()}"
            + (f"\nprofiling: {describe_profiling(args)}" if profiler is not None else "")
        )
        if start.resume is not None:
            fabric.print(
                f"resuming from {start.resume.path} at step {position.optimizer_step}, epoch {position.epoch}, "
                f"sample {position.sample_index} of {plan.samples_per_rank} per rank"
            )
        if fabric.global_rank == 0:
            if stale := remove_stale_staging(args.ckpt_dir):
                fabric.print(f"removed {len(stale)} partial checkpoint(s) left by an interrupted save")
            record_written(args.ckpt_dir, written_names(args))  # in the manifest before they exist
            (Path(args.ckpt_dir) / RECIPE_FILE).write_text(resolved_recipe(args))

        # A resumed run continues its checkpoint's metric history (AstrAI starts a new one at every resume).
        metric_log = MetricLog.resumed(args.metrics, start.resume.path if start.resume is not None else None)
        if start.resume is None:  # recorded once per run, at its start
            metric_log.add("parameters", position.epoch, position.optimizer_step, position.consumed_samples, **counts)
        save = make_saver(fabric, model, optimizer, scheduler, start, args, metric_log, extra_meta)
        window_size = getattr(dataset, "window_size", None) or start.model_config.max_position_embeddings
        reporter = Reporter(
            fabric, plan, metric_log, first_step=position.optimizer_step + 1,
            flops_per_token=flops_per_token(start.model_config, window_size),
            peak_flops=peak_flops(fabric.device, precision_of(fabric), args.peak_flops), compiled=bool(args.compile),
        )  # fmt: skip
        try:
            with StopRequest() as stop:
                history = fit(fabric, model, optimizer, scheduler, batches, sampler, compute_loss, args, plan,
                              position, save, reporter, val_loader, stop)  # fmt: skip
        finally:
            shut_down_workers(train_loader, val_loader)
            if profiler is not None:
                profiler.close()  # writes the trace, also when the run ended before the last profiled step
        latest = find_latest_checkpoint(args.ckpt_dir)
        skipped = f" ({position.skipped_steps} skipped: non-finite loss)" if position.skipped_steps else ""
        if stop.honoured:
            cause = stop.signal_name or "a signal to another rank"
            fabric.print(
                f"stopped by {cause} after step {position.optimizer_step}{skipped}; latest checkpoint: {latest}\n"
                f"continue with: astrai-fabric {args.train_type} --config {Path(args.ckpt_dir) / RECIPE_FILE} "
                "--resume auto"
            )
        else:
            fabric.print(f"done after step {position.optimizer_step}{skipped}; latest checkpoint: {latest}")
        if fabric.global_rank == 0 and latest is not None:
            try:
                fabric.print(f"plot: {plot_runs([Path(args.ckpt_dir)], Path(args.ckpt_dir) / PLOT_FILE)}")
            except UserError as err:  # the run is done and saved: a history it cannot plot is only a warning
                fabric.print(f"warning: no plot ({err})")
    return history
