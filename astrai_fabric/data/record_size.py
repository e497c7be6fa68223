"""One record's size, bounded: every reader of records (JSONL, and the parquet, arrow, CSV, JSON, ``save_to_disk`` and
Hub sources of ``data/sources.py``) refuses a record larger than ``MAX_RECORD_BYTES`` in one line naming it
(``FILE:LINE``, ``FILE row N``), before it is held whole as Python values and long before it is tokenised: the
tokenizer takes about 170 bytes of memory per byte of one text, so a 200 MB record ended the process (the Rust
allocator aborts, with no message).

A record is one JSONL line, or one row of a table (its cells together). How each kind is bounded, so that the memory
one record takes while it is read is a small multiple of the limit (``tests/test_data_sources.py`` measures it):

- JSONL, and a ``.json`` file of JSON lines: lines are read with a limit; a longer one is refused after the limit's
  bytes are read (about 2x the limit held; a line within it is held about 3x: its bytes, its text, its values).
- CSV larger than the limit: its rows measured as written, a chunk at a time, before ``datasets`` (pandas) reads
  it; a row longer than twice the limit (quoting at most doubles a text) is refused after that many bytes, none held.
- arrow larger than the limit: its record batches memory-mapped and measured from their offsets (no text is read).
- parquet: its footer first (a row group whose rows average more than the limit holds one larger: refused unread),
  then rows in batches (``sources.BATCH_ROWS``, pyarrow's reader), never a whole row group at once; a page holding a
  larger value is decoded (pages are about 1 MiB as writers write them; a hostile one-value page costs its size) and
  the row is refused before it becomes Python values.
- every batch of rows from ``datasets`` (and of a ``save_to_disk`` table, memory-mapped) is measured in arrow before
  it becomes Python values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from astrai_fabric.errors import UserError

MAX_RECORD_BYTES = 16 << 20
"""The most one record may hold: 16 MiB of text, about 4 million tokens (a long book is 1-5 MB); the tokenizer
needs about 3 GB for one text of this size. docs/data.md states it; tests lower it."""


def limit_words() -> str:
    """The limit as a message says it."""
    return f"{_amount(MAX_RECORD_BYTES)} (the limit for one record, docs/data.md)"


def lines(handle: IO[bytes], label: str, first_line: int = 1) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line from ``handle``'s position, none read past the limit: a longer line is
    refused as ``LABEL:LINE``, its first ``MAX_RECORD_BYTES + 1`` bytes read and no more."""
    limit = MAX_RECORD_BYTES
    line_no = first_line
    while raw := handle.readline(limit + 1):
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise UserError(f"{label}:{line_no}: a line longer than {limit_words()}; split it into smaller records")
        yield line_no, raw
        line_no += 1


def check_table(table: Any, label: str, first_row: int) -> None:
    """Refuse the first row of ``table`` (a pyarrow Table or RecordBatch, its rows ``FIRST_ROW``... of ``LABEL``)
    whose cells hold more than the limit together, measured from the arrow buffers (no Python value made)."""
    if not table.num_rows:
        return
    sizes = np.zeros(table.num_rows, np.int64)
    for column in table.columns:
        sizes += row_bytes(column)
    over = np.flatnonzero(sizes > MAX_RECORD_BYTES)
    if over.size:
        row = int(over[0])
        raise UserError(
            f"{_row(label, first_row + row)}: a record of {int(sizes[row]):,} bytes, more than {limit_words()}; "
            "split it into smaller records"
        )


def _row(label: str, row: int) -> str:
    """``LABEL row N``; a CSV file's header is the row before row 0."""
    return f"{label} row {row}" if row >= 0 else f"{label}'s header row"


def checked_rows(tables: Iterable[Any], label: str, first_row: int) -> Iterator[dict[str, list]]:
    """Each arrow table of ``tables`` (rows ``FIRST_ROW``... of ``LABEL``) checked (``check_table``), then as Python
    columns ``{name: values}``."""
    row = first_row
    for table in tables:
        check_table(table, label, row)
        row += table.num_rows
        yield table.to_pydict()


def row_bytes(array: Any) -> np.ndarray:
    """Each row's bytes in a pyarrow (chunked) array: text and binary by their lengths, lists and structs as the
    sum of what they hold, a dictionary's entries by the value each points to, anything else by its width (8 where
    it has none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.ChunkedArray):
        parts = [row_bytes(chunk) for chunk in array.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    kind = array.type
    if pa.types.is_dictionary(kind):
        entries = row_bytes(array.dictionary)
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return entries[indices] if entries.size else np.zeros(len(array), np.int64)
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_string_view(kind)
        or pa.types.is_binary_view(kind)
    ):
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        inner = row_bytes(array.flatten())
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
    if pa.types.is_map(kind):
        inner = row_bytes(array.keys) + row_bytes(array.items)
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
    if pa.types.is_struct(kind):
        sizes = np.zeros(len(array), np.int64)
        for field in array.flatten():
            sizes += row_bytes(field)
        return sizes
    try:
        width = max(kind.bit_width // 8, 1)
    except ValueError:  # no fixed width (a union, an extension type): counted as a number would be
        width = 8
    return np.full(len(array), width, np.int64)


def check_file(file: Path, kind: str, label: str) -> None:
    """Before ``datasets`` reads ``file`` (a ``kind`` source file, named ``LABEL``): the bounded look its kind allows
    (module docstring), refusing a record larger than the limit in one line. A file no larger than the limit holds
    none, and is not looked at."""
    if kind == "parquet":  # the footer is read whatever the size: it is the only look that decodes nothing
        _check_parquet_footer(file, label)
        return
    if file.stat().st_size <= MAX_RECORD_BYTES:
        return
    if kind == "csv":
        _scan_csv(file, label)
    elif kind == "arrow":
        _scan_arrow(file, label)
    elif kind == "json":
        _scan_json_lines(file, label)


def _check_parquet_footer(file: Path, label: str) -> None:
    """A row group whose columns hold more than the limit per row on average (their uncompressed bytes, from the
    footer) has a row larger than the limit: refused without decoding a page."""
    import pyarrow.parquet

    metadata = pyarrow.parquet.ParquetFile(file).metadata
    first = 0
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        rows = group.num_rows
        if rows and group.total_byte_size > MAX_RECORD_BYTES * rows:
            where = f"row {first}" if rows == 1 else f"rows {first}-{first + rows - 1} (row group {index})"
            per_row = _amount(group.total_byte_size // rows)
            raise UserError(
                f"{label} {where}: {per_row} per record, more than {limit_words()}; split it into smaller records"
            )
        first += rows


def _scan_csv(file: Path, label: str) -> None:
    """``file``'s rows measured as written, a chunk of ``SCAN_BYTES`` at a time, none held: a row ends at a line
    break outside quotes (a quote toggles quoting; a doubled one, an escaped quote, toggles it twice). A row longer
    than twice the limit (quoting at most doubles a text) is refused as soon as that many bytes of it are read; one
    within it is read by ``datasets`` and measured there."""
    limit = 2 * MAX_RECORD_BYTES
    row, row_start, offset, quoted = -1, 0, 0, 0  # row: the row being read (the header is the one before row 0)
    with file.open("rb") as handle:
        while chunk := handle.read(SCAN_BYTES):
            data = np.frombuffer(chunk, np.uint8)
            inside = np.bitwise_xor.accumulate((data == ord('"')).view(np.uint8)) ^ quoted  # 1: within quotes
            ends = offset + np.flatnonzero(((data == ord("\n")) | (data == ord("\r"))) & (inside == 0))
            starts = np.concatenate(([row_start], ends[:-1] + 1))
            lengths = ends - starts
            rows = row + np.cumsum(lengths > 0) - (lengths > 0)  # each row's number (blank lines are no rows)
            over = np.flatnonzero(lengths > limit)
            if over.size:
                _refuse_written_row(label, int(rows[over[0]]), limit)
            if ends.size:
                row, row_start = int(rows[-1]) + int(lengths[-1] > 0), int(ends[-1]) + 1
            offset += len(chunk)
            quoted = int(inside[-1])
            if offset - row_start > limit:  # the row being read is too long already: read no more of it
                _refuse_written_row(label, row, limit)


SCAN_BYTES = 256 << 10
"""What ``_scan_csv`` reads at a time (it holds about 8 times this while it measures it)."""


def _refuse_written_row(label: str, row: int, limit: int) -> None:
    raise UserError(
        f"{_row(label, row)}: a row longer than {_amount(limit)} as written, more than {limit_words()}; split it "
        "into smaller records"
    )


def _scan_arrow(file: Path, label: str) -> None:
    """``file``'s record batches memory-mapped (an arrow stream, or an arrow file), each measured from its offsets:
    no text is read. A file pyarrow cannot open is left to ``datasets``, which says why."""
    import pyarrow as pa

    with pa.memory_map(str(file)) as mapped:
        try:
            try:
                batches: Iterable[Any] = pa.ipc.open_stream(mapped)
            except pa.ArrowInvalid:
                mapped.seek(0)
                reader = pa.ipc.open_file(mapped)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            row = 0
            for batch in batches:
                check_table(batch, label, row)
                row += batch.num_rows
        except (pa.ArrowInvalid, OSError):
            return


def _scan_json_lines(file: Path, label: str) -> None:
    """A ``.json`` file of JSON lines, each line bounded as JSONL's are. One holding a JSON array (its first byte
    ``[``) is one document, which ``datasets`` reads whole; its rows are measured after."""
    with file.open("rb") as handle:
        start = handle.read(64).lstrip(b"\xef\xbb\xbf \t\r\n")
        if start.startswith(b"["):
            return
        handle.seek(0)
        for _ in lines(handle, label):
            pass


def _amount(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) or value >= 10 else f"{value:.1f} {unit}"
    return f"{size} bytes"
