"""Llama (``modeling_llama.py``): the layout every family here starts from (pre-norm blocks, SiLU-gated MLP, GQA,
rotate-half RoPE), so its file is short; the checks of that block are shared by the classes built on it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from astrai_fabric.checkpoint.hf.family import Family, Refuse
from astrai_fabric.config.model import ModelConfig


class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    defaults = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    export_priority = 1000  # the plainest: every model no other class claims

    def claims(self, config: ModelConfig) -> bool:
        return True

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        check_block(config, state, refuse)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {**written, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


FAMILY = Llama()


def check_block(config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
    """Refuses what no class built on Llama's block computes: norms elsewhere than before each sublayer, q/k/v
    biases with q/k norms, and AstrAI's q/k norm after RoPE where it differs from Qwen3's before it."""
    if config.norm_placement != "pre":
        refuse("norm_placement", config.norm_placement, "no transformers class exported here has these norms")
    if config.use_qk_norm and config.attention_qkv_bias:
        refuse("attention_qkv_bias", True, "no transformers class has both q/k/v biases and q/k norms")
    if config.use_qk_norm and not config.qk_norm_before_rope:
        # Qwen3 normalises before RoPE, AstrAI after; the two agree only when the two weights of every rotated
        # pair (2i, 2i+1) are equal, since then the per-dim scale commutes with the rotation.
        unequal = [
            k
            for k, v in state.items()
            if re.search(r"\.(q|k)_norm\.weight$", k) and not torch.equal(v.float()[0::2], v.float()[1::2])
        ]
        if unequal:
            refuse(
                "use_qk_norm",
                True,
                f"AstrAI normalises q/k after RoPE, transformers' Qwen3 before, and "
                f"{unequal[0]} scales the two dims of a rotated pair differently",
            )


def refuse_ungated_shared_experts(config: ModelConfig, refuse: Refuse) -> None:
    """The MoE classes built on Llama's block add no shared expert, or (Qwen2-MoE) one gated by a sigmoid."""
    if config.n_shared_experts:
        refuse(
            "n_shared_experts",
            config.n_shared_experts,
            "shared experts added ungated (AstrAI's) have no "
            "equivalent: Qwen2-MoE gates its one by a sigmoid, Mixtral and Qwen3-MoE have none",
        )
