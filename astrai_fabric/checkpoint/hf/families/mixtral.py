"""Mixtral (``modeling_mixtral.py``): Llama's block with an MoE in every layer: the router's softmax in float32 over
all experts, top-k, renormalised, no shared expert; on disk ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.J.w1/w3/w2`` (the gate/up/down projections)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.families.llama import check_block, refuse_ungated_shared_experts
from astrai_fabric.checkpoint.hf.family import Family, NamePairs, Reader, Refuse
from astrai_fabric.config.model import ModelConfig


class Mixtral(Family):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    defaults = dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    keys = frozenset({"num_local_experts", "num_experts_per_tok"})
    export_priority = 80

    def fields(self, read: Reader) -> dict[str, Any]:
        return dict(
            ffn_type="moe",
            n_routed_experts=read.int("num_local_experts"),
            n_activated_experts=read.int("num_experts_per_tok"),
            n_shared_experts=0,
            moe_intermediate_size=read.int("intermediate_size"),
            norm_topk_prob=True,
        )

    def claims(self, config: ModelConfig) -> bool:
        return config.ffn_type == "moe" and not config.shared_expert_gate and not config.use_qk_norm

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        check_block(config, state, refuse)
        refuse_ungated_shared_experts(config, refuse)
        dense = [i for i in range(config.num_hidden_layers) if config.ffn_type_of_layer(i) == "mlp"]
        if dense:
            refuse("mlp_only_layers/decoder_sparse_step", dense, "Mixtral has an MoE in every layer")
        if not config.norm_topk_prob:
            refuse("norm_topk_prob", False, "Mixtral renormalises the top-k routing weights")
        if config.attention_qkv_bias:
            refuse("attention_qkv_bias", True, "Mixtral's attention has no biases")

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        return {
            **written,
            "intermediate_size": config.moe_intermediate_size or config.intermediate_size,
            "num_local_experts": config.n_routed_experts,
            "num_experts_per_tok": config.n_activated_experts,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "router_aux_loss_coef": config.moe_aux_loss_coef,
        }

    def tensor_names(self, config: ModelConfig | None) -> NamePairs:
        return NAMES


FAMILY = Mixtral()

NAMES: NamePairs = (
    ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.weight"),
    # w1/w3/w2 are the gate/up/down projections (MixtralBlockSparseTop2MLP in transformers 4)
    *[
        (
            f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight",
            f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight",
        )
        for w, p in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
    ],
)
