"""The checkpoints in a ``ckpt_dir``: their names (``epoch_E_step_S``), the newest complete one (what ``--resume
auto`` takes), the ones saved after a step, pruning to ``keep_last_k``, and clearing what an interrupted save left.
Reads names and headers only, never a tensor. Who may write into a ``ckpt_dir`` at all is ``ownership.py``'s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

from astrai_fabric.checkpoint.files import ADAPTER_FILE, CONFIG_FILE, META_FILE, WEIGHTS_FILE
from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.json_files import MAX_JSON_BYTES, read_json_file
from astrai_fabric.regular_files import check_regular_file, open_regular_file

CHECKPOINT_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")


def find_latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The complete ``epoch_E_step_S`` directory with the highest step under ``ckpt_dir``, or None.

    Staging directories are hidden (``.NAME.tmp-…``) and never match. A directory that is not complete and valid
    (see ``checkpoint_problem``: damaged by something other than our atomic writes) is skipped with a warning; one
    holding a FIFO, a device or a link out of it where a file goes is refused (``CheckpointError``).
    """
    for path in reversed(complete_checkpoints(ckpt_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warnings.warn(f"{path}: skipped, not a complete checkpoint ({problem})", stacklevel=2)
    return None


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The ``epoch_E_step_S`` directories under ``ckpt_dir`` with their meta.json and weights, oldest first (a
    symlink to one counts; a dangling symlink does not). Weights that are there but no regular file (a link to
    ``/dev/zero``) count too, so that ``find_latest_checkpoint`` refuses them by name rather than pass over the
    newest checkpoint without a word."""
    found = []
    for path in Path(ckpt_dir).glob("epoch_*_step_*"):
        match = CHECKPOINT_NAME.match(path.name)
        weights = os.path.lexists(path / WEIGHTS_FILE) or os.path.lexists(path / ADAPTER_FILE)
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
    ``.pt`` archives' directories are intact and the files as long as they say (no tensor is read).

    A file there that is not a regular file inside the checkpoint (a FIFO, a device, a directory, a link to nothing
    or out of the checkpoint) is no damage a save or a copy leaves: it is refused (``CheckpointError``, naming it),
    never read or skipped; each file is opened as what it is (``regular_files``), so none can block or run on."""
    names = [name for name in (META_FILE, CONFIG_FILE, WEIGHTS_FILE, ADAPTER_FILE) if os.path.lexists(path / name)]
    archives = sorted(path.glob("*.pt"))
    for file in [*(path / name for name in names), *archives]:
        check_regular_file(file, within=path, error=CheckpointError)
    for name in (META_FILE, CONFIG_FILE):
        try:
            if not isinstance(read_json_file(path / name, name, within=path), dict):
                return f"{name} is not a JSON object"
        except UserError as err:
            return str(err)
    weight_names = [name for name in (WEIGHTS_FILE, ADAPTER_FILE) if name in names] or [WEIGHTS_FILE]
    for name in weight_names:
        try:
            with open_regular_file(path / name, within=path, error=CheckpointError) as weights:
                header_size = int.from_bytes(weights.file.read(8), "little")
                if 8 + header_size > weights.size_bytes:  # read() would first allocate what the header claims
                    return f"{name} is truncated"
                if header_size > MAX_JSON_BYTES:
                    return f"{name}: unreadable header (it claims {header_size} bytes)"
                header = json.loads(weights.file.read(header_size))
            end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
            if weights.size_bytes < 8 + header_size + end:
                return f"{name} is truncated"
        except UserError as err:  # gone or replaced since the check above
            return str(err)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            return f"{name}: unreadable header ({err})"
    for file in archives:
        try:
            with open_regular_file(file, within=path, error=CheckpointError) as archive:
                if not zipfile.is_zipfile(archive.file):  # reads the archive's directory at its end, no more
                    return f"{file.name} is truncated or not a torch archive"
        except UserError as err:
            return str(err)
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
