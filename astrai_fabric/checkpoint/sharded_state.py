"""The sharded resume state (``state/``, torch distributed checkpoint) read without running anything its files hold.

Torch's reader unpickles ``state/.metadata`` whole, and its load planner unpickles every non-tensor entry of the
``.distcp`` files with ``weights_only=False``: a planted file would run code during ``--resume`` or ``export``. Here
the metadata is unpickled by a reader that admits only the names torch writes there
(``torch_private.checkpoint_metadata_globals``), checked against what it claims (each entry in a file inside
``state/`` and within its bytes, untransformed; no tensor larger than the bytes that hold it, so nothing it makes us
allocate exceeds the files on disk), and handed to torch's reader in place of torch's own reading; non-tensor entries
go through torch's ``weights_only`` loader. A damaged state (a file missing or cut short, a metadata file that does
not unpickle) is a ``CheckpointError`` naming the file, raised by ``check_sharded_state`` before anything is written.
Imports torch.distributed.checkpoint: imported by ``checkpoint.state`` and the resume preflight only.
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from astrai_fabric import torch_private
from astrai_fabric.errors import CheckpointError, brief
from astrai_fabric.regular_files import open_regular_file

METADATA_FILE = ".metadata"
"""The file torch's ``FileSystemWriter`` writes the state's index into (one for all ranks)."""
MAX_VALUE_BYTES = 1 << 20
"""The most bytes one non-tensor entry (an optimizer setting) may hold: each is a few hundred."""
DAMAGED = (
    "the optimizer's sharded state is damaged or not torch's (its weights are not: --resume_optimizer false resumes "
    "from them with a fresh optimizer)"
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles what torch's checkpoint metadata is made of and refuses any other name before it is looked up."""

    def __init__(self, file: BinaryIO, allowed: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"it names {brief(module)}.{brief(name)}, which torch's checkpoint metadata never holds"
            ) from None


def check_sharded_state(state_dir: Path) -> Metadata:
    """``state_dir/.metadata`` read (restricted) and checked against the files beside it; ``CheckpointError`` naming
    the file and what is wrong. Run by every command that reads a sharded state, before it writes anything."""
    path = state_dir / METADATA_FILE
    with open_regular_file(
        path, within=state_dir, error=CheckpointError, expected="the sharded state's index, written by torch"
    ) as opened:
        try:
            metadata = _MetadataUnpickler(opened.file, torch_private.checkpoint_metadata_globals()).load()
        except Exception as err:  # noqa: BLE001 - whatever the bytes make the unpickler raise, the file is bad
            raise CheckpointError(
                f"{path}: not a sharded state's index ({type(err).__name__}: {brief(str(err), 120)}); {DAMAGED}"
            ) from None
    try:
        problem = _first_problem(metadata, state_dir)
    except (AttributeError, TypeError, ValueError, OverflowError) as err:  # a field missing or of another kind
        problem = f"malformed ({type(err).__name__}: {brief(str(err), 80)})"
    except CheckpointError as err:  # a file it names is missing or no file
        raise CheckpointError(f"{err}; {DAMAGED}") from None
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}; {DAMAGED}")
    return metadata


def _first_problem(metadata: Any, state_dir: Path) -> str | None:
    """What is wrong with ``metadata`` as the index of the files in ``state_dir``, or None."""
    if not isinstance(metadata, Metadata):
        return f"holds {type(metadata).__name__}, not torch's checkpoint metadata"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its entries or their storage are not tables"
    file_sizes: dict[str, int] = {}
    for index, info in storage.items():
        relative_path = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(index, MetadataIndex) or not isinstance(relative_path, str):
            return "a storage entry is not an index and a file"
        if not _plain_name(relative_path):
            return f"a storage entry names {brief(relative_path)}, not a file of the state's own folder"
        if not (_natural(offset) and _natural(length)):
            return f"{brief(index.fqn)}: its offset or length is not a byte count"
        if getattr(info, "transform_descriptors", None):
            return f"{brief(index.fqn)}: stored transformed (compressed), which these checkpoints never are"
        if relative_path not in file_sizes:
            with open_regular_file(state_dir / relative_path, within=state_dir, error=CheckpointError) as opened:
                file_sizes[relative_path] = opened.size_bytes
        if offset + length > file_sizes[relative_path]:
            return (
                f"{brief(index.fqn)} lies at bytes {offset:,} to {offset + length:,} of {relative_path}, which holds "
                f"{file_sizes[relative_path]:,} (cut short)"
            )
    tensor_bytes = 0
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            return "an entry's name is not text"
        if isinstance(entry, BytesStorageMetadata):
            info = storage.get(MetadataIndex(fqn))
            if info is None:
                return f"{brief(fqn)} is stored nowhere"
            if (problem := _value_problem(state_dir, info)) is not None:
                return f"{brief(fqn)} in {info.relative_path}: {problem}"
            continue
        if not isinstance(entry, TensorStorageMetadata) or not _is_shape(entry.size):
            return f"{brief(fqn)}: neither a tensor of a shape nor a value"
        dtype = getattr(entry.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(entry.chunks, list):
            return f"{brief(fqn)}: a tensor without a dtype or chunks"
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not _inside(chunk, entry.size):
                return f"{brief(fqn)}: a chunk outside the tensor's shape {tuple(entry.size)}"
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                return f"{brief(fqn)}: its chunk at {tuple(chunk.offsets)} is stored nowhere"
            if info.length < math.prod(chunk.sizes) * dtype.itemsize:
                return f"{brief(fqn)}: its chunk at {tuple(chunk.offsets)} has fewer bytes than its shape needs"
        tensor_bytes += math.prod(entry.size) * dtype.itemsize
    if tensor_bytes > sum(file_sizes.values()):
        return f"its tensors need {tensor_bytes:,} bytes, more than the {sum(file_sizes.values()):,} its files hold"
    return _planner_data_problem(getattr(metadata, "planner_data", None), entries)


def _value_problem(state_dir: Path, info: Any) -> str | None:
    """A non-tensor entry (a learning rate, betas, a step count) read by torch's ``weights_only`` loader, which builds
    plain values and tensors and nothing else: what it refuses, or None."""
    if info.length > MAX_VALUE_BYTES:
        return f"a stored value of {info.length:,} bytes (optimizer settings take a few hundred)"
    with open_regular_file(state_dir / info.relative_path, within=state_dir, error=CheckpointError) as opened:
        opened.file.seek(info.offset)
        stored = opened.file.read(info.length)
    try:
        torch.load(io.BytesIO(stored), weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the safe loader refuses, the value is not plain data
        return f"a stored value that is not plain data ({type(err).__name__}: {brief(str(err), 80)})"
    return None


def _planner_data_problem(planner_data: Any, entries: dict[str, Any]) -> str | None:
    """Each entry's place in the nested state (torch rebuilds the nesting from it when reading the state whole): a
    path of names and list positions, the positions below the number of entries (a list is padded up to them)."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict):
        return "the entries' places in the state are not a table"
    for fqn, where in planner_data.items():
        if fqn not in entries or not isinstance(where, tuple | list):
            return f"{brief(fqn)}: a place for an entry it does not hold"
        for step in where:
            if not (isinstance(step, str) or (_natural(step) and step < len(entries))):
                return f"{brief(fqn)}: its place in the state goes through {brief(step)}"
    return None


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_shape(size: Any) -> bool:
    return isinstance(size, torch.Size) and all(_natural(dim) for dim in size)


def _inside(chunk: ChunkStorageMetadata, size: torch.Size) -> bool:
    offsets, sizes = chunk.offsets, chunk.sizes
    if not (_is_shape(offsets) and _is_shape(sizes) and len(offsets) == len(sizes) == len(size)):
        return False
    return all(start + extent <= dim for start, extent, dim in zip(offsets, sizes, size, strict=True))


class _CheckedReader(FileSystemReader):
    """Torch's reader of ``state/``, handed its index as ``check_sharded_state`` read it: torch's own unpickles it."""

    def __init__(self, state_dir: Path, metadata: Metadata) -> None:
        super().__init__(state_dir)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.metadata
        if metadata.storage_meta is None:  # as torch's own read_metadata completes it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyValues:
    """A load planner's non-tensor entries (learning rates, betas, step counts) read by torch's ``weights_only``
    loader, which builds plain values and tensors and nothing else; the value is handed on as torch's planner
    expects it, saved again from what was built."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a value torch's safe loader refuses is a damaged entry
            raise CheckpointError(
                f"{read_item.dest_index.fqn}: a stored value that is not plain data ({type(err).__name__})"
            ) from None
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


class _CheckedPlanner(_WeightsOnlyValues, DefaultLoadPlanner):
    """Torch's default planner (the state read into a template) with ``_WeightsOnlyValues``."""


def load_sharded_state(template: dict[str, Any], state_dir: Path) -> None:
    """``state_dir`` read into ``template`` in place (each rank its shards, resharded to the template's layout by torch
    distributed checkpoint), nothing in it unpickled but by the restricted readers above."""
    reader = _CheckedReader(state_dir, check_sharded_state(state_dir))
    _translated(lambda: dcp.load(template, storage_reader=reader, planner=_CheckedPlanner()), state_dir)


def read_whole_state(state_dir: Path) -> dict[str, Any]:
    """The whole of ``state_dir`` in one process as the nested state it was saved from (``export``): a template of
    every entry its checked index lists (the tensors allocated as it says, bounded by the files' bytes), filled by
    ``load_sharded_state``, then nested again where the index says each entry was."""
    metadata = check_sharded_state(state_dir)
    flat = {
        fqn: torch.empty(entry.size, dtype=entry.properties.dtype) if isinstance(entry, TensorStorageMetadata) else None
        for fqn, entry in metadata.state_dict_metadata.items()
    }
    reader = _CheckedReader(state_dir, metadata)
    _translated(lambda: dcp.load(flat, storage_reader=reader, planner=_CheckedPlanner(), no_dist=True), state_dir)
    places = metadata.planner_data or {}
    whole: dict[str, Any] = {}
    for fqn, value in flat.items():
        _place(whole, places.get(fqn, (fqn,)), value)
    return whole


def _place(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """``value`` at ``path`` under ``root``, making the dicts (a name next) and lists (a position next, padded with
    None up to it) on the way, as torch's distributed checkpoint nests a state it flattened."""
    container: Any = root
    for step, following in zip(path[:-1], path[1:], strict=True):
        made = {} if isinstance(following, str) else []
        if isinstance(container, list):
            container.extend([None] * (step + 1 - len(container)))
            if container[step] is None:
                container[step] = made
        else:
            container.setdefault(step, made)
        container = container[step]
    if isinstance(container, list):
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def _translated(load: Any, state_dir: Path) -> None:
    """Run ``load``; torch's wrapped failures as one ``CheckpointError`` naming ``state_dir`` (ours as raised)."""
    try:
        with warnings.catch_warnings():  # one process reading a sharded state is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load()
    except CheckpointException as err:
        raised = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
        ours = next((e for e in raised if isinstance(e, CheckpointError)), None)
        if ours is not None:
            raise CheckpointError(f"{state_dir}: {ours}; {DAMAGED}") from None
        what = next((f"{type(e).__name__}: {brief(str(e), 120)}" for e in raised), "unknown")
        raise CheckpointError(f"{state_dir}: the sharded state could not be read ({what}); {DAMAGED}") from None
