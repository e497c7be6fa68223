"""Qwen3 (``modeling_qwen3.py``): Qwen2's layout without the q/k/v biases, with each q/k head normalised before
RoPE (``qk_norm_before_rope``) and ``head_dim`` set on its own (``heads x head_dim`` may differ from
``hidden_size``)."""

from __future__ import annotations

from typing import Any

from astrai_fabric.checkpoint.hf.families.qwen2 import Qwen2
from astrai_fabric.checkpoint.hf.family import Reader
from astrai_fabric.config.model import ModelConfig


class Qwen3(Qwen2):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    defaults = dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=4096,
        max_window_layers=28,
    )
    export_priority = 100
    reads_attention_bias = True

    def fields(self, read: Reader) -> dict[str, Any]:
        return dict(use_qk_norm=True, qk_norm_before_rope=True)

    def claims(self, config: ModelConfig) -> bool:
        return bool(config.use_qk_norm)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {**super().write(config, written, where), "attention_bias": False}


FAMILY = Qwen3()
