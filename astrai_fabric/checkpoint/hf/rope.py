"""RoPE in a Hugging Face config, read as transformers reads it: both config forms (transformers 4's ``rope_theta``
+ ``rope_scaling``, transformers 5's ``rope_parameters``), the scaled kinds (``linear`` and ``llama3`` with their own
formulas; ``yarn``, its frequencies blended by rotations over the original length and cos/sin times its attention
factor; ``longrope`` and ``dynamic``, frequencies chosen per forward by its length past the original one) kept in
``rope_frequency_scaling`` for every family, and the share of each head that rotates. AstrAI's ``rope_scaling``
(NTK) is another function, never read from here."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from astrai_fabric.checkpoint.hf.family import Family, Reader
from astrai_fabric.config.model import YARN_OPTIONAL
from astrai_fabric.errors import ConfigError

ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate", "short_factor", "long_factor",
}  # fmt: skip
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def read_rope(read: Reader, family: Family) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_frequency_scaling)`` from either form, read as transformers 5 does
    (``PreTrainedConfig.convert_rope_params_to_dict``): transformers 4's ``rope_scaling`` wins over
    ``rope_parameters``, a theta inside the dict over the top-level ``rope_theta``, ``rope_type`` over ``type``."""
    params = read.get("rope_scaling") or read.get("rope_parameters") or {}
    key = "rope_scaling" if read.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ConfigError(f"{read.source}: {key!r} must be an object, got {params!r}")
    params = family.rope_parameters(read, params)
    if any(isinstance(v, dict) for v in params.values()):
        read.refuse(key, "(per layer type)", "RoPE parameters per attention type are not mapped")
    theta = params.get("rope_theta", read.get("rope_theta"))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not (0 < theta < math.inf):
        raise ConfigError(f"{read.source}: rope_theta must be a finite number > 0, got {theta!r}")
    kind = family.rope_kind(read, params.get("rope_type", params.get("type", "default")), params, key)
    if kind not in ROPE_TYPES:
        read.refuse(f"{key} rope_type", kind, f"the RoPE types mapped are {list(ROPE_TYPES)}")
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        warnings.warn(f"{read.source}: ignoring {key} keys the {kind} RoPE does not use: {unknown}", stacklevel=3)
    if kind == "default":
        return float(theta), None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": params.get("factor")}
    if kind == "llama3":
        scaling.update(
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            # transformers' default when absent: the model's own maximum length
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", read.get("max_position_embeddings")
            ),
        )
    if kind == "yarn":
        scaling.update(_yarn(read, params))
    elif kind == "longrope":
        scaling.update(_longrope(read, params, family.longrope_original(read, params)))
    elif kind == "dynamic":
        # transformers rescales past the model's own max_position_embeddings (``_compute_dynamic_ntk_parameters``)
        scaling.update(original_max_position_embeddings=read.get("max_position_embeddings"))
    return float(theta), scaling


def _yarn(read: Reader, params: Mapping[str, Any]) -> dict[str, Any]:
    """A yarn ``rope_frequency_scaling``'s numbers, with transformers' defaults (``_compute_yarn_parameters``,
    ``standardize_rope_params``): the original length is the model's own, the factor their ratio, ``beta_fast``
    32 and ``beta_slow`` 1 (also for 0); the optional ones only when set."""
    original = params.get("original_max_position_embeddings", read.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and isinstance(original, int | float) and original > 0:
        factor = read.int("max_position_embeddings") / original
    optional = {name: params[name] for name in (*YARN_OPTIONAL, "truncate") if params.get(name) is not None}
    return dict(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=params.get("beta_fast") or 32,
        beta_slow=params.get("beta_slow") or 1,
        **optional,
    )


def _longrope(read: Reader, params: Mapping[str, Any], original: Any) -> dict[str, Any]:
    """A longrope ``rope_frequency_scaling``'s numbers, read as transformers does (``_compute_longrope_parameters``)
    over the family's original length (``Family.longrope_original``): the factor, when absent, is
    ``max_position_embeddings / original``; ``attention_factor`` only when set."""
    factor = params.get("factor")
    if factor is None and isinstance(original, int | float) and original > 0:
        factor = read.int("max_position_embeddings") / original
    optional = {"attention_factor": params["attention_factor"]} if params.get("attention_factor") is not None else {}
    return dict(
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=params.get("short_factor"),
        long_factor=params.get("long_factor"),
        **optional,
    )


def dynamic_limit(limit: int, scaling: dict[str, Any] | None) -> int:
    """The positions a dynamic NTK model runs to here: transformers' class has no limit (the base keeps growing with
    the length) but ours needs one for its tables and its length checks, so ``factor`` times the original length,
    the extension the factor names; a sliding window shorter than the original length (``position_limit``) stays."""
    if scaling is None or scaling["rope_type"] != "dynamic" or limit != scaling["original_max_position_embeddings"]:
        return limit
    factor = scaling["factor"]
    return int(factor * limit) if isinstance(factor, int | float) and factor >= 1 and math.isfinite(factor) else limit


def rotary_dim(read: Reader, family: Family, head_dim: int) -> int | None:
    """How many of each head's first dims RoPE rotates, None for all: ``int(head_dim * partial_rotary_factor)``
    (``modeling_phi3.py``), the factor read from the RoPE parameters first, as transformers 5 does. Only a family
    whose attention splits its heads so reads it (Llama's would rotate a whole head with a shorter table)."""
    params = read.get("rope_scaling") or read.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", read.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return None
    if not family.partial_rotary:
        read.refuse("partial_rotary_factor", factor, f"{family.model_type}'s attention here rotates whole heads")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor < 1:
        raise ConfigError(f"{read.source}: 'partial_rotary_factor' must be a number in (0, 1], got {factor!r}")
    return int(head_dim * factor)
