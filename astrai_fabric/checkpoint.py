"""AstrAI's checkpoint directory, written atomically and read strictly (AstrAI's
``astrai/serialization/checkpoint.py``). The only safetensors importer.

A checkpoint is a directory::

    meta.json           {"epoch", "consumed_samples", "timestamp", ...run fields..., "astrai_fabric": {...}}
    config.json         the model config (AstrAI's schema)
    model.safetensors   full tensors, AstrAI key names, no ``lm_head.weight`` when tied
    optimizer.pt ...    one ``{key}.pt`` per extra state (AstrAI reads every ``*.pt``)

plus any files the caller adds (tokenizer files, the resolved recipe). AstrAI ignores the ``astrai_fabric`` meta
key, which records our format version and package versions. A plain model directory (``config.json`` with
``model.safetensors`` or a sharded ``model.safetensors.index.json``) loads too, as AstrAI's ``load_any`` does, and
so does a Hugging Face model directory (a ``config.json`` whose ``model_type`` is not AstrAI's): its config and
tensors are mapped by ``astrai_fabric.hf``, or refused there before anything is read further.

Writes go to a hidden sibling (``.NAME.tmp-…``) that is renamed into place once complete, so an interrupted save
never leaves a directory that looks complete and never touches an existing checkpoint. Loads are strict and every
failure is one ``CheckpointError`` naming the file; ``.pt`` files load with ``weights_only=True``, so a checkpoint
from a stranger cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import time
import uuid
import warnings
import zipfile
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from astrai_fabric import hf, lora
from astrai_fabric.config.model import ModelConfig, read_config_json
from astrai_fabric.errors import CheckpointError, ConfigError

META_FILE = "meta.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A LoRA checkpoint's adapter, in AstrAI's ``save_lora`` layout (keys ``<layer>.lora_A`` / ``<layer>.lora_B``)."""
LORA_BASE_KEY = "lora_base"
"""``meta.json`` key of a LoRA checkpoint: where its base weights are (``path`` relative to the checkpoint,
``absolute``) and the ``sha256`` of each base weight file."""
FORMAT_KEY = "astrai_fabric"
"""``meta.json`` key holding our format description; its absence marks a checkpoint written by AstrAI."""
FORMAT_VERSION = 1
RESERVED_META = ("epoch", "consumed_samples", "timestamp", FORMAT_KEY)
# Prefixes that wrappers put in front of parameter names: torch.compile (AstrAI's B3) and DDP.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


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


@dataclass
class LoRAAdapter:
    """An adapter read from ``adapter_model.safetensors`` + ``adapter_config.json``."""

    spec: lora.LoRASpec
    state_dict: dict[str, Tensor]
    base: Path | None = None
    """The directory of the base weights it was trained on (found through ``meta.json``), if it has one."""


# --- writing -----------------------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | Path,
    state_dict: Mapping[str, Tensor] | None,
    config: Mapping[str, Any],
    *,
    epoch: int = 0,
    consumed_samples: int = 0,
    meta: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    files: Mapping[str, str | bytes | Path] | None = None,
    overwrite: bool = False,
    staging: Path | None = None,
    adapter: Mapping[str, Tensor] | None = None,
    adapter_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write an AstrAI checkpoint directory atomically and return its path.

    ``meta`` holds the run's fields (written after AstrAI's three leading keys); ``extra`` maps stems to objects
    saved as ``{stem}.pt``; ``files`` maps file names to text, bytes, or a path to copy. An existing directory is
    an error unless ``overwrite``, in which case it is replaced only after the new one is complete. ``staging`` is
    a directory from ``staging_dir`` that others have already written into (a sharded state); default: a new one.
    A LoRA checkpoint passes ``adapter`` and ``adapter_config`` (written as AstrAI's ``save_lora`` writes them) and
    ``state_dict`` None unless the merged weights are wanted too.
    """
    target = Path(directory)
    if target.exists() and not overwrite:
        raise CheckpointError(f"{target}: already exists; refusing to overwrite a checkpoint")
    clashes = [k for k in (meta or {}) if k in RESERVED_META]
    if clashes:
        raise ValueError(f"meta keys {clashes} are written by save_checkpoint itself")
    staging = staging or staging_dir(target)
    try:
        full_meta = {
            "epoch": epoch,
            "consumed_samples": consumed_samples,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **(meta or {}),
            FORMAT_KEY: _format_description(),
        }
        _write_text(staging / META_FILE, json.dumps(full_meta, indent=2))
        _write_text(staging / CONFIG_FILE, json.dumps(dict(config), indent=2))
        _crash_point("meta")
        if state_dict is not None:
            save_file(_safetensors_ready(state_dict), str(staging / WEIGHTS_FILE))
            _fsync(staging / WEIGHTS_FILE)
        if adapter is not None:
            save_file(_safetensors_ready(adapter), str(staging / ADAPTER_FILE))
            _fsync(staging / ADAPTER_FILE)
            _write_text(staging / ADAPTER_CONFIG_FILE, json.dumps(dict(adapter_config or {}), indent=2))
        _crash_point("weights")
        for stem, obj in (extra or {}).items():
            torch.save(obj, staging / f"{stem}.pt")
            _fsync(staging / f"{stem}.pt")
        _crash_point("extra")
        _write_files(staging, files or {})
        _fsync(staging)
        _crash_point("rename")
        _move_into_place(staging, target)
    except (OSError, SafetensorError) as err:  # a full disk, a file-size limit, a lost mount: nothing left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"{target}: could not write the checkpoint ({getattr(err, 'strerror', None) or err}); nothing was "
            "written and earlier checkpoints are intact. Free space (or choose another --ckpt_dir) and resume from "
            "the newest"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def save_model_directory(
    directory: str | Path,
    tensors: Mapping[str, Tensor],
    files: Mapping[str, str | bytes | Path],
    *,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a model directory atomically: ``files`` (name → text, bytes or a path to copy; the config among them)
    and the weights as ``model.safetensors`` or, when they exceed ``max_shard_bytes``, as
    ``model-0000K-of-0000N.safetensors`` shards with ``model.safetensors.index.json`` (the layout transformers
    writes and reads: tensors in order, a new shard when the next one would overflow, a larger tensor alone).
    ``metadata`` goes into each safetensors header. An existing directory is an error."""
    target = Path(directory)
    if os.path.lexists(target):
        raise CheckpointError(f"{target}: already exists; refusing to overwrite it (choose another --out)")
    ready = _safetensors_ready(tensors)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in ready.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    staging = staging_dir(target)
    try:
        names = [WEIGHTS_FILE] if len(shards) == 1 else [
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))
        ]  # fmt: skip
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, str(staging / name), metadata=dict(metadata) if metadata else None)
            _fsync(staging / name)
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in ready.values())
            weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_text(staging / WEIGHTS_INDEX_FILE, json.dumps(index, indent=2))
        _write_files(staging, files)
        _fsync(staging)
        _move_into_place(staging, target)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"{target}: could not write ({getattr(err, 'strerror', None) or err}); nothing was written"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


_crash_counts: dict[str, int] = {}


def _crash_point(point: str) -> None:
    """Test hook for crash safety: ``ASTRAI_FABRIC_CRASH_AT=POINT@N`` kills this process with SIGKILL, as a power
    cut would, the N-th time a save reaches POINT: ``meta``, ``weights`` or ``extra`` (after writing those files), or
    ``rename`` (everything written and synced, just before the rename that completes the checkpoint)."""
    wanted = os.environ.get("ASTRAI_FABRIC_CRASH_AT")
    if wanted and wanted.partition("@")[0] == point:
        _crash_counts[point] = _crash_counts.get(point, 0) + 1
        if str(_crash_counts[point]) == (wanted.partition("@")[2] or "1"):
            os.kill(os.getpid(), signal.SIGKILL)


def staging_dir(target: Path) -> Path:
    """A new hidden sibling of ``target`` to write into (its name never matches ``epoch_*_step_*``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def _move_into_place(staging: Path, target: Path) -> None:
    if not os.path.lexists(target):
        os.rename(staging, target)
    else:
        # Keep the old directory until the new one is in place, so no moment exists without a good checkpoint.
        retired = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, retired)
        os.rename(staging, target)
        _remove(retired)
    _fsync(target.parent)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory we replaced; a symlink in its place is unlinked, its target never touched."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _format_description() -> dict[str, Any]:
    from astrai_fabric import __version__

    versions = {"astrai_fabric": __version__}
    for package in ("torch", "lightning", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"format_version": FORMAT_VERSION, "versions": versions}


def _safetensors_ready(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses shared tensors)."""
    ready, seen = {}, set()
    for key, tensor in state_dict.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"state_dict[{key!r}] is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach().cpu().contiguous()
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        ready[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return ready


def _write_files(directory: Path, files: Mapping[str, str | bytes | Path]) -> None:
    """Each of ``files`` into ``directory``: text, bytes, or a copy of the file a path names."""
    for name, content in files.items():
        dest = directory / name
        if isinstance(content, Path):
            shutil.copyfile(content, dest)
            _fsync(dest)
        elif isinstance(content, bytes):
            _write_bytes(dest, content)
        else:
            _write_text(dest, content)


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, (text if text.endswith("\n") else text + "\n").encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- finding -----------------------------------------------------------------------------------------------------

CHECKPOINT_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")


def find_latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete ``epoch_E_step_S`` directory with the highest step under ``ckpt_dir``, or None.

    Staging directories are hidden (``.NAME.tmp-…``) and never match. A directory that is not complete and valid
    (see ``checkpoint_problem``: damaged by something other than our atomic writes) is skipped with a warning.
    """
    for path in reversed(complete_checkpoints(ckpt_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warnings.warn(f"{path}: skipped, not a complete checkpoint ({problem})", stacklevel=2)
    return None


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The ``epoch_E_step_S`` directories under ``ckpt_dir`` with their meta.json and weights, oldest first (a
    symlink to one counts; a dangling symlink does not)."""
    found = []
    for path in Path(ckpt_dir).glob("epoch_*_step_*"):
        match = CHECKPOINT_NAME.match(path.name)
        weights = (path / WEIGHTS_FILE).is_file() or (path / ADAPTER_FILE).is_file()
        if match and (path / META_FILE).is_file() and weights:
            found.append(((int(match[2]), int(match[1])), path))
    return [path for _, path in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The optimizer step in a checkpoint directory's name."""
    return int(CHECKPOINT_NAME.match(path.name)[2])


def checkpoints_after(ckpt_dir: str | Path, step: int) -> list[Path]:
    """The checkpoints under ``ckpt_dir`` saved after optimizer step ``step``, oldest first."""
    return [path for path in complete_checkpoints(ckpt_dir) if checkpoint_step(path) > step]


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole checkpoint, or None. Cheap: JSON files parse, the safetensors header and the
    ``.pt`` archives' directories are intact and the files as long as they say (no tensor is read)."""
    for name in (META_FILE, CONFIG_FILE):
        try:
            if not isinstance(json.loads((path / name).read_text(encoding="utf-8")), dict):
                return f"{name} is not a JSON object"
        except (OSError, ValueError) as err:
            return f"{name}: {err}"
    names = [name for name in (WEIGHTS_FILE, ADAPTER_FILE) if (path / name).is_file()] or [WEIGHTS_FILE]
    for name in names:
        weights = path / name
        try:
            with weights.open("rb") as file:
                header_size = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(header_size))
            end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
            if weights.stat().st_size < 8 + header_size + end:
                return f"{name} is truncated"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{name}: unreadable header ({err})"
    for file in sorted(path.glob("*.pt")):
        if not zipfile.is_zipfile(file):
            return f"{file.name} is truncated or not a torch archive"
    return None


def remove_stale_staging(ckpt_dir: str | Path) -> list[Path]:
    """Clear what interrupted saves left: hidden ``.NAME.tmp-*`` folders are deleted; a ``.NAME.old-*`` folder (a
    replaced checkpoint, caught between the two renames) goes back to ``NAME`` if that is missing. Returns the
    folders deleted."""
    root = Path(ckpt_dir)
    for retired in sorted(root.glob(".epoch_*_step_*.old-*")):
        original = root / retired.name[1:].rsplit(".old-", 1)[0]
        if not original.exists():
            os.rename(retired, original)
    stale = sorted(root.glob(".epoch_*_step_*.tmp-*")) + sorted(root.glob(".epoch_*_step_*.old-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def prune_checkpoints(ckpt_dir: str | Path, keep_last_k: int) -> list[Path]:
    """Delete all but the newest ``keep_last_k`` checkpoints under ``ckpt_dir`` (call after a save completes).

    Only directories a run wrote are pruned: a symlink named like a checkpoint (someone linked one in) is neither
    deleted nor followed, nor counted among the ``keep_last_k``."""
    removed = [path for path in complete_checkpoints(ckpt_dir) if not path.is_symlink()][:-keep_last_k]
    for path in removed:
        shutil.rmtree(path)
    return removed


# --- reading -----------------------------------------------------------------------------------------------------


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
    config = _read_json(path / CONFIG_FILE, what="AstrAI's model config")
    source = None
    if hf.is_hf_config(config):  # mapped (or refused) before a tensor is read
        model_config = hf.model_config_from_hf(config, source=str(path / CONFIG_FILE))
        source = hf.HFSource(model_type=config["model_type"], config=config)
        config = model_config.to_dict()
    meta = _read_json(path / META_FILE, what="the run's meta data") if (path / META_FILE).exists() else {}
    for key in ("epoch", "consumed_samples"):
        if key in meta and (not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0):
            raise CheckpointError(f"{path / META_FILE}: {key!r} must be a non-negative integer, got {meta[key]!r}")
    extra = {}
    if load_extra:
        extra = {f.stem: _read_pt(f) for f in sorted(path.glob("*.pt")) if f.stem not in skip}
    adapter = None
    if (path / ADAPTER_FILE).is_file():
        adapter = read_adapter(path)
        if not merge_lora or not (path / WEIGHTS_FILE).is_file():
            adapter.base = resolve_lora_base(path, meta)
    if adapter is not None and (not merge_lora or not (path / WEIGHTS_FILE).is_file()):
        state_dict = load_checkpoint(adapter.base, load_extra=False).state_dict
        if merge_lora:
            state_dict = lora.merge_state_dict(state_dict, adapter.state_dict, adapter.spec.scaling)
    else:
        state_dict = _read_weights(path)  # headers only: tensors are read where they go (``load_model_weights``)
    if source is not None:
        state_dict = state_dict.renamed({key: hf.import_name(key, model_config) for key in state_dict})
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


def read_adapter(directory: str | Path) -> LoRAAdapter:
    """``adapter_model.safetensors`` + ``adapter_config.json`` of a directory (ours, or AstrAI's ``save_lora``)."""
    path = Path(directory)
    spec = lora.LoRASpec.from_adapter_config(
        _read_json(path / ADAPTER_CONFIG_FILE, what="the LoRA adapter's config"), str(path / ADAPTER_CONFIG_FILE)
    )
    tensors = dict(StoredStateDict.from_files([path / ADAPTER_FILE]))  # small: read whole
    odd = [k for k in tensors if not lora.is_adapter_key(k)]
    if odd or not tensors:
        raise CheckpointError(f"{path / ADAPTER_FILE}: expected only <layer>.lora_A / <layer>.lora_B keys, got "
                              f"{_abbreviate(odd or ['nothing'])}")  # fmt: skip
    ranks = {tuple(v.shape)[0 if k.endswith("lora_A") else 1] for k, v in tensors.items() if v.dim() == 2}
    if ranks != {spec.r} or any(v.dim() != 2 for v in tensors.values()):
        raise CheckpointError(f"{path / ADAPTER_FILE}: adapter ranks {sorted(ranks)} do not match r={spec.r} of "
                              f"{ADAPTER_CONFIG_FILE}")  # fmt: skip
    return LoRAAdapter(spec, tensors)


def weight_files(directory: Path) -> list[Path]:
    """The files a model directory's weights are read from (what a LoRA checkpoint's ``sha256`` covers)."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / WEIGHTS_INDEX_FILE).is_file():
        index = _read_json(directory / WEIGHTS_INDEX_FILE, what="a sharded safetensors index")
        shards = sorted(set((index.get("weight_map") or {}).values()))
        return [directory / WEIGHTS_INDEX_FILE, *(directory / shard for shard in shards)]
    if (directory / ADAPTER_FILE).is_file():  # a LoRA checkpoint as base: its own base is checked when it loads
        return [directory / ADAPTER_FILE, directory / ADAPTER_CONFIG_FILE]
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} or {ADAPTER_FILE} (expected weights)")


def weight_digests(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of a model directory's weight files."""
    digests = {}
    for file in weight_files(directory):
        digest = hashlib.sha256()
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
        digests[file.name] = digest.hexdigest()
    return digests


def lora_base_entry(base: Path, checkpoint: Path, digests: dict[str, str]) -> dict[str, Any]:
    """The ``meta.json`` pointer from ``checkpoint`` to its base: relative where the two share a root, absolute too."""
    base = base.resolve()
    try:
        relative = os.path.relpath(base, checkpoint.resolve())
    except ValueError:  # another drive (Windows)
        relative = None
    return {"path": relative, "absolute": str(base), "sha256": digests}


def resolve_lora_base(path: Path, meta: Mapping[str, Any]) -> Path:
    """The base directory a LoRA checkpoint points to, its weight files checked against the recorded sha256."""
    entry = meta.get(LORA_BASE_KEY)
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), dict)
        and all(isinstance(entry.get(k), str | None) for k in ("path", "absolute"))
    ):
        raise CheckpointError(
            f"{path / META_FILE}: a LoRA checkpoint without merged weights needs '{LORA_BASE_KEY}' "
            f"{{path, absolute, sha256}} naming its base weights, got {entry!r}"
        )
    candidates = [Path(entry[k]) if k == "absolute" else path / entry[k] for k in ("path", "absolute") if entry[k]]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        raise CheckpointError(
            f"{path}: its LoRA base weights are missing (looked in {', '.join(map(str, candidates))}); "
            "put the base model back there, or resume from a checkpoint written with --lora_save_full"
        )
    digests = weight_digests(found)
    if digests != entry["sha256"]:
        differ = sorted(k for k in {*digests, *entry["sha256"]} if digests.get(k) != entry["sha256"].get(k))
        raise CheckpointError(
            f"{path}: the LoRA base at {found} is not the one this adapter was trained on (sha256 of "
            f"{', '.join(differ)} differs); restore that base model, or start a new run from it"
        )
    return found


def read_model_config(directory: str | Path) -> ModelConfig:
    """The model config of a model or checkpoint directory, AstrAI's or Hugging Face's (mapped, or refused with a
    ``ConfigError`` naming the model_type or field), without reading any weights."""
    path = Path(directory) / CONFIG_FILE
    raw = read_config_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    if hf.is_hf_config(raw):
        return hf.model_config_from_hf(raw, source=str(path))
    return ModelConfig.from_dict(raw, source=str(path))


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (expected {what})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_weights(path: Path) -> StoredStateDict:
    if (path / WEIGHTS_FILE).exists():
        state_dict = StoredStateDict.from_files([path / WEIGHTS_FILE])
    elif (path / WEIGHTS_INDEX_FILE).exists():
        weight_map = _read_json(path / WEIGHTS_INDEX_FILE, what="a sharded safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{path / WEIGHTS_INDEX_FILE}: expected a non-empty 'weight_map' object")
        shards = sorted({str(v) for v in weight_map.values()})
        state_dict = StoredStateDict.from_files([path / shard for shard in shards])
        absent = sorted(k for k in weight_map if k not in state_dict)
        if absent:
            raise CheckpointError(f"{path / WEIGHTS_INDEX_FILE}: keys listed but absent from their shards: {absent}")
    else:
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (expected the model's weights)")
    return _strip_wrapper_prefixes(state_dict, path)


@dataclass(frozen=True)
class _Stored:
    """One tensor on disk: its file, its name there, its shape, and the head width when its rows are stored in
    transformers' rotate-half pairing (permuted to ours as they are read)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str
    """safetensors' name for it (``BF16``, ``F32``, ...)."""
    head_dim: int | None = None


_CHUNK_ELEMENTS = 1 << 24
"""Elements read per mapping (32 MiB in bf16). The pages of a memory-mapped file that a read touches count in the
process's RSS until the file is unmapped, which safetensors does when its handle closes: reading a big tensor in
row chunks, each through a fresh ``safe_open``, keeps that overhead to one chunk instead of a whole shard."""


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class StoredStateDict(Mapping[str, Tensor]):
    """A state dict still on disk: names and shapes come from the safetensors headers (checked when the files are
    opened); a tensor is read only when asked for, straight into its destination (``read``), so loading never holds
    a second full copy of the model. Indexing reads the whole tensor into memory of its own (the file's dtype);
    pickling (a broadcast to ranks that cannot see the files) reads every tensor."""

    def __init__(self, entries: dict[str, _Stored]) -> None:
        self._entries = entries

    @classmethod
    def from_files(cls, files: list[Path]) -> StoredStateDict:
        entries = {}
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: file not found")
            try:
                with safe_open(str(file), framework="pt") as handle:  # validates the header against the file size
                    for key in handle.keys():
                        stored = handle.get_slice(key)
                        entries[key] = _Stored(file, key, tuple(stored.get_shape()), stored.get_dtype())
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{file}: not a readable safetensors file, perhaps truncated ({err})") from None
        return cls(entries)

    def renamed(self, names: Mapping[str, tuple[str, int | None] | None]) -> StoredStateDict:
        """The same tensors under new names (``names[key]`` is ``(new name, head_dim or None)`` as
        ``hf.import_name`` gives, or None to leave a tensor out); keys not in ``names`` keep theirs."""
        entries = {}
        for key, entry in self._entries.items():
            target = names.get(key, (key, entry.head_dim))
            if target is not None:
                entries[target[0]] = _Stored(entry.file, entry.key, entry.shape, entry.dtype, target[1])
        return StoredStateDict(entries)

    def __getitem__(self, key: str) -> Tensor:
        return self.read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self.items()),)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def dtype(self, key: str) -> torch.dtype | None:
        """The tensor's dtype on disk (None for one torch has no name for)."""
        return _SAFETENSORS_DTYPES.get(self._entries[key].dtype)

    def read(
        self,
        key: str,
        out: Tensor | None = None,
        dtype: torch.dtype | None = None,
        box: tuple[tuple[int, int], ...] | None = None,
    ) -> Tensor:
        """Tensor ``key`` in our layout, copied into ``out`` (cast to its dtype) or into a new tensor of ``dtype``
        (default: the file's). ``box`` (``(start, stop)`` per dimension) reads only that part: a rank's shard.

        Read in chunks of rows through fresh memory maps (``_CHUNK_ELEMENTS``). Rows of a rotated q/k tensor move
        only within their head, so each chunk covers whole heads in the file and is permuted on the way in; the
        only temporary is one chunk's worth.
        """
        entry = self._entries[key]
        if box is None:
            box = tuple((0, n) for n in entry.shape)
        try:
            if not entry.shape:  # a scalar: nothing to chunk
                with safe_open(str(entry.file), framework="pt") as handle:
                    source = handle.get_tensor(entry.key)
                    out = torch.empty((), dtype=dtype or source.dtype) if out is None else out
                    out.copy_(source)
                return out
            (start, stop), rest = box[0], box[1:]
            columns = tuple(slice(a, b) for a, b in rest)
            unit = entry.head_dim or 1  # rows read together: whole heads of a rotated tensor
            row_elements = math.prod(b - a for a, b in rest)
            step = max(1, _CHUNK_ELEMENTS // max(1, row_elements * unit)) * unit
            first = start // unit * unit
            for low in range(first, stop, step):
                high = min(low + step, -(-stop // unit) * unit)
                with safe_open(str(entry.file), framework="pt") as handle:
                    chunk = handle.get_slice(entry.key)[(slice(low, high), *columns)]
                    if out is None:
                        out = torch.empty((stop - start, *chunk.shape[1:]), dtype=dtype or chunk.dtype)
                    if entry.head_dim is not None:
                        chunk = hf.rotate_half_to_interleaved(chunk, entry.head_dim)
                    keep = slice(max(start, low) - low, min(stop, high) - low)
                    out[max(start, low) - start : min(stop, high) - start].copy_(chunk[keep])
                    del chunk  # before the handle closes and unmaps the file
            if out is None:  # an empty box (a rank holding no rows of a small tensor)
                out = torch.empty((0, *(b - a for a, b in rest)), dtype=dtype or torch.float32)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            raise CheckpointError(
                f"{entry.file}: cannot read {entry.key!r}, perhaps changed since it was opened ({err})"
            ) from None
        return out


def _strip_wrapper_prefixes(state_dict: StoredStateDict, path: Path) -> StoredStateDict:
    """Accept AstrAI's ``--compile`` checkpoints (keys start with ``_orig_mod.``, B3) by dropping the prefix."""
    for prefix in _WRAPPER_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            warnings.warn(f"{path}: weight names carry the wrapper prefix {prefix!r}; it is removed", stacklevel=3)
            state_dict = state_dict.renamed({k: (k[len(prefix) :], None) for k in state_dict})
    return state_dict


def _read_pt(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error: ([^.\n]*?)(?: was not an allowed global|\.|$)", str(err), re.M)
        raise CheckpointError(
            f"{file}: refused to load: it holds Python objects other than tensors and plain data, which could run "
            f"code ({found.group(1) if found else 'not a plain-data file'})"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise CheckpointError(f"{file}: cannot be read, perhaps truncated ({err})") from None


# --- matching weights to a model ---------------------------------------------------------------------------------


def load_model_weights(
    model: nn.Module,
    state_dict: Mapping[str, Tensor],
    source: str | Path,
    assign: bool = False,
    dtype: torch.dtype | None = None,
    adapter: Mapping[str, Tensor] | None = None,
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
    """
    from astrai_fabric.model.transformer import EMBED_KEY, LM_HEAD_KEY

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
    expected = {k: tuple(v.shape) for k, v in targets.items()}
    problems = []
    missing = [k for k in expected if k not in shapes]
    if missing and not (missing == [LM_HEAD_KEY] and EMBED_KEY in shapes):  # AstrAI clones the embedding
        problems.append(f"missing keys {_abbreviate(missing)}")
    unexpected = [k for k in shapes if k not in expected]
    if unexpected:
        problems.append(f"unexpected keys {_abbreviate(unexpected)}")
    wrong = [
        f"{k} (file {list(shapes[k])}, model {list(shape)})"
        for k, shape in expected.items()
        if k in shapes and shapes[k] != shape
    ]
    if wrong:
        problems.append(f"wrong shapes {_abbreviate(wrong)}")
    if problems:
        raise CheckpointError(f"{source}: does not match the model built from its config.json: " + "; ".join(problems))
    from torch.distributed.tensor import DTensor  # here: importing it costs the CLI's start-up time elsewhere

    if assign or any(t.is_meta for t in targets.values()):
        loaded = {k: adapter[k] if k in adapter else _read_whole(state_dict, k, dtype) for k in shapes}
        model.load_state_dict(loaded, strict=True, assign=True)
        return
    with torch.no_grad():
        for key, target in targets.items():
            if dtype is not None and target.dtype != dtype and target.is_floating_point():
                if isinstance(target, DTensor):
                    raise ValueError("dtype: a sharded model is cast by its strategy, not while loading")
                target.data = torch.empty(target.shape, dtype=dtype)  # untouched until read into: no memory yet
            if key in adapter:
                _read_into(adapter, key, target)
            else:
                _read_into(state_dict, EMBED_KEY if key not in shapes else key, target)  # the clone AstrAI makes


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
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    target = target.detach()
    if not isinstance(target, DTensor):
        if isinstance(state_dict, StoredStateDict):
            state_dict.read(key, out=target)
        else:
            target.copy_(state_dict[key])
        return
    local = target.to_local()
    if all(type(p) in (Shard, Replicate) for p in target.placements):
        # Each rank reads only its own box of the file (see ``load_sharded_weights`` in train/common.py for why
        # not rank 0 reading and sending).
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
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


def _abbreviate(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}, ... {len(items) - limit} more]" if len(items) > limit else f"[{shown}]"


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
    model = empty_model(config)
    if dtype is None and isinstance(ckpt.state_dict, StoredStateDict):  # each parameter as its file stores it
        state = ckpt.state_dict
        with torch.no_grad():
            for key, param in model.state_dict(keep_vars=True).items():
                stored = state.dtype(key) if key in state else None
                if stored is not None and stored.is_floating_point and stored != param.dtype:
                    param.data = torch.empty(param.shape, dtype=stored)
    load_model_weights(model, ckpt.state_dict, source=weights_source(ckpt), dtype=dtype)
    return model


class _SkipInit(TorchFunctionMode):
    """Turns the ``torch.nn.init`` functions into no-ops (the tensors keep whatever ``torch.empty`` gave)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def empty_model(config: ModelConfig) -> nn.Module:
    """An ``AutoRegressiveLM`` on CPU whose weights are allocated by ``torch.empty`` and never initialised: the
    pages of a large allocation cost no memory until written, so loading into it (``load_model_weights``) peaks at
    the model's size. Cheaper than the meta device, whose first use imports torch's Python decompositions (~5 s)."""
    from astrai_fabric.model import AutoRegressiveLM

    with _SkipInit():
        return AutoRegressiveLM(config)


def weights_source(ckpt: Checkpoint) -> Path:
    """The weights file to name in an error: ``model.safetensors``, or the index of a sharded directory."""
    if (ckpt.path / WEIGHTS_FILE).exists() or not (ckpt.path / WEIGHTS_INDEX_FILE).exists():
        return ckpt.path / WEIGHTS_FILE
    return ckpt.path / WEIGHTS_INDEX_FILE
