"""``metric.jsonl`` read back: what makes one of its lines a metric entry. Light (no torch): ``astrai-fabric plot``
reads a run's history (and refuses a line that is not one), and a resumed run carries its checkpoint's history on
(``metrics.MetricLog.resumed``, which drops such a line with a warning), so both hold a line to the same checks.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterator
from pathlib import Path

from astrai_fabric.errors import UserError
from astrai_fabric.regular_files import open_regular_file

MAX_STEP = 2**63 - 1
"""The largest optimizer step an entry can name (the step counters are int64)."""
MAX_TYPE_CHARS = 64
"""An entry's ``type`` is a short name (``step``, ``validation``, ``epoch``, ``parameters``)."""
MAX_LINE_BYTES = 1 << 20
"""One entry is a few hundred bytes (its metrics by name); a longer line is not one we wrote, and is not read whole."""


def metric_entry_problem(entry: object) -> str | None:
    """Why ``entry``, one parsed line of ``metric.jsonl``, is not a metric entry, or None: an object whose ``type``
    is a short name and whose ``step`` an integer in [0, 2^63). What else it holds is checked where it is used (plot
    draws only the values that are finite numbers)."""
    if not isinstance(entry, dict):
        return f"not a JSON object, got {type(entry).__name__}"
    kind, step = entry.get("type"), entry.get("step")
    if not (isinstance(kind, str) and 0 < len(kind) <= MAX_TYPE_CHARS and kind.isprintable()):
        return f"type {reprlib.repr(kind)}, expected a name such as 'step'"
    if not (type(step) is int and 0 <= step <= MAX_STEP):
        return f"step {reprlib.repr(step)}, expected an integer in [0, 2^63)"
    return None


def metric_lines(path: Path, within: Path | None = None) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of the ``metric.jsonl`` at ``path``, opened as a regular file
    (``within`` the directory it was found in by a scan), no line read past ``MAX_LINE_BYTES``: a longer one is an
    error naming ``path:line``. Bytes that are not UTF-8 are replaced (the entry's checks then refuse the line)."""
    with open_regular_file(path, within=within, expected="a metric history") as opened:
        line_no = 0
        while raw := opened.file.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise UserError(f"{path}:{line_no}: a line longer than {MAX_LINE_BYTES:,} bytes, not a metric entry")
            if line := raw.decode("utf-8", errors="replace").strip():
                yield line_no, line
