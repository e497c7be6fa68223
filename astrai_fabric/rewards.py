"""Reward functions for online GRPO, named in the recipe by import path (AstrAI's ``BaseRewardModel.score`` shape).

A reward is any callable ``reward(prompts, responses, records) -> [B][G] numbers``: ``prompts`` are the B prompt
texts, ``responses`` the G sampled texts per prompt, ``records`` the B JSONL records (for reference answers). The
recipe names it as ``reward: {class_path: package.module.Class, init_args: {...}}`` (a class is instantiated with
``init_args``, a function is used as is) or simply ``reward: package.module.function``. A recipe is data: only the
bundled rewards resolve by default; naming any other code needs ``--trust_code`` on the command line.
"""

from __future__ import annotations

import importlib
import inspect
import reprlib
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from astrai_fabric.errors import ConfigError, UserError, keep_traceback


class Reward(Protocol):
    def __call__(
        self, prompts: list[str], responses: list[list[str]], records: list[dict[str, Any]]
    ) -> Sequence[Sequence[float]]: ...


class LengthReward:
    """``-|len(response) - target_chars| / target_chars``: best (0) at exactly ``target_chars`` characters."""

    def __init__(self, target_chars: int = 16) -> None:
        if target_chars < 1:
            raise ConfigError(f"LengthReward: target_chars must be positive, got {target_chars}")
        self.target_chars = target_chars

    def __call__(self, prompts: list[str], responses: list[list[str]], records: list[dict]) -> list[list[float]]:
        return [[-abs(len(r) - self.target_chars) / self.target_chars for r in group] for group in responses]


class ExactMatchReward:
    """1 when the response, stripped, equals the record's ``field`` (stripped), else 0 (e.g. arithmetic answers)."""

    def __init__(self, field: str = "answer") -> None:
        self.field = field

    def __call__(self, prompts: list[str], responses: list[list[str]], records: list[dict]) -> list[list[float]]:
        out = []
        for record, group in zip(records, responses, strict=True):
            if self.field not in record:
                raise ConfigError(f"ExactMatchReward: a prompt record has no {self.field!r} field: {record}")
            answer = str(record[self.field]).strip()
            out.append([float(r.strip() == answer) for r in group])
        return out


BUNDLED: dict[str, Callable[..., Any]] = {
    "astrai_fabric.rewards.LengthReward": LengthReward,
    "astrai_fabric.rewards.ExactMatchReward": ExactMatchReward,
}
"""The rewards a recipe may name without ``--trust_code``, by import path (resolved here, nothing is imported)."""


def reward_spec_problem(spec: Any, trust_code: bool) -> str | None:
    """Why ``spec`` (a recipe's ``reward``) cannot be used, or None. Checked before anything runs or is written."""
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("class_path"), str)
        or set(spec) - {"class_path", "init_args"}
    ):
        return f"reward must be an import path or {{class_path, init_args}}, got {spec!r}"
    if not isinstance(spec.get("init_args") or {}, dict):
        return f"reward init_args must be a mapping of argument names to values, got {spec['init_args']!r}"
    if spec["class_path"] not in BUNDLED and not trust_code:
        return (
            f"reward {spec['class_path']!r} is not one of the bundled rewards ({', '.join(BUNDLED)}); importing other "
            "code runs it, so it needs --trust_code on the command line (a recipe cannot set it)"
        )
    return None


def load_reward(spec: str | dict[str, Any], trust_code: bool = False) -> Reward:
    """Build the reward a recipe names (see the module docstring). Outside ``BUNDLED`` only with ``trust_code``, and
    then only a function or a class whose instances are called as ``reward(prompts, responses, records)``: never an
    arbitrary class with arbitrary arguments (``subprocess.Popen`` is a class too)."""
    if problem := reward_spec_problem(spec, trust_code):
        raise ConfigError(problem)
    spec = {"class_path": spec} if isinstance(spec, str) else spec
    path, init_args = spec["class_path"], spec.get("init_args") or {}
    target = BUNDLED.get(path) or _import(path)
    if isinstance(target, type):
        call = next((vars(base)["__call__"] for base in target.__mro__[:-1] if "__call__" in vars(base)), None)
        if call is None or not _takes_three_arguments(call, skip_self=True):
            raise ConfigError(
                f"reward {path!r} is a class whose instances are not rewards (no __call__(prompts, responses, records))"
            )
        try:
            return target(**init_args)
        except TypeError as err:
            raise ConfigError(f"reward {path!r}: bad init_args {init_args} ({err})") from None
    if not inspect.isfunction(target) or not _takes_three_arguments(target):
        raise ConfigError(f"reward {path!r} is neither a function of (prompts, responses, records) nor a reward class")
    if init_args:
        raise ConfigError(f"reward {path!r} is a function: it takes no init_args")
    return target


def _import(path: str) -> Any:
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"reward {path!r} cannot be imported ({err})") from None


def _takes_three_arguments(function: Any, skip_self: bool = False) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return False
    dummies = ([None] if skip_self else []) + [[], [], []]
    try:
        signature.bind(*dummies)
    except TypeError:
        return False
    return True


FLOAT32_MAX = torch.finfo(torch.float32).max
"""The largest reward a float32 holds (offline rewards are held to it too: ``data/records.check_rewards``)."""


def reward_name(reward: Reward) -> str:
    """The import path a reward goes by in messages: the function's, or the class's of an instance."""
    target = reward if inspect.isfunction(reward) else type(reward)
    return f"{target.__module__}.{target.__qualname__}"


def score(
    reward: Reward,
    prompts: list[str],
    responses: list[list[str]],
    records: list[dict],
    traceback_dir: Path | None = None,
) -> Tensor:
    """``rewards [B, G]`` (float32), checked: one finite number per response (an int or a float, not a bool, a
    string or None: nothing is passed through ``float()``), or one clear error naming the reward.

    A reward that is not one of ``BUNDLED`` is the user's code: whatever it raises (or raises while its result is
    iterated) is their mistake, a ``UserError`` naming the function and the exception, its traceback written to
    ``traceback_dir/reward-error-HOST-PID.log`` (stderr where there is no such directory)."""
    name = reward_name(reward)
    if (reward if inspect.isfunction(reward) else type(reward)) in BUNDLED.values():  # ours: its errors are too
        values = _rows(reward(prompts, responses, records))
    else:
        try:
            values = _rows(reward(prompts, responses, records))
        except (Exception, SystemExit) as err:  # whatever the user's code raises is theirs to see (sys.exit too)
            where = _keep_traceback(err, traceback_dir)
            summary = " ".join("".join(traceback.format_exception_only(type(err), err)).split())[:300]
            raise UserError(f"your reward function {name} raised {summary} ({where})") from err
    shape = [len(responses), len(responses[0])]
    if not isinstance(values, list) or not all(isinstance(row, list) for row in values):
        raise ConfigError(
            f"reward {name} returned {_kind(values)}; it must return {shape[0]} lists of {shape[1]} numbers (one per "
            "response of each prompt)"
        )
    if len(values) != shape[0] or any(len(row) != shape[1] for row in values):
        lengths = sorted({len(row) for row in values})
        got = f"shape {[len(values), *lengths]}" if len(lengths) == 1 else f"lists of {lengths} numbers"
        raise ConfigError(f"reward {name} returned {got}, expected {shape} (prompts, group)")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if not _is_number(value):
                raise ConfigError(
                    f"reward {name} returned {_kind(value)} for response {j} of prompt {i}: a reward is a number "
                    "(an int or a float; not a bool, a string or None)"
                )
            if not (abs(value) <= FLOAT32_MAX):  # NaN fails too; a Python int past float's range compares
                raise ConfigError(_not_finite(name, value, i, j))
    return torch.tensor([[float(v) for v in row] for row in values], dtype=torch.float32)


def check_finite(rewards: Tensor, name: str) -> Tensor:
    """``rewards [B, G]`` a reward model computed (``reward_model.RewardModelScorer``), refused as a reward
    function's result is (``score``) where one is not finite: NaN or infinite scores would rank pairs and weigh
    advantages by nothing (every comparison with NaN is false) while the policy steps on them. Returns ``rewards``."""
    if bad := (~torch.isfinite(rewards)).nonzero().tolist():
        i, j = bad[0]
        raise ConfigError(_not_finite(name, rewards[i, j].item(), i, j))
    return rewards


def _not_finite(name: str, value: Any, i: int, j: int) -> str:
    return (
        f"reward {name} returned {_kind(value)} for response {j} of prompt {i}: rewards must be finite in float32 "
        "(|r| <= 3.4e38)"
    )


def _rows(values: Any) -> Any:
    """A reward's result as a list of lists where it is a sequence of sequences (a 2-d tensor or array too),
    else as it is, for the checks to name. Iterating it runs the user's code: this is called where that is theirs."""
    if not _is_sequence(values):
        return values
    return [list(row) if _is_sequence(row) else row for row in values]


def _is_sequence(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() > 0
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)


def _is_number(value: Any) -> bool:
    """A real number that is not a bool: Python's, numpy's or a 0-d tensor of a real dtype (types whose
    ``float()`` and ``abs()`` run no code of the user's)."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and value.dtype != torch.bool and not value.dtype.is_complex
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """``str ('1.0')``: a value's type and a short look at it, for a message (``reprlib``'s: bounded however large
    the value, and a ``__repr__`` of the user's that raises is no error)."""
    return f"{type(value).__name__} ({reprlib.repr(value)})" if value is not None else "None"


def _keep_traceback(err: BaseException, directory: Path | None) -> str:
    """Keep the traceback of the reward's exception, from the reward's own frame down (``errors.keep_traceback``:
    ``directory/reward-error-HOST-PID.log``, or stderr); say where."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None  # leave out score's own frame
    text = "".join(traceback.format_exception(type(err), err, tb))
    log = keep_traceback(text, directory, "reward-error", "your reward function's traceback")
    return f"its traceback: {log}" if log is not None else "its traceback above"
