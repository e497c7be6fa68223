"""Recipes and command lines as the parsers take them (``cli``): a recipe file read as data (YAML's safe loader,
AstrAI's sections flattened), and the spellings of a command line made ours: AstrAI's (``-c``, ``--no-X``, bare
booleans, ``--dry-run``, repeated list flags), other projects' names (``config.aliases``) and booleans as
transformers writes them, each read as ours and said in the run's notes; unknown names refused with what to give
instead. Imports neither jsonargparse nor torch: a mistaken flag is refused before either is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from astrai_fabric.config.aliases import ALIASES as OTHER_NAMES
from astrai_fabric.config.aliases import NOT_TAKEN, WHOLE_NUMBERS, Alias, alias_problem, whole_number
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import UserError
from astrai_fabric.regular_files import open_regular_file

ASTRAI_SECTIONS = ("model", "data", "parallel", "training", "ckpt", "log")
IGNORED_SECTIONS = ("runtime",)
ALIASES = {name: alias.flag for name, alias in OTHER_NAMES.items()}
"""Other projects' names of a training flag or recipe key → the field (``config.aliases``)."""
ONE_OF = {"the warmup": ("warmup_steps", "warmup_ratio")}
"""Flags that set one thing two ways: where a later recipe or the command line gives one, an earlier recipe's other
is unset (``TrainArgs.validate`` refuses the two from one source)."""
MAX_RECIPE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Flags:
    """The flags of one command, from its arguments dataclass: all names, the booleans, the repeatable lists, and
    other projects' names for them (the training commands': ``config.aliases``; none for the others)."""

    names: frozenset[str]
    bools: frozenset[str]
    lists: frozenset[str]
    aliases: dict[str, Alias] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, args_type: type, aliases: dict[str, Alias] | None = None) -> Flags:
        hints = typing.get_type_hints(args_type)
        bools = {n for n, h in hints.items() if h is bool or bool in typing.get_args(h)}
        lists = {n for n, h in hints.items() if typing.get_origin(h) is list}
        return cls(frozenset(hints), frozenset(bools), frozenset(lists), dict(aliases or {}))

    def field_of(self, name: str) -> str:
        """The field ``name`` sets: itself, or the one it is another name of."""
        return self.aliases[name].flag if name in self.aliases else name

    def is_boolean(self, name: str) -> bool:
        """Whether ``--name`` alone means true (and ``--no-name`` false)."""
        return name in self.aliases and self.aliases[name].takes_bare or self.field_of(name) in self.bools


TRAIN_FLAGS = Flags.of(TrainArgs, OTHER_NAMES)


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader (plain data only), refusing what YAML allows but a recipe must not hold: a key given twice
    (YAML keeps the last one silently), a key that is not a string, and aliases (``*name``: shared or exponentially
    large values)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a recipe", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None, None, f"keys must be strings, got {key!r}", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_recipe(path: Path, notes: list[str] | None = None) -> dict[str, Any]:
    """A recipe's keys, flat: AstrAI's sections merged, ``runtime`` dropped, other projects' names read as ours (each
    said in ``notes``), unknown keys refused."""
    with open_regular_file(path, name=f"--config {path}") as recipe:  # a FIFO, a device, a dangling link: refused
        if recipe.size_bytes > MAX_RECIPE_BYTES:
            raise UserError(f"{path}: {recipe.size_bytes:,} bytes; a recipe is a short YAML file (at most 1 MiB)")
        text = recipe.read()
    try:
        raw = yaml.load(text.decode("utf-8"), Loader=_RecipeLoader) or {}
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"{path}: not valid YAML{at}: {' '.join(str(err.problem or err.context).split())}") from None
    except (yaml.YAMLError, RecursionError, ValueError) as err:  # ValueError: an integer of over 4300 digits
        raise UserError(f"{path}: not valid YAML ({one_line(err)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of flags to values, got {type(raw).__name__}")
    flat: dict[str, Any] = {}
    given: dict[str, tuple[str, Any]] = {}  # field -> the key and value it was given by
    read_as: list[str] = []
    for key, value in raw.items():
        if key in IGNORED_SECTIONS:
            continue
        items = value.items() if key in ASTRAI_SECTIONS and isinstance(value, dict) else [(key, value)]
        for name, item in items:
            field = TRAIN_FLAGS.field_of(name)
            earlier = given.get(field)
            if earlier is not None and earlier != (name, item) and (name in ALIASES or earlier[0] != name):
                if earlier[0] != name:
                    raise UserError(f"{path}: {earlier[0]} and {name} both set {field}: give one")
                raise UserError(f"{path}: {name} given twice, {_shown(earlier[1])} and {_shown(item)}: give one")
            given[field] = (name, item)
            if TRAIN_FLAGS.is_boolean(name):
                item = _boolean_value(item)
            flat[field] = _as_ours(name, item, TRAIN_FLAGS, f"{path}: ", _shown)
            if name in ALIASES and OTHER_NAMES[name].origin != "AstrAI":
                _note(read_as, name, field, _shown(item), _shown(flat[field]), False)
    for what, pair in ONE_OF.items():
        if all(flat.get(name) is not None for name in pair):  # a resolved recipe holds the unset one as null
            raise UserError(f"{path}: {' and '.join(pair)} both set {what}: give one")
    if read_as and notes is not None:
        notes.append(f"{path}: {', '.join(read_as)}")
    unknown = [k for k in flat if k not in TRAIN_FLAGS.names]
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(with_suggestion(k, TRAIN_FLAGS) for k in unknown)}")
    return flat


def normalize(argv: list[str], flags: Flags, check_choices: bool = True, notes: list[str] | None = None) -> list[str]:
    """AstrAI's spellings → ours: ``-c``, ``--no-X``, bare booleans, ``--dry-run``, repeated list flags; other
    projects' names (``flags.aliases``) → ours, with their values read as ours (each said in ``notes``). One flag
    given by two of its names, or by one of them twice with different values, is refused (ours twice: the last
    wins, as in AstrAI)."""
    out: list[str] = []
    lists: dict[str, list[str]] = {}
    given: dict[str, tuple[str, str]] = {}  # field -> the name and value it was given by
    read_as: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "-c":
            token = "--config"
        if token.startswith("--config="):  # one token, as argparse also takes it
            out += ["--config", token.removeprefix("--config=")]
            continue
        if not token.startswith("--") or token in ("--config", "--print_config", "--help"):
            out.append(token)
            continue
        spelled, has_value, value = token[2:].partition("=")
        negated = spelled.startswith("no-") and flags.is_boolean(spelled[3:])
        name = spelled[3:] if negated else spelled
        field = flags.field_of(name)
        if negated:
            value = "false"
        elif not has_value:
            bare = i >= len(argv) or argv[i].startswith("--")
            if bare and flags.is_boolean(name):
                value = "true"
            elif bare and check_choices and field not in flags.names:
                raise UserError(f"unknown flag {with_suggestion(name, flags, '--')}")
            elif bare:
                out.append(f"--{field}")  # let the parser say what is missing
                continue
            else:
                value, i = argv[i], i + 1
        if check_choices and field not in flags.names:
            raise UserError(f"unknown flag {with_suggestion(name, flags, '--')}")
        if flags.is_boolean(name):
            value = _boolean_word(value)
        if field in given and (name, value) != given[field] and (name in flags.aliases or given[field][0] != name):
            earlier, earlier_value = given[field]
            raise UserError(
                f"--{earlier} {earlier_value} and --{name} {value} both set --{field}: give one"
                if earlier != name
                else f"--{name} given twice, {earlier_value} and {value}: give one"
            )
        given[field] = (name, value)
        ours = _as_ours(name, value, flags, "--", str)
        if name in flags.aliases and flags.aliases[name].origin != "AstrAI":
            _note(read_as, f"--{spelled}", f"--{field}", value, ours, flags.is_boolean(name))
        value = ours
        if field in flags.lists and not value.startswith("["):
            lists.setdefault(field, []).append(value)
            continue
        out.append(f"--{field}={value}")
    for what, pair in ONE_OF.items():
        if all(name in given and given[name][1] != "null" for name in pair):
            both = " and ".join(f"--{name} {given[name][1]}" for name in pair)
            raise UserError(f"{both} both set {what}: give one")
    if read_as and notes is not None:
        notes.append(", ".join(read_as))
    out += [f"--{name}={json.dumps(values)}" for name, values in lists.items()]
    return out


def _note(notes: list[str], theirs: str, ours: str, value: str, our_value: str, boolean: bool) -> None:
    """Say in ``notes`` that ``theirs`` was read as ``ours``, the values shown where they differ (``--bf16`` as
    ``--precision bf16-mixed``, ``--num_train_epochs 3.0`` as ``--n_epoch 3``); a boolean's is its spelling."""
    same = str(our_value) == str(value)
    if boolean and value == "false" and not theirs.startswith("--no-"):
        theirs += " false"
    elif not same and not boolean:
        theirs += f" {value}"
    if not same:
        ours += f" {our_value}"
    elif boolean and value == "false":
        ours = ours.replace("--", "--no-", 1)
    if (note := f"{theirs} as {ours}") not in notes:
        notes.append(note)


BOOLEAN_WORDS = {"true": True, "t": True, "yes": True, "y": True, "1": True,
                 "false": False, "f": False, "no": False, "n": False, "0": False}  # fmt: skip
"""A boolean as transformers spells one, in any case (``HfArgumentParser``'s ``string_to_bool``): ``--bf16 True``."""


def _boolean_word(value: str) -> str:
    """A command line's boolean (``BOOLEAN_WORDS``) as ours, ``true`` or ``false``; anything else as given, for the
    parser to refuse."""
    word = BOOLEAN_WORDS.get(value.lower())
    return value if word is None else str(word).lower()


def _boolean_value(value: Any) -> Any:
    """A recipe's boolean spelled as a word (``BOOLEAN_WORDS``) or as 0 or 1, as a bool; anything else as given."""
    if isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.lower()]
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


def _as_ours(name: str, value: Any, flags: Flags, prefix: str, shown: Callable[[Any], str]) -> Any:
    """``value`` given to ``name`` (a flag's string, a recipe's YAML value) as our flag reads it: another project's
    value spelled as ours, an integral ``3.0`` where ours counts in whole numbers; refused where the meanings part
    (the message names it as ``prefix`` + ``name`` + its value ``shown``)."""
    problem = None
    if name in flags.aliases:
        value, problem = alias_problem(name, value)
    elif name in WHOLE_NUMBERS and name in flags.names:
        value, problem = whole_number(value, WHOLE_NUMBERS[name])
    if problem is not None:
        raise UserError(f"{prefix}{name} {shown(value)}: {problem}")
    return value


def with_suggestion(name: str, flags: Flags, prefix: str = "") -> str:
    """``name`` with what to give instead, spelled as the user wrote it (``prefix`` ``--`` for a flag, nothing for a
    recipe key): by meaning first (another project's name we do not take, ``config.aliases.NOT_TAKEN``), then by
    spelling (the closest of the flags and their other names)."""
    meanings = NOT_TAKEN if flags.aliases else {}  # the training flags' table
    if name in meanings:
        return f"{prefix}{name} ({meanings[name]})"
    if prefix and name.startswith("no-"):  # AstrAI's negation of a boolean flag: suggest a negation
        booleans = [n for n in [*flags.bools, *flags.aliases] if flags.is_boolean(n)]
        close = [f"no-{n}" for n in difflib.get_close_matches(name[3:], booleans, n=1)]
    else:
        close = difflib.get_close_matches(name, [*flags.names, *flags.aliases, *meanings], n=1)
    if close and close[0] in meanings:
        return f"{prefix}{name} (did you mean {prefix}{close[0]}? Not taken here: {meanings[close[0]]})"
    return f"{prefix}{name} (did you mean {prefix}{close[0]}?)" if close else f"{prefix}{name}"


def _shown(value: Any) -> str:
    """A recipe's value as YAML writes it, on one line (``true``, ``0.5``, ``linear``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=200).removesuffix("\n...\n").strip()


def one_line(err: Exception) -> str:
    """A parser's or YAML's message on one line."""
    return " ".join(str(err).split())
