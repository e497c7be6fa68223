"""``astrai-fabric prepare``: JSONL records to AstrAI's offline bin shards for seq and sft (AstrAI's
``astrai/preprocessing``), streamed: memory stays bounded whatever the size of the input.

    astrai-fabric prepare INPUT.jsonl... -o DIR -c pipeline.json [--tokenizer_path DIR] [--num_proc N] [--resume]

The pipeline file is AstrAI's ``PipelineConfig`` (``data/pipeline.py``). The output is
``DIR/<domain>/shard_NNNN/{meta.json, <key>.bin}``: flat arrays with AstrAI's ``meta.json`` (``{key: {"shape",
"dtype"}}``), which AstrAI's ``MmapStore`` and this package's datasets read.

A run is two passes over the inputs. The first checks every line (UTF-8, JSON, an object) before anything is written.
The second reads, tokenises (``--num_proc`` processes, results taken in input order so the shards are the same
bytes for any N), packs and writes shard by shard (``data/shard_writer.py``) into a hidden staging sibling of the
output, which records after every finished shard what is done; the output appears, by one rename, only when all is.
A run that is killed leaves the staging folder, and the same command with ``--resume`` continues it.

Departures from AstrAI's pipeline: every record keeps a loss mask of its own length, so masks stay aligned in any
mix of masked and unmasked records (AstrAI pads or shortens them, B9); ``loss_mask`` defaults to bool (AstrAI:
int32); text documents end with the EOS token unless ``preprocessing.append_eos`` is false (AstrAI adds none);
``input.sources`` (dpo/grpo) is refused: those train from JSONL directly (AstrAI's bin output for them holds no
record offsets and is not trainable either, and truncates float rewards to int32, B16).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from astrai_fabric.data.parallel import tokenise_chunks
from astrai_fabric.data.pipeline import (  # re-exported: data/dataset_config.py and callers import them from here
    ACTIONS,
    GROUPS,
    Document,
    PipelineConfig,
    Section,
    check_keys,
    parse_sections,
    tokenize_record,
)
from astrai_fabric.data.shard_writer import Position, ShardWriter, StagingState
from astrai_fabric.data.sources import Source, open_source
from astrai_fabric.data.storage import detect_format, jsonl_lines, parse_record
from astrai_fabric.errors import TrainingError, UserError
from astrai_fabric.faults import crash_point
from astrai_fabric.tokenizer import Tokenizer

__all__ = ["ACTIONS", "GROUPS", "Document", "PipelineConfig", "Section", "check_keys", "parse_sections", "prepare",
           "tokenize_record"]  # fmt: skip

CHUNK_BYTES = 256 << 10
"""Input text sent to a tokenising worker at a time: about a tenth of a second of work, little to pickle."""
SHARDS = "shards"
"""The staging folder's subfolder that becomes the output."""


def staging_path(output: Path) -> Path:
    """The hidden sibling a prepare of ``output`` writes into, the same for every run (so ``--resume`` finds it)."""
    return output.parent / f".{output.name}.prepare-partial"


@dataclass
class Input:
    """One input of a prepare: a JSONL file (read line by line, as always) or a ``datasets`` source (``source``,
    streamed in batches of rows; a record's position is its part and row, where a JSONL line's is its byte offset
    and line)."""

    path: Path
    source: Source | None = None

    def identity(self) -> dict[str, Any]:
        """The input as it is on disk (``--resume`` continues only a prepare of the same)."""
        files = [self.path] if self.source is None else self.source.files()
        stats = [{"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]
        if self.source is None:
            return stats[0]
        return {"path": str(self.path), "subset": self.source.subset, "split": self.source.split, "files": stats}

    def size(self) -> int:
        return sum(p.stat().st_size for p in ([self.path] if self.source is None else self.source.files()))


def open_inputs(paths: list[Path], subset: str | None = None, split: str | None = None) -> list[Input]:
    """Each path as inputs: a JSONL file; a directory of JSONL files (its sorted top-level ``*.jsonl``, as training
    reads it); or a ``datasets`` source (a file, a directory, a ``save_to_disk`` directory, a Hub dataset id) with
    ``subset`` and ``split`` (``--data_subset``, ``--data_split``) chosen in it."""
    inputs: list[Input] = []
    for path in paths:
        kind = detect_format(path, "input")
        if kind == "bin":
            raise UserError(f"input {path}: holds bin shards, already prepared; inputs are records")
        if kind != "jsonl":
            inputs.append(Input(path, open_source(path, kind, "input", subset, split)))
            continue
        for flag, value in (("--data_subset", subset), ("--data_split", split)):
            if value is not None:
                raise UserError(f"{flag} {value!r}: input {path} is JSONL, which has no subsets or splits")
        files = [path] if path.is_file() else sorted(path.glob("*.jsonl"))
        if not files:
            raise UserError(f"input {path}: no .jsonl files directly inside")
        inputs += [Input(file) for file in files]
    return inputs


def prepare(
    inputs: list[Path],
    output: Path,
    config: PipelineConfig,
    tokenizer: Tokenizer,
    num_proc: int = 1,
    resume: bool = False,
    subset: str | None = None,
    split: str | None = None,
) -> str:
    """Write the shards of ``inputs`` (``open_inputs``) under ``output`` (nothing appears there until all are
    written) with ``num_proc`` tokenising processes; ``resume`` continues the killed run of the same command.
    Returns a summary of what was read, kept and dropped."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"-o {output}: exists and is not empty; choose a new directory")
    for path in inputs:
        if not path.exists() and path.suffix.lower() == ".jsonl":
            raise UserError(f"{path}: input file not found")
        if output.resolve() in (path.resolve(), *path.resolve().parents) and output.exists():
            raise UserError(f"-o {output}: holds the input {path}; choose a new directory")
    if not isinstance(num_proc, int) or num_proc < 1:
        raise UserError(f"--num_proc must be an integer >= 1, got {num_proc!r}")
    inputs = open_inputs(inputs, subset, split)
    staging = staging_path(output)
    identity = _identity(inputs, config, tokenizer)
    state = None
    if staging.exists():
        if not resume:
            raise UserError(
                f"-o {output}: an unfinished prepare of it is in {staging}; add --resume to continue it, or delete "
                "that folder to start again"
            )
        state = StagingState.load(staging)
        if state is not None:
            _check_identity(state.identity, identity, staging)
    if state is None:  # a new run (or one killed before its first state): every line checked before writing
        state = StagingState(identity, _validate(inputs, config.max_items))
        shutil.rmtree(staging, ignore_errors=True)
        (staging / SHARDS).mkdir(parents=True)
        state.save(staging)
    try:
        _stream(inputs, staging, state, config, tokenizer, num_proc)
    except UserError:  # a mistake found midway (a chat template failing on one record): nothing is kept
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except BrokenProcessPool:
        raise TrainingError(
            f"a tokenising worker died (killed, or out of memory); the finished shards are kept in {staging}: run the "
            "same command with --resume to continue"
        ) from None
    (staging / SHARDS).rename(output)  # the whole output at once (an empty directory there is replaced)
    shutil.rmtree(staging)
    counts = state.counts
    reasons = ", ".join(f"{n} {reason}" for reason, n in Counter(counts["dropped"]).most_common()) or "none"
    per_domain = ", ".join(f"{domain}: {n}" for domain, n in sorted(state.finished.items()))
    return (
        f"records: {counts['read']:,} read, {counts['kept']:,} kept, dropped: {reasons}\n"
        f"tokens: {counts['tokens']:,} ({counts['trained']:,} trained)\n"
        f"shards: {sum(state.finished.values())} ({per_domain}) in {output}"
    )


def _identity(inputs: list[Input], config: PipelineConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What makes two runs the same run: the inputs as they are on disk, the pipeline, the tokenizer's files."""
    files = [entry.identity() for entry in inputs]
    digest = hashlib.sha256()
    for name, path in sorted(tokenizer.files.items()):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {"inputs": files, "pipeline": config.fingerprint(), "tokenizer": digest.hexdigest()}


def _check_identity(recorded: dict[str, Any], current: dict[str, Any], staging: Path) -> None:
    changed = [what for key, what in (("pipeline", "pipeline (-c)"), ("tokenizer", "tokenizer")) if
               recorded.get(key) != current[key]]  # fmt: skip
    if [f.get("path") for f in recorded.get("inputs", [])] != [f["path"] for f in current["inputs"]]:
        changed.append("list of inputs")
    elif recorded["inputs"] != current["inputs"]:
        changed += [f"input {new['path']} (it changed since)" for old, new in zip(recorded["inputs"],
                    current["inputs"], strict=True) if old != new]  # fmt: skip
    if changed:
        raise UserError(
            f"--resume: {staging} holds a prepare of a different {', '.join(changed)}; run that command again, or "
            "delete the folder to start this one"
        )


def _validate(inputs: list[Input], max_items: int | None) -> int:
    """Check every record of every input (the records past ``max_items`` too); return the count to prepare."""
    total = 0
    with tqdm(total=sum(i.size() for i in inputs), desc="checking", unit="B", unit_scale=True,
              dynamic_ncols=True, disable=not sys.stderr.isatty()) as progress:  # fmt: skip
        done = 0
        for entry in inputs:
            count, path = 0, entry.path
            if entry.source is None:
                for line_no, _, end, line in jsonl_lines(path):
                    parse_record(line, f"{path}:{line_no}")
                    count += 1
                    if count % 4096 == 0:
                        progress.update(done + end - progress.n)
            else:  # read whole (a file datasets cannot read fails here), one batch of rows at a time
                count = sum(1 for _ in entry.source.records())
            if not count and entry.source is not None:
                raise UserError(f"input {path}: split {entry.source.split!r} is empty (no records)")
            if not count:
                raise UserError(f"input {path}: the dataset is empty (no records)")
            total += count
            done += entry.size()
            progress.update(done - progress.n)
    return total if max_items is None else min(total, max_items)


def _lines(
    inputs: list[Input], start: Position, limit: int
) -> Iterator[tuple[Position, Position, str, str | dict[str, Any]]]:
    """``(position, position after it, where, JSONL line or record)`` of each record from ``start`` until ``limit``
    records. A source's position is its part (``offset``) and row in it (``line``, counted from 1 as lines are)."""
    record = start.record
    for index in range(start.file, len(inputs)):
        source, path = inputs[index].source, inputs[index].path
        if source is None:
            offset, line = (start.offset, start.line) if index == start.file else (0, 1)
            for line_no, begin, end, text in jsonl_lines(path, offset, line):
                if record >= limit:
                    return
                yield (Position(record, index, begin, line_no), Position(record + 1, index, end, line_no + 1),
                       f"{path}:{line_no}", text)  # fmt: skip
                record += 1
            continue
        part, row = (start.offset, start.line - 1) if index == start.file else (0, 0)
        for at, number, where, item in source.records(part, row):
            if record >= limit:
                return
            yield Position(record, index, at, number + 1), Position(record + 1, index, at, number + 2), where, item
            record += 1


def _stream(
    inputs: list[Input], staging: Path, state: StagingState, config: PipelineConfig, tokenizer: Tokenizer, num_proc: int
) -> None:
    """Tokenise and write from where ``state`` says, updating it (and saving it after every finished shard)."""
    for shard in sorted((staging / SHARDS).glob("*/shard_*")):  # half-written by a killed run: written again
        if int(shard.name.removeprefix("shard_")) >= state.finished.get(shard.parent.name, 0):
            shutil.rmtree(shard)
    # Records before ``state.next`` are counted; those of a shard still open then are read again to rebuild it.
    counted = state.next.record
    start = min(state.open.values(), key=lambda p: p.record, default=state.next)
    open_from = {domain: p.record for domain, p in state.open.items()}
    writer = ShardWriter(staging / SHARDS, config, state.finished)
    counts = state.counts
    dropped = Counter(counts["dropped"])
    chunks: deque[list[tuple[Position, Position]]] = deque()
    progress = tqdm(total=state.num_records, initial=start.record, desc="tokenising", unit=" records",
                    dynamic_ncols=True, disable=not sys.stderr.isatty())  # fmt: skip
    started, first_tokens = time.perf_counter(), counts["tokens"]
    with progress:
        for results in tokenise_chunks(_chunks(inputs, start, state.num_records, chunks), config, tokenizer, num_proc):
            for (position, after), result in zip(chunks.popleft(), results, strict=True):
                if position.record < counted:  # replayed: only what the open shards held
                    if isinstance(result, str) or position.record < open_from.get(result[0], counted):
                        continue
                else:
                    counts["read"] += 1
                    if isinstance(result, str):
                        dropped[result] += 1
                        continue
                    counts["kept"] += 1
                    counts["tokens"] += len(result[1])
                    counts["trained"] += int(result[2].sum())
                domain = result[0]
                if domain not in writer.open:
                    state.open[domain] = position
                if writer.add(*result):
                    del state.open[domain]
                    state.finished, state.next = writer.finished, after
                    counts["dropped"] = dict(dropped)
                    state.save(staging)
                    crash_point("prepare-shard")  # tests: ASTRAI_FABRIC_CRASH_AT=prepare-shard@N, SIGKILL here
            progress.update(len(results))
            rate = (counts["tokens"] - first_tokens) / (time.perf_counter() - started)
            progress.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
    writer.finish_all()
    state.finished, state.open = writer.finished, {}
    counts["dropped"] = dict(dropped)
    if not counts["kept"]:
        raise UserError(
            f"{', '.join(str(i.path) for i in inputs)}: no record was kept ({dict(dropped)}) by the pipeline, with the "
            f"tokenizer (and chat_template) in {tokenizer.directory}; nothing written"
        )


def _chunks(
    inputs: list[Input], start: Position, limit: int, positions: deque[list[tuple[Position, Position]]]
) -> Iterator[list[tuple[str, str | dict[str, Any]]]]:
    """``(where, JSONL line or record)`` lists of about ``CHUNK_BYTES`` of text (a record's size is guessed from its
    text values); each one's positions are appended to ``positions``."""
    chunk: list[tuple[str, str | dict[str, Any]]] = []
    where: list[tuple[Position, Position]] = []
    size = 0
    for position, after, name, item in _lines(inputs, start, limit):
        chunk.append((name, item))
        where.append((position, after))
        size += len(item) if isinstance(item, str) else _text_size(item)
        if size >= CHUNK_BYTES:
            positions.append(where)
            yield chunk
            chunk, where, size = [], [], 0
    if chunk:
        positions.append(where)
        yield chunk


def _text_size(value: Any) -> int:
    """Characters of text in a record's values (how much tokenising it is)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_size(v) for v in value.values()) + 1
    if isinstance(value, list):
        return sum(_text_size(v) for v in value) + 1
    return 1
