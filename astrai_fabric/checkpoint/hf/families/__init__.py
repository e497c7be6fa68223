"""The Hugging Face families, one module each, found here: every module of this folder holds one ``FAMILY`` (a
``family.Family``), so adding a family is adding its file. A family that builds on another (Qwen3 on Qwen2, Gemma 3
on Gemma 2, the MoE classes on Llama's block) imports what it shares from that file, as transformers' own modular
files do.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping

from astrai_fabric.checkpoint.hf.family import Family
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


def _discover() -> tuple[Family, ...]:
    found = [importlib.import_module(f"{__name__}.{module.name}").FAMILY for module in pkgutil.iter_modules(__path__)]
    return tuple(sorted(found, key=lambda family: (family.export_priority, family.model_type)))


FAMILIES = _discover()
"""Every family, in the order export asks them (``Family.export_priority``)."""
for _family in FAMILIES:
    _family.foreign_options = {
        field: off
        for other in FAMILIES
        if other.own_options is not _family.own_options
        for field, off in other.own_options.items()
    }
BY_MODEL_TYPE: Mapping[str, Family] = {family.model_type: family for family in FAMILIES}
SUPPORTED_MODEL_TYPES = tuple(sorted(BY_MODEL_TYPE))
MULTIMODAL: Mapping[str, Family] = {f.multimodal_model_type: f for f in FAMILIES if f.multimodal_model_type}
"""Multimodal model_types whose language model is loaded alone, by that language model's family."""
REFUSED_MODEL_TYPES = {name: why for family in FAMILIES for name, why in family.refused_relatives.items()}
"""Architectures refused with the reason; any other model_type is refused as unknown."""


def family(model_type: str, source: str = "config.json") -> Family:
    """The family of a supported ``model_type``, else a ``ConfigError`` naming it and why."""
    if model_type not in BY_MODEL_TYPE:
        why = REFUSED_MODEL_TYPES.get(model_type, "unknown architecture")
        raise ConfigError(
            f"{source}: Hugging Face model_type {model_type!r} is not supported ({why}); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return BY_MODEL_TYPE[model_type]


def claiming(config: ModelConfig) -> Family:
    """The family whose class computes ``config``'s function (the first to claim it; Llama claims every model), the
    one export writes and whose tensor names a model's files carry."""
    return next(family for family in FAMILIES if family.claims(config))
