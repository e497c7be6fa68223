"""The kind of a value read from outside against a field's annotation, checked before the value is used as a key,
compared or hashed: ``kind_problem`` says what is wrong in the words of the error message. One checker for every
typed schema read from a file or a flag (``ModelConfig`` from ``config.json``, ``TrainArgs`` from a recipe), so a
list where a string belongs is one line naming the field, never a ``TypeError`` deep inside."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

INT64_MAX = 2**63 - 1
"""Integers past int64 cannot reach torch (an ``OverflowError`` there), nor mean a count of anything."""


def kind_problem(value: Any, annotation: Any) -> str | None:
    """None when ``value`` is of the kind ``annotation`` names, else ``"must be ..., got ..."``. JSON's kinds: a
    bool is no integer; an integer is a fine float (JSON has one number); integers fit in int64; ``Literal[...]``
    is one of its values; ``list[X]`` holds only X."""
    allowed = _allowed(annotation)
    if _fits(value, allowed):
        return None
    if int in allowed and isinstance(value, int) and not isinstance(value, bool):
        return f"must fit in 64 bits (at most {INT64_MAX}), got {_show(value)}"
    return f"must be {' or '.join(_describe(kind) for kind in allowed)}, got {_show(value)}"


def wants_float(annotation: Any) -> bool:
    """Whether ``annotation`` accepts a float (a JSON integer read for it is converted)."""
    return float in _allowed(annotation)


def _allowed(annotation: Any) -> tuple[Any, ...]:
    """The kinds an annotation accepts: ``X | None`` → ``(X, NoneType)``; ``Literal`` and ``list[X]`` kept whole."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(kind for arg in typing.get_args(annotation) for kind in _allowed(arg))
    return (annotation,)


def _fits(value: Any, allowed: tuple[Any, ...]) -> bool:
    for kind in allowed:
        origin = typing.get_origin(kind)
        if kind is type(None) or kind is None:
            ok = value is None
        elif origin is typing.Literal:
            ok = any(type(value) is type(choice) and value == choice for choice in typing.get_args(kind))
        elif origin is list:
            (item,) = typing.get_args(kind) or (Any,)
            ok = isinstance(value, list) and (item is Any or all(_fits(v, _allowed(item)) for v in value))
        elif kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT64_MAX
        elif kind is float:
            ok = isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool))
        else:
            ok = isinstance(value, origin or kind)
        if ok:
            return True
    return False


def _describe(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if kind is type(None) or kind is None:
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(choice) for choice in typing.get_args(kind))
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        return "list" if item is Any else f"list of {' or '.join(_describe(k) for k in _allowed(item))}"
    return getattr(origin or kind, "__name__", str(kind))


def _show(value: Any) -> str:
    """The value as JSON, shortened: an error line, not a dump."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**20:
        text = f"about 10^{round(value.bit_length() * 0.30103)}"
    return text if len(text) <= 80 else text[:77] + "..."
