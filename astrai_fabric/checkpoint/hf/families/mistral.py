"""Mistral (``modeling_mistral.py``): Llama's function with a sliding window over every layer, which loading turns
into a position limit where the two agree. Export never writes it: Llama's class computes the same."""

from __future__ import annotations

from astrai_fabric.checkpoint.hf.family import Family


class Mistral(Family):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    defaults = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=4096,
    )
    export_priority = 1000  # claims no model: asked last


FAMILY = Mistral()
