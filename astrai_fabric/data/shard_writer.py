"""Bin shards written while records stream in (``astrai-fabric prepare``), and the staging folder's record of what is
finished, which ``--resume`` continues from.

Each domain has at most one open shard. A kept record goes into its domain's open shard, and the shard is finished
once it holds ``output.max_tokens_per_shard`` record tokens (counted before packing, as before streaming), so the
shards are the same whatever the input size. ``simple`` packing appends each record to the shard's files as it
comes (memory: one write buffer); ``bfd`` and ``bfd_split`` reorder the records of one shard, so an open shard's
records are held (compactly, 9 bytes a token) until it is finished: the packing window is the shard, as it always
was here.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from astrai_fabric.data.pipeline import PipelineConfig
from astrai_fabric.errors import UserError
from astrai_fabric.faults import crash_point

Piece = tuple[np.ndarray, np.ndarray, np.ndarray]
"""``(ids int32, mask uint8, position_ids int32)`` of one record, or of one part of a record (``bfd_split``)."""
DEFAULT_DTYPES = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
WRITE_BUFFER_TOKENS = 1 << 20
"""Tokens gathered before one write per key: few system calls, a few MB of memory."""
STATE_FILE = "prepare_state.json"


def pack(documents: list[tuple[np.ndarray, np.ndarray]], config: PipelineConfig) -> list[Piece]:
    """The pieces of ``(ids, mask)`` records in the packing order; doc_reset positions are per record."""
    pieces = []
    for ids, mask in documents:
        positions = np.arange(len(ids), dtype=np.int32)
        if config.packing_strategy == "bfd_split" and len(ids) > config.max_packed_len:
            step = config.max_packed_len
            starts = range(0, len(ids), step)
            pieces += [(ids[i : i + step], mask[i : i + step], positions[i : i + step]) for i in starts]
        else:
            n = config.max_packed_len if config.packing_strategy == "simple" else len(ids)
            pieces.append((ids[:n], mask[:n], positions[:n]))
    if config.packing_strategy == "simple":
        return pieces
    # Best-fit decreasing: longest first (ties in input order), each into the fullest bin it fits (the first such
    # bin on a tie); bins are then laid end to end. ``rooms`` is kept sorted by (room, bin) so the best bin is one
    # bisection away rather than a scan of every bin.
    bins: list[list[Piece]] = []
    rooms: list[tuple[int, int]] = []
    for piece in sorted(pieces, key=lambda p: -len(p[0])):
        length = len(piece[0])
        at = bisect.bisect_left(rooms, (length, -1))
        if at < len(rooms):
            room, index = rooms.pop(at)
            bins[index].append(piece)
        else:
            room, index = config.max_packed_len, len(bins)
            bins.append([piece])
        if room - length > 0:  # a full bin takes nothing more
            bisect.insort(rooms, (room - length, index))
    return [piece for bin_ in bins for piece in bin_]


class ShardFile:
    """One ``shard_NNNN`` folder: each key's ``.bin`` appended to in order, ``meta.json`` written once it is done."""

    def __init__(self, directory: Path, config: PipelineConfig) -> None:
        self.directory = directory
        self.keys = ["sequence"] + ([] if config.is_text else ["loss_mask"])
        self.keys += [] if config.position_ids_mode == "none" else ["position_ids"]
        self.continuous = config.position_ids_mode == "continuous"
        self.dtypes = {key: np.dtype({**DEFAULT_DTYPES, **config.dtype}[key]) for key in self.keys}
        if directory.exists():  # left by a run killed while writing it (never one a state counts as finished)
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        self.files = {key: open(directory / f"{key}.bin", "wb") for key in self.keys}  # closed in finish()
        crash_point("prepare-shard-open")
        self.length = 0
        self.pending: list[Piece] = []
        self.pending_tokens = 0

    def append(self, pieces: list[Piece]) -> None:
        self.pending += pieces
        self.pending_tokens += sum(len(p[0]) for p in pieces)
        if self.pending_tokens >= WRITE_BUFFER_TOKENS:
            self._write()

    def _write(self) -> None:
        if not self.pending:
            return
        arrays = {"sequence": np.concatenate([p[0] for p in self.pending])}
        arrays["loss_mask"] = np.concatenate([p[1] for p in self.pending])
        n = len(arrays["sequence"])
        if self.continuous:
            arrays["position_ids"] = np.arange(self.length, self.length + n)
        else:
            arrays["position_ids"] = np.concatenate([p[2] for p in self.pending])
        for key in self.keys:
            self.files[key].write(np.ascontiguousarray(arrays[key].astype(self.dtypes[key])).data)
        self.length += n
        self.pending, self.pending_tokens = [], 0

    def finish(self) -> None:
        """Everything on disk (synced), ``meta.json`` last: a shard with a ``meta.json`` is whole."""
        self._write()
        for file in self.files.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()
        crash_point("prepare-shard-data")
        meta = {key: {"shape": [self.length], "dtype": str(self.dtypes[key])} for key in self.keys}
        write_synced(self.directory / "meta.json", json.dumps(meta))


class OpenShard:
    """A domain's shard being filled: ``simple`` pieces go straight to its files, other packings wait for the end."""

    def __init__(self, directory: Path, config: PipelineConfig) -> None:
        self.config = config
        self.file = ShardFile(directory, config)
        self.held: list[tuple[np.ndarray, np.ndarray]] = []
        self.tokens = 0

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.tokens += len(ids)
        if self.config.packing_strategy == "simple":
            self.file.append(pack([(ids, mask)], self.config))
        else:
            self.held.append((ids, mask))

    def finish(self) -> None:
        self.file.append(pack(self.held, self.config))
        self.file.finish()


@dataclass
class Position:
    """Where a record starts in the inputs: its number over all inputs, and its file, byte offset and line."""

    record: int = 0
    file: int = 0
    offset: int = 0
    line: int = 1


@dataclass
class StagingState:
    """What the staging folder holds (``prepare_state.json``), rewritten after every finished shard."""

    identity: dict[str, Any]
    """The inputs (path, size, modification time), the pipeline's and the tokenizer's fingerprints."""
    num_records: int
    """Records in the inputs (all of them, found valid by the pass before anything was written)."""
    finished: dict[str, int] = field(default_factory=dict)
    """Finished shards per domain (``shard_0000`` ... ``shard_{n-1}``)."""
    open: dict[str, Position] = field(default_factory=dict)
    """Per domain with an open shard: its first record. ``--resume`` reads again from the earliest of them."""
    next: Position = field(default_factory=Position)
    """The first record not yet read when the state was written."""
    counts: dict[str, Any] = field(
        default_factory=lambda: {"read": 0, "kept": 0, "tokens": 0, "trained": 0, "dropped": {}}
    )
    shapes: dict[str, str] = field(default_factory=dict)
    """``"INPUT:PART"`` (indexes) -> the record shape the checking pass found for that file, where its records are
    converted (``data/shapes.py``); kept here so that a resumed run converts them the same way, wherever it starts."""
    shapes_read: str = ""
    """The summary's words for the shapes read (``Shaper.describe``); empty when records were read as they are."""

    def save(self, staging: Path) -> None:
        write_synced(staging / STATE_FILE, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, staging: Path) -> StagingState | None:
        """The state in ``staging``, or None when there is none (a run killed before its first state)."""
        path = staging / STATE_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            state = cls(**raw)
            state.open = {domain: Position(**p) for domain, p in state.open.items()}
            state.next = Position(**raw.get("next", {}))
            return state
        except FileNotFoundError:
            return None
        except (TypeError, AttributeError, ValueError, RecursionError) as err:  # ValueError: JSON and UTF-8
            # Written whole or not at all (write_synced), so this is not a crash's doing: say so, do not guess.
            raise UserError(f"{path}: not a prepare state ({err}); delete {staging} to start again") from None


def write_synced(path: Path, text: str) -> None:
    """``text`` at ``path`` whole or not at all: written beside it, synced, renamed over it."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    crash_point("prepare-synced")
    os.replace(partial, path)


class ShardWriter:
    """Every domain's shards under ``root``; ``add`` says whether the record finished a shard."""

    def __init__(self, root: Path, config: PipelineConfig, finished: dict[str, int]) -> None:
        self.root = root
        self.config = config
        self.finished = dict(finished)
        self.open: dict[str, OpenShard] = {}

    def add(self, domain: str, ids: np.ndarray, mask: np.ndarray) -> bool:
        shard = self.open.get(domain)
        if shard is None:
            directory = self.root / domain / f"shard_{self.finished.get(domain, 0):04d}"
            shard = self.open[domain] = OpenShard(directory, self.config)
        shard.add(ids, mask)
        if shard.tokens < self.config.max_tokens_per_shard:
            return False
        self._finish(domain)
        return True

    def finish_all(self) -> None:
        for domain in list(self.open):
            self._finish(domain)

    def _finish(self, domain: str) -> None:
        self.open.pop(domain).finish()
        self.finished[domain] = self.finished.get(domain, 0) + 1
