"""Binding weights to a model: a checkpoint or model directory read as the model it holds (AstrAI's layout, a
Hugging Face directory mapped through ``hf``, a LoRA checkpoint merged), checked to fit the model exactly, and read
tensor by tensor straight into its parameters (whole, or each rank its part of a sharded one). ``load_model`` is
AstrAI's ``from_pretrained``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from astrai_fabric import lora, quantize
from astrai_fabric.checkpoint import hf
from astrai_fabric.checkpoint.adapter import LoRAAdapter, read_adapter, resolve_lora_base
from astrai_fabric.checkpoint.files import (
    ADAPTER_FILE,
    CONFIG_FILE,
    FORMAT_KEY,
    META_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    StoredStateDict,
    abbreviate,
    read_json,
    read_pt,
    read_weights,
)
from astrai_fabric.config.model import ModelConfig, read_config_json
from astrai_fabric.errors import CheckpointError, ConfigError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.model.expert_parallel import held_elsewhere
from astrai_fabric.model.pipeline import held_by_other_stages
from astrai_fabric.model.transformer import EMBED_KEY, LM_HEAD_KEY, count_parameters, rope_table_bytes
from astrai_fabric.torch_private import local_shape_and_global_offset


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` read. ``meta`` is empty and the counters are 0 for a plain model directory."""

    path: Path
    config: dict[str, Any]
    """``config.json`` as written (use ``model_config()`` for the typed, validated form)."""
    state_dict: Mapping[str, Tensor]
    """A ``StoredStateDict`` when read from files: names and shapes known, each tensor read on use."""
    epoch: int = 0
    consumed_samples: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """``{stem: object}`` for each ``{stem}.pt`` (``optimizer``, ``scheduler``, ...)."""
    source: hf.HFSource | None = None
    """The Hugging Face architecture and config for a directory imported from one (``config`` and ``state_dict``
    are then already ours); None for AstrAI's layout."""
    lora: LoRAAdapter | None = None
    """A LoRA checkpoint's adapter (``state_dict`` then holds the base with it merged, or the base alone when read
    with ``merge_lora=False``)."""

    @property
    def is_training_checkpoint(self) -> bool:
        """True when the directory has a ``meta.json`` (a checkpoint of a run, not just a model)."""
        return bool(self.meta)

    @property
    def format_version(self) -> int | None:
        """Our format version, or None for a directory AstrAI (or anyone else) wrote."""
        return self.meta.get(FORMAT_KEY, {}).get("format_version") if self.meta else None

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config, source=str(self.path / CONFIG_FILE))


def load_checkpoint(
    directory: str | Path, *, load_extra: bool = True, skip: Collection[str] = (), merge_lora: bool = True
) -> Checkpoint:
    """Read a checkpoint directory, or a plain model directory, as AstrAI's ``Checkpoint.load_any`` does.

    ``load_extra=False`` skips every ``*.pt`` file (e.g. when only the weights are wanted); ``skip`` names stems
    to leave out (``{"optimizer"}``). A LoRA checkpoint (``adapter_model.safetensors``) gives the model it computes,
    its adapter merged into the base (its own merged ``model.safetensors`` when it has one, else the base it points
    to, hash-checked); ``merge_lora=False`` gives the base alone, to resume training the adapter (``lora``).
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or model directory")
    config = read_json(path / CONFIG_FILE, what="AstrAI's model config")
    source = None
    if hf.is_hf_config(config, str(path / CONFIG_FILE)):  # mapped (or refused) before a tensor is read
        model_config = hf.model_config_from_hf(config, source=str(path / CONFIG_FILE))
        source = hf.HFSource(model_type=config["model_type"], config=config)
        config = model_config.to_dict()
    meta = read_json(path / META_FILE, what="the run's meta data") if os.path.lexists(path / META_FILE) else {}
    for key in ("epoch", "consumed_samples"):
        if key in meta and (not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0):
            raise CheckpointError(f"{path / META_FILE}: {key!r} must be a non-negative integer, got {meta[key]!r}")
    extra = {}
    if load_extra:
        extra = {f.stem: read_pt(f, within=path) for f in sorted(path.glob("*.pt")) if f.stem not in skip}
    adapter = None
    if (path / ADAPTER_FILE).is_file():
        adapter = read_adapter(path)
        if not merge_lora or not (path / WEIGHTS_FILE).is_file():
            adapter.base = resolve_lora_base(path, meta)
    if adapter is not None and (not merge_lora or not (path / WEIGHTS_FILE).is_file()):
        state_dict = load_checkpoint(adapter.base, load_extra=False).state_dict
        if merge_lora:
            record = quantize.quantization_record(meta, str(path / META_FILE))
            if record is not None:  # QLoRA: the adapter was trained over the base's NF4 form, so merge into that
                state_dict = quantize.round_trip(state_dict, record, str(path / META_FILE))
            state_dict = lora.merge_state_dict(state_dict, adapter.state_dict, adapter.spec.scaling)
    else:
        state_dict = read_weights(path)  # headers only: tensors are read where they go (``load_model_weights``)
        if source is not None:  # transformers' names (a base read above has ours already)
            check_hf_names(state_dict, model_config, source.model_type, path)
            state_dict = state_dict.renamed({key: hf.import_targets(key, model_config) for key in state_dict})
    return Checkpoint(
        path=path,
        config=config,
        state_dict=state_dict,
        epoch=meta.get("epoch", 0),
        consumed_samples=meta.get("consumed_samples", 0),
        meta=meta,
        extra=extra,
        source=source,
        lora=adapter,
    )


def check_hf_names(state_dict: Mapping[str, Tensor], config: ModelConfig, model_type: str, path: Path) -> None:
    """A Hugging Face directory's tensors are bound by transformers' names only, as transformers binds them:
    a name it would not load (AstrAI's spelling among them) is refused, and so is a missing ``lm_head.weight``
    where the config unties it (transformers would compute with a head of its own, not a clone of the embedding,
    which is AstrAI's rule for its own directories)."""
    weights = path / (WEIGHTS_INDEX_FILE if (path / WEIGHTS_INDEX_FILE).exists() else WEIGHTS_FILE)
    foreign = [k for k in state_dict if hf.import_targets(k, config) and not hf.is_hf_name(k)]
    if foreign:
        raise CheckpointError(
            f"{weights}: {abbreviate(foreign)} are not tensor names of a Hugging Face "
            f"{model_type} model (transformers would not load them)"
        )
    if skipped := hf.multi_token_prediction_layers(state_dict, config):
        warnings.warn(
            f"{weights}: skipping layers {skipped}, {model_type}'s multi-token-prediction modules, which "
            "the causal LM never runs",
            stacklevel=3,
        )
    if not config.tied and not config.score_head and hf.our_key_to_hf(LM_HEAD_KEY) not in state_dict:
        raise CheckpointError(
            f"{weights}: no lm_head.weight, but {CONFIG_FILE} says tie_word_embeddings: false, so transformers "
            "would compute with a head of its own (randomly initialised), not the embedding; add the head, or set "
            "tie_word_embeddings: true if the embedding is the head"
        )


def read_model_config(directory: str | Path) -> ModelConfig:
    """The model config of a model or checkpoint directory, AstrAI's or Hugging Face's (mapped, or refused with a
    ``ConfigError`` naming the model_type or field), without reading any weights."""
    path = Path(directory) / CONFIG_FILE
    raw = read_config_json(path)
    if hf.is_hf_config(raw, str(path)):
        return hf.model_config_from_hf(raw, source=str(path))
    return ModelConfig.from_dict(raw, source=str(path))


def load_model_weights(
    model: nn.Module,
    state_dict: Mapping[str, Tensor],
    source: str | Path,
    assign: bool = False,
    dtype: torch.dtype | None = None,
    adapter: Mapping[str, Tensor] | None = None,
    quantized: Collection[str] = (),
) -> None:
    """Put ``state_dict`` into ``model`` after checking it fits exactly: one error lists every mismatch.

    ``adapter`` holds the tensors of a LoRA run's adapters, which the base's file lacks by design (a model injected
    on the meta device and sharded gets them here, each rank its part, in the adapters' own dtype).

    For a tied model an ``lm_head.weight`` in the file is accepted only when it equals the embedding (a file
    with a different head would silently lose it). ``source`` names the file in the error.

    A model built on the meta device (or ``assign``) takes new tensors, of ``dtype`` when given, else of the
    file's dtype. Otherwise every tensor is copied into the parameter it belongs to, cast to its dtype; a
    sharded parameter (a DTensor, after FSDP or tensor parallelism) receives only its own part, read from the
    file where ``state_dict`` is a ``StoredStateDict``. Either way one tensor is read at a time, straight into
    its place, so memory holds the model and at most one tensor (or one chunk of one) besides.

    ``quantized`` names linear weights stored as NF4 (QLoRA, ``quantize.py``): each is replaced by its quantised form
    as soon as it is read, so the float copy of one weight at a time is all the float memory they take.
    """
    shapes = {k: _stored_shape(state_dict, k) for k in state_dict}
    adapter = dict(adapter or {})
    shapes.update({k: tuple(v.shape) for k, v in adapter.items()})
    tied = getattr(getattr(model, "config", None), "tied", False)
    if tied and LM_HEAD_KEY in shapes:
        if EMBED_KEY in shapes and not (
            shapes[LM_HEAD_KEY] == shapes[EMBED_KEY] and torch.equal(state_dict[LM_HEAD_KEY], state_dict[EMBED_KEY])
        ):
            raise CheckpointError(
                f"{source}: holds an lm_head.weight that differs from embed_tokens.weight, but the config says "
                "tie_word_embeddings: true (set it to false to keep the separate head)"
            )
        del shapes[LM_HEAD_KEY]
    targets = model.state_dict(keep_vars=True)
    # Expert parallelism's other experts, a pipeline's other stages: checked here, read by the ranks that hold them.
    elsewhere = held_elsewhere(model) | held_by_other_stages(model, shapes)
    expected = {k: tuple(v.shape) for k, v in targets.items()} | elsewhere
    problems = []
    missing = [k for k in expected if k not in shapes]
    if missing and not (missing == [LM_HEAD_KEY] and EMBED_KEY in shapes):  # AstrAI clones the embedding
        problems.append(f"missing keys {abbreviate(missing)}")
    unexpected = [k for k in shapes if k not in expected]
    if unexpected:
        problems.append(f"unexpected keys {abbreviate(unexpected)}")
    wrong = [
        f"{k} (file {list(shapes[k])}, model {list(shape)})"
        for k, shape in expected.items()
        if k in shapes and shapes[k] != shape
    ]
    if wrong:
        problems.append(f"wrong shapes {abbreviate(wrong)}")
    if problems:
        raise CheckpointError(f"{source}: does not match the model built from its config.json: " + "; ".join(problems))
    if assign or any(t.is_meta for t in targets.values()):
        loaded = {
            k: adapter[k] if k in adapter else _read_whole(state_dict, k, dtype) for k in shapes if k not in elsewhere
        }
        model.load_state_dict(loaded, strict=True, assign=True)
        return
    with torch.no_grad():
        for key, target in targets.items():
            if dtype is not None and target.dtype != dtype and target.is_floating_point():
                if _is_dtensor(target):
                    raise ValueError("dtype: a sharded model is cast by its strategy, not while loading")
                target.data = torch.empty(target.shape, dtype=dtype)  # untouched until read into: no memory yet
            if key in adapter:
                _read_into(adapter, key, target)
            else:
                _read_into(state_dict, EMBED_KEY if key not in shapes else key, target)  # the clone AstrAI makes
            if key in quantized:
                quantize.quantize_weight(model, key)


def _is_dtensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor: it adds 0.7-4 s (measured) to
    ``generate`` and ``export``, whose models hold none; a model that holds one has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _stored_shape(state_dict: Mapping[str, Tensor], key: str) -> tuple[int, ...]:
    if isinstance(state_dict, StoredStateDict):
        return state_dict.shape(key)
    return tuple(state_dict[key].shape)


def _read_whole(state_dict: Mapping[str, Tensor], key: str, dtype: torch.dtype | None) -> Tensor:
    if isinstance(state_dict, StoredStateDict):
        return state_dict.read(key, dtype=dtype)
    tensor = state_dict[key]
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def _read_into(state_dict: Mapping[str, Tensor], key: str, target: Tensor) -> None:
    """Copy tensor ``key`` into ``target``: all of it, or a DTensor's local part."""
    target = target.detach()
    if not _is_dtensor(target):
        if isinstance(state_dict, StoredStateDict):
            state_dict.read(key, out=target)
        else:
            target.copy_(state_dict[key])
        return
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # loaded already: see _is_dtensor

    local = target.to_local()
    if all(type(p) in (Shard, Replicate) for p in target.placements):
        # Each rank reads only its own box of the file (see ``load_sharded_weights`` in train/models.py for why
        # not rank 0 reading and sending).
        shape, offset = local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        box = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
        if isinstance(state_dict, StoredStateDict):
            state_dict.read(key, out=local, box=box)
        else:
            local.copy_(state_dict[key][tuple(slice(a, b) for a, b in box)])
        return
    # Other placements (FSDP's strided shards over a tensor-parallel split): read the whole tensor, one at a time,
    # and let DTensor cut this rank's part (no communication: every rank has the same full tensor).
    full = _read_whole(state_dict, key, target.dtype).to(local.device)
    local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())


def load_model(directory: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """Build an ``AutoRegressiveLM`` from a model or checkpoint directory (AstrAI's ``from_pretrained``).

    The model's tensors are allocated uninitialised (``empty_model``) and each is read from the memory-mapped files
    straight into its place, as ``dtype`` (default: the file's dtype, tensor by tensor), so no memory or time goes
    into a random initialisation that would be overwritten, and the peak is the model plus one chunk of one tensor
    (docs/huggingface.md, Memory).
    """
    ckpt = load_checkpoint(directory, load_extra=False)
    config = ckpt.model_config()
    config.check_buildable(source=str(ckpt.path / CONFIG_FILE))
    model = empty_model(config, str(ckpt.path / CONFIG_FILE))
    if dtype is None and isinstance(ckpt.state_dict, StoredStateDict):  # each parameter as its file stores it
        state = ckpt.state_dict
        with torch.no_grad():
            for key, param in model.state_dict(keep_vars=True).items():
                stored = state.dtype(key) if key in state else None
                if stored is not None and stored.is_floating_point and stored != param.dtype:
                    param.data = torch.empty(param.shape, dtype=stored)
    load_model_weights(model, ckpt.state_dict, source=weights_source(ckpt), dtype=dtype)
    return model


def load_language_model(directory: str | Path, dtype: torch.dtype | None = None, command: str = "this") -> nn.Module:
    """``load_model`` for what needs an LM head (generate, chat, evaluate): a reward model is refused in one line
    naming ``command``, before any tensor is read."""
    if Path(directory).is_dir() and read_model_config(directory).score_head:  # else load_model's own error
        raise CheckpointError(
            f"{directory}: a reward model (a score head, no LM head), which {command} cannot run; "
            "it scores rollouts with --reward_model"
        )
    return load_model(directory, dtype=dtype)


class _SkipInit(TorchFunctionMode):
    """Turns the ``torch.nn.init`` functions into no-ops (the tensors keep whatever ``torch.empty`` gave)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def shape_model(config: ModelConfig) -> nn.Module:
    """An ``AutoRegressiveLM`` on the meta device (shapes and dtypes, no storage), its initialisation skipped: there it
    computes nothing, yet each init call runs through torch's Python decompositions (~0.5 ms a tensor: 2 minutes for
    4,096 layers of 16 experts, measured in ``bench/planner.py``). For counting, planning and FSDP's sharding."""
    with torch.device("meta"), _SkipInit():
        return AutoRegressiveLM(config)


def empty_model(config: ModelConfig, source: str = "config.json") -> nn.Module:
    """An ``AutoRegressiveLM`` on CPU whose weights are allocated by ``torch.empty`` and never initialised: the
    pages of a large allocation cost no memory until written, so loading into it (``load_model_weights``) peaks at
    the model's size. Cheaper than the meta device, whose first use imports torch's Python decompositions (~5 s).
    ``source`` names the config in the error when the model cannot fit in memory (``check_fits_here``, before any
    tensor; ``allocating``, a tensor the allocator refuses)."""
    check_fits_here(config, source)
    with _SkipInit(), allocating(source):
        return AutoRegressiveLM(config)


def check_fits_here(config: ModelConfig, source: str) -> None:
    """Refuse, before a tensor is made, a model this machine cannot hold in any form a command loads: its RoPE table
    (computed, so written, float32) and its weights at NF4's size (the smallest: QLoRA's base), from the config's
    arithmetic alone. The table is what a config can make enormous with no weight to read (``head_dim`` 1e9: 2.5 TB,
    which would be computed until the machine swapped); a larger real model is refused by its load where it fails."""
    table = rope_table_bytes(config)
    needed = table + count_parameters(config) * quantize.BYTES_PER_WEIGHT
    if needed > host_memory_bytes():
        raise ConfigError(
            f"{source}: this model does not fit in memory here: its RoPE table alone takes {table / 2**30:,.1f} GiB "
            f"and its {count_parameters(config):,} parameters at least {(needed - table) / 2**30:,.1f} GiB more; "
            f"this machine has {host_memory_bytes() / 2**30:,.1f} GiB"
        )


ALLOCATION_FAILED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
"""torch's CPU allocator refusing a tensor (a ``RuntimeError``; CUDA's is ``torch.OutOfMemoryError``)."""


@contextmanager
def allocating(source: str) -> Iterator[None]:
    """Building the model ``source`` describes on this host: the allocator refusing one of its tensors (sizes no
    machine here holds) is a ``ConfigError`` naming ``source``, the tensor and the machine's memory, not a
    traceback; a run builds its model before it writes anything."""
    try:
        yield
    except RuntimeError as err:
        failed = ALLOCATION_FAILED.search(str(err))
        if failed is None:
            raise
        raise ConfigError(
            f"{source}: this model does not fit in memory here: allocating one of its tensors "
            f"({int(failed[1]) / 2**30:,.1f} GiB) failed on a machine with {host_memory_bytes() / 2**30:,.1f} GiB"
        ) from None


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_source(ckpt: Checkpoint) -> Path:
    """The weights file to name in an error: ``model.safetensors``, or the index of a sharded directory."""
    if (ckpt.path / WEIGHTS_FILE).exists() or not (ckpt.path / WEIGHTS_INDEX_FILE).exists():
        return ckpt.path / WEIGHTS_FILE
    return ckpt.path / WEIGHTS_INDEX_FILE
