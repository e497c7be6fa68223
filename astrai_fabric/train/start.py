"""Where a run starts, read once before anything is built: ``resolve_start`` reads ``param_path``, the tokenizer,
the data directory's ``dataset_config.json`` and the checkpoint to resume (``resume.py``), checks that they belong
together, and returns a ``Start``; the files are read where they are (``read_on_rank_zero``: no shared filesystem
needed). Also the frozen reference model of dpo/grpo (``reference_model``), rebuilt from where the run started.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric import Fabric
from torch import nn

from astrai_fabric import hub, quantize
from astrai_fabric.checkpoint import (
    ADAPTER_FILE,
    CONFIG_FILE,
    LORA_BASE_KEY,
    META_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    Checkpoint,
    hf,
    load_checkpoint,
    read_model_config,
    weight_digests,
)
from astrai_fabric.checkpoint.adapter import check_resumed_base
from astrai_fabric.checkpoint.ownership import check_writable
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.train import TrainArgs, default_window_size
from astrai_fabric.data.dataset_config import DatasetConfig, read_dataset_config
from astrai_fabric.data.storage import detect_format
from astrai_fabric.data.windows import DataStart, data_tokenizer
from astrai_fabric.errors import ConfigError, UserError, raised_on_every_rank
from astrai_fabric.losses import loss_chunk_positions
from astrai_fabric.reward_model import reward_model_config, reward_model_weights
from astrai_fabric.strategy import is_fsdp, planned_accelerator, setup_frozen
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train.models import initial_model, load_sharded_weights, meta_model
from astrai_fabric.train.resume import check_resume, resume_checkpoint


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
    window_size: int | None = None
    """Tokens per training sample: ``--window_size``, else the model's ``max_position_embeddings``, capped for a
    model from Hugging Face (``config.train.default_window_size``; resolved here once; every train type's data and
    the throughput's FLOPs count use it)."""

    def loss_chunk_size(self, args: TrainArgs) -> int:
        """Positions per chunk of the fused head and loss for this run, 0 for the whole logits
        (``losses.loss_chunk_positions`` of the vocabulary and a micro-batch's windows); 0 for a reward model, whose
        head has no vocabulary."""
        if self.model_config.score_head:
            return 0
        return loss_chunk_positions(
            args.loss_chunk_size,
            self.model_config.vocab_size,
            args.batch_per_device * self.window_size,
            self.fused_loss_is_faster(args),
        )

    def fused_loss_is_faster(self, args: TrainArgs) -> bool:
        """Whether the fused head and loss is never the slower, whatever the size, for this run
        (``losses.loss_chunk_positions``): a mean over tokens (seq, sft: per-token weights known before the forward)
        on CPU, where it was measured, with linear logits (a soft-capped head makes the whole logits anyway)."""
        weights_known = args.train_type in ("seq", "sft") and self.model_config.final_logit_softcapping is None
        return weights_known and planned_accelerator(args.device_type) == "cpu"

    def data_start(self) -> DataStart:
        """What the run's data reads of this start (``data.windows``: the windows of seq and sft)."""
        sizes = (self.model_config.vocab_size, self.model_config.max_position_embeddings)
        return DataStart(*sizes, self.window_size, self.tokenizer, self.no_tokenizer, self.dataset_config)

    def need_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer, or the one-line error saying ``what`` needs one and why there is none."""
        return self.data_start().need_tokenizer(what)


T = TypeVar("T")


def read_on_rank_zero(fabric: Fabric, read: Callable[[], T], paths: Iterable[str | Path]) -> T:
    """``read()`` on every rank when every rank sees ``paths`` (as flags give them: ``bundled:`` names are
    resolved here), else on rank 0 only, its result sent to the others (so a resume needs no shared filesystem). A
    mistake found while reading is raised on every rank, and shown once when every rank found it
    (``raised_on_every_rank``)."""
    if fabric.world_size == 1:
        return read()
    paths = [hub.local_path(p) for p in paths]  # a Hub id: its cached snapshot, if this machine has one
    visible = all(p.exists() for p in paths)
    if fabric.all_reduce(torch.tensor(float(visible), device=fabric.device), reduce_op="min").item() == 1:
        try:
            value, error = read(), None
        except UserError as err:
            value, error = None, err
        raise_together(fabric, error, lambda n: f"{n} other rank(s) could not read {', '.join(map(str, paths))}")
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


def raise_together(fabric: Fabric, error: UserError | None, others: Callable[[int], str]) -> None:
    """Collective: every rank stops when any found ``error`` (one alone would leave the others waiting in their next
    collective). Shown once where every rank found it; otherwise each rank that did says why, and the others say
    ``others(how many did)``, pointing to their messages."""
    flag = torch.tensor(float(error is not None), device=fabric.device)
    failed = int(fabric.all_reduce(flag, reduce_op="sum").item())
    if error is not None:
        raise raised_on_every_rank(error, fabric.local_rank) if failed == fabric.world_size else error
    if failed > 0:
        raise UserError(f"{others(failed)} (their messages say why)")


def resolve_start(fabric: Fabric, args: TrainArgs) -> Start:
    """The start of the run, read where the files are (see ``read_on_rank_zero``), its Hub ids pinned first
    (``pin_hub_ids``)."""
    pin_hub_ids(fabric, args)
    paths = [args.param_path]
    if isinstance(args.resume, str) and args.resume not in ("auto", "true", "false"):
        paths.append(args.resume)
    return read_on_rank_zero(fabric, partial(read_start, args), paths)


def pin_hub_ids(fabric: Fabric, args: TrainArgs) -> None:
    """The flags that are Hub ids (``hub.HUB_FLAGS``: models, tokenizers, the dataset) pinned in ``args`` to
    ``org/name@commit``, the same commit on every rank: global rank 0 resolves them (fetching what its node lacks)
    and sends the pins; then local rank 0 of each other node fetches those commits while the other ranks wait (the
    collective that says whether all went well), so one process per node downloads and the rest read the cache.
    The CLI pins them once before it launches (``cli.train_command``), so that a download is not timed by
    ``--dist_timeout``; here they are then found in the cache. Checkpoints record the pinned ids (meta.json, the
    recipe)."""
    values = hub_values(args)
    if not any(hub.looks_like_hub_id(value) for value in values.values()):
        return  # the same answer on every rank: no collective
    if fabric.world_size == 1:
        set_values(args, hub.pin_hub_flags(values, args.data_subset, args.data_split))
        return
    outcome = None
    if fabric.global_rank == 0:
        try:
            outcome = ("value", hub.pin_hub_flags(values, args.data_subset, args.data_split))
        except UserError as err:
            outcome = ("error", err)
    kind, value = fabric.broadcast(outcome)
    if kind == "error":
        raise raised_on_every_rank(value, fabric.local_rank)
    error = None
    if fabric.local_rank == 0 and fabric.global_rank != 0:
        try:
            for flag, pin in value.items():
                if pin != getattr(args, flag):  # a Hub id rank 0 pinned (a path it has is left as it is)
                    choice = hub.dataset_choice(flag, args.data_subset, args.data_split)  # the files rank 0 has
                    hub.fetch(pin, flag, **choice)
        except UserError as err:
            error = err
    raise_together(fabric, error, lambda n: f"{n} node(s) could not fetch the Hub snapshot rank 0 resolved")
    set_values(args, value)


def hub_values(args: TrainArgs) -> dict[str, str | None]:
    """``{flag: value}`` of the flags that may name a Hub repository (``hub.HUB_FLAGS``)."""
    return {flag: getattr(args, flag) for flag in hub.HUB_FLAGS}


def set_values(args: TrainArgs, values: dict[str, Any]) -> None:
    """``args`` with ``values`` (``{flag: value}``, e.g. Hub ids pinned) set in place."""
    for flag, value in values.items():
        setattr(args, flag, value)


class WindowPastPositions(ConfigError):
    """A ``--window_size`` past the model's positions; ``positions``: its ``max_position_embeddings`` (the dry run
    plans with that window, so its memory still shows)."""

    def __init__(self, message: str, positions: int) -> None:
        super().__init__(message)
        self.positions = positions


def read_start(args: TrainArgs) -> Start:
    """Read ``param_path`` and find the checkpoint to resume from, checking they belong together."""
    check_writable(args.ckpt_dir)
    param_path = hub.resolve_model(args.param_path, "param_path")
    if not param_path.exists():
        raise UserError(f"param_path {param_path}: not found (expected a model or checkpoint directory)")
    if not os.path.lexists(param_path / CONFIG_FILE):  # one there that is no file is refused by name when read
        raise UserError(f"param_path {param_path}: no config.json (expected a model or checkpoint directory)")
    model_config = read_model_config(param_path)  # AstrAI's config.json, or a Hugging Face one mapped
    model_config.check_buildable(source=str(param_path / CONFIG_FILE))
    if args.window_size is not None and args.window_size > model_config.max_position_embeddings:
        raise WindowPastPositions(
            f"window_size {args.window_size} exceeds max_position_embeddings {model_config.max_position_embeddings} "
            f"of {param_path / CONFIG_FILE}: the model has no position past it; lower --window_size",
            model_config.max_position_embeddings,
        )
    if args.lora_r:
        meta_model(model_config, args)  # every target names a layer of this model, checked before anything is read
    if args.quantize is not None:
        quantize.require_torchao()
    # A Hub dataset's file is in its snapshot (pinned and fetched by now; a dry run reads only what is cached).
    data_path = hub.local_path(args.data_root_path, "dataset", args.data_subset, args.data_split)
    dataset_config = read_dataset_config(data_path, args.train_type)
    # The run's tokenizer: --tokenizer_path, which must hold one, else param_path's, where none is no error (the
    # reason is kept for need_tokenizer): AstrAI trains seq/sft on bin shards from such a directory.
    if args.tokenizer_path:
        tokenizer, no_tokenizer = Tokenizer.from_dir(hub.resolve_model(args.tokenizer_path, "tokenizer_path")), None
    else:
        tokenizer, no_tokenizer = Tokenizer.from_dir_if_present(param_path)
    if dataset_config is not None and dataset_config.tokenizer_dir is not None:
        tokenizer, no_tokenizer = data_tokenizer(dataset_config, tokenizer), None
    # Larger models pad vocab_size; a smaller one cannot work.
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise UserError(
            f"tokenizer {tokenizer.directory} has {tokenizer.vocab_size:,} ids, but the model's vocab_size is "
            f"{model_config.vocab_size:,} ({param_path / CONFIG_FILE}): pass the tokenizer the model was built for"
        )
    if args.train_type == "reward_model" and not model_config.score_head:  # a language model to score with
        pad_token_id = tokenizer.padding_id if tokenizer is not None else 0
        model_config = reward_model_config(model_config, pad_token_id)
    elif model_config.score_head and args.train_type != "reward_model":
        raise UserError(
            f"param_path {param_path}: a reward model (a score head, no LM head): it trains with "
            f"reward_model, not {args.train_type}"
        )
    resume = resume_checkpoint(args, param_path)
    lora_base = lora_digests = None
    if resume is not None:
        check_resume(resume, model_config, args)
        weights = resume
        if resume.lora is not None:
            lora_base, lora_digests = resume.lora.base, resume.meta[LORA_BASE_KEY]["sha256"]
            check_resumed_base(resume.path, lora_base, lora_digests, param_path)  # never one of two bases unused
    elif any((param_path / name).exists() for name in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE, ADAPTER_FILE)):
        weights = load_checkpoint(param_path, load_extra=False)  # a LoRA checkpoint: its adapter merged
        if args.lora_r:
            lora_base, lora_digests = param_path, weight_digests(param_path)
    else:
        weights = None
    if args.train_type == "reward_model" and weights is not None and not weights.model_config().score_head:
        weights = reward_model_weights(weights, model_config)  # the LM head left out, a new score head
    if args.lora_r and weights is None:
        raise UserError(
            f"lora_r {args.lora_r}: param_path {param_path} has no weights to adapt (LoRA trains adapters on a "
            "trained model; pass a directory with model.safetensors)"
        )
    origin = resume or weights
    source = None
    if origin is not None:
        source = hf.source_of(origin.source, origin.meta, model_config, str(origin.path / META_FILE))
    return Start(
        model_config,
        weights,
        resume,
        tokenizer,
        no_tokenizer,
        dataset_config,
        lora_base,
        lora_digests,
        source,
        window_size=args.window_size or default_window_size(model_config.max_position_embeddings, source is not None),
    )


def require_records(path: Path, train_type: str) -> Path:
    """Record-based train types read records (JSONL or a ``datasets`` source), not bin shards: AstrAI's bin output
    for them has no record offsets."""
    if detect_format(path) == "bin":
        raise UserError(f"data_root_path {path}: {train_type} reads records (JSONL, parquet, ...), not bin shards")
    return path


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
        return None, {
            "param_path": hub.recorded(start.lora_base),
            "random_seed": args.random_seed,
            "adapters_off": True,
        }
    if args.reference_path is not None:
        path, seed = hub.recorded(args.reference_path), args.random_seed  # a Hub id: org/name@commit
    elif start.resume is not None and "reference" in start.resume.meta:
        path, seed = start.resume.meta["reference"]["param_path"], start.resume.meta["reference"]["random_seed"]
    elif start.resume is not None:
        fabric.print(f"reference model: the resumed policy ({start.resume.path}), as AstrAI does")
        path, seed = str(start.resume.path.resolve()), args.random_seed
    else:
        path = hub.recorded(start.weights.path) if start.weights is not None else None
        seed = args.random_seed
    weights = None
    if path is not None:
        weights = read_on_rank_zero(fabric, partial(_read_reference, path), [path])
    model = initial_model(fabric, start.model_config, weights, seed, f"reference model {path or args.param_path}")
    model = setup_frozen(fabric, model)
    if is_fsdp(fabric) and weights is not None:  # sharded on the meta device: materialise, then read the shards
        model.to_empty(device=fabric.device)
        model.rotary_embedding.reset_parameters(device=fabric.device)
        load_sharded_weights(model, weights)
    return model, {"param_path": path, "random_seed": seed}


def _read_reference(recorded: str) -> Checkpoint:
    """The reference's weights from where it is recorded: a directory, or a Hub id (``org/name@commit``)."""
    path = hub.resolve_model(recorded, "reference model")
    if not path.is_dir():
        raise UserError(f"reference model {path}: not found (pass the starting weights as --reference_path)")
    return load_checkpoint(path, load_extra=False)
