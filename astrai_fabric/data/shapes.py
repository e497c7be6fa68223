"""Record shapes: the column layouts datasets come in, each record read as the canonical record its train type reads.

seq reads ``{"text"}``, sft ``{"messages"}``, dpo ``{"prompt"|"input", "chosen", "rejected"}`` and grpo
``{"prompt"|"input", ...}`` (online) or ``{"prompt", "responses", "rewards"}`` (offline). The other shapes people
have are converted record by record into those, so tokenisation, loss masks and the datasets never see a difference
(``tests/test_data_shapes.py`` checks the token ids and masks, shape by shape):

- ``sharegpt``: ``{"conversations": [{"from", "value"}, ...]}``, roles human/gpt/system (or user/assistant);
- ``alpaca``: ``{"instruction", "input"?, "output", "system"?}``: a system message when ``system`` is non-empty, one
  user message (``instruction`` and ``input``, those non-empty, joined by a blank line ``"\\n\\n"``: the Alpaca
  repo's prompt without its prose preamble and ``###`` headers, whose place the chat template takes), one
  assistant message (``output``);
- ``prompt_completion``: TRL's prompt/completion, each a string (the prompt one user message, AstrAI's rule for a
  string prompt; the completion one assistant message) or a list of messages (TRL's conversational form);
- ``implicit_preference``: TRL's ``chosen`` and ``rejected`` message lists without a prompt column: the messages
  they start with in common are the prompt, the one assistant message after them each response.

A source (a file: a record's ``where`` without its line or row, ``source_of``) holds one shape: ``auto`` detects it from
its first record's columns, trying the train type's shapes in ``SHAPES`` order; a later record that fits another
shape is refused by name. A column holding null counts as absent (a ``datasets`` table fills the columns a row
lacks with nulls). ``--data_columns field=column`` reads a field from another column (torchtune's ``column_map``).
``prepare`` reads seq and sft records the same way (``keep_unshaped``: what fits no shape is left for its pipeline
to drop, as AstrAI's does). Nothing here opens a file: records come as ``(where, record)`` from a reader
(``data/storage.py``).
"""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from astrai_fabric.data.storage import Record
from astrai_fabric.errors import UserError

Columns = dict[str, str]
"""A shape's fields (their canonical names) → the record's columns holding them."""

_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 60


def _brief(value: Any) -> str:
    """A value in an error line: its repr, cut short (a record's column can be megabytes)."""
    return _BRIEF.repr(value)


def _text(record: dict[str, Any], columns: Columns, name: str, where: str, shape: str) -> str:
    value = record[columns[name]]
    if not isinstance(value, str):
        raise UserError(f"{where}: column {columns[name]!r} must be a string ({shape} shape), got {_brief(value)}")
    return value


def _optional_text(record: dict[str, Any], columns: Columns, name: str, where: str, shape: str) -> str:
    return _text(record, columns, name, where, shape) if name in columns else ""


def _renamed(record: dict[str, Any], columns: Columns, where: str) -> dict[str, Any]:
    """The record with each field under its canonical name; the other columns are kept (grpo's rewards read them)."""
    return {**record, **{name: record[column] for name, column in columns.items()}}


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT's ``from`` values and the chat roles they are (torchtune's ``ShareGPTToMessages`` map, plus the chat
roles themselves, which TRL's ``maybe_convert_to_chatml`` passes through)."""


def _sharegpt(record: dict[str, Any], columns: Columns, where: str) -> dict[str, Any]:
    column = columns["conversations"]
    turns = record[column]
    if not isinstance(turns, list):
        raise UserError(
            f"{where}: column {column!r} must be a list of {{from, value}} turns (sharegpt shape), got {_brief(turns)}"
        )
    if not turns:
        raise UserError(f"{where}: column {column!r} is an empty conversation (sharegpt shape): nothing to train")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise UserError(
                f"{where}: {column!r} turn {i} needs 'from' and 'value' (sharegpt shape), got {_brief(turn)}"
            )
        role = turn["from"]
        if not isinstance(role, str) or role not in SHAREGPT_ROLES:
            raise UserError(
                f"{where}: {column!r} turn {i}: unknown 'from' role {_brief(role)}; sharegpt roles are human, gpt and "
                "system (or user and assistant)"
            )
        if not isinstance(turn["value"], str):
            raise UserError(f"{where}: {column!r} turn {i}: 'value' must be a string, got {_brief(turn['value'])}")
        messages.append({"role": SHAREGPT_ROLES[role], "content": turn["value"]})
    return {**record, "messages": messages}


ALPACA_SEPARATOR = "\n\n"
"""Between an alpaca record's instruction and its non-empty input in the user message (module docstring)."""


def _alpaca(record: dict[str, Any], columns: Columns, where: str) -> dict[str, Any]:
    system = _optional_text(record, columns, "system", where, "alpaca")
    parts = [
        _text(record, columns, "instruction", where, "alpaca"),
        _optional_text(record, columns, "input", where, "alpaca"),
    ]
    messages = [{"role": "system", "content": system}] if system else []
    messages += [
        {"role": "user", "content": ALPACA_SEPARATOR.join(part for part in parts if part)},
        {"role": "assistant", "content": _text(record, columns, "output", where, "alpaca")},
    ]
    return {**record, "messages": messages}


def _turns(value: Any, column: str, role: str, where: str) -> list[Any]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value  # each message is checked where the conversation is tokenised
    raise UserError(
        f"{where}: column {column!r} must be a string or a non-empty list of {{role, content}} messages "
        f"(prompt_completion shape), got {_brief(value)}"
    )


def _prompt_completion(record: dict[str, Any], columns: Columns, where: str) -> dict[str, Any]:
    prompt = _turns(record[columns["prompt"]], columns["prompt"], "user", where)
    completion = _turns(record[columns["completion"]], columns["completion"], "assistant", where)
    return {**record, "messages": prompt + completion}


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _implicit_preference(record: dict[str, Any], columns: Columns, where: str) -> dict[str, Any]:
    chosen, rejected = record[columns["chosen"]], record[columns["rejected"]]
    if not (_is_messages(chosen) and _is_messages(rejected)):
        kinds = f"{type(chosen).__name__} and {type(rejected).__name__}"
        raise UserError(
            f"{where}: the record needs 'prompt' (or 'input'), or 'chosen' and 'rejected' as lists of "
            f"{{role, content}} messages that start with the same messages (TRL's implicit prompt), got {kinds}"
        )
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        raise UserError(
            f"{where}: {columns['chosen']!r} and {columns['rejected']!r} start with different messages, so there is no "
            "prompt (implicit_preference shape: the messages both start with are the prompt); add a 'prompt' column"
        )
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        rest = messages[shared:]
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            raise UserError(
                f"{where}: after the {shared} message(s) both start with (the prompt), {columns[name]!r} must hold one "
                f"assistant message, got roles {_brief([m['role'] for m in rest])} (implicit_preference shape)"
            )
    return {**record, "prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


PROMPT_OR_INPUT = {"prompt": ("prompt", "input")}
"""dpo and grpo read ``input`` where a record has no ``prompt`` (AstrAI's rule)."""


@dataclass
class Shape:
    name: str
    train_type: str
    required: tuple[str, ...]
    convert: Callable[[dict[str, Any], Columns, str], dict[str, Any]]
    optional: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    """Fields whose column means another shape (a prompt column: not the implicit-prompt form)."""
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """A field's default columns, in order, where it is not just its own name."""
    canonical: bool = False
    """The train type's own record, read as it is."""

    @property
    def fields(self) -> tuple[str, ...]:
        return self.required + self.optional


SHAPES = {shape.name: shape for shape in (
    Shape("text", "seq", ("text",), _renamed, canonical=True),
    Shape("messages", "sft", ("messages",), _renamed, canonical=True),
    Shape("sharegpt", "sft", ("conversations",), _sharegpt),
    Shape("alpaca", "sft", ("instruction", "output"), _alpaca, optional=("input", "system")),
    Shape("prompt_completion", "sft", ("prompt", "completion"), _prompt_completion),
    Shape("preference", "dpo", ("prompt", "chosen", "rejected"), _renamed, aliases=PROMPT_OR_INPUT, canonical=True),
    Shape("implicit_preference", "dpo", ("chosen", "rejected"), _implicit_preference, excludes=("prompt",),
          aliases=PROMPT_OR_INPUT),
    Shape("online_prompt", "dpo", ("prompt",), _renamed, excludes=("chosen", "rejected"), aliases=PROMPT_OR_INPUT,
          canonical=True),
    Shape("unpaired", "kto", ("prompt", "completion", "label"), _renamed, aliases=PROMPT_OR_INPUT, canonical=True),
    Shape("groups", "grpo", ("prompt", "responses", "rewards"), _renamed, aliases=PROMPT_OR_INPUT, canonical=True),
    Shape("prompt", "grpo", ("prompt",), _renamed, excludes=("responses",), aliases=PROMPT_OR_INPUT, canonical=True),
)}  # fmt: skip
"""Every shape, each train type's in the order ``auto`` tries them."""

STRING, LIST, TEXT_OR_MESSAGES = ("string",), ("list",), ("string", "list")
COLUMN_KINDS = {
    "text": {"text": STRING},
    "messages": {"messages": LIST},
    "sharegpt": {"conversations": LIST},
    "alpaca": {"instruction": STRING, "input": STRING, "output": STRING, "system": STRING},
    "prompt_completion": {"prompt": TEXT_OR_MESSAGES, "completion": TEXT_OR_MESSAGES},
    "preference": {"prompt": TEXT_OR_MESSAGES, "chosen": TEXT_OR_MESSAGES, "rejected": TEXT_OR_MESSAGES},
    "implicit_preference": {"chosen": LIST, "rejected": LIST},
    "online_prompt": {"prompt": TEXT_OR_MESSAGES},
    "unpaired": {"prompt": TEXT_OR_MESSAGES, "completion": TEXT_OR_MESSAGES, "label": ("bool",)},
    "groups": {"prompt": TEXT_OR_MESSAGES, "responses": LIST, "rewards": ("list", "number")},
    "prompt": {"prompt": TEXT_OR_MESSAGES},
}
"""Each shape's fields and the column kinds (``sources.column_kinds``) that can hold them: what a file's schema is
checked against before its rows are read (``Shaper.check_schema``). A null column is absent, as a null value is."""
_KIND_WORDS = {STRING: "a string", LIST: "a list", TEXT_OR_MESSAGES: "a string or a list of messages",
               ("list", "number"): "a list of numbers or a number", ("bool",): "a boolean"}  # fmt: skip

DATA_FORMATS = ("auto", *SHAPES)
"""``--data_format``'s values."""
CANONICAL_FIELDS = {
    shape.train_type: shape.required[0]
    for shape in SHAPES.values()
    if shape.train_type in ("seq", "sft") and shape.canonical
}
"""The one field seq and sft records are read by (``text``, ``messages``): every shape of theirs becomes it."""


def shapes_of(train_type: str | None, data_format: str = "auto") -> list[Shape]:
    """The shapes a source of ``train_type`` may have: the one ``data_format`` names, else all of the type's."""
    if data_format != "auto":
        return [SHAPES[data_format]]
    return [shape for shape in SHAPES.values() if train_type is None or shape.train_type == train_type]


def parse_columns(spec: str | None) -> Columns:
    """``--data_columns field=column,...`` as ``{field: column}`` (``settings_problems`` checks it first)."""
    if spec is None:
        return {}
    return {name.strip(): column.strip() for name, _, column in (entry.partition("=") for entry in spec.split(","))}


def settings_problems(train_type: str | None, data_format: str, data_columns: str | None) -> list[str]:
    """What is wrong with ``--data_format`` and ``--data_columns`` for ``train_type`` (``TrainArgs.validate``)."""
    problems = []
    if data_format not in DATA_FORMATS:
        return []  # its kind check names it
    if data_format != "auto" and train_type is not None and SHAPES[data_format].train_type != train_type:
        names = ", ".join(shape.name for shape in shapes_of(train_type))
        problems.append(
            f"data_format {data_format!r} is {_a(SHAPES[data_format].train_type)} shape; {train_type} reads {names} "
            "(or auto)"
        )
    if not isinstance(data_columns, str):
        return problems
    if not data_columns.strip():
        return [*problems, "data_columns is empty: give field=column pairs (e.g. prompt=question) or leave it out"]
    shapes = shapes_of(train_type, data_format)
    known = list(dict.fromkeys(name for shape in shapes for name in shape.fields))
    of = f"the {data_format} shape" if data_format != "auto" else f"the {train_type or 'record'} shapes"
    names, columns = set(), set()
    for entry in data_columns.split(","):
        name, equals, column = (part.strip() for part in entry.partition("="))
        if not (equals and name and column):
            problems.append(f"data_columns entry {entry.strip()!r} must be field=column (e.g. prompt=question)")
        elif name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"data_columns: {name!r} is not a field of {of}{hint}; fields: {', '.join(known)}")
        elif name in names:
            problems.append(f"data_columns names the field {name!r} twice")
        elif column in columns:
            problems.append(f"data_columns reads the column {column!r} for two fields")
        names.add(name)
        columns.add(column)
    return problems


def check_not_shaped(data_format: str, data_columns: str | None, reason: str) -> None:
    """Refuse ``--data_format``/``--data_columns`` where records are not read by shape (``reason`` says why)."""
    given = [f"--{n}" for n, v in (("data_format", data_format != "auto"), ("data_columns", data_columns)) if v]
    if given:
        raise UserError(f"{' and '.join(given)}: {reason}; record shapes apply to records read as they are")


WHERE_IN_SOURCE = re.compile(r"(:\d+| row \d+)$")
"""The end of a record's ``where`` that says where it is in its source: ``:LINE`` (JSONL), `` row N`` (a ``datasets``
file, ``data/sources.py``)."""


def source_of(where: str) -> str:
    """The source (file) a record's ``where`` names."""
    return WHERE_IN_SOURCE.sub("", where)


class Shaper:
    """Records of any shape of one train type → its canonical records, each source's shape detected from its first
    record (or forced by ``data_format``); call it once per record, in order (``prepare`` can too)."""

    def __init__(
        self, train_type: str, data_format: str = "auto", data_columns: str | None = None, keep_unshaped: bool = False
    ) -> None:
        self.train_type, self.data_format = train_type, data_format
        self.candidates = shapes_of(train_type, data_format)
        self.columns = parse_columns(data_columns)
        self.keep_unshaped = keep_unshaped
        """``prepare``'s reading: a record that fits no shape where the train type's own shape is the one it comes
        closest to (its source's shape, or when that is not known yet, the shape most of whose columns it has) is
        returned as it is, for the pipeline to drop as AstrAI's does (a record without its field renders nothing);
        training refuses it. Any other record that fits no shape, or one of another shape than its source's, is
        refused either way."""
        self.sources: dict[str, tuple[Shape, str]] = {}
        """Each source's shape and the ``where`` of its first record."""
        self.counts: dict[str, int] = {}
        """Records converted, per source."""

    def __call__(self, where: str, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` (read at ``where``, ``"file:line"``) as its train type's canonical record."""
        source = source_of(where)
        if source not in self.sources:
            shape = next((s for s in self.candidates if self._fits(s, record)), None)
            if shape is None:
                if self.keep_unshaped and self._closest(record).canonical:
                    return record
                raise self._missing(where, record, None)
            self.sources[source] = (shape, where)
        shape, first = self.sources[source]
        if not self._fits(shape, record):
            other = next((s for s in self.candidates if s is not shape and self._fits(s, record)), None)
            if other is None and self.keep_unshaped and shape.canonical:
                return record
            if other is None:
                raise self._missing(where, record, shape)
            raise UserError(
                f"{where}: the record has the {other.name} shape ({describe_columns(other)}), but {first}, the "
                f"source's first record, has the {shape.name} shape: one source holds one shape (split it by shape, "
                "or give --data_format to read every record as one)"
            )
        self.counts[source] = self.counts.get(source, 0) + 1
        return shape.convert(record, self._resolve(shape, record)[0], where)

    def _column(self, shape: Shape, name: str, record: dict[str, Any]) -> str | None:
        """The column of ``record`` holding field ``name`` (mapped, else its default names), or None."""
        names = (self.columns[name],) if name in self.columns else shape.aliases.get(name, (name,))
        return next((column for column in names if record.get(column) is not None), None)

    def _resolve(self, shape: Shape, record: dict[str, Any]) -> tuple[Columns, list[str]]:
        """The fields ``record`` has (field → column), and the required ones it lacks."""
        found = {name: column for name in shape.fields if (column := self._column(shape, name, record)) is not None}
        return found, [name for name in shape.required if name not in found]

    def _fits(self, shape: Shape, record: dict[str, Any]) -> bool:
        return not self._resolve(shape, record)[1] and not any(self._column(shape, n, record) for n in shape.excludes)

    def _closest(self, record: dict[str, Any]) -> Shape:
        """The shape ``record`` comes closest to: the most required columns present, the first on ties."""
        return max(self.candidates, key=lambda s: len(s.required) - len(self._resolve(s, record)[1]))

    def check_schema(self, label: str, kinds: dict[str, tuple[str, str]]) -> None:
        """Refuse, before a row is read, a file (``label``) whose schema gives a column the shape reads a kind that
        cannot hold it (``COLUMN_KINDS``): a ``text`` column of int64, say. The shape is the one its columns give,
        as the first record would (``auto`` tries them in order); a schema that fits none is left to the records."""
        present = {column for column, (kind, _) in kinds.items() if kind != "null"}

        def column(shape: Shape, name: str) -> str | None:
            names = (self.columns[name],) if name in self.columns else shape.aliases.get(name, (name,))
            return next((c for c in names if c in present), None)

        shape = next(
            (
                s
                for s in self.candidates
                if all(column(s, n) for n in s.required) and not any(column(s, n) for n in s.excludes)
            ),
            None,
        )
        for name, allowed in COLUMN_KINDS[shape.name].items() if shape is not None else ():
            found = column(shape, name)
            if found is not None and kinds[found][0] not in allowed:
                raise UserError(
                    f"{label}: column {found!r} is {kinds[found][1]} in the file's schema, but the {shape.name} shape "
                    f"reads it as {_KIND_WORDS[allowed]}; convert the column, or map another one with --data_columns"
                )

    def _missing(self, where: str, record: dict[str, Any], shape: Shape | None) -> UserError:
        """The error for a record lacking a column of ``shape`` (None: of every shape; the closest one is named)."""
        guessed = shape is None
        if shape is None:
            shape = self._closest(record)
        found, missing = self._resolve(shape, record)
        if not missing:  # every column it needs, and one that means another shape
            column = next(c for n in shape.excludes if (c := self._column(shape, n, record)) is not None)
            return UserError(
                f"{where}: the {shape.name} shape reads records without a {column!r} column, and this one has it: "
                "drop the column, or give --data_format the shape that reads it"
            )
        names = [self.columns.get(name, name) for name in missing]
        if shape.name == "text":
            needs = f"a string field {names[0]!r}"
        elif shape.name == "messages":
            needs = f"a non-empty list {names[0]!r}"
        elif names == ["prompt"] and "prompt" not in self.columns:
            needs = "'prompt' (or 'input')"
        else:
            needs = str(names)
        others = [s for s in self.candidates if s is not shape]
        if guessed and others and len(missing) == len(shape.required):
            needs += (
                f" (or the columns of another {self.train_type} shape: "
                + "; ".join(describe_columns(s) for s in others)
                + ")"
            )
        elif not shape.canonical or len(self.candidates) > 1:
            needs += f" ({shape.name} shape)"
        unused = [str(key) for key in record if key not in found.values() and key not in names]
        hint = "".join(f"; column {column!r} is null" for column in names if column in record)
        for name, column in zip(missing, names, strict=True):
            close = difflib.get_close_matches(column, unused, n=1, cutoff=0.6)
            if close:
                hint += f"; the closest column to {column!r} is {close[0]!r}: --data_columns {name}={close[0]} reads it"
                break
        keys = _brief(sorted(str(key) for key in record))
        return UserError(f"{where}: {_a(self.train_type)} record needs {needs}, got keys {keys}{hint}")

    def describe(self) -> str:
        """The plan's words for the shapes read (``alpaca shape (52,002 records)``), or "" when every source had the
        train type's own shape under its own column names."""
        if self.data_format == "auto" and not self.columns and all(s.canonical for s, _ in self.sources.values()):
            return ""
        records: dict[str, list[int]] = {}
        for source, (shape, _) in self.sources.items():
            count = records.setdefault(shape.name, [0, 0])
            count[0] += self.counts.get(source, 0)
            count[1] += 1
        several = len(records) > 1
        parts = [
            f"{name} shape ({n:,} record{'s' * (n != 1)}" + (f" in {files} source(s))" if several else ")")
            for name, (n, files) in records.items()
        ]
        if self.columns:
            parts.append("columns " + ",".join(f"{name}={column}" for name, column in self.columns.items()))
        return ", ".join(parts)


def _a(train_type: str) -> str:
    return f"an {train_type}" if train_type == "sft" else f"a {train_type}"


def describe_columns(shape: Shape) -> str:
    """A shape's columns in an error line: ``instruction, output`` or ``chosen, rejected without prompt``."""
    text = ", ".join(shape.required)
    return text + "".join(f" without {name}" for name in shape.excludes)


def shape_records(
    records: Iterable[Record], train_type: str, data_format: str = "auto", data_columns: str | None = None
) -> tuple[list[Record], Shaper]:
    """Every record as its train type's canonical record (its ``where`` kept), and the ``Shaper`` that read them (for
    the plan: ``Shaper.describe``)."""
    shaper = Shaper(train_type, data_format, data_columns)
    return [(where, shaper(where, record)) for where, record in records], shaper
