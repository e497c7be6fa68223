"""Records from the sources the ``datasets`` library reads: parquet, arrow, CSV and JSON files, directories of them,
directories written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, and Hub dataset ids (``org/name``,
``org/name@revision``), with their subsets (``--data_subset``) and splits (``--data_split``).

The only importer of ``datasets``, and only when such a source is opened: JSONL and bin shards (``data/storage.py``)
never need it, and commands that read neither do not pay its second of start-up. Without the extra, a source of
another kind is one line naming it (``EXTRA``).

A source is read part by part (one data file, or one saved split), each as a stream of row batches, so memory stays
flat however large it is; a record is a plain dict of its columns (nothing here interprets them) with where it came
from, ``"FILE row N"`` (rows counted from 0 in each file, as ``datasets`` and pandas count them). Each batch is
measured in arrow before it becomes Python values, and each file looked at first as its kind allows, so that a
record larger than ``record_size.MAX_RECORD_BYTES`` is refused, named, before it is read whole. A Hub dataset id is
downloaded into the Hugging Face cache (``hub.snapshot``, as models are; ``HF_HUB_OFFLINE=1``: from the cache only)
and then read from those local files, as a local directory is (its README's ``configs`` name the
subsets; file names such as ``train-*``/``test-*`` the splits), never through ``datasets``' own Hub filesystem.
Where its card names subsets, the snapshot holds only the chosen subset's files (and split's), found here by the
card's patterns (``dataset_card``), since ``datasets`` fails on a repository whose other subsets were not fetched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai_fabric import dataset_card, hub
from astrai_fabric.data import record_size
from astrai_fabric.errors import UserError, listed

EXTRA = "pip install 'astrai-fabric[datasets]'"
SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}
"""Data files by suffix (``.jsonl`` is ``data/storage.py``'s, read without ``datasets``)."""
NOT_DATA = {
    "config.json", "dataset_config.json", "dataset_dict.json", "dataset_info.json", "generation_config.json",
    "meta.json", "special_tokens_map.json", "state.json", "tokenizer.json", "tokenizer_config.json",
}  # fmt: skip
"""JSON files that sit beside data (a model's, a tokenizer's, AstrAI's data config) and are never records."""
BATCH_ROWS = 1024
"""Rows read at a time from a part (parquet's too, never a whole row group): a few MB of a typical text dataset."""


def source_kind(path: Path, what: str = "data_root_path") -> str | None:
    """The kind of the local source at ``path``: ``"parquet"``, ``"arrow"``, ``"csv"``, ``"json"`` (a file, or a
    directory holding files of one kind), ``"saved"`` (a ``save_to_disk`` directory), or None (none of these); a
    directory mixing kinds is an error naming one file of each. Needs no ``datasets``."""
    if path.is_file():
        return SUFFIXES.get(path.suffix.lower())
    if (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    ):
        return "saved"
    found: dict[str, Path] = {}
    for file in sorted(data_files(path, (*SUFFIXES, ".jsonl"))):
        found.setdefault(SUFFIXES.get(file.suffix.lower(), "jsonl"), file)
    if "jsonl" in found:  # JSONL directories are read as they always were: only their .jsonl files
        found.pop("json", None)
    if len(found) > 1:
        kinds = ", ".join(f"{kind} ({file})" for kind, file in found.items())
        raise UserError(f"{what} {path}: holds data files of several kinds ({kinds}); keep one kind")
    return next(iter(found), None)


def data_files(path: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """The files under directory ``path`` with one of ``suffixes`` (hidden folders and ``NOT_DATA`` names skipped)."""
    for root, folders, files in os.walk(path):
        folders[:] = [f for f in folders if not f.startswith(".")]
        for name in files:
            if Path(name).suffix.lower() in suffixes and name not in NOT_DATA and not name.startswith("."):
                yield Path(root) / name


@dataclass
class Part:
    """One data file, or one saved split, read on its own so that every record names where it is."""

    label: str
    rows: Callable[[int], Iterator[dict[str, list]]]
    """Batches of columns from row ``start`` on."""
    files: list[Path] = field(default_factory=list)
    """The local files it reads (for ``prepare --resume``'s identity)."""
    schema: Callable[[], dict[str, tuple[str, str]] | None] = lambda: None
    """Its columns' kinds without reading a row (``column_kinds``), where the file states them (parquet's footer, an
    arrow stream's header, a saved table); None where only the rows say (CSV, JSON)."""


@dataclass
class Source:
    """A ``datasets`` source opened: its parts in order, and what was chosen of it."""

    name: str
    kind: str
    subset: str | None
    split: str
    parts: list[Part]

    def records(self, part: int = 0, row: int = 0) -> Iterator[tuple[int, int, str, dict[str, Any]]]:
        """``(part, row, where, record)`` of every record from row ``row`` of part ``part`` on, streamed."""
        for index in range(part, len(self.parts)):
            current = self.parts[index]
            number = row if index == part else 0
            try:
                for batch in current.rows(number):
                    columns = list(batch)
                    for values in zip(*batch.values(), strict=True):
                        yield index, number, f"{current.label} row {number}", dict(zip(columns, values, strict=True))
                        number += 1
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 — whatever pyarrow/pandas/datasets raise on a file they cannot read
                raise UserError(f"{current.label}: not a readable {self.kind} file ({_reason(err)})") from None

    def files(self) -> list[Path]:
        return [file for part in self.parts for file in part.files]

    def check_schemas(self, check: Callable[[str, dict[str, tuple[str, str]]], None]) -> None:
        """``check(label, column kinds)`` of each part whose file states its columns' types, before any row is read
        (``shapes.Shaper.check_schema``: a column of the wrong kind named at once, not at its first row)."""
        for part in self.parts:
            try:
                kinds = part.schema()
            except Exception:  # noqa: BLE001 — a file pyarrow cannot open: reading it says why, naming it
                kinds = None
            if kinds is not None:
                check(part.label, kinds)


def column_kinds(schema: Any) -> dict[str, tuple[str, str]]:
    """A pyarrow schema's columns as ``{name: (kind, type)}``: ``kind`` one of string, list, number, bool, struct,
    null or other (what ``data/shapes.py`` checks, with no pyarrow there), ``type`` pyarrow's own spelling."""
    import pyarrow as pa

    def kind(data_type: Any) -> str:
        if pa.types.is_dictionary(data_type):  # pandas' categories: the values' kind
            return kind(data_type.value_type)
        for name, test in (
            ("string", pa.types.is_string),
            ("string", pa.types.is_large_string),
            ("list", pa.types.is_list),
            ("list", pa.types.is_large_list),
            ("list", pa.types.is_fixed_size_list),
            ("number", pa.types.is_integer),
            ("number", pa.types.is_floating),
            ("number", pa.types.is_decimal),
            ("bool", pa.types.is_boolean),
            ("struct", pa.types.is_struct),
            ("null", pa.types.is_null),
        ):
            if test(data_type):
                return name
        return "other"

    return {schema_field.name: (kind(schema_field.type), str(schema_field.type)) for schema_field in schema}


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _datasets(kind: str, name: str, what: str):
    """The ``datasets`` module, quiet (its progress bars and log lines would break the one-line promise)."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{what} {name}: reading {kind} data needs the datasets library: {EXTRA}") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    return datasets


def open_source(
    path: Path, kind: str, what: str = "data_root_path", subset: str | None = None, split: str | None = None
) -> Source:
    """The source at ``path`` of ``kind`` (``data/storage.py``'s ``detect_format``), its subset and split chosen and
    checked (an unknown one lists those there); ``what`` names it in messages."""
    name = str(path)
    datasets = _datasets("Hugging Face Hub" if kind == "hub" else kind, name, what)
    if kind == "saved":
        return _saved(datasets, path, what, subset, split)
    if kind == "hub":
        directory = hub.snapshot(hub.HubId.parse(name), what, repo_type="dataset", subset=subset, split=split)
    elif path.is_file():
        if subset is not None:
            raise UserError(f"--data_subset {subset!r}: {what} {name} is one {kind} file, without subsets")
        if split not in (None, "train"):
            raise UserError(f"--data_split {split!r}: {what} {name} is one {kind} file, whose only split is 'train'")
        return Source(name, kind, None, "train", [_file_part(datasets, kind, path, path)])
    else:
        directory = path
    return _directory(datasets, name, kind, directory, what, subset, split)


def _file_part(datasets, kind: str, file: Path, label: str | Path) -> Part:
    def rows(start: int) -> Iterator[dict[str, list]]:
        record_size.check_file(file, kind, str(label))  # a record past the limit, found reading no more than it
        if kind == "parquet":
            return record_size.checked_rows(_parquet_batches(file, start), str(label), start)
        stream = datasets.load_dataset(kind, data_files=[str(file)], split="train", streaming=True)
        stream = (stream.skip(start) if start else stream).with_format("arrow")  # measured before Python values
        return record_size.checked_rows(stream.iter(batch_size=BATCH_ROWS), str(label), start)

    def schema() -> dict[str, tuple[str, str]] | None:
        import pyarrow as pa
        import pyarrow.parquet

        if kind == "parquet":  # the footer alone
            return column_kinds(pyarrow.parquet.read_schema(file))
        if kind == "arrow":  # the stream's (or file's) header alone, as datasets writes and reads either
            with pa.memory_map(str(file)) as mapped:
                try:
                    return column_kinds(pa.ipc.open_stream(mapped).schema)
                except pa.ArrowInvalid:
                    mapped.seek(0)
                    return column_kinds(pa.ipc.open_file(mapped).schema)
        return None  # CSV and JSON: only their rows say

    return Part(str(label), rows, [file], schema)


def _parquet_batches(file: Path, start: int) -> Iterator[Any]:
    """A parquet file's rows from row ``start`` on, ``BATCH_ROWS`` at a time, by pyarrow's own reader: ``datasets``'
    (pyarrow's dataset scanner) decodes a whole row group before its first batch, and row groups are often hundreds
    of MB. The same columns and values as ``datasets`` reads (its reader casts to the features the file's schema
    states: the types it has)."""
    import pyarrow.parquet  # datasets brings it

    parquet = pyarrow.parquet.ParquetFile(file)
    groups, skip = [], start
    for index in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(index).num_rows
        if groups or skip < rows:
            groups.append(index)
        else:
            skip -= rows  # a whole row group before ``start``: not read
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=groups) if groups else ():
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        yield batch.slice(skip) if skip else batch
        skip = 0


def _directory(
    datasets, name: str, kind: str, directory: Path, what: str, subset: str | None, split: str | None
) -> Source:
    """A directory of data files (a Hub snapshot too), read as ``datasets`` reads a dataset repository: its README's
    ``configs`` name the subsets, file names (``train-*``, ``test-*``, ...) the splits, and every file is ``train``
    when none says. Only data files count (``NOT_DATA`` is never read, whatever ``datasets`` would guess)."""
    hub, directory = kind == "hub", directory.absolute()
    if hub:  # a snapshot holds only the chosen subset's files where its card names subsets (hub._dataset_allow)
        card = dataset_card.subsets(dataset_card.read_card(directory), f"{what} {name}: {dataset_card.CARD}")
        if card is not None:
            chosen = dataset_card.choose(card, subset, f"{what} {name}")
            if chosen.splits is not None or chosen.data_dir:
                return _card_subset(datasets, name, directory, what, subset, chosen, split)
            subset = chosen.name  # an entry naming no files: datasets reads it, the whole layout fetched
    else:  # datasets reads a local card's header too, and walks it: its size and aliases bounded first
        dataset_card.header(dataset_card.read_card(directory), f"{what} {name}: {dataset_card.CARD}")
    subsets = _call(lambda: datasets.get_dataset_config_names(str(directory)), name)
    if subset is not None and subset not in subsets:
        raise UserError(f"--data_subset {subset!r}: {what} {name} has no such subset; it has {_listed(subsets)}")
    if subset is None and len(subsets) > 1 and "default" not in subsets:
        raise UserError(f"{what} {name}: has subsets {_listed(subsets)}; choose one with --data_subset")
    wanted = set(data_files(directory, (*SUFFIXES, ".jsonl")))
    if hub or subsets != ["default"]:  # the repository's own layout (README configs, or a Hub repository's guess)
        builder = _call(lambda: datasets.load_dataset_builder(str(directory), name=subset), name)
        found, reader = builder.config.data_files or {}, builder.name
    else:  # a plain local directory: its files of the kind found (source_kind), split by their names
        from datasets.data_files import DataFilesDict, get_data_patterns

        found = _call(lambda: DataFilesDict.from_patterns(get_data_patterns(str(directory)), str(directory)), name)
        reader = kind
    splits = {str(key): sorted(f for f in map(Path, files) if f in wanted) for key, files in found.items()}
    splits = {key: files for key, files in splits.items() if files}
    if reader not in SUFFIXES.values() or not splits:
        raise UserError(f"{what} {name}: no parquet, arrow, CSV or JSON data files found")
    chosen = _choose_split(splits, split, name, what)
    parts = [
        _file_part(datasets, reader, file, f"{name}: {file.relative_to(directory)}" if hub else file)
        for file in splits[chosen]
    ]
    return Source(name, reader if hub else kind, subset, chosen, parts)


def _card_subset(
    datasets, name: str, directory: Path, what: str, subset: str | None, chosen: dataset_card.Subset, split: str | None
) -> Source:
    """The subset ``chosen`` of a Hub snapshot, its files found by its card's patterns (``dataset_card.matching``)
    or, where it names only a ``data_dir``, by the file names there; not by ``datasets``, which resolves every
    subset's patterns and fails on those of the subsets not fetched."""
    wanted = {file.relative_to(directory).as_posix(): file for file in data_files(directory, (*SUFFIXES, ".jsonl"))}
    if chosen.splits is None:  # a data_dir's own layout: its files split by their names, as datasets splits them
        from datasets.data_files import DataFilesDict, get_data_patterns

        base = str(directory / chosen.data_dir)
        found = _call(lambda: DataFilesDict.from_patterns(get_data_patterns(base), base), name)
        located = set(wanted.values())
        splits = {str(key): sorted(f for f in map(Path, files) if f in located) for key, files in found.items()}
    else:
        splits = {
            key: [wanted[n] for n in dataset_card.matching(patterns, wanted)] for key, patterns in chosen.splits.items()
        }
    splits = {key: files for key, files in splits.items() if files}
    readers = {SUFFIXES.get(file.suffix.lower(), "json") for files in splits.values() for file in files}
    if not splits:
        raise UserError(f"{what} {name}: subset {chosen.name!r} holds no parquet, arrow, CSV or JSON data files")
    if len(readers) > 1:
        raise UserError(
            f"{what} {name}: subset {chosen.name!r} holds data files of several kinds "
            f"({', '.join(sorted(readers))}); datasets reads one kind per subset"
        )
    reader = readers.pop()
    picked = _choose_split(splits, split, name, what)
    parts = [_file_part(datasets, reader, file, f"{name}: {file.relative_to(directory)}") for file in splits[picked]]
    return Source(name, reader, subset, picked, parts)


def _saved(datasets, path: Path, what: str, subset: str | None, split: str | None) -> Source:
    """A ``save_to_disk`` directory: one ``Dataset`` (its only split) or a ``DatasetDict`` (``--data_split``)."""
    name = str(path)
    if subset is not None:
        raise UserError(f"--data_subset {subset!r}: {what} {name} is a save_to_disk directory, without subsets")
    loaded = _call(lambda: datasets.load_from_disk(name), name)
    if isinstance(loaded, datasets.DatasetDict):
        chosen = _choose_split({key: [] for key in loaded}, split, name, what)
        dataset = loaded[chosen]
    else:
        chosen = str(loaded.split or "train")
        if split not in (None, chosen):
            raise UserError(f"--data_split {split!r}: {what} {name} holds one dataset, whose split is {chosen!r}")
        dataset = loaded

    def rows(start: int) -> Iterator[dict[str, list]]:
        table = dataset.with_format("arrow")  # slices of the memory-mapped table: measured before Python values
        slices = (table[begin : begin + BATCH_ROWS] for begin in range(start, len(dataset), BATCH_ROWS))
        return record_size.checked_rows(slices, f"{name} ({chosen})", start)

    files = [Path(f["filename"]) for f in dataset.cache_files]
    schema = lambda: column_kinds(dataset.data.schema)  # noqa: E731 — the memory-mapped table's: no row read
    return Source(name, "saved", None, chosen, [Part(f"{name} ({chosen})", rows, files, schema)])


def _choose_split(splits: dict[str, list[Path]], split: str | None, name: str, what: str) -> str:
    if split is not None:
        if split not in splits:
            raise UserError(f"--data_split {split!r}: {what} {name} has no such split; it has {_listed(splits)}")
        return split
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return next(iter(splits))
    raise UserError(f"{what} {name}: has splits {_listed(splits)} and none is 'train'; choose one with --data_split")


def _listed(names) -> str:
    return listed(names)


def _call(function: Callable[[], Any], name: str) -> Any:
    """``function()``, with what ``datasets`` raises on files it cannot read as the one line naming the source."""
    try:
        return function()
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 — datasets' own errors are ValueError, FileNotFoundError, its own kinds
        raise UserError(f"{name}: not readable by datasets ({_reason(err)})") from None
