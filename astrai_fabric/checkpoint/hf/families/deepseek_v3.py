"""DeepSeek-V3 (``modeling_deepseek_v3.py``): latent attention (MLA) whose query may go through ``q_a_proj``,
``q_a_layernorm`` and ``q_b_proj`` (our ``q_proj``), whose ``kv_a_proj_with_mqa`` ends with one RoPE key head shared
by every head, and whose softmax scale carries YaRN's ``mscale_all_dim``; its RoPE pairs are interleaved already
(``rope_interleave``), so no row is permuted. The MoE after ``first_k_dense_replace`` dense layers routes by sigmoid
scores, chooses with ``mlp.gate.e_score_correction_bias`` among its ``topk_group`` best of ``n_group`` groups, scales
by ``routed_scaling_factor``, and adds ``mlp.shared_experts``, one MLP ``n_shared_experts`` times as wide. Layers
past ``num_hidden_layers`` are its multi-token-prediction modules, skipped with a warning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from astrai_fabric.checkpoint.hf.family import Family, NamePairs, Reader, Refuse
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    defaults = dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    keys = frozenset({
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
        "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
        "first_k_dense_replace", "rope_interleave", "num_nextn_predict_layers", "num_mtp_layers",
        "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
        # read or checked although only DeepSeek's own code names them (the Hub's files carry them)
        "scoring_func", "topk_method", "moe_layer_freq",
        # the Hub's files: its training-time balance loss, its expert-parallel degree (harmless)
        "aux_loss_alpha", "seq_aux", "ep_size",
    })  # fmt: skip
    export_priority = 10
    refused_relatives = {
        "deepseek_v2": "multi-head latent attention with a decoupled shared RoPE key, YaRN and group-limited routing "
        "differ from ours",
    }
    rotate_half = False  # rope_interleave, the only layout mapped; the scores do not depend on the dims' order
    skips_trailing_layers = True  # num_nextn_predict_layers, arXiv:2412.19437 section 2.2; transformers skips them
    only_class = (
        "latent attention with a shared RoPE key",
        dict(
            yarn_softmax_scale=True,
            use_qk_norm=None,
            use_gated_attention=None,
            norm_placement="pre",
            rotary_dim=None,
            ffn_type="moe",
            scoring_func="sigmoid",
            score_correction_bias=True,
            decoder_sparse_step=1,
            n_shared_experts=1,
            shared_expert_gate=False,
        ),
    )

    def fields(self, read: Reader) -> dict[str, Any]:
        """DeepSeek's latent attention (``DeepseekV3Attention``) and an MoE after ``first_k_dense_replace`` dense
        layers (``DeepseekV3MoE``, ``DeepseekV3TopkRouter``). What its Hub files say that transformers' class does not
        compute (another routing, interleaving or MoE layer frequency) is refused, since DeepSeek's own code and
        transformers' would then compute two functions."""
        heads, layers = read.int("num_attention_heads"), read.int("num_hidden_layers")
        if (read.int("num_key_value_heads", optional=True) or heads) != heads:  # None means one per head
            read.refuse(
                "num_key_value_heads",
                read.get("num_key_value_heads"),
                f"DeepSeek's kv_b_proj gives each of the {heads} heads its own key and value",
            )
        for key, computed in (
            ("rope_interleave", True),
            ("scoring_func", "sigmoid"),
            ("topk_method", "noaux_tc"),
            ("moe_layer_freq", 1),
        ):
            if read.get(key, computed) != computed:
                read.refuse(key, read.get(key), f"transformers' DeepseekV3 computes {key} {computed!r} only")
        dense = read.get("first_k_dense_replace")
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ConfigError(f"{read.source}: 'first_k_dense_replace' must be an integer >= 0, got {dense!r}")
        routed_width = read.int("moe_intermediate_size")
        return dict(
            head_dim=None,  # transformers writes qk_rope_head_dim there; MLA's widths are fields of their own
            attn_type="mla",
            q_lora_rank=read.int("q_lora_rank", optional=True),
            kv_lora_rank=read.int("kv_lora_rank"),
            qk_nope_head_dim=read.int("qk_nope_head_dim"),
            qk_rope_head_dim=read.int("qk_rope_head_dim"),
            v_head_dim=read.int("v_head_dim"),
            mla_shared_rope_key=True,
            yarn_softmax_scale=True,
            ffn_type="moe",
            n_routed_experts=read.int("n_routed_experts"),
            n_activated_experts=read.int("num_experts_per_tok"),
            moe_intermediate_size=routed_width,
            # DeepseekV3MoE's shared experts are one MLP n_shared_experts times as wide as a routed one, unscaled
            n_shared_experts=1,
            shared_expert_intermediate_size=routed_width * read.int("n_shared_experts"),
            mlp_only_layers=list(range(min(dense, layers))) or None,
            norm_topk_prob=read.bool("norm_topk_prob", default=True),
            scoring_func="sigmoid",
            score_correction_bias=True,
            n_group=read.int("n_group"),
            topk_group=read.int("topk_group"),
            routed_scaling_factor=read.number("routed_scaling_factor"),
        )

    def rope_kind(self, read: Reader, kind: Any, params: Mapping[str, Any], key: str) -> Any:
        if kind not in ("default", "yarn") and params.get("mscale_all_dim"):
            # DeepseekV3Attention's yarn_apply_mscale scales the softmax under any non-default kind; ours under yarn
            read.refuse(f"{key} mscale_all_dim", params["mscale_all_dim"], f"it is mapped with yarn only, not {kind}")
        return kind

    def claims(self, config: ModelConfig) -> bool:
        return config.attn_type == "mla"

    def check_export(self, config: ModelConfig, state: Mapping[str, Tensor], refuse: Refuse) -> None:
        """Its class's fields (``only_class``), its dense layers first, a shared MLP as wide as some routed ones, a
        key and value for every head."""
        if not config.mla_shared_rope_key:
            refuse(
                "attn_type",
                "mla",
                "AstrAI's latent attention differs from DeepSeek's (whose RoPE key is shared "
                "across heads); no transformers class computes it",
            )
        self.require_only_class(config, refuse)
        heads, dense = config.num_attention_heads, config.mlp_only_layers or []
        if (config.num_key_value_heads or heads) != heads:
            refuse(
                "num_key_value_heads", config.num_key_value_heads, f"DeepSeek-V3 has a key and value per head ({heads})"
            )
        if dense != list(range(len(dense))):
            refuse("mlp_only_layers", dense, "DeepSeek-V3's dense layers are its first first_k_dense_replace ones")
        routed = config.moe_intermediate_size or config.intermediate_size
        if (config.shared_expert_intermediate_size or config.intermediate_size) % routed:
            refuse(
                "shared_expert_intermediate_size",
                config.shared_expert_intermediate_size,
                f"DeepSeek-V3's shared MLP is n_shared_experts routed experts wide ({routed} each)",
            )

    def write(self, config: ModelConfig, written: dict[str, Any], where: str) -> dict[str, Any]:
        routed = config.moe_intermediate_size or config.intermediate_size
        return dict(
            written,
            head_dim=config.qk_rope_head_dim,  # what DeepseekV3Config writes there
            intermediate_size=config.intermediate_size or routed,  # unused without dense layers, yet required
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim or config.attention_head_dim,
            n_routed_experts=config.n_routed_experts,
            num_experts_per_tok=config.n_activated_experts,
            moe_intermediate_size=routed,
            n_shared_experts=(config.shared_expert_intermediate_size or config.intermediate_size) // routed,
            first_k_dense_replace=len(config.mlp_only_layers or []),
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            rope_interleave=True,
            num_nextn_predict_layers=0,
            attention_bias=False,
            output_router_logits=False,
        )

    def tensor_names(self, config: ModelConfig | None) -> NamePairs:
        # with a compressed query, q_b_proj is our q_proj (whose input is the normalised rank-q_lora_rank latent),
        # found before the plain q_proj every family shares
        return NAMES if config is not None and not config.q_lora_rank else QUERY_LORA_NAMES + NAMES


FAMILY = DeepseekV3()

NAMES: NamePairs = (
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attention.kv_a_proj.weight"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.attention.kv_norm.weight"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attention.kv_b_proj.weight"),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.score_correction_bias"),
    *[
        (f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight")
        for p in ("gate", "up", "down")
    ],
    *[
        (f"model.layers.{{i}}.mlp.shared_experts.{p}_proj.weight", f"layers.{{i}}.mlp.shared_experts.0.{p}.weight")
        for p in ("gate", "up", "down")
    ],
)
QUERY_LORA_NAMES: NamePairs = (
    ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attention.q_a_proj.weight"),
    ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attention.q_a_norm.weight"),
    ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attention.q_proj.weight"),
)
