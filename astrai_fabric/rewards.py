"""Reward functions for online GRPO, named in the recipe by import path (AstrAI's ``BaseRewardModel.score`` shape).

A reward is any callable ``reward(prompts, responses, records) -> [B][G] numbers``: ``prompts`` are the B prompt
texts, ``responses`` the G sampled texts per prompt, ``records`` the B JSONL records (for reference answers). The
recipe names it as ``reward: {class_path: package.module.Class, init_args: {...}}`` (a class is instantiated with
``init_args``, a function is used as is) or simply ``reward: package.module.function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
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


def load_reward(spec: str | dict[str, Any]) -> Reward:
    """Import and build the reward a recipe names (see the module docstring)."""
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if not isinstance(spec, dict) or "class_path" not in spec or set(spec) - {"class_path", "init_args"}:
        raise ConfigError(f"reward must be an import path or {{class_path, init_args}}, got {spec!r}")
    path, init_args = spec["class_path"], spec.get("init_args") or {}
    module_name, _, name = path.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"reward {path!r} cannot be imported ({err})") from None
    if isinstance(target, type):
        try:
            return target(**init_args)
        except TypeError as err:
            raise ConfigError(f"reward {path!r}: bad init_args {init_args} ({err})") from None
    if init_args:
        raise ConfigError(f"reward {path!r} is a function: it takes no init_args")
    return target


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
