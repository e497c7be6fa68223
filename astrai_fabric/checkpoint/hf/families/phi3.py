"""Phi-3 (``modeling_phi3.py``): Llama's function with q, k and v stacked in one ``qkv_proj`` and gate and up in one
``gate_up_proj`` (``fused``: split as they are read, fused again on export), and RoPE on each head's first
``int(head_dim * partial_rotary_factor)`` dims only (``rotary_dim``; only those rows are permuted). Its config reads
early files' RoPE names as longrope and keeps longrope's original length at its top level."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.family import Family, Reader, Refuse
from astrai_fabric.config.model import ModelConfig


class Phi3(Family):
    model_type = "phi3"
    architecture = "Phi3ForCausalLM"
    defaults = dict(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    keys = frozenset({"original_max_position_embeddings"})
    export_priority = 50
    partial_rotary = True
    fused = {
        "self_attn.qkv_proj": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate", "mlp.up"),
    }
    only_class = (
        "RoPE on part of each head",
        dict(norm_placement="pre", use_qk_norm=None, attention_qkv_bias=False, ffn_type="mlp"),
    )

    def rope_kind(self, read: Reader, kind: Any, params: Mapping[str, Any], key: str) -> Any:
        if kind in ("su", "yarn"):
            kind = "longrope"  # Phi3Config's reading of its early files' names (convert_rope_params_to_dict)
        if kind not in ("default", "longrope"):
            read.refuse(f"{key} rope_type", kind, "Phi3Config accepts default and longrope only")
        return kind

    def longrope_original(self, read: Reader, params: Mapping[str, Any]) -> Any:
        return read.get("original_max_position_embeddings", 4096)  # the top-level key wins, its class default 4096

    def claims(self, config: ModelConfig) -> bool:
        return config.rotary_dim is not None

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        head_dim, rotary_dim = config.attention_head_dim, config.rotary_dim
        if int(head_dim * (rotary_dim / head_dim)) != rotary_dim:
            refuse(
                "rotary_dim",
                rotary_dim,
                f"Phi-3 rotates int(head_dim * partial_rotary_factor) dims, and no "
                f"float factor gives {rotary_dim} of {head_dim}",
            )
        scaling = config.rope_frequency_scaling
        if scaling is not None and scaling["rope_type"] != "longrope":
            refuse("rope_frequency_scaling", scaling, "Phi3Config accepts the default RoPE and longrope only")
        self.require_only_class(config, refuse)

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        original = (written["rope_scaling"] or {}).get(
            "original_max_position_embeddings", config.max_position_embeddings
        )
        return {
            **written,
            "partial_rotary_factor": config.rope_dim / config.attention_head_dim,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "sliding_window": None,
            "original_max_position_embeddings": original,
        }


FAMILY = Phi3()
