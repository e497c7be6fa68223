"""``astrai-fabric prepare``: JSONL records to AstrAI's offline bin shards for seq and sft (AstrAI's
``astrai/preprocessing``), streamed: memory stays bounded whatever the size of the input.

    astrai-fabric prepare INPUT.jsonl... -o DIR -c pipeline.json [--tokenizer_path DIR] [--num_proc N] [--resume]
                          [--data_format SHAPE] [--data_columns field=column,...]

The pipeline file is AstrAI's ``PipelineConfig`` (``data/pipeline.py``). The output is
``DIR/<domain>/shard_NNNN/{meta.json, <key>.bin}``: flat arrays with AstrAI's ``meta.json`` (``{key: {"shape",
"dtype"}}``), which AstrAI's ``MmapStore`` and this package's datasets read.

A run is two passes over the inputs. The first checks every line (UTF-8, JSON, an object) before anything is written.
The second reads, tokenises (``--num_proc`` processes, results taken in input order so the shards are the same
bytes for any N), packs and writes shard by shard (``data/shard_writer.py``) into a hidden staging sibling of the
output, which records after every finished shard what is done; the output appears, by one rename, only when all is.
A run that is killed leaves the staging folder, and the same command with ``--resume`` continues it.

The pipeline says what it writes: plain documents (``PipelineConfig.is_text``) are seq data, anything masked sft.
Where its sections read that type's own field (``text``; ``messages`` through the template), records of every
shape of the type (alpaca, ShareGPT, prompt/completion, ...) are read as training reads them (``data/shapes.py``,
``--data_format``, ``--data_columns``): the checking pass finds each file's shape (and refuses a record of another),
the workers convert each record by it. A record that fits no shape is left to the pipeline, which drops it as
AstrAI's does.

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
from astrai_fabric.data.shapes import CANONICAL_FIELDS, DATA_FORMATS, Shaper, settings_problems, source_of
from astrai_fabric.data.shard_writer import Position, ShardWriter, StagingState
from astrai_fabric.data.sources import Source, open_source
from astrai_fabric.data.storage import detect_format, jsonl_lines, parse_record
from astrai_fabric.errors import TrainingError, UserError
from astrai_fabric.faults import crash_point
from astrai_fabric.regular_files import read_regular_file
from astrai_fabric.tokenizer import MAX_TOKENIZER_BYTES, Tokenizer

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


def shaped_type(config: PipelineConfig) -> str | None:
    """``seq`` or ``sft``, the kind of data ``config`` writes (plain documents are seq, AstrAI's "text config";
    anything masked sft), where every section reads that type's own field (``CANONICAL_FIELDS``: ``text``, or
    ``messages`` through the chat template), so that records of any of its shapes can be read as that field; else
    None: the sections name fields of their own, read as they are."""
    train_type = "seq" if config.is_text else "sft"
    field = CANONICAL_FIELDS[train_type]
    if all(s.field == field and s.template == (train_type == "sft") for s in config.sections):
        return train_type
    return None


def check_shape_flags(config: PipelineConfig, data_format: str, data_columns: str | None) -> str | None:
    """The train type whose record shapes ``prepare`` reads with ``config`` (``shaped_type``), ``--data_format`` and
    ``--data_columns`` checked for it; refused where the pipeline reads fields of its own."""
    if data_format not in DATA_FORMATS:
        raise UserError(f"--data_format {data_format!r}: expected one of {', '.join(DATA_FORMATS)}")
    train_type = shaped_type(config)
    if train_type is None:
        if data_format != "auto" or data_columns is not None:
            fields = sorted({s.field for s in config.sections})
            given = " and ".join(
                f"--{n}" for n, v in (("data_format", data_format != "auto"), ("data_columns", data_columns)) if v
            )
            raise UserError(
                f"{given}: the pipeline (-c) reads the fields {fields} as they are; record shapes become a 'text' "
                "section (seq) or a 'messages' template section (sft), so name that field in -c to use them"
            )
        return None
    problems = settings_problems(train_type, data_format, data_columns)
    if problems:
        raise UserError(f"{'; '.join(problems)} (the pipeline (-c) writes {train_type} data)")
    return train_type


def prepare(
    inputs: list[Path],
    output: Path,
    config: PipelineConfig,
    tokenizer: Tokenizer,
    num_proc: int = 1,
    resume: bool = False,
    subset: str | None = None,
    split: str | None = None,
    data_format: str = "auto",
    data_columns: str | None = None,
) -> str:
    """Write the shards of ``inputs`` (``open_inputs``) under ``output`` (nothing appears there until all are
    written) with ``num_proc`` tokenising processes; ``resume`` continues the killed run of the same command;
    ``data_format`` and ``data_columns`` as training's (module docstring). Returns a summary of what was read, kept
    and dropped."""
    staging = staging_path(output)
    if resume and staging.is_dir() and not (staging / SHARDS).exists() and output.is_dir():
        return _finish_published(inputs, output, staging, config, tokenizer, subset, split, data_format, data_columns)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"-o {output}: exists and is not empty; choose a new directory")
    for path in inputs:
        if not path.exists() and path.suffix.lower() == ".jsonl":
            raise UserError(f"{path}: input file not found")
        if output.resolve() in (path.resolve(), *path.resolve().parents) and output.exists():
            raise UserError(f"-o {output}: holds the input {path}; choose a new directory")
    if not isinstance(num_proc, int) or num_proc < 1:
        raise UserError(f"--num_proc must be an integer >= 1, got {num_proc!r}")
    train_type = check_shape_flags(config, data_format, data_columns)
    inputs = open_inputs(inputs, subset, split)
    identity = _identity(inputs, config, tokenizer, data_format, data_columns)
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
        shaper = None if train_type is None else Shaper(train_type, data_format, data_columns, keep_unshaped=True)
        num_records, shapes, shapes_read = _validate(inputs, config.max_items, shaper)
        state = StagingState(identity, num_records, shapes=shapes, shapes_read=shapes_read)
        shutil.rmtree(staging, ignore_errors=True)
        (staging / SHARDS).mkdir(parents=True)
        state.save(staging)
    try:
        _stream(inputs, staging, state, config, tokenizer, num_proc, data_columns)
    except UserError:  # a mistake found midway (a chat template failing on one record): nothing is kept
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except BrokenProcessPool:
        raise TrainingError(
            f"a tokenising worker died (killed, or out of memory); the finished shards are kept in {staging}: run the "
            "same command with --resume to continue"
        ) from None
    state.save(staging)  # the last shards counted, for a --resume after the rename to report
    (staging / SHARDS).rename(output)  # the whole output at once (an empty directory there is replaced)
    crash_point("prepare-output")
    shutil.rmtree(staging)
    return _summary(state, output)


def _finish_published(
    inputs: list[Path],
    output: Path,
    staging: Path,
    config: PipelineConfig,
    tokenizer: Tokenizer,
    subset: str | None,
    split: str | None,
    data_format: str,
    data_columns: str | None,
) -> str:
    """``--resume`` of a run killed after its output was renamed into place and before its staging folder was gone:
    the output is whole; the folder (of this same run, its state says) is removed and the run's summary given."""
    state = StagingState.load(staging)
    if state is not None:
        identity = _identity(open_inputs(inputs, subset, split), config, tokenizer, data_format, data_columns)
        _check_identity(state.identity, identity, staging)
    shutil.rmtree(staging)
    if state is None:  # killed while removing it, the state gone first
        return f"shards: in {output}, finished by an earlier run (its summary went with its staging folder)"
    return _summary(state, output)


def _summary(state: StagingState, output: Path) -> str:
    """What a finished run read, kept and dropped, and where its shards are."""
    counts = state.counts
    reasons = ", ".join(f"{n} {reason}" for reason, n in Counter(counts["dropped"]).most_common()) or "none"
    per_domain = ", ".join(f"{domain}: {n}" for domain, n in sorted(state.finished.items()))
    shapes = f"records read as {state.shapes_read}\n" if state.shapes_read else ""
    return (
        f"records: {counts['read']:,} read, {counts['kept']:,} kept, dropped: {reasons}\n{shapes}"
        f"tokens: {counts['tokens']:,} ({counts['trained']:,} trained)\n"
        f"shards: {sum(state.finished.values())} ({per_domain}) in {output}"
    )


def _identity(
    inputs: list[Input], config: PipelineConfig, tokenizer: Tokenizer, data_format: str, data_columns: str | None
) -> dict[str, Any]:
    """What makes two runs the same run: the inputs as they are on disk, the pipeline, the tokenizer's files, the
    shape flags."""
    files = [entry.identity() for entry in inputs]
    digest = hashlib.sha256()
    for name, path in sorted(tokenizer.files.items()):
        digest.update(name.encode() + b"\0" + read_regular_file(path, max_bytes=MAX_TOKENIZER_BYTES, what=name) + b"\0")
    return {
        "inputs": files,
        "pipeline": config.fingerprint(),
        "tokenizer": digest.hexdigest(),
        "shapes": {"data_format": data_format, "data_columns": data_columns},
    }


NO_SHAPE_FLAGS = {"data_format": "auto", "data_columns": None}
"""What a staging folder written before the shape flags existed was prepared with."""


def _check_identity(recorded: dict[str, Any], current: dict[str, Any], staging: Path) -> None:
    changed = [
        what
        for key, what in (("pipeline", "pipeline (-c)"), ("tokenizer", "tokenizer"))
        if recorded.get(key) != current[key]
    ]
    if recorded.get("shapes", NO_SHAPE_FLAGS) != current["shapes"]:
        changed.append("--data_format or --data_columns")
    if [f.get("path") for f in recorded.get("inputs", [])] != [f["path"] for f in current["inputs"]]:
        changed.append("list of inputs")
    elif recorded["inputs"] != current["inputs"]:
        changed += [
            f"input {new['path']} (it changed since)"
            for old, new in zip(recorded["inputs"], current["inputs"], strict=True)
            if old != new
        ]
    if changed:
        raise UserError(
            f"--resume: {staging} holds a prepare of a different {', '.join(changed)}; run that command again, or "
            "delete the folder to start this one"
        )


def _validate(inputs: list[Input], max_items: int | None, shaper: Shaper | None) -> tuple[int, dict[str, str], str]:
    """Check every record of every input (the records past ``max_items`` too), each read by ``shaper`` where records
    have shapes; return the count to prepare, the shape found for each file whose records are converted
    (``StagingState.shapes``) and the words for them (up to ``max_items``)."""
    total, shapes, described = 0, {}, ""
    for entry in inputs:  # a column of the wrong kind, from the files' schemas: before any row is read
        if shaper is not None and entry.source is not None:
            entry.source.check_schemas(shaper.check_schema)

    def check(index: int, part: int, where: str, record: dict[str, Any]) -> None:
        nonlocal described
        if shaper is None:
            return
        shaper(where, record)
        key = f"{index}:{part}"
        if key not in shapes and (found := shaper.sources.get(source_of(where))) is not None:
            shape = found[0]
            shapes[key] = shape.name if not shape.canonical or shaper.columns else ""  # "": read as it is
        if total + count == max_items:
            described = shaper.describe()

    with tqdm(
        total=sum(i.size() for i in inputs),
        desc="checking",
        unit="B",
        unit_scale=True,
        dynamic_ncols=True,
        disable=not sys.stderr.isatty(),
    ) as progress:
        done = 0
        for index, entry in enumerate(inputs):
            count, path = 0, entry.path
            if entry.source is None:
                for line_no, _, end, line in jsonl_lines(path):
                    count += 1
                    check(index, 0, f"{path}:{line_no}", parse_record(line, f"{path}:{line_no}"))
                    if count % 4096 == 0:
                        progress.update(done + end - progress.n)
            else:  # read whole (a file datasets cannot read fails here), one batch of rows at a time
                for part, _, where, record in entry.source.records():
                    count += 1
                    check(index, part, where, record)
            if not count and entry.source is not None:
                raise UserError(f"input {path}: split {entry.source.split!r} is empty (no records)")
            if not count:
                raise UserError(f"input {path}: the dataset is empty (no records)")
            total += count
            done += entry.size()
            progress.update(done - progress.n)
    if shaper is not None and (max_items is None or total < max_items):
        described = shaper.describe()
    return (total if max_items is None else min(total, max_items)), {k: v for k, v in shapes.items() if v}, described


def _lines(
    inputs: list[Input], start: Position, limit: int, shapes: dict[str, str]
) -> Iterator[tuple[Position, Position, str, str | dict[str, Any], str | None]]:
    """``(position, position after it, where, JSONL line or record, shape)`` of each record from ``start`` until
    ``limit`` records, ``shape`` its file's in ``shapes`` (``StagingState.shapes``), or None. A source's position is
    its part (``offset``) and row in it (``line``, counted from 1 as lines are)."""
    record = start.record
    for index in range(start.file, len(inputs)):
        source, path = inputs[index].source, inputs[index].path
        if source is None:
            offset, line = (start.offset, start.line) if index == start.file else (0, 1)
            shape = shapes.get(f"{index}:0")
            for line_no, begin, end, text in jsonl_lines(path, offset, line):
                if record >= limit:
                    return
                yield (
                    Position(record, index, begin, line_no),
                    Position(record + 1, index, end, line_no + 1),
                    f"{path}:{line_no}",
                    text,
                    shape,
                )
                record += 1
            continue
        part, row = (start.offset, start.line - 1) if index == start.file else (0, 0)
        for at, number, where, item in source.records(part, row):
            if record >= limit:
                return
            yield (
                Position(record, index, at, number + 1),
                Position(record + 1, index, at, number + 2),
                where,
                item,
                shapes.get(f"{index}:{at}"),
            )
            record += 1


def _stream(
    inputs: list[Input],
    staging: Path,
    state: StagingState,
    config: PipelineConfig,
    tokenizer: Tokenizer,
    num_proc: int,
    data_columns: str | None = None,
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
    progress = tqdm(
        total=state.num_records,
        initial=start.record,
        desc="tokenising",
        unit=" records",
        dynamic_ncols=True,
        disable=not sys.stderr.isatty(),
    )
    started, first_tokens = time.perf_counter(), counts["tokens"]
    with progress:
        records = _chunks(inputs, start, state.num_records, state.shapes, chunks)
        for results in tokenise_chunks(records, config, tokenizer, num_proc, data_columns):
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
                    crash_point("prepare-shard-meta")  # the shard whole, the state not yet saying so
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
    inputs: list[Input],
    start: Position,
    limit: int,
    shapes: dict[str, str],
    positions: deque[list[tuple[Position, Position]]],
) -> Iterator[list[tuple[str, str | dict[str, Any], str | None]]]:
    """``(where, JSONL line or record, shape)`` lists of about ``CHUNK_BYTES`` of text (a record's size is guessed from
    its text values); each one's positions are appended to ``positions``."""
    chunk: list[tuple[str, str | dict[str, Any], str | None]] = []
    where: list[tuple[Position, Position]] = []
    size = 0
    for position, after, name, item, shape in _lines(inputs, start, limit, shapes):
        chunk.append((name, item, shape))
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
