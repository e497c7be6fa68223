"""Gemma 3 (``modeling_gemma3.py``): Gemma 2's block (``gemma2.py``) with per-head q/k norms before RoPE, a RoPE base
of its own for the sliding layers (transformers 5's ``rope_parameters["sliding_attention"]``, transformers 4's
``rope_local_base_freq``) and five sliding layers in six by default. A multimodal ``gemma3`` checkpoint's language
model loads as this family, its other towers left out."""

from __future__ import annotations

import math
from typing import Any

from astrai_fabric.checkpoint.hf.families.gemma2 import Gemma2, uses_gemma_options
from astrai_fabric.checkpoint.hf.family import Reader
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


class Gemma3(Gemma2):
    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    defaults = dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        hidden_activation="gelu_pytorch_tanh",
    )
    # _sliding_window_pattern: its private copy of sliding_window_pattern, written beside the layer_types it made
    keys = Gemma2.keys | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
    export_priority = 20
    refused_relatives = {}
    multimodal_model_type = "gemma3"
    default_sliding_pattern = None  # sliding_window_pattern
    only_class = (
        "Gemma 2's block with per-head q/k norms",
        dict(
            norm_placement="sandwich",
            norm_unit_offset=True,
            scale_embeddings=True,
            mlp_activation="gelu_pytorch_tanh",
            use_qk_norm=True,
            qk_norm_before_rope=True,
            qk_norm_over_projection=False,
            attention_qkv_bias=False,
            ffn_type="mlp",
            rotary_dim=None,
        ),
    )

    @property
    def sequence_classifier(self) -> str:
        return "Gemma3TextForSequenceClassification"  # Gemma3ForSequenceClassification is the multimodal model's

    def fields(self, read: Reader) -> dict[str, Any]:
        return {
            **super().fields(read),
            "use_qk_norm": True,
            "qk_norm_before_rope": True,
            "rope_local_theta": local_rope_theta(read),
        }

    def rope_parameters(self, read: Reader, params: dict[str, Any]) -> dict[str, Any]:
        full = params.get("full_attention")
        return full if isinstance(full, dict) else params  # the sliding layers' own: ``local_rope_theta``

    def claims(self, config: ModelConfig) -> bool:
        return uses_gemma_options(config) and bool(config.use_qk_norm)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        written = super().write(config, written, where)
        sliding = "sliding_attention" in written["layer_types"]
        if sliding and config.rope_local_theta is None and config.rope_frequency_scaling is not None:
            raise ConfigError(
                f"{where}: rope_frequency_scaling {config.rope_frequency_scaling!r} cannot be exported "
                "to Hugging Face: Gemma 3's sliding layers take the default RoPE, and these share the "
                "scaled one (rope_local_theta is not set)"
            )
        return {**written, "rope_local_base_freq": config.rope_local_theta or written["rope_theta"]}


FAMILY = Gemma3()


def local_rope_theta(read: Reader) -> float:
    """The sliding layers' RoPE base: transformers 5's ``rope_parameters["sliding_attention"]`` (default RoPE only),
    else transformers 4's ``rope_local_base_freq``."""
    params = read.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if not isinstance(local, dict):
        return read.number("rope_local_base_freq")
    if local.get("rope_type", "default") != "default":
        read.refuse(
            "rope_parameters sliding_attention rope_type",
            local.get("rope_type"),
            "the sliding layers' RoPE here is the default one",
        )
    if not isinstance(local.get("rope_theta"), int | float) or not 0 < local["rope_theta"] < math.inf:
        raise ConfigError(f"{read.source}: rope_parameters sliding_attention rope_theta must be a finite number > 0")
    return float(local["rope_theta"])
