"""Qwen3-MoE (``modeling_qwen3_moe.py``): Qwen3's attention (q/k norms before RoPE, no biases) and Qwen2-MoE's
router without the shared expert (``qwen2_moe.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.families.llama import check_block, refuse_ungated_shared_experts
from astrai_fabric.checkpoint.hf.families.qwen2 import Qwen2
from astrai_fabric.checkpoint.hf.families.qwen2_moe import MOE_KEYS, NAMES, moe_config, moe_fields
from astrai_fabric.checkpoint.hf.family import Family, NamePairs, Reader, Refuse
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    defaults = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=4096,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
    )
    keys = MOE_KEYS | {"num_local_experts"}
    export_priority = 70
    sliding_window = Qwen2.sliding_window

    def fields(self, read: Reader) -> dict[str, Any]:
        # Qwen3MoeConfig's attribute_map stores num_experts as num_local_experts: transformers 5 writes that key,
        # the Hub's files (transformers 4) the other.
        named = {key: read.int(key) for key in ("num_experts", "num_local_experts") if key in read.raw}
        if len(set(named.values())) > 1:
            raise ConfigError(f"{read.source}: 'num_experts' and 'num_local_experts' disagree: {named}")
        experts = next(iter(named.values()), None) or read.int("num_experts")
        return dict(use_qk_norm=True, qk_norm_before_rope=True, **moe_fields(read, experts, shared=False))

    def claims(self, config: ModelConfig) -> bool:
        return config.ffn_type == "moe" and not config.shared_expert_gate and bool(config.use_qk_norm)

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        check_block(config, state, refuse)
        refuse_ungated_shared_experts(config, refuse)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {**written, **moe_config(config), "attention_bias": False}

    def tensor_names(self, config: ModelConfig | None) -> NamePairs:
        return NAMES


FAMILY = Qwen3Moe()
