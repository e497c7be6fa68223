"""OLMo 2 (``modeling_olmo2.py``): each sublayer's output normalised before the residual add and not its input
(``norm_placement: post``; its ``post_attention_layernorm`` is the attention output's norm, Llama's the MLP input's),
and a q/k RMSNorm over the whole projection, before RoPE (``qk_norm_over_projection``): its weight is permuted head
by head like the rows, and the RMS over all of them is unchanged by the order."""

from __future__ import annotations

from typing import Any

from astrai_fabric.checkpoint.hf.family import Family, Reader
from astrai_fabric.config.model import ModelConfig


class Olmo2(Family):
    model_type = "olmo2"
    architecture = "Olmo2ForCausalLM"
    defaults = dict(
        vocab_size=50304,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    export_priority = 40
    only_class = (
        "output norms only or a q/k norm over the whole projection",
        dict(
            norm_placement="post",
            use_qk_norm=True,
            qk_norm_over_projection=True,
            qk_norm_before_rope=True,
            attention_qkv_bias=False,
            ffn_type="mlp",
            rotary_dim=None,
        ),
    )

    def fields(self, read: Reader) -> dict[str, Any]:
        return dict(use_qk_norm=True, qk_norm_before_rope=True, qk_norm_over_projection=True, norm_placement="post")

    def claims(self, config: ModelConfig) -> bool:
        return config.norm_placement == "post" or bool(config.qk_norm_over_projection)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {**written, "attention_bias": False}


FAMILY = Olmo2()
