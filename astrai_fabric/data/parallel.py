"""Records tokenised by ``--num_proc`` worker processes for ``astrai-fabric prepare``, the results in input order (so
the shards are the same bytes for any number of processes).

A process pool's executor rather than ``multiprocessing.Pool.imap``: a worker that dies (killed, out of memory) breaks
the executor, which raises ``BrokenProcessPool`` in the main process, where ``imap`` would wait for the lost result
forever. Workers are forked: they start with the tokenizer already loaded and skip re-importing torch (which
``astrai_fabric.data`` pulls in: seconds per process). A tokenizer forked after its thread pool ran only turns that
pool off in the worker, which encodes one record at a time anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import numpy as np

from astrai_fabric.data.pipeline import PipelineConfig, tokenize_record
from astrai_fabric.data.shapes import SHAPES, Shaper
from astrai_fabric.data.storage import parse_record
from astrai_fabric.faults import crash_point
from astrai_fabric.tokenizer import Tokenizer

Tokenised = tuple[str, np.ndarray, np.ndarray] | str
"""A record's ``(domain, ids int32, mask uint8)``, or the reason it is dropped."""
Chunk = list[tuple[str, str | dict[str, Any], str | None]]
"""Records as ``(where, JSONL line, shape)``, parsed in the worker, or ``(where, record, shape)`` from a ``datasets``
source; ``shape``: the record shape (``data/shapes.py``) the checking pass found for the record's source, converted
here, or None (read as it is)."""


class _Tokeniser:
    """A chunk of records to their ``Tokenised`` results, in order."""

    def __init__(self, config: PipelineConfig, tokenizer: Tokenizer, data_columns: str | None = None) -> None:
        self.config, self.tokenizer, self.data_columns = config, tokenizer, data_columns
        self.shapers: dict[str, Shaper] = {}
        """One per shape, forced to it: a record is converted by its source's shape alone, wherever a chunk starts."""

    def __call__(self, chunk: Chunk) -> list[Tokenised]:
        results: list[Tokenised] = []
        for where, item, shape in chunk:
            record = parse_record(item, where) if isinstance(item, str) else item
            if shape is not None:
                if shape not in self.shapers:
                    self.shapers[shape] = Shaper(SHAPES[shape].train_type, shape, self.data_columns, keep_unshaped=True)
                record = self.shapers[shape](where, record)
            document = tokenize_record(record, self.config, self.tokenizer, where)
            if isinstance(document, str):
                results.append(document)
            else:  # compact for the trip back and the shard's buffer (ids fit int32: vocabularies are < 2**31)
                ids, mask = np.asarray(document.ids, np.int32), np.asarray(document.mask, np.uint8)
                results.append((document.domain, ids, mask))
        return results


_worker: _Tokeniser | None = None
"""The tokenising worker process's tokeniser, made once when the process starts."""


def _start_worker(config: PipelineConfig, tokenizer: Tokenizer, data_columns: str | None) -> None:
    global _worker
    _worker = _Tokeniser(config, tokenizer, data_columns)
    try:  # Linux: a worker dies with the main process, never left waiting for chunks that will not come
        import ctypes  # here: only worker processes need it

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _tokenise_in_worker(chunk: Chunk) -> list[Tokenised]:
    crash_point("prepare-worker")  # tests: ASTRAI_FABRIC_CRASH_AT=prepare-worker@N, the N-th chunk of each worker
    assert _worker is not None
    return _worker(chunk)


def tokenise_chunks(
    chunks: Iterator[Chunk],
    config: PipelineConfig,
    tokenizer: Tokenizer,
    num_proc: int,
    data_columns: str | None = None,
) -> Iterator[list[Tokenised]]:
    """Each chunk's results in input order, from ``num_proc`` processes (this one when 1), at most two chunks per
    process in flight (memory stays bounded however long ``chunks`` is); ``data_columns`` as ``--data_columns``."""
    if num_proc == 1:
        yield from map(_Tokeniser(config, tokenizer, data_columns), chunks)
        return
    pool = ProcessPoolExecutor(
        num_proc, get_context("fork"), initializer=_start_worker, initargs=(config, tokenizer, data_columns)
    )
    try:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(_tokenise_in_worker, chunk))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
