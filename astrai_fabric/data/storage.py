"""Reading training data from disk: AstrAI's bin shards and JSONL files (AstrAI's ``astrai/dataset/storage.py``), and
which kind of source a path is (the others, read through ``datasets``, are ``data/sources.py``'s).

Bin layout: ``ROOT/**/meta.json`` next to ``<key>.bin`` files; ``meta.json`` maps each key to
``{"shape": [n], "dtype": "int32", ...}`` and each key is one flat array. Shards are read in sorted path order
(AstrAI follows the filesystem's unsorted ``glob`` order, B23), so the token stream is the same on every machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from astrai_fabric.data import record_size
from astrai_fabric.data.sources import open_source, source_kind
from astrai_fabric.errors import UserError
from astrai_fabric.hub import looks_like_hub_id
from astrai_fabric.json_files import parse_json, read_json_file
from astrai_fabric.regular_files import open_regular_file

Record = tuple[str, dict[str, Any]]
"""A record with where it came from (``"file.jsonl:line"``, ``"file.parquet row N"``), for error messages."""

FORMATS = ("bin", "jsonl", "parquet", "arrow", "csv", "json", "saved", "hub")
"""What ``detect_format`` tells apart: bin shards, JSONL (both read here) and the sources ``data/sources.py`` reads
through ``datasets`` (``saved``: a ``save_to_disk`` directory; ``hub``: a Hub dataset id)."""


def detect_format(path: Path, what: str = "data_root_path") -> str:
    """One of ``FORMATS`` for ``path``: ``"bin"`` for a directory of bin shards, ``"jsonl"`` for a JSONL file or a
    directory holding some, ``"hub"`` for a Hub dataset id that is no local path, else the ``datasets`` kind of the
    file or directory (one kind: a directory mixing them is an error); ``what`` names ``path`` in messages."""
    if not path.exists():
        if looks_like_hub_id(str(path)):
            return "hub"
        raise UserError(f"{what} {path}: not found")
    if not path.is_dir():  # a FIFO, a device or a socket is refused by name, not searched as a folder
        with open_regular_file(path, name=f"{what} {path}", expected="records or a folder of them"):
            pass
    if path.is_file():
        if path.suffix.lower() == ".jsonl":
            return "jsonl"
        kind = source_kind(path, what)
        if kind is None:
            raise UserError(
                f"{what} {path}: expected a .jsonl file or a directory (or a .parquet, .arrow, .csv or .json "
                f"file), got a {path.suffix} file"
            )
        return kind
    if any(path.rglob("*.bin")) and any(path.rglob("meta.json")):
        return "bin"
    kind = source_kind(path, what)
    if kind is None:
        raise UserError(
            f"{what} {path}: no bin shards (meta.json + *.bin) or .jsonl files found (nor parquet, arrow, "
            "CSV or JSON files)"
        )
    return kind


def read_records(
    path: Path,
    what: str = "data_root_path",
    subset: str | None = None,
    split: str | None = None,
    schema_check: Callable[[str, dict[str, tuple[str, str]]], None] | None = None,
) -> list[Record]:
    """Every record of the JSONL or ``datasets`` source at ``path`` (``read_jsonl``, ``data/sources.py``), with
    ``subset`` and ``split`` (``--data_subset``, ``--data_split``) chosen in a ``datasets`` source, whose files'
    schemas go to ``schema_check`` (``shapes.Shaper.check_schema``) before a row is read."""
    kind = detect_format(path, what)
    if kind in ("bin", "jsonl"):
        for flag, value in (("--data_subset", subset), ("--data_split", split)):
            if value is not None:
                shown = "bin shards" if kind == "bin" else "JSONL"
                raise UserError(f"{flag} {value!r}: {what} {path} is {shown}, which has no subsets or splits")
        if kind == "bin":
            raise UserError(f"{what} {path}: holds bin shards, not records")
        return read_jsonl(path, what)
    source = open_source(path, kind, what, subset, split)
    if schema_check is not None:
        source.check_schemas(schema_check)
    records = [(where, record) for _, _, where, record in source.records()]
    if not records:
        raise UserError(f"{what} {path}: split {source.split!r} is empty (no records)")
    return records


ID_KEYS = ("sequence", "position_ids")
"""Keys holding ids: integer dtypes only. Other keys (masks) may be bool, integer or float; nothing else is ever
mapped (an ``object`` array would be raw bytes read as Python pointers)."""


def read_bin_shards(root: Path) -> dict[str, list[np.ndarray]]:
    """Every key's per-shard arrays (memory-mapped, read-only), shards in sorted order; each ``meta.json`` entry is
    checked (a 1-D shape, a bool or integer dtype, the file exactly that size) before its file is mapped."""
    streams: dict[str, list[np.ndarray]] = {}
    for meta_path in sorted(root.rglob("meta.json")):
        meta = read_json_file(meta_path, "shard metadata {key: {shape, dtype}}")
        if not isinstance(meta, dict):
            raise UserError(f"{meta_path}: expected a JSON object {{key: {{shape, dtype}}}}, got {type(meta).__name__}")
        for key, info in meta.items():
            file = meta_path.parent / f"{key}.bin"
            dtype, shape = _shard_layout(meta_path, key, info)
            expected = shape[0] * dtype.itemsize
            if not file.is_file() or file.stat().st_size != expected:
                found = file.stat().st_size if file.is_file() else "no file"
                raise UserError(f"{file}: expected {expected} bytes for shape {list(shape)} {dtype}, found {found}")
            streams.setdefault(key, []).append(np.memmap(file, dtype=dtype, mode="r", shape=shape))
    if not streams:
        raise UserError(f"data_root_path {root}: no bin shard holds any key")
    return streams


def _shard_layout(meta_path: Path, key: str, info: Any) -> tuple[np.dtype, tuple[int]]:
    """The dtype and 1-D shape a ``meta.json`` entry gives its key, checked."""
    where = f"{meta_path}: entry {key!r}"
    if not isinstance(key, str) or not key or "/" in key or key.startswith("."):
        raise UserError(f"{meta_path}: {key!r} is not a shard key (a plain file name stem)")
    if not isinstance(info, dict) or "shape" not in info or "dtype" not in info:
        raise UserError(f"{where} needs 'shape' and 'dtype', got {info!r}")
    shape = info["shape"]
    if not (
        isinstance(shape, list)
        and len(shape) == 1
        and isinstance(shape[0], int)
        and not isinstance(shape[0], bool)
        and shape[0] >= 0
    ):
        raise UserError(f"{where}: 'shape' must be [length], one non-negative integer, got {shape!r}")
    kinds = "iu" if key in ID_KEYS else "biuf"
    try:
        dtype = np.dtype(info["dtype"]) if isinstance(info["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None or dtype.shape:
        allowed = "an integer dtype (int32, uint16, ...)" if key in ID_KEYS else "a bool, integer or float dtype"
        raise UserError(f"{where}: 'dtype' must be {allowed}, got {info['dtype']!r}")
    return dtype, (shape[0],)


def read_jsonl(path: Path, what: str = "data_root_path") -> list[Record]:
    """Records of a JSONL file, or of the sorted top-level ``*.jsonl`` files of a directory; ``what`` names the
    path in error messages."""
    files = [path] if path.is_file() else sorted(path.glob("*.jsonl"))
    if not files:
        raise UserError(f"{what} {path}: no .jsonl files directly inside")
    records = [
        (f"{file}:{line_no}", parse_record(line, f"{file}:{line_no}"))
        for file in files
        for line_no, _, _, line in jsonl_lines(file)
    ]
    if not records:
        raise UserError(f"{what} {path}: the dataset is empty (no records)")
    return records


def jsonl_lines(file: Path, offset: int = 0, first_line: int = 1) -> Iterator[tuple[int, int, int, str]]:
    """``(line number, start byte, end byte, text)`` of each non-blank line of ``file``, from byte ``offset`` (line
    ``first_line``); a line that is not UTF-8, or longer than one record may be (``record_size``, read no further),
    is an error that names it."""
    with open_regular_file(file, expected="JSONL records") as opened:
        f = opened.file
        f.seek(offset)
        for line_no, raw in record_size.lines(f, str(file), first_line):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{file}:{line_no}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if line.strip():
                yield line_no, offset, offset + len(raw), line
            offset += len(raw)


def parse_record(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as its record (a JSON object); ``where`` (``"file:line"``) names it in the error."""
    record = parse_json(line, where)
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record
