"""The bytes of AstrAI's checkpoint directory: written atomically, read strictly and safely (AstrAI's
``astrai/serialization/checkpoint.py``). The only safetensors importer.

A checkpoint is a directory::

    meta.json           {"epoch", "consumed_samples", "timestamp", ...run fields..., "astrai_fabric": {...}}
    config.json         the model config (AstrAI's schema)
    model.safetensors   full tensors, AstrAI key names, no ``lm_head.weight`` when tied
    optimizer.pt ...    one ``{key}.pt`` per extra state (AstrAI reads every ``*.pt``)

plus any files the caller adds (tokenizer files, the resolved recipe). AstrAI ignores the ``astrai_fabric`` meta
key, which records our format version and package versions. A plain model directory (``config.json`` with
``model.safetensors`` or a sharded ``model.safetensors.index.json``) has the same weight files.

Writes go to a hidden sibling (``.NAME.tmp-…``) that is renamed into place once complete, so an interrupted save
never leaves a directory that looks complete and never touches an existing checkpoint. Reads are strict and every
failure is one ``CheckpointError`` naming the file; ``.pt`` files load with ``weights_only=True``, so a checkpoint
from a stranger cannot run code; safetensors files are opened lazily (``StoredStateDict``: headers checked when
opened, each tensor read on use, in chunks, straight into its place).

Over 300 lines for one responsibility: every safetensors read and write goes through here (the seam that keeps the
format's safety rules in one file), and the lazy reader is most of it. What a directory means (a model, a LoRA
checkpoint, a Hugging Face import) is ``weights.load_checkpoint``'s.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai_fabric import __version__
from astrai_fabric.checkpoint import hf
from astrai_fabric.errors import CheckpointError
from astrai_fabric.faults import crash_point
from astrai_fabric.json_files import read_json_object
from astrai_fabric.regular_files import check_regular_file, open_regular_file

META_FILE = "meta.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A LoRA checkpoint's adapter, in AstrAI's ``save_lora`` layout (keys ``<layer>.lora_A`` / ``<layer>.lora_B``)."""
STATE_DIR = "state"
"""A ``--sharded_checkpoint`` checkpoint's optimizer shards (``checkpoint.state``; ``export`` completes it)."""
FORMAT_KEY = "astrai_fabric"
"""``meta.json`` key holding our format description; its absence marks a checkpoint written by AstrAI."""
FORMAT_VERSION = 1
NOTHING_KEPT = (
    "nothing of it was kept and earlier checkpoints are intact. Free space (or choose another --ckpt_dir) and resume "
    "from the newest"
)
"""How a failed checkpoint save ends: its staging removed, the others untouched."""
RESERVED_META = ("epoch", "consumed_samples", "timestamp", FORMAT_KEY)
# Prefixes that wrappers put in front of parameter names: torch.compile (AstrAI's B3) and DDP.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


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
    saved as ``{stem}.pt``; ``files`` maps file names to text, bytes, or a path to copy. An existing path (other
    than an empty directory) is an error unless ``overwrite``, in which case it is replaced only after the new one
    is complete. ``staging`` is
    a directory from ``staging_dir`` that others have already written into (a sharded state); default: a new one.
    A LoRA checkpoint passes ``adapter`` and ``adapter_config`` (written as AstrAI's ``save_lora`` writes them) and
    ``state_dict`` None unless the merged weights are wanted too.
    """
    target = Path(directory)
    if not overwrite and not _vacant(target):
        raise CheckpointError(f"{target}: already exists; refusing to overwrite a checkpoint")
    clashes = [k for k in (meta or {}) if k in RESERVED_META]
    if clashes:
        raise ValueError(f"meta keys {clashes} are written by save_checkpoint itself")
    staging = staging or _new_staging(target)
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
        crash_point("meta")
        if state_dict is not None:
            _save_tensors(_safetensors_ready(state_dict), staging / WEIGHTS_FILE)
        if adapter is not None:
            _save_tensors(_safetensors_ready(adapter), staging / ADAPTER_FILE)
            _write_text(staging / ADAPTER_CONFIG_FILE, json.dumps(dict(adapter_config or {}), indent=2))
        crash_point("weights")
        for stem, obj in (extra or {}).items():
            _save_pt(obj, staging / f"{stem}.pt")
        crash_point("extra")
        _write_files(staging, files or {})
        _fsync(staging)
        crash_point("rename")
        _move_into_place(staging, target, overwrite)
    except OSError as err:  # a full disk, a file-size limit, a lost mount: nothing left behind
        failure = write_failure(err, staging, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"{target}: {failure}; {NOTHING_KEPT}") from None
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
    weights_name: str = WEIGHTS_FILE,
) -> Path:
    """Write a model directory atomically: ``files`` (name → text, bytes or a path to copy; the config among them)
    and the weights as ``model.safetensors`` or, when they exceed ``max_shard_bytes``, as
    ``model-0000K-of-0000N.safetensors`` shards with ``model.safetensors.index.json`` (the layout transformers
    writes and reads: tensors in order, a new shard when the next one would overflow, a larger tensor alone).
    ``metadata`` goes into each safetensors header; ``weights_name`` names a single file (PEFT's adapter is
    ``adapter_model.safetensors``). An existing path is an error, an empty directory aside (replaced by the
    rename that puts the new one in place, which fails should anything appear in it meanwhile)."""
    target = Path(directory)
    if not _vacant(target):
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
    staging = _new_staging(target)
    try:
        names = (
            [weights_name]
            if len(shards) == 1
            else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        )
        for name, shard in zip(names, shards, strict=True):
            _save_tensors(shard, staging / name, metadata)
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in ready.values())
            weight_map = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            _write_text(staging / WEIGHTS_INDEX_FILE, json.dumps(index, indent=2))
        _write_files(staging, files)
        _fsync(staging)
        _move_into_place(staging, target, overwrite=False)
    except OSError as err:
        failure = write_failure(err, staging, target)
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"{target}: {failure}; nothing was written") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def write_failure(err: Exception, staging: Path, target: Path, file: Path | None = None) -> str:
    """Why writing ``file`` (or the file ``err`` names) into ``staging``, to become ``target``, failed, naming it as
    ``target`` would hold it and, for a full disk, the device: ``no space left on /dev/sdb1 (mounted at /data) while
    writing .../optimizer.pt``. A writer that hides the errno (torch's distributed checkpoint says ``unexpected
    pos``) counts as a full disk where no space is left now."""
    name = getattr(err, "filename", None)
    file = Path(name) if file is None and isinstance(name, str) else file
    if file is not None and file.is_relative_to(staging):
        file = target / file.relative_to(staging)
    while_writing = f" while writing {file}" if file is not None else ""
    if getattr(err, "errno", None) == errno.ENOSPC or (not isinstance(err, OSError) and _full(staging)):
        return f"no space left on {_device_of(staging)}{while_writing}"
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip().splitlines()[-1][:300]
    return f"could not write the checkpoint ({reason}{while_writing})"


def _full(path: Path) -> bool:
    """Whether the file system holding ``path`` has less than a page left for this user."""
    try:
        return shutil.disk_usage(path).free < 4096
    except OSError:
        return False


def _device_of(path: Path) -> str:
    """The file system ``path`` is on, as ``/proc/self/mounts`` names it, and where it is mounted."""
    mount = Path(os.path.realpath(path))
    while not os.path.ismount(mount):
        mount = mount.parent
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:  # not Linux
        entries = []
    # The last mount at a point hides the earlier ones; spaces in a mount point are written as \040.
    sources = [fields[0] for fields in entries if len(fields) > 1 and fields[1].replace("\\040", " ") == str(mount)]
    return f"{sources[-1]} (mounted at {mount})" if sources else f"the file system mounted at {mount}"


def staging_dir(target: Path) -> Path:
    """A new hidden sibling of ``target`` to write into (its name never matches ``epoch_*_step_*``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    return staging


def _new_staging(target: Path) -> Path:
    try:
        return staging_dir(target)
    except OSError as err:  # a parent that is a file, no permission, a name too long
        raise CheckpointError(f"{target}: could not write ({err.strerror or err}); nothing was written") from None


def _vacant(target: Path) -> bool:
    """Nothing at ``target``, or an empty directory (not a link): what a new directory may take the place of."""
    if not os.path.lexists(target):
        return True
    return target.is_dir() and not target.is_symlink() and not any(target.iterdir())


def _move_into_place(staging: Path, target: Path, overwrite: bool) -> None:
    """``staging`` renamed to ``target``. Without ``overwrite`` the rename alone: it takes the place of nothing or
    of an empty directory, and fails (an ``OSError``) where anything else has appeared there since the check."""
    if not overwrite or not os.path.lexists(target):
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
            try:
                shutil.copyfile(content, dest)
            except OSError as err:
                err.filename = err.filename or str(dest)
                raise
            _fsync(dest)
        elif isinstance(content, bytes):
            _write_bytes(dest, content)
        else:
            _write_text(dest, content)


def _save_tensors(tensors: Mapping[str, Tensor], path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """safetensors' ``save_file`` to ``path``, synced; its failure an ``OSError`` naming ``path`` (safetensors raises
    its own error, the errno only in its text)."""
    try:
        save_file(tensors, str(path), metadata=dict(metadata) if metadata else None)
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        raise OSError(int(code[1]) if code else errno.EIO, str(err), str(path)) from None
    _fsync(path)


class _KeptWriteError:
    """A binary file that ``torch.save`` writes through, keeping the ``OSError`` of a failed write: torch's writer
    reports one only as ``unexpected pos``, which hides a full disk."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            self.file.write(data)
        except OSError as err:
            self.error = err
            raise
        return len(data)

    def flush(self) -> None:
        self.file.flush()


def _save_pt(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path``, synced; a failed write an ``OSError`` naming ``path``."""
    try:
        with open(path, "wb") as file:
            writer = _KeptWriteError(file)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            file.flush()
            os.fsync(file.fileno())
    except OSError as err:
        err.filename = err.filename or str(path)
        raise


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, (text if text.endswith("\n") else text + "\n").encode("utf-8"))


def _write_bytes(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        err.filename = err.filename or str(path)
        raise


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading -----------------------------------------------------------------------------------------------------


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``, or a ``CheckpointError`` naming the file and ``what`` it should hold."""
    return read_json_object(path, what, CheckpointError)


def read_weights(path: Path) -> StoredStateDict:
    """The weights of a model directory, ``model.safetensors`` or the shards its index lists (headers only).

    Read exactly or refused, naming the file and the key: the index and the shards' headers agree tensor for
    tensor (each key in the shard it names, each tensor of a shard listed there, none stored twice); an index
    beside ``model.safetensors`` must describe that file (else which holds the model is ambiguous: refused); no
    file is read from outside the directory (``tensor_files``)."""
    if os.path.lexists(path / WEIGHTS_INDEX_FILE):
        index, weight_map = read_weight_map(path)
        state_dict = StoredStateDict.from_files(tensor_files(path))
        for key in state_dict:
            if weight_map.get(key) != state_dict.file(key).name:
                listed = f"maps it to {weight_map[key]}" if key in weight_map else "does not list it"
                raise CheckpointError(f"{state_dict.file(key)}: holds {key!r}, but {index.name} {listed}")
        absent = [k for k in weight_map if k not in state_dict]
        if absent:
            raise CheckpointError(f"{index}: maps {absent[0]!r} to {weight_map[absent[0]]}, which does not hold it")
    elif os.path.lexists(path / WEIGHTS_FILE):
        state_dict = StoredStateDict.from_files(tensor_files(path))
    else:
        raise CheckpointError(
            f"{path}: has no weights (no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}; a config alone, like bundled:tiny, "
            "is where training starts): give a checkpoint a run wrote, or the directory holding the weights"
        )
    return _strip_wrapper_prefixes(state_dict, path)


def read_weight_map(path: Path) -> tuple[Path, dict[str, str]]:
    """``model.safetensors.index.json`` (checked as ``inside``) and its ``weight_map``, tensor name → the name of a
    shard beside it; refused where a value is no such name, or where the index sits beside a ``model.safetensors``
    it does not describe (transformers would read that file and ignore the index)."""
    index = inside(path, WEIGHTS_INDEX_FILE)
    weight_map = read_json(index, what="a sharded safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty 'weight_map' object")
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(
                f"{index}: 'weight_map' maps {key!r} to a {type(name).__name__}, expected the "
                "file name of a shard beside the index"
            )
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise CheckpointError(
                f"{index}: 'weight_map' maps {key!r} to {name[:200]!r}, expected the file name "
                "of a shard beside the index (no path: nothing is read from outside the model "
                "directory)"
            )
    if os.path.lexists(path / WEIGHTS_FILE) and set(weight_map.values()) != {WEIGHTS_FILE}:
        raise CheckpointError(
            f"{index}: lists shards beside a {WEIGHTS_FILE}, so which file holds the model is ambiguous "
            f"(transformers would read {WEIGHTS_FILE} and ignore the index); remove the one that is stale"
        )
    return index, weight_map


def tensor_files(path: Path) -> list[Path]:
    """The safetensors files a model directory's weights are read from, each checked as ``inside``: the shards
    its index names, else ``model.safetensors``. Reads only the index."""
    if os.path.lexists(path / WEIGHTS_INDEX_FILE):
        return [inside(path, name) for name in sorted(set(read_weight_map(path)[1].values()))]
    return [inside(path, WEIGHTS_FILE)]


def inside(path: Path, name: str) -> Path:
    """``path / name``, a regular file inside ``path`` once links are followed: a link may point within the
    directory or, in the Hugging Face cache (``huggingface_hub``'s ``snapshots/REV/``), into the same repository's
    ``blobs/``; one pointing anywhere else is refused, so a model's files (its weights, the files an export copies)
    never make us read outside it. A FIFO, a device or a link to nothing is refused by name (``regular_files``)."""
    file = path / name
    root = Path(os.path.realpath(path))
    places = [root]
    repository = root.parent.parent
    if root.parent.name == "snapshots" and repository.name.startswith("models--") and (repository / "blobs").is_dir():
        places.append(repository / "blobs")
    check_regular_file(file, within=places, within_name="the model directory", error=CheckpointError)
    return file


def files_inside(path: Path, names: Iterable[str]) -> dict[str, Path]:
    """Those of ``names`` present in ``path``, each checked as ``inside`` (a regular file within it once links are
    followed): what an export or a merge copies, so a link to a file elsewhere (or to a device, which would never
    end) is refused, never copied into what may be published."""
    return {name: inside(path, name) for name in names if os.path.lexists(path / name)}


@dataclass(frozen=True)
class _Stored:
    """One tensor on disk: its file, its name there, its shape, the head width (and rotated rows per head) when its
    rows are stored in transformers' rotate-half pairing (permuted to ours as they are read), and its rows in the
    stored tensor when it is one part of a fused one (``hf.Target``)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str
    """safetensors' name for it (``BF16``, ``F32``, ...)."""
    head_dim: int | None = None
    rotary_dim: int | None = None
    first_row: int = 0
    """Where its rows start in the stored tensor."""


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

    def __init__(self, entries: dict[str, _Stored | Tensor]) -> None:
        self._entries = entries

    @classmethod
    def from_files(cls, files: list[Path]) -> StoredStateDict:
        """The tensors of ``files``; a name stored in two of them is refused (which one holds it is ambiguous)."""
        entries: dict[str, _Stored] = {}
        for file in files:
            try:
                with (
                    open_regular_file(file, error=CheckpointError) as opened,
                    safe_open(opened.reopenable_path, framework="pt") as handle,  # checks the header against the size
                ):
                    for key in handle.keys():
                        if key in entries:
                            raise CheckpointError(
                                f"{file}: holds {key!r}, which {entries[key].file.name} holds "
                                "too; each tensor is stored once"
                            )
                        stored = handle.get_slice(key)
                        entries[key] = _Stored(file, key, tuple(stored.get_shape()), stored.get_dtype())
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{file}: not a readable safetensors file, perhaps truncated ({err})") from None
        return cls(entries)

    def renamed(self, names: Mapping[str, list[hf.Target]]) -> StoredStateDict:
        """The same tensors under new names, as ``hf.import_targets`` gives them (an empty list leaves a tensor out,
        several split it by rows); keys not in ``names`` stay as they are."""
        entries = {}
        for key, entry in self._entries.items():
            if key not in names:
                entries[key] = entry
            for name, head_dim, rotary_dim, rows in names.get(key, []):
                shape, first_row = entry.shape, entry.first_row
                if rows is not None:
                    shape, first_row = (rows[1] - rows[0], *entry.shape[1:]), first_row + rows[0]
                entries[name] = _Stored(entry.file, entry.key, shape, entry.dtype, head_dim, rotary_dim, first_row)
        return StoredStateDict(entries)

    def with_tensors(self, tensors: Mapping[str, Tensor], without: Iterable[str] = ()) -> StoredStateDict:
        """The stored tensors less ``without``, and ``tensors`` (held in memory: a new reward head) beside them."""
        entries = {k: v for k, v in self._entries.items() if k not in set(without)}
        return StoredStateDict({**entries, **tensors})

    def __getitem__(self, key: str) -> Tensor:
        return self.read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self.items()),)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entries[key].shape)

    def file(self, key: str) -> Path:
        """The file that holds tensor ``key``."""
        return self._entries[key].file

    def dtype(self, key: str) -> torch.dtype | None:
        """The tensor's dtype on disk (None for one torch has no name for)."""
        entry = self._entries[key]
        return entry.dtype if isinstance(entry, Tensor) else _SAFETENSORS_DTYPES.get(entry.dtype)

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
        if isinstance(entry, Tensor):  # one held in memory (``with_tensors``)
            part = entry[tuple(slice(a, b) for a, b in box)]
            return part.to(dtype or part.dtype, copy=True) if out is None else out.copy_(part)
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
                    rows = slice(entry.first_row + low, entry.first_row + high)
                    chunk = handle.get_slice(entry.key)[(rows, *columns)]
                    if out is None:
                        out = torch.empty((stop - start, *chunk.shape[1:]), dtype=dtype or chunk.dtype)
                    if entry.head_dim is not None:
                        chunk = hf.rotate_half_to_interleaved(chunk, entry.head_dim, entry.rotary_dim)
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
            state_dict = state_dict.renamed({k: [hf.Target(k[len(prefix) :])] for k in state_dict})
    return state_dict


def read_pt(file: Path, within: Path | None = None) -> Any:
    """A ``.pt`` file as plain data (``weights_only``): one that holds other Python objects is refused. Opened as
    what it is (``regular_files``; ``within``: the directory a scan found it in, which it must resolve inside)."""
    try:
        with open_regular_file(file, within=within, error=CheckpointError) as opened:
            return torch.load(opened.reopenable_path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error: ([^.\n]*?)(?: was not an allowed global|\.|$)", str(err), re.M)
        raise CheckpointError(
            f"{file}: refused to load: it holds Python objects other than tensors and plain data, which could run "
            f"code ({found.group(1) if found else 'not a plain-data file'})"
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise CheckpointError(f"{file}: cannot be read, perhaps truncated ({err})") from None


def abbreviate(items: list[str], limit: int = 8) -> str:
    """``items`` for an error message: the first ``limit``, then how many more."""
    shown = ", ".join(items[:limit])
    return f"[{shown}, ... {len(items) - limit} more]" if len(items) > limit else f"[{shown}]"
