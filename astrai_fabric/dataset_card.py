"""A Hub dataset's card (``README.md``, its YAML header) read for its ``configs``: the subsets (``--data_subset``),
each one's data files as path patterns, by split where the card names splits. ``hub.py`` reads it to fetch only the
chosen subset's files (a repository such as HuggingFaceFW/fineweb holds terabytes across its subsets), and
``data/sources.py`` to read those files from the snapshot (``datasets`` cannot: it resolves every subset's patterns
and fails on the ones not fetched).

The card is data from outside: parsed with YAML's safe loader, what its aliases expand to bounded by its size
(``yaml_values``: an alias bomb is refused before anything walks it), every field of every entry checked for its
kind, counts and lengths bounded, values in messages cut short (``errors.brief``), and a pattern that is absolute
or climbs out of the repository (``..``) refused; any of these is one line naming the card. The patterns mean what
``datasets`` makes of them (fsspec's glob): ``*`` and ``?`` stay inside one folder, ``**`` crosses folders, ``[...]``
is a character class; ``data_dir`` is the folder they are relative to. The rule for no ``--data_subset`` is
``datasets``': the entry marked ``default: true``, else the only entry, else the one named ``default``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai_fabric.errors import UserError, brief, listed

CARD = "README.md"
MAX_HEADER_BYTES = 4 << 20
"""A card's YAML header; fineweb-2's, with its ~1,900 subsets, is about 300 KB."""
MAX_VALUES = MAX_HEADER_BYTES
"""Values in a card's header with its aliases expanded: no more than its bytes (as a header without aliases), so
that walking it costs what reading it did (``yaml_values``)."""
MAX_CONFIGS = 10_000
MAX_PATTERNS = 100_000
"""Patterns in the whole card (each subset's, each split's)."""
MAX_NAME_CHARS = 256
MAX_PATTERN_CHARS = 1024
_HEADER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)^---[ \t]*$", re.S | re.M)
"""The YAML block a card opens with, as huggingface_hub's and datasets' readers find it."""


@dataclass(frozen=True)
class Subset:
    """One ``configs`` entry: its name and its data files, ``{split: patterns}`` (a card giving one string or list
    gives ``train``, as ``datasets`` reads it; ``data_dir`` already joined); None where the entry names no files: it
    reads the repository's own layout, under ``data_dir`` where it gives one (file names such as ``train-*`` say
    the splits)."""

    name: str
    splits: dict[str, tuple[str, ...]] | None
    default: bool = False
    data_dir: str = ""


def read_card(folder: Path) -> str | None:
    """The text of ``folder``'s card (its header bounded), or None where there is none."""
    path = folder / CARD
    if not path.is_file():
        return None
    with path.open("rb") as file:
        return file.read(MAX_HEADER_BYTES + 64).decode("utf-8", errors="replace")


def header(card: str | None, where: str) -> dict | None:
    """The card's YAML header as data (its size, and what its aliases expand to, bounded: ``yaml_values``); None
    where the card has none. ``where`` names the card in messages."""
    if card is None:
        return None
    found = _HEADER.match(card)
    if found is None:
        if card.lstrip("\ufeff").startswith("---") and len(card.encode()) > MAX_HEADER_BYTES:
            raise UserError(f"{where}: its YAML header is larger than {MAX_HEADER_BYTES >> 20} MiB; not a dataset card")
        return None  # no header (or one never closed, which datasets reads as none)
    if len(found.group(1).encode()) > MAX_HEADER_BYTES:
        raise UserError(f"{where}: its YAML header is larger than {MAX_HEADER_BYTES >> 20} MiB; not a dataset card")
    import yaml  # here: hub.py imports this module, and only a dataset card needs a YAML parser

    from astrai_fabric import yaml_values

    try:
        data = yaml_values.load(found.group(1), MAX_VALUES)
    except yaml_values.AliasExpansionError as err:
        line = err.problem_mark.line + 2  # the card's line: its header starts after the opening ---
        raise UserError(f"{where}: its YAML header's {err.problem} (line {line}); not a dataset card") from None
    except (yaml.YAMLError, RecursionError, ValueError) as err:
        reason = " ".join(str(err).split())[:200]
        raise UserError(f"{where}: its YAML header is not readable YAML ({reason})") from None
    if data is not None and not isinstance(data, dict):
        raise UserError(f"{where}: its YAML header is a {type(data).__name__}, expected a mapping")
    return data


def subsets(card: str | None, where: str) -> list[Subset] | None:
    """The card's ``configs``, checked; None where the card (or its header) has none. ``where`` names the card in
    messages."""
    found = header(card, where)
    if found is None:
        return None
    configs = found.get("configs")
    if configs is None or configs == []:  # datasets reads both as no subsets
        return None
    if not isinstance(configs, list) or not configs:
        raise UserError(f"{where}: configs is {_kind(configs)}, expected a list of {{config_name, data_files}}")
    if len(configs) > MAX_CONFIGS:
        raise UserError(f"{where}: configs has {len(configs)} entries, more than {MAX_CONFIGS}")
    found_subsets, budget = [], [MAX_PATTERNS]
    for index, entry in enumerate(configs):
        found_subsets.append(_subset(entry, f"{where}: configs[{index}]", budget))
    names = [s.name for s in found_subsets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"{where}: configs names {repeated[0]!r} more than once")
    if sum(s.default for s in found_subsets) > 1:
        raise UserError(f"{where}: configs marks more than one entry default: true")
    return found_subsets


def choose(found: list[Subset], subset: str | None, where: str) -> Subset:
    """The entry ``subset`` names (``--data_subset``), else the default one (the module docstring's rule); an
    unknown name, or none given where there are several and no default, is one line listing them."""
    named = {s.name: s for s in found}
    if subset is not None:
        if subset not in named:
            raise UserError(f"--data_subset {subset!r}: {where} has no such subset; it has {_listed(named)}")
        return named[subset]
    default = [s for s in found if s.default] or (found if len(found) == 1 else [named.get("default")])
    if default[0] is None:
        raise UserError(f"{where}: has subsets {_listed(named)}; choose one with --data_subset")
    return default[0]


def split_patterns(chosen: Subset, split: str | None, where: str) -> dict[str, tuple[str, ...]]:
    """``{split: patterns}`` of ``chosen``: only ``split``'s where one is given (``--data_split``), every split's
    otherwise; a split the entry does not name is one line listing those it has."""
    assert chosen.splits is not None
    if split is None:
        return chosen.splits
    if split not in chosen.splits:
        raise UserError(
            f"--data_split {split!r}: subset {chosen.name!r} of {where} has no such split; it has "
            f"{_listed(chosen.splits)}"
        )
    return {split: chosen.splits[split]}


def matching(patterns: Iterable[str], names: Iterable[str]) -> list[str]:
    """The repository paths (``/``-separated, relative) among ``names`` that one of ``patterns`` matches, sorted;
    hidden files and folders (``.x``, ``__x``) never, as ``datasets`` skips them."""
    compiled = [re.compile(_regex(p)) for p in patterns]
    return sorted(
        name
        for name in names
        if not any(part.startswith((".", "__")) for part in name.split("/"))
        and any(c.fullmatch(name) for c in compiled)
    )


def _subset(entry: Any, where: str, budget: list[int]) -> Subset:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: is {_kind(entry)}, expected a mapping {{config_name, data_files}}")
    name = entry.get("config_name", "default")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise UserError(
            f"{where}.config_name: is {_kind(name)}, expected a printable name of at most {MAX_NAME_CHARS} characters"
        )
    default = entry.get("default", False)
    if not isinstance(default, bool):
        raise UserError(f"{where}.default: is {_kind(default)}, expected true or false")
    data_dir = entry.get("data_dir")
    if data_dir is not None:
        data_dir = _pattern(data_dir, f"{where}.data_dir").strip("/")
        data_dir = "" if data_dir == "." else data_dir
    prefix = f"{data_dir}/" if data_dir else ""
    files = entry.get("data_files")
    if files is None:
        return Subset(name, None, default, data_dir or "")
    at = f"{where}.data_files"
    mappings = isinstance(files, list) and bool(files) and all(isinstance(f, dict) for f in files)
    if isinstance(files, str) or (isinstance(files, list) and files and all(isinstance(f, str) for f in files)):
        splits = {"train": _patterns(files, at, budget)}
    elif mappings:
        splits = {}
        for index, item in enumerate(files):
            split, path = item.get("split", "train"), item.get("path")
            if not isinstance(split, str) or not re.fullmatch(r"\w+(\.\w+)*", split) or len(split) > MAX_NAME_CHARS:
                raise UserError(
                    f"{at}[{index}].split: is {_kind(split)}, expected a split name (letters, digits, _ and .)"
                )
            if split in splits:
                raise UserError(f"{at}[{index}].split: {split!r} appears more than once")
            splits[split] = _patterns(path, f"{at}[{index}].path", budget)
    else:
        raise UserError(
            f"{at}: is {_kind(files)}, expected a string, a list of strings or a list of {{split, path}} mappings"
        )
    return Subset(
        name, {split: tuple(prefix + p for p in found) for split, found in splits.items()}, default, data_dir or ""
    )


def _patterns(value: Any, where: str, budget: list[int]) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise UserError(f"{where}: is {_kind(value)}, expected a path pattern or a list of them")
    budget[0] -= len(values)
    if budget[0] < 0:
        raise UserError(f"{where}: the card names more than {MAX_PATTERNS} data file patterns")
    return tuple(_pattern(v, where) for v in values)


def _pattern(value: Any, where: str) -> str:
    """A path pattern inside the repository: a string, bounded, relative, never climbing out of it."""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_PATTERN_CHARS:
        raise UserError(
            f"{where}: is {_kind(value)}, expected a path pattern of at most {MAX_PATTERN_CHARS} characters"
        )
    parts = value.replace("\\", "/").split("/")
    if value.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:", value) or ".." in parts or "\0" in value:
        raise UserError(f"{where}: {value!r} is not a path inside the repository (absolute, or with ..)")
    return value.removeprefix("./")


def _regex(pattern: str) -> str:
    """fsspec's glob as a regular expression (the module docstring): ``**/`` any folders or none, ``**`` anything,
    ``*`` and ``?`` within one folder, ``[...]`` a class (``[!...]`` its complement); all else literal."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            inside = pattern[i + 1 : end]
            negate = inside.startswith("!")
            out.append("[" + ("^" if negate else "") + re.escape(inside[negate:]).replace("\\-", "-") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _kind(value: Any) -> str:
    """A value's type and a short look at it, bounded however large the value (``errors.brief``)."""
    return f"{type(value).__name__} {brief(value)}"


def _listed(names: Iterable[str]) -> str:
    return listed(names)
