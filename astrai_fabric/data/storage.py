"""Reading training data from disk: AstrAI's bin shards and JSONL files (spec §4.3-4.4).

Bin layout: ``ROOT/**/meta.json`` next to ``<key>.bin`` files; ``meta.json`` maps each key to
``{"shape": [n], "dtype": "int32", ...}`` and each key is one flat array. Shards are read in sorted path order
(AstrAI follows the filesystem's unsorted ``glob`` order, B23), so the token stream is the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from astrai_fabric.errors import UserError

Record = tuple[str, dict[str, Any]]
"""A JSONL record with where it came from (``"file.jsonl:line"``), for error messages."""


def detect_format(path: Path) -> str:
    """``"bin"`` for a directory of bin shards, ``"jsonl"`` for a JSONL file or a directory holding some."""
    if not path.exists():
        raise UserError(f"data_root_path {path}: not found")
    if path.is_file():
        if path.suffix.lower() == ".jsonl":
            return "jsonl"
        raise UserError(f"data_root_path {path}: expected a .jsonl file or a directory, got a {path.suffix} file")
    if any(path.rglob("*.bin")) and any(path.rglob("meta.json")):
        return "bin"
    if any(path.rglob("*.jsonl")):
        return "jsonl"
    raise UserError(f"data_root_path {path}: no bin shards (meta.json + *.bin) or .jsonl files found")


def read_bin_shards(root: Path) -> dict[str, list[np.ndarray]]:
    """Every key's per-shard arrays (memory-mapped, read-only), shards in sorted order."""
    streams: dict[str, list[np.ndarray]] = {}
    for meta_path in sorted(root.rglob("meta.json")):
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise UserError(f"{meta_path}: not valid JSON ({err})") from None
        for key, info in meta.items():
            file = meta_path.parent / f"{key}.bin"
            try:
                dtype, shape = np.dtype(info["dtype"]), tuple(info["shape"])
            except (KeyError, TypeError) as err:
                raise UserError(f"{meta_path}: entry {key!r} needs 'shape' and 'dtype' ({err})") from None
            expected = int(np.prod(shape)) * dtype.itemsize
            if not file.is_file() or file.stat().st_size != expected:
                found = file.stat().st_size if file.is_file() else "no file"
                raise UserError(f"{file}: expected {expected} bytes for shape {list(shape)} {dtype}, found {found}")
            streams.setdefault(key, []).append(np.memmap(file, dtype=dtype, mode="r", shape=shape))
    if not streams:
        raise UserError(f"data_root_path {root}: no bin shard holds any key")
    return streams


def read_jsonl(path: Path, what: str = "data_root_path") -> list[Record]:
    """Records of a JSONL file, or of the sorted top-level ``*.jsonl`` files of a directory; ``what`` names the
    path in error messages."""
    files = [path] if path.is_file() else sorted(path.glob("*.jsonl"))
    if not files:
        raise UserError(f"{what} {path}: no .jsonl files directly inside")
    records = []
    for file in files:
        with open(file, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise UserError(f"{file}:{line_no}: not UTF-8 text ({err.reason} at byte {err.start})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{file}:{line_no}: not valid JSON ({err})") from None
                if not isinstance(record, dict):
                    raise UserError(f"{file}:{line_no}: expected a JSON object, got {type(record).__name__}")
                records.append((f"{file}:{line_no}", record))
    if not records:
        raise UserError(f"{what} {path}: the dataset is empty (no records)")
    return records
