"""Qwen2 (``modeling_qwen2.py``): Llama's block with q/k/v biases (no o bias), and a sliding window that applies
only with ``use_sliding_window``, to the layers from ``max_window_layers`` on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.families.llama import check_block
from astrai_fabric.checkpoint.hf.family import Family, Reader, Refuse
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


class Qwen2(Family):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    defaults = dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=4096,
        max_window_layers=28,
    )
    keys = frozenset({"use_sliding_window", "max_window_layers"})
    export_priority = 90
    reads_attention_bias = False  # its q/k/v biases are built in; the class never reads attention_bias

    def fields(self, read: Reader) -> dict[str, Any]:
        return dict(attention_qkv_bias=True)

    def sliding_window(self, read: Reader) -> Any:
        return read.get("sliding_window") if read.get("use_sliding_window", False) else None

    def attention_kinds(self, read: Reader, window: int | None) -> set[str]:
        """With a window, the layers ``>= max_window_layers`` slide."""
        if window is None:
            return {"full_attention"}
        n_layers, first_full = read.int("num_hidden_layers"), max_window_layers(read)
        windowed, full = first_full < n_layers, first_full > 0
        return {kind for kind, present in (("sliding_attention", windowed), ("full_attention", full)) if present}

    def claims(self, config: ModelConfig) -> bool:
        return bool(config.attention_qkv_bias)

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        check_block(config, state, refuse)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {
            **written,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.num_hidden_layers,
        }


FAMILY = Qwen2()


def max_window_layers(read: Reader) -> int:
    first_full = read.get("max_window_layers")
    if not isinstance(first_full, int) or isinstance(first_full, bool):
        raise ConfigError(f"{read.source}: 'max_window_layers' must be an integer, got {first_full!r}")
    return first_full
