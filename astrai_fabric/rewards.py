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
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from astrai_fabric.errors import ConfigError


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


def score(reward: Reward, prompts: list[str], responses: list[list[str]], records: list[dict]) -> Tensor:
    """``rewards [B, G]`` (float32), checked: one finite number per response, or one clear error."""
    name = getattr(reward, "__qualname__", type(reward).__qualname__)
    values = reward(prompts, responses, records)
    shape = (len(responses), len(responses[0]))
    try:
        tensor = torch.as_tensor([[float(v) for v in row] for row in values], dtype=torch.float32)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"reward {name} must return {shape[0]} lists of {shape[1]} numbers ({err})") from None
    if tuple(tensor.shape) != shape:
        raise ConfigError(f"reward {name} returned shape {list(tensor.shape)}, expected {list(shape)} (prompts, group)")
    if not torch.isfinite(tensor).all():
        raise ConfigError(f"reward {name} returned non-finite values: {tensor.tolist()}")
    return tensor
