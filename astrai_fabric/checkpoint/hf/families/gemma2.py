"""Gemma 2 (``modeling_gemma2.py``): RMSNorms scaling by ``1 + weight`` before and after each sublayer
(``pre_feedforward_layernorm`` is the MLP's input norm, ``post_attention_layernorm`` the attention output's),
embeddings times ``sqrt(hidden_size)`` in the weight's dtype, GeGLU (``gelu_pytorch_tanh``), the softmax scale
``query_pre_attn_scalar ** -0.5``, soft-capping ``c * tanh(x / c)`` of the scores and the logits, and a sliding
window (``q - k < sliding_window``) on the ``layer_types`` layers, else every other one. Gemma 3 builds on this
file."""

from __future__ import annotations

from typing import Any, ClassVar

from astrai_fabric.checkpoint.hf.family import Family, Reader, is_set
from astrai_fabric.config.model import MAX_LAYERS, ModelConfig
from astrai_fabric.errors import ConfigError


class Gemma2(Family):
    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    defaults = dict(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    keys = frozenset({"hidden_activation", "query_pre_attn_scalar"})
    export_priority = 30
    refused_relatives = {
        "gemma": "its RMSNorm scales by (1 + weight), its embeddings by sqrt(hidden_size) and its MLP uses GELU",
    }
    activation = ("hidden_activation", "gelu_pytorch_tanh")
    soft_capping = True
    windows_per_layer = True
    own_options = dict(
        norm_unit_offset=False,
        scale_embeddings=False,
        mlp_activation="silu",
        query_pre_attn_scalar=None,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=None,
        layer_types=None,
        rope_local_theta=None,
    )
    only_class = (
        "norms around each sublayer scaling by 1 + weight, scaled embeddings and GeGLU",
        dict(
            norm_placement="sandwich",
            norm_unit_offset=True,
            scale_embeddings=True,
            mlp_activation="gelu_pytorch_tanh",
            use_qk_norm=None,
            attention_qkv_bias=False,
            ffn_type="mlp",
            rotary_dim=None,
            rope_local_theta=None,
        ),
    )
    default_sliding_pattern: ClassVar[int | None] = 2
    """Every how many layers one attends fully when the config lists no ``layer_types`` (None: its config says)."""

    def fields(self, read: Reader) -> dict[str, Any]:
        n_layers = read.int("num_hidden_layers")
        if n_layers > MAX_LAYERS:  # before a list of that length is made
            raise ConfigError(f"{read.source}: 'num_hidden_layers' must be at most {MAX_LAYERS:,}, got {n_layers:,}")
        layer_types = read.get("layer_types")
        if not layer_types:
            pattern = self.default_sliding_pattern or read.int("sliding_window_pattern")
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        sliding = isinstance(layer_types, list) and "sliding_attention" in layer_types
        return dict(
            norm_placement="sandwich",
            norm_unit_offset=True,
            scale_embeddings=True,
            mlp_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=read.int("query_pre_attn_scalar"),
            attn_logit_softcapping=read.get("attn_logit_softcapping"),
            final_logit_softcapping=read.get("final_logit_softcapping"),
            sliding_window=read.int("sliding_window") if sliding else None,
            layer_types=layer_types if sliding else None,
        )

    def claims(self, config: ModelConfig) -> bool:
        return uses_gemma_options(config) and not config.use_qk_norm

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        written = {key: value for key, value in written.items() if key != "hidden_act"}  # named hidden_activation
        return {
            **written,
            "hidden_activation": "gelu_pytorch_tanh",
            # None means head_dim ** -0.5 here, Gemma's query_pre_attn_scalar = head_dim
            "query_pre_attn_scalar": config.query_pre_attn_scalar or config.attention_head_dim,
            "attn_logit_softcapping": config.attn_logit_softcapping,
            "final_logit_softcapping": config.final_logit_softcapping,
            "layer_types": config.layer_types or ["full_attention"] * config.num_hidden_layers,
            "sliding_window": config.sliding_window or config.max_position_embeddings,  # used by no layer when unset
            "attention_bias": False,
        }


FAMILY = Gemma2()


def uses_gemma_options(config: ModelConfig) -> bool:
    """Whether ``config`` has Gemma's block (sandwich norms) or any option only the Gemma classes compute."""
    options = Gemma2.own_options
    return config.norm_placement == "sandwich" or any(is_set(getattr(config, f), options[f]) for f in options)
