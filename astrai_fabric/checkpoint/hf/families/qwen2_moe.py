"""Qwen2-MoE (``modeling_qwen2_moe.py``): Qwen2's attention (q/k/v biases, ``qkv_bias``) and an MoE whose router
takes the softmax and top-k, renormalised only with ``norm_topk_prob`` (default false), plus one shared expert
scaled by ``sigmoid(shared_expert_gate(x))``; layer ``i`` is MoE unless listed in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0`` (AstrAI's rule too). On disk ``mlp.gate`` (the router),
``mlp.experts.J.*``, ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``. Qwen3-MoE builds on this file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.families.llama import check_block
from astrai_fabric.checkpoint.hf.families.qwen2 import Qwen2, max_window_layers
from astrai_fabric.checkpoint.hf.family import Family, NamePairs, Reader, Refuse
from astrai_fabric.config.model import ModelConfig

MOE_KEYS = frozenset({"use_sliding_window", "max_window_layers", "num_experts", "num_experts_per_tok",
                      "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})  # fmt: skip
"""The config keys both Qwen MoE classes read."""


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    defaults = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        sliding_window=4096,
        max_window_layers=28,
        decoder_sparse_step=1,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts_per_tok=4,
        num_experts=60,
        norm_topk_prob=False,
        qkv_bias=True,
    )
    keys = MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"}
    export_priority = 60
    reads_attention_bias = False  # its q/k/v biases are qkv_bias; the class never reads attention_bias
    sliding_window = Qwen2.sliding_window

    def fields(self, read: Reader) -> dict[str, Any]:
        return dict(attention_qkv_bias=read.bool("qkv_bias", True), **moe_fields(read, read.int("num_experts"), True))

    def attention_kinds(self, read: Reader, window: int | None) -> set[str]:
        """With a window, the even layers ``< max_window_layers`` slide."""
        if window is None:
            return {"full_attention"}
        n_layers, first_full = read.int("num_hidden_layers"), max_window_layers(read)
        windowed, full = first_full > 0, n_layers > 1 or first_full <= 0
        return {kind for kind, present in (("sliding_attention", windowed), ("full_attention", full)) if present}

    def claims(self, config: ModelConfig) -> bool:
        return config.ffn_type == "moe" and bool(config.shared_expert_gate)

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        check_block(config, state, refuse)
        if config.n_shared_experts != 1:
            refuse("n_shared_experts", config.n_shared_experts, "Qwen2-MoE gates exactly one shared expert")
        if config.use_qk_norm:
            refuse("use_qk_norm", True, "Qwen2-MoE's attention has no q/k norms")

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        shared = config.shared_expert_intermediate_size or config.intermediate_size
        return {
            **written,
            **moe_config(config),
            "shared_expert_intermediate_size": shared,
            "qkv_bias": config.attention_qkv_bias,
            "max_window_layers": config.num_hidden_layers,
        }

    def tensor_names(self, config: ModelConfig | None) -> NamePairs:
        return NAMES


FAMILY = Qwen2Moe()

NAMES: NamePairs = (  # Qwen3-MoE's too, which has no shared expert
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    *[
        (f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight")
        for p in ("gate", "up", "down")
    ],
    *[
        (f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight", f"layers.{{i}}.mlp.shared_experts.0.{p}.weight")
        for p in ("gate", "up", "down")
    ],
    ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
)


def moe_fields(read: Reader, num_experts: int, shared: bool) -> dict[str, Any]:
    """The MoE fields of a Qwen MoE config (``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``), with one gated
    shared expert or none."""
    mlp_only_layers = read.get("mlp_only_layers")
    return dict(
        ffn_type="moe",
        n_routed_experts=num_experts,
        n_activated_experts=read.int("num_experts_per_tok"),
        moe_intermediate_size=read.int("moe_intermediate_size"),
        n_shared_experts=int(shared),
        shared_expert_intermediate_size=read.int("shared_expert_intermediate_size") if shared else None,
        shared_expert_gate=shared,
        norm_topk_prob=read.bool("norm_topk_prob", default=False),
        decoder_sparse_step=read.int("decoder_sparse_step"),
        mlp_only_layers=mlp_only_layers or None,  # its kind and range are ModelConfig's checks
    )


def moe_config(config: ModelConfig) -> dict[str, Any]:
    """A Qwen MoE config's own fields for ``config`` (the inverse of ``moe_fields``)."""
    routed = config.moe_intermediate_size or config.intermediate_size
    return dict(
        # the dense layers' width; with none, an unused value the config class still requires
        intermediate_size=config.intermediate_size or routed,
        num_experts=config.n_routed_experts,
        num_experts_per_tok=config.n_activated_experts,
        moe_intermediate_size=routed,
        norm_topk_prob=config.norm_topk_prob,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers or []),
        use_sliding_window=False,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=config.moe_aux_loss_coef,
    )
