"""What a Hugging Face family is to the engine: ``Family``, the record each file of ``families/`` fills in (its
model_type and transformers class, its config defaults and keys, the fields it reads and writes, its tensor names,
what it refuses), and ``Reader``, the typed reads of a ``config.json`` every family's code goes through.

The engine (``config.py``, ``rope.py``, ``weights.py``) asks these questions of whichever family a config or a model
belongs to and names no family itself; what a family does not override is Llama's answer, the layout every
transformers decoder shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import Tensor

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError

Refuse = Callable[[str, Any, str], None]
"""``refuse(field, value, why)``: raises the export's one-line ``ConfigError`` naming a field of ours."""
NamePairs = tuple[tuple[str, str], ...]
"""``(Hugging Face tensor name, ours)`` templates; ``{i}`` is a layer, ``{j}`` an expert."""


class Reader:
    """Typed reads of a Hugging Face config with its class's defaults; each error names the Hugging Face key."""

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any], source: str) -> None:
        self.raw, self.defaults, self.source = raw, defaults, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw[key] if key in self.raw else self.defaults.get(key, default)

    def int(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{self.source}: {key!r} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not (0 < value < math.inf):
            raise ConfigError(f"{self.source}: {key!r} must be a finite number > 0, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key!r} must be true or false, got {value!r}")
        return value

    def refuse(self, key: str, value: Any, why: str) -> None:
        raise ConfigError(f"{self.source}: {key} {value!r} is not supported: {why}; nothing was loaded")


def is_set(value: Any, off: Any) -> bool:
    """Whether an option differs from its off value, ``False`` and ``None`` both meaning off."""
    return (value or None) != (off or None)


class Family:
    """One transformers architecture (``model_type``), as this project maps it both ways. Subclasses set the class
    attributes and override the methods where the family departs from Llama's layout, the default here."""

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    """The transformers class of its causal LM (``modeling_<type>.py``)."""
    defaults: ClassVar[Mapping[str, Any]]
    """The config class's defaults (``configuration_<type>.py``), used where a config.json omits a key, as transformers
    itself does. Real checkpoints carry every key; hand-written or diffed configs may not."""
    keys: ClassVar[frozenset[str]] = frozenset()
    """The config keys it reads beyond those every family's are read for (``config.SHARED_KEYS``); others warn."""
    export_priority: ClassVar[int] = 0
    """Export asks the families from the lowest value up which one ``claims`` a model: a class computing a special
    case of another's function comes before it (Llama, the plainest, last)."""
    refused_relatives: ClassVar[Mapping[str, str]] = {}
    """model_types of related architectures refused by name, with the reason (what differs from this family)."""
    multimodal_model_type: ClassVar[str | None] = None
    """The model_type of a multimodal checkpoint whose language model is this family (only that is loaded)."""

    # --- config.json -> ModelConfig ----------------------------------------------------------------------------------
    activation: ClassVar[tuple[str, str]] = ("hidden_act", "silu")
    """The key naming its MLP's activation and the one value computed here."""
    reads_attention_bias: ClassVar[bool] = True
    """Whether its class reads ``attention_bias`` (then a true one, an o_proj bias, is refused)."""
    soft_capping: ClassVar[bool] = False
    """Whether its class soft-caps scores and logits (others refuse the soft-capping keys)."""
    partial_rotary: ClassVar[bool] = False
    """Whether its attention rotates part of each head (others refuse a ``partial_rotary_factor`` below 1)."""
    windows_per_layer: ClassVar[bool] = False
    """Whether sliding windows are computed layer by layer (else positions are limited to a window on every layer,
    where it equals full attention, and a window on some layers is refused)."""

    def fields(self, read: Reader) -> dict[str, Any]:
        """The ``ModelConfig`` fields particular to it, over those every family reads (``config.py``)."""
        return {}

    def sliding_window(self, read: Reader) -> Any:
        """The window its layers slide over, None for none (Qwen's applies only with ``use_sliding_window``)."""
        return read.get("sliding_window")

    def attention_kinds(self, read: Reader, window: int | None) -> set[str]:
        """The kinds of attention its layers have when the config lists no ``layer_types``: a set, not one per
        layer, since the layer count is not bounded yet. A window applies to every layer by default."""
        return {"sliding_attention" if window is not None else "full_attention"}

    # --- RoPE ---------------------------------------------------------------------------------------------------------
    def rope_parameters(self, read: Reader, params: dict[str, Any]) -> dict[str, Any]:
        """The RoPE parameters of its full-attention layers, out of the config's (one dict for most families)."""
        return params

    def rope_kind(self, read: Reader, kind: Any, params: Mapping[str, Any], key: str) -> Any:
        """``rope_type`` as its config class reads it, or the refusal of one it does not accept."""
        return kind

    def longrope_original(self, read: Reader, params: Mapping[str, Any]) -> Any:
        """longrope's original length: the RoPE dict's, else the model's own (``standardize_rope_params``)."""
        return params.get("original_max_position_embeddings", read.get("max_position_embeddings"))

    # --- ModelConfig -> config.json ---------------------------------------------------------------------------------
    only_class: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    """What only its class computes among those exported here, and the fields it needs for that (a model it
    ``claims`` with any other value is refused by field, ``require_only_class``)."""
    own_options: ClassVar[Mapping[str, Any]] = {}
    """Options of ours that only its class computes, at their off value: a model with one set is its, and another
    family's only-class check requires them off. Declared by the family that introduced them (one deriving from it
    inherits the same mapping)."""
    foreign_options: Mapping[str, Any] = {}
    """Every other family's ``own_options``: set by the registry (``families``), which knows them all."""

    def claims(self, config: ModelConfig) -> bool:
        """Whether its class is the one to export ``config`` to (before the checks that may still refuse it)."""
        return False

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        """Refuses (``refuse``) what its class cannot compute of a model it claims."""
        self.require_only_class(config, refuse)

    def require_only_class(self, config: ModelConfig, refuse: Refuse) -> None:
        """Refuses a field that differs from what its class needs (``only_class``), and any option only another
        family's class computes (``foreign_options``)."""
        if self.only_class is None:
            return
        what, needed = self.only_class
        for field, wanted in {**self.foreign_options, **needed}.items():
            if is_set(getattr(config, field), wanted):
                refuse(
                    field, getattr(config, field), f"{self.architecture}, the class with {what}, has {field} {wanted!r}"
                )

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        """Its ``config.json`` for ``config``: ``written``, every family's fields (``config.hf_config``), with its
        own added or taken out."""
        return written

    @property
    def sequence_classifier(self) -> str:
        """The transformers class of a reward model (one label) of this family: ``*ForSequenceClassification``."""
        return self.architecture.replace("ForCausalLM", "ForSequenceClassification")

    # --- tensors ----------------------------------------------------------------------------------------------------
    rotate_half: ClassVar[bool] = True
    """Whether its q/k rows pair dims in transformers' rotate-half layout (permuted to ours, ``weights.py``)."""
    fused: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """Tensors of its files that hold several of ours, rows stacked: its name within a block -> ours, in order."""
    skips_trailing_layers: ClassVar[bool] = False
    """Whether its files' layers past ``num_hidden_layers`` are modules the causal LM never runs (skipped)."""

    def tensor_names(self, config: ModelConfig | None) -> NamePairs:
        """Its own tensor names, found before those every family shares (``weights.SHARED_NAMES``); for no config,
        every name it may use."""
        return ()
