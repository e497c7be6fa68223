"""JSON that comes from outside the process: the one place that turns every way it can be malformed into one line.

The JSON files the package reads (``config.json``, ``meta.json``, ``tokenizer_config.json``, a sharded checkpoint's
index, shard metadata, ``dataset_config.json``, a prepare pipeline) and JSONL records go through ``parse_json``.
Python's parser fails in three ways: a ``ValueError`` (a syntax error, bytes that are not UTF-8, an integer of
more than 4300 digits), a ``RecursionError`` for nesting deeper than the interpreter's limit (``[[[[...``), and
memory for a file too large to hold. Each is a bad file, not a bug, so each becomes the caller's ``UserError``
subclass naming the file. Readers where a bad file has a meaning of its own (the ckpt_dir lock record and
manifest, prepare's staging state, a metric history line) catch the same two exceptions themselves. ``NaN`` and
``Infinity`` stay accepted: Python's own ``json.dumps`` writes them, and a ``meta.json`` AstrAI saved after a
diverged step may hold one. A file is read through ``regular_files`` (a FIFO, a device or a dangling link is
refused by name, its size known before a byte is read).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astrai_fabric.errors import UserError
from astrai_fabric.regular_files import read_regular_file

MAX_JSON_BYTES = 64 << 20
"""Metadata files are kilobytes (a large model's sharded index is about 100 KB); a file past this is not one."""


def parse_json(text: str | bytes, source: str, error: type[UserError] = UserError) -> Any:
    """The value ``text`` holds; any malformation is an ``error`` naming ``source`` (a path, ``path:line``)."""
    try:
        return json.loads(text)
    except ValueError as err:  # a syntax error, bytes that are not UTF-8, an integer of more than 4300 digits
        raise error(f"{source}: not valid JSON ({err})") from None
    except RecursionError:
        raise error(f"{source}: not valid JSON (nested too deeply)") from None


def read_json_file(
    path: Path, what: str, error: type[UserError] = UserError, within: Path | Sequence[Path] | None = None
) -> Any:
    """The value in the JSON file ``path``; missing, not a regular file, unreadable, oversized or malformed is an
    ``error`` naming it and ``what`` the file should hold. ``within``: the directory of our own it was found in by
    a scan, which it must resolve inside (``regular_files``)."""
    data = read_regular_file(path, max_bytes=MAX_JSON_BYTES, what=what, within=within, error=error)
    return parse_json(data, str(path), error)


def read_json_object(
    path: Path, what: str, error: type[UserError] = UserError, within: Path | Sequence[Path] | None = None
) -> dict[str, Any]:
    """``read_json_file`` for a file that must hold one JSON object."""
    value = read_json_file(path, what, error, within)
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
