"""Hugging Face model directories: the one place that knows transformers' conventions (transformers is never
imported; it is the test oracle, ``tests/test_huggingface.py``).

A Hugging Face ``config.json`` names its architecture in ``model_type``. Each supported one maps onto the single
model of this project, ``AutoRegressiveLM``, so that it computes *the same function*; anything that would compute
something else is refused by name before a byte is written (AstrAI's adapter loads such models approximately, its
bug B21). The facts, with the transformers source files that state them (``src/transformers/models/<type>/``):

- **RoPE pairing.** transformers' ``rotate_half`` pairs dims ``(i, i + d/2)`` of each head; ours (AstrAI's,
  Meta's original) pairs ``(2i, 2i + 1)``, both with frequency ``i``. Importing permutes the rows of each q/k head
  (weights, biases and the per-head q/k norm weights) from one layout to the other; v and o are unchanged, and the
  scores ``q·k`` are the same because both sides move alike (``rotate_half_to_interleaved``).
- **Qwen3** normalises each q/k head *before* RoPE (``qk_norm_before_rope``) and sets ``head_dim`` on its own, so
  ``heads × head_dim`` may differ from ``hidden_size``. **Qwen2** has q/k/v biases and no o bias.
- **RoPE scaling**: ``rope_type`` ``linear`` and ``llama3`` have their own formulas (``modeling_rope_utils.py``),
  kept in ``rope_frequency_scaling``; AstrAI's ``rope_scaling`` (NTK) is a different function.
- **Mixtral**: router softmax in float32 over all experts, top-k, renormalised, no shared experts; on disk
  ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.J.w1/w3/w2`` (gate/up/down projections).
- **Qwen2-MoE, Qwen3-MoE**: the same softmax and top-k, renormalised only with ``norm_topk_prob`` (default false);
  layer ``i`` is MoE unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (AstrAI's rule
  too). Qwen2-MoE adds one shared expert scaled by ``sigmoid(shared_expert_gate(x))`` (``shared_expert_gate``) and
  has q/k/v biases (``qkv_bias``); Qwen3-MoE has Qwen3's attention and no shared expert. On disk ``mlp.gate``
  (the router), ``mlp.experts.J.gate_proj/up_proj/down_proj``, ``mlp.shared_expert.*`` and
  ``mlp.shared_expert_gate``.
- **OLMo 2** (``modeling_olmo2.py``) normalises each sublayer's output before the residual add and not its input
  (``norm_placement: post``; its ``post_attention_layernorm`` is the attention output's norm, Llama's the MLP
  input's), and its q/k RMSNorm spans the whole projection, before RoPE (``qk_norm_over_projection``): the weight is
  permuted head by head like the rows, and the RMS over all of them is unchanged by the order.
- **Phi-3** (``modeling_phi3.py``) is Llama's function with q, k and v stacked in one ``qkv_proj`` and gate and up in
  one ``gate_up_proj`` (``FUSED``: split as they are read, fused again on export), and RoPE on each head's first
  ``int(head_dim * partial_rotary_factor)`` dims only (``rotary_dim``; only those rows are permuted).
- **DeepSeek-V3** (``modeling_deepseek_v3.py``): MLA whose query may go through ``q_a_proj``, ``q_a_layernorm`` and
  ``q_b_proj`` (our ``q_proj``), whose ``kv_a_proj_with_mqa`` ends with one RoPE key head shared by every head, and
  whose softmax scale carries YaRN's ``mscale_all_dim``; its RoPE pairs are interleaved already
  (``rope_interleave``), so no row is permuted. The MoE after ``first_k_dense_replace`` dense layers routes by
  sigmoid scores, chooses with ``mlp.gate.e_score_correction_bias`` among its ``topk_group`` best of ``n_group``
  groups, scales by ``routed_scaling_factor``, and adds ``mlp.shared_experts``, one MLP ``n_shared_experts`` times
  as wide. Layers past ``num_hidden_layers`` are its multi-token-prediction modules, skipped with a warning.
- **RoPE yarn** (``_compute_yarn_parameters``): frequencies blended by rotations over the original length, cos and
  sin times its attention factor; kept in ``rope_frequency_scaling`` for every family.
- **RoPE longrope and dynamic** (``_compute_longrope_parameters``, ``_compute_dynamic_ntk_parameters``): frequencies
  chosen per forward by its length (largest position + 1) past the original length, as ``dynamic_rope_update``
  does: LongRoPE's short or long per-pair factors (Phi-3), dynamic NTK's base raised with the length.
- **Gemma 2, Gemma 3** (``modeling_gemma2.py``, ``modeling_gemma3.py``): RMSNorms scaling by ``1 + weight`` before
  and after each sublayer (``pre_feedforward_layernorm`` is the MLP's input norm, ``post_attention_layernorm`` the
  attention output's), embeddings times ``sqrt(hidden_size)`` in the weight's dtype, GeGLU (``gelu_pytorch_tanh``),
  the softmax scale ``query_pre_attn_scalar ** -0.5``, soft-capping ``c * tanh(x / c)`` of the scores and the
  logits (Gemma 2), a sliding window on the ``layer_types`` layers (``q - k < sliding_window``); Gemma 3 adds per-head
  q/k norms before RoPE and a RoPE base of its own for the sliding layers (``_gemma``).
- **Tied embeddings**: a tied checkpoint has no ``lm_head.weight``.
- Both config forms: transformers 4 (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and transformers 5
  (``rope_parameters``, ``dtype``).

Reading the files stays in ``checkpoint/files.py`` (the only safetensors importer); this module maps configs and
tensors, both ways: ``state_dict_to_hf`` is the inverse of ``state_dict_from_hf``, and ``hf_config`` writes the
config of the architecture a model came from (``HFSource``, kept in ``meta.json``) or of the transformers class
computing the same function (``export_model_type``), refusing by field what has no equivalent
(``astrai_fabric.export`` writes the directory).

Over 300 lines for one responsibility: every Hugging Face convention (twelve architectures, both directions,
their refusals) in one module, so no other module needs to know any of them.
"""

from __future__ import annotations

import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from astrai_fabric.config.kinds import kind_problem
from astrai_fabric.config.model import ASTRAI_MODEL_TYPE, EXTENDED_MODEL_TYPE, MAX_LAYERS, YARN_OPTIONAL, ModelConfig
from astrai_fabric.errors import CheckpointError, ConfigError, UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmo2",
                         "deepseek_v3", "phi3", "gemma2", "gemma3_text")  # fmt: skip
GEMMA_TYPES = ("gemma2", "gemma3_text")
QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")

REFUSED_MODEL_TYPES = {
    "gemma": "its RMSNorm scales by (1 + weight), its embeddings by sqrt(hidden_size) and its MLP uses GELU",
    "deepseek_v2": "multi-head latent attention with a decoupled shared RoPE key, YaRN and group-limited routing "
    "differ from ours",
}
"""Architectures refused with the reason; any other model_type is refused as unknown."""
MULTIMODAL_TEXT_TOWERS = {"gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
"""Multimodal checkpoints whose language model is loaded (``language_model_config``), by the model_type and
transformers class of that language model alone (what export writes)."""

_DEFAULTS: dict[str, dict[str, Any]] = {
    # Each config class's defaults (``configuration_<type>.py``), used where a config.json omits a key, as
    # transformers itself does. Real checkpoints carry every key; hand-written or diffed configs may not.
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=10000.0, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, max_window_layers=28),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, max_window_layers=28,
                      decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, qkv_bias=True),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, decoder_sparse_step=1,
                      moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False),
    "olmo2": dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0, tie_word_embeddings=True,
                        query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                        hidden_activation="gelu_pytorch_tanh"),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0),
}  # fmt: skip

_DEEPSEEK_V3_KEYS = (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "rope_interleave", "num_nextn_predict_layers", "num_mtp_layers", "scoring_func", "topk_method", "moe_layer_freq",
)  # fmt: skip
"""Keys of DeepSeek-V3's config (``configuration_deepseek_v3.py``, and those of the Hub's files that DeepSeek's own
code reads: ``scoring_func``, ``topk_method``, ``moe_layer_freq``), each read or checked by ``_deepseek_v3``."""
_READ_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "hidden_act", "attention_bias",
    "mlp_bias", "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "num_local_experts", "num_experts_per_tok", "router_jitter_noise", "quantization_config",
    "final_logit_softcapping", "attn_logit_softcapping", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
    "resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "hidden_activation", "query_pre_attn_scalar",
    "rope_local_base_freq", "sliding_window_pattern", "use_bidirectional_attention",
    *_DEEPSEEK_V3_KEYS,
}  # fmt: skip
_HARMLESS_KEYS = {
    # Metadata, generation defaults and training-loss settings that do not change the function of the weights.
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "output_router_logits",
    "router_aux_loss_coef", "_name_or_path", "return_dict", "output_attentions", "output_hidden_states",
    # PreTrainedConfig's generic fields (in ``to_dict()``, rarely in a saved file), none used by a causal LM's forward
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
    # DeepSeek-V3's Hub files: its remote code, its training-time balance loss, its expert-parallel degree
    "auto_map", "aux_loss_alpha", "seq_aux", "ep_size",
    # Gemma 3's private copy of sliding_window_pattern, written beside the layer_types it made (which are read)
    "_sliding_window_pattern",
}  # fmt: skip
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "partial_rotary_factor", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate", "short_factor", "long_factor"}  # fmt: skip
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


SOURCE_KEY = "source"
"""``meta.json`` key of a checkpoint trained from a Hugging Face directory: its ``HFSource`` (AstrAI ignores it)."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}  # fmt: skip
"""The transformers class of each supported model_type (``modeling_<type>.py``)."""


def sequence_classifier(model_type: str) -> str:
    """The transformers class of a reward model (one label) of ``model_type``: ``*ForSequenceClassification``."""
    if model_type == "gemma3_text":
        return "Gemma3TextForSequenceClassification"  # Gemma3ForSequenceClassification is the multimodal model's
    return ARCHITECTURES[model_type].replace("ForCausalLM", "ForSequenceClassification")


@dataclass(frozen=True)
class HFSource:
    """Where an imported model came from: enough to write the same architecture back (export)."""

    model_type: str
    config: dict[str, Any]
    """The Hugging Face ``config.json`` as read."""

    @property
    def architecture(self) -> str:
        """The transformers class named in the config (``architectures``), else the model_type's."""
        named = self.config.get("architectures")
        if isinstance(named, list) and len(named) == 1 and isinstance(named[0], str):
            return named[0]
        return ARCHITECTURES[self.model_type]

    def to_meta(self) -> dict[str, Any]:
        """The ``meta.json`` entry (``SOURCE_KEY``) a checkpoint trained from this model carries."""
        return {"format": "huggingface", "model_type": self.model_type, "architecture": self.architecture,
                "config": self.config}  # fmt: skip

    @classmethod
    def from_meta(cls, value: Any, model_config: ModelConfig, where: str) -> HFSource:
        """A ``meta.json`` ``source`` entry, checked: a supported Hugging Face config whose mapping is the
        checkpoint's own model (else export would write another model's config around these weights)."""
        fits = isinstance(value, dict) and value.get("format") == "huggingface"
        fits = fits and isinstance(value.get("config"), dict)
        if not fits or value.get("model_type") != value["config"].get("model_type"):
            raise CheckpointError(
                f"{where}: {SOURCE_KEY!r} must be {{format: 'huggingface', model_type, architecture, config}} with "
                f"the config's own model_type, got {str(value)[:200]}"
            )
        with warnings.catch_warnings():  # unknown keys were reported when the model was imported
            warnings.simplefilter("ignore")
            mapped = model_config_from_hf(value["config"], source=f"{where} {SOURCE_KEY!r} config")
        ours, theirs = _architecture_fields(model_config), _architecture_fields(mapped)
        if ours != theirs:
            differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise CheckpointError(
                f"{where}: {SOURCE_KEY!r} describes another model than config.json (they differ in {differ})"
            )
        return cls(model_type=value["model_type"], config=value["config"])


def _architecture_fields(config: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k != "neftune_alpha"}  # NEFTune is training-time noise


def source_of(imported: HFSource | None, meta: Mapping[str, Any], model_config: ModelConfig,
              where: str) -> HFSource | None:  # fmt: skip
    """The Hugging Face architecture a model directory stands for: the directory's own (``imported``, when it is a
    Hugging Face directory), else the ``source`` its ``meta.json`` records (checked), else None."""
    if imported is not None:
        return imported
    if SOURCE_KEY in meta:
        return HFSource.from_meta(meta[SOURCE_KEY], model_config, where)
    return None


def is_hf_config(raw: Mapping[str, Any], source: str = "config.json") -> bool:
    """True when a ``config.json`` names a Hugging Face architecture (AstrAI writes ``autoregressive_lm`` or
    nothing, we also ``astrai_fabric_lm``). The first read of ``model_type``: its kind is checked here."""
    if problem := kind_problem(raw.get("model_type"), str | None):
        raise ConfigError(f"{source}: 'model_type' {problem}")
    return raw.get("model_type") not in (None, ASTRAI_MODEL_TYPE, EXTENDED_MODEL_TYPE)


def model_config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` that computes what the Hugging Face config ``raw`` describes, or a ``ConfigError`` (one
    line naming the model_type or the field) when it cannot be computed exactly."""
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL_TEXT_TOWERS:
        return model_config_from_hf(language_model_config(raw, source), source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = REFUSED_MODEL_TYPES.get(model_type, "unknown architecture")
        raise ConfigError(
            f"{source}: Hugging Face model_type {model_type!r} is not supported ({why}); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    read = _Reader(raw, _DEFAULTS[model_type], source)
    _refuse_unmapped(read, model_type)
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim = read.int("head_dim", optional=True)
    if head_dim is not None and head_dim * heads == hidden:
        head_dim = None  # AstrAI's own rule gives the same width; keep the config AstrAI-shaped
    theta, frequency_scaling = _rope(read, model_type)
    values: dict[str, Any] = dict(
        model_type=ASTRAI_MODEL_TYPE,
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=read.int("num_hidden_layers"),
        rms_norm_eps=read.number("rms_norm_eps"),
        intermediate_size=read.int("intermediate_size"),
        tie_word_embeddings=read.bool("tie_word_embeddings", default=False),
        max_position_embeddings=_dynamic_limit(_position_limit(read, model_type), frequency_scaling),
        rope_theta=theta,
        num_attention_heads=heads,
        num_key_value_heads=read.int("num_key_value_heads", optional=True) or heads,
        head_dim=head_dim,
        attention_qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and read.bool("qkv_bias", True)),
        use_qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2") or None,
        qk_norm_before_rope=model_type in ("qwen3", "qwen3_moe", "olmo2"),
        qk_norm_over_projection=model_type == "olmo2",
        norm_placement="post" if model_type == "olmo2" else "pre",
        rotary_dim=_rotary_dim(read, model_type, head_dim or hidden // heads),
        rope_frequency_scaling=frequency_scaling,
    )
    if model_type == "mixtral":
        values.update(
            ffn_type="moe",
            n_routed_experts=read.int("num_local_experts"),
            n_activated_experts=read.int("num_experts_per_tok"),
            n_shared_experts=0,
            moe_intermediate_size=values["intermediate_size"],
            norm_topk_prob=True,
        )
    if model_type in QWEN_MOE_TYPES:
        values.update(_qwen_moe(read, model_type))
    if model_type == "deepseek_v3":
        values.update(_deepseek_v3(read))
    if model_type in GEMMA_TYPES:
        values.update(_gemma(read, model_type))
    values.update(_score_head(read))
    unknown = sorted(k for k in raw if k not in _READ_KEYS | _HARMLESS_KEYS)
    if unknown:
        warnings.warn(f"{source}: ignoring keys the {model_type} mapping does not know: {unknown}", stacklevel=2)
    config = ModelConfig.from_dict(values, source=source)
    config.check_buildable(source=source)
    return config


def _score_head(read: _Reader) -> dict[str, Any]:
    """A ``*ForSequenceClassification`` with one label is a reward model: a score head read at the last token before
    ``pad_token_id`` (transformers' rule); a causal LM's config gives nothing."""
    architectures = read.get("architectures") or []
    if not any(isinstance(name, str) and name.endswith("ForSequenceClassification") for name in architectures):
        return {}
    labels = read.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else read.get("num_labels", 2)  # transformers' default 2
    if num_labels != 1:
        read.refuse("num_labels", num_labels, "a classifier of several labels is not a reward model (one score)")
    pad_token_id = read.get("pad_token_id")
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        read.refuse("pad_token_id", pad_token_id, "a reward model reads its score at the last token before padding, "
                    "which needs the padding id")  # fmt: skip
    return dict(score_head=True, pad_token_id=pad_token_id)


def _gemma(read: _Reader, model_type: str) -> dict[str, Any]:
    """The fields of a Gemma 2 or Gemma 3 text config (``modeling_gemma2.py``, ``modeling_gemma3.py``): norms before
    and after each sublayer scaling by ``1 + weight``, embeddings scaled by ``sqrt(hidden_size)``, GeGLU, the softmax
    scale ``query_pre_attn_scalar ** -0.5``, soft-capping (Gemma 2), sliding-window layers by ``layer_types`` (else
    every other layer, Gemma 2, or five in six, Gemma 3's ``sliding_window_pattern``), and Gemma 3's per-head q/k
    norms before RoPE and the sliding layers' own RoPE base."""
    n_layers = read.int("num_hidden_layers")
    if n_layers > MAX_LAYERS:  # before a list of that length is made
        raise ConfigError(f"{read.source}: 'num_hidden_layers' must be at most {MAX_LAYERS:,}, got {n_layers:,}")
    layer_types = read.get("layer_types")
    if not layer_types:
        pattern = 2 if model_type == "gemma2" else read.int("sliding_window_pattern")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    sliding = isinstance(layer_types, list) and "sliding_attention" in layer_types
    values = dict(
        norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True, mlp_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=read.int("query_pre_attn_scalar"),
        attn_logit_softcapping=read.get("attn_logit_softcapping"),
        final_logit_softcapping=read.get("final_logit_softcapping"),
        sliding_window=read.int("sliding_window") if sliding else None,
        layer_types=layer_types if sliding else None,
    )  # fmt: skip
    if model_type == "gemma3_text":
        values.update(use_qk_norm=True, qk_norm_before_rope=True, rope_local_theta=_local_rope_theta(read))
    return values


def _local_rope_theta(read: _Reader) -> float:
    """Gemma 3's sliding layers' RoPE base: transformers 5's ``rope_parameters["sliding_attention"]`` (default RoPE
    only), else transformers 4's ``rope_local_base_freq``."""
    params = read.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if not isinstance(local, dict):
        return read.number("rope_local_base_freq")
    if local.get("rope_type", "default") != "default":
        read.refuse("rope_parameters sliding_attention rope_type", local.get("rope_type"),
                    "the sliding layers' RoPE here is the default one")  # fmt: skip
    if not isinstance(local.get("rope_theta"), int | float) or not 0 < local["rope_theta"] < math.inf:
        raise ConfigError(f"{read.source}: rope_parameters sliding_attention rope_theta must be a finite number > 0")
    return float(local["rope_theta"])


def language_model_config(raw: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The config of a multimodal checkpoint's language model (``MULTIMODAL_TEXT_TOWERS``), what loading and export
    read in its place, with a warning that its other towers are left out."""
    text_type, architecture = MULTIMODAL_TEXT_TOWERS[raw["model_type"]]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a multimodal {raw['model_type']} config needs a 'text_config' object")
    warnings.warn(f"{source}: a multimodal {raw['model_type']} checkpoint: its language model is loaded, its vision "
                  f"tower and projector are left out (images are not read); export writes the language model alone, "
                  f"a {architecture}", stacklevel=3)  # fmt: skip
    shared = {key: raw[key] for key in ("tie_word_embeddings", "dtype", "torch_dtype") if key in raw}
    return {**text, **shared, "model_type": text_type, "architectures": [architecture]}


def _qwen_moe(read: _Reader, model_type: str) -> dict[str, Any]:
    """The MoE fields of a Qwen2-MoE or Qwen3-MoE config (``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``)."""
    shared = model_type == "qwen2_moe"  # one shared expert, gated; Qwen3-MoE has none
    if shared:
        experts = read.int("num_experts")
    else:
        # Qwen3MoeConfig's attribute_map stores num_experts as num_local_experts: transformers 5 writes that key,
        # the Hub's files (transformers 4) the other.
        named = {key: read.int(key) for key in ("num_experts", "num_local_experts") if key in read.raw}
        if len(set(named.values())) > 1:
            raise ConfigError(f"{read.source}: 'num_experts' and 'num_local_experts' disagree: {named}")
        experts = next(iter(named.values()), None) or read.int("num_experts")
    mlp_only_layers = read.get("mlp_only_layers")
    return dict(
        ffn_type="moe",
        n_routed_experts=experts,
        n_activated_experts=read.int("num_experts_per_tok"),
        moe_intermediate_size=read.int("moe_intermediate_size"),
        n_shared_experts=int(shared),
        shared_expert_intermediate_size=read.int("shared_expert_intermediate_size") if shared else None,
        shared_expert_gate=shared,
        norm_topk_prob=read.bool("norm_topk_prob", default=False),
        decoder_sparse_step=read.int("decoder_sparse_step"),
        mlp_only_layers=mlp_only_layers or None,  # its kind and range are ModelConfig's checks
    )


def _deepseek_v3(read: _Reader) -> dict[str, Any]:
    """The fields of a DeepSeek-V3 config (``DeepseekV3Attention``, ``DeepseekV3MoE``, ``DeepseekV3TopkRouter``):
    DeepSeek's latent attention, and an MoE after ``first_k_dense_replace`` dense layers. What its Hub files say that
    transformers' class does not compute (another routing, interleaving or MoE layer frequency) is refused, since
    DeepSeek's own code and transformers' would then compute two functions."""
    heads, layers = read.int("num_attention_heads"), read.int("num_hidden_layers")
    if (read.int("num_key_value_heads", optional=True) or heads) != heads:  # None means one per head
        read.refuse("num_key_value_heads", read.get("num_key_value_heads"),
                    f"DeepSeek's kv_b_proj gives each of the {heads} heads its own key and value")  # fmt: skip
    for key, computed in (("rope_interleave", True), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                          ("moe_layer_freq", 1)):  # fmt: skip
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
        # DeepseekV3MoE's shared experts are one MLP n_shared_experts times as wide as a routed one, added unscaled
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


class _Reader:
    """Typed reads of a Hugging Face config with the class defaults; each error names the Hugging Face key."""

    def __init__(self, raw: Mapping[str, Any], defaults: dict[str, Any], source: str) -> None:
        self.raw, self.defaults, self.source = raw, defaults, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw[key] if key in self.raw else self.defaults.get(key, default)

    def int(self, key: str, optional: bool = False) -> int | None:
        value = self.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{self.source}: {key!r} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not (0 < value < math.inf):
            raise ConfigError(f"{self.source}: {key!r} must be a finite number > 0, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: {key!r} must be true or false, got {value!r}")
        return value

    def refuse(self, key: str, value: Any, why: str) -> None:
        raise ConfigError(f"{self.source}: {key} {value!r} is not supported: {why}; nothing was loaded")


def _refuse_unmapped(read: _Reader, model_type: str) -> None:
    """Fields that change the function and that the model here does not compute."""
    act_key, act_wanted = "hidden_act", "silu"
    if model_type in GEMMA_TYPES:
        act_key, act_wanted = "hidden_activation", "gelu_pytorch_tanh"
    if read.get(act_key, act_wanted) != act_wanted:
        read.refuse(act_key, read.get(act_key), f"the {model_type} MLP here is gated by {act_wanted}")
    if read.get("mlp_bias", False) not in (False, None):
        read.refuse("mlp_bias", read.get("mlp_bias"), "the MLP here has no biases")
    # Qwen2's and Qwen2-MoE's q/k/v biases are built in (qkv_bias); their classes never read attention_bias
    if model_type not in ("qwen2", "qwen2_moe") and read.get("attention_bias", False) not in (False, None):
        read.refuse("attention_bias", read.get("attention_bias"), "its o_proj bias has no equivalent here")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if read.get(key) is not None and model_type not in GEMMA_TYPES:
            read.refuse(key, read.get(key), f"{model_type} has no logit soft-capping")
    if read.get("use_bidirectional_attention"):
        read.refuse("use_bidirectional_attention", True, "the model here is a causal language model")
    for key in ("attention_dropout", "router_jitter_noise", "resid_pdrop", "embd_pdrop"):
        value = read.get(key, 0.0)
        if value not in (0, 0.0, None):
            read.refuse(key, value, "training-time noise that the model here does not add")
    quantization = read.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "(set)") if isinstance(quantization, dict) else "(set)"
        read.refuse("quantization_config", method, "FP8 block-quantised weights (DeepSeek-V3's release) are not "
                    "dequantised here; use a bf16 copy" if method == "fp8" else "quantized weights are not loaded; "
                    "use a floating-point copy")  # fmt: skip


def _rope(read: _Reader, model_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_frequency_scaling)`` from either form, read as transformers 5 does
    (``PreTrainedConfig.convert_rope_params_to_dict``): transformers 4's ``rope_scaling`` wins over
    ``rope_parameters``, a theta inside the dict over the top-level ``rope_theta``, ``rope_type`` over ``type``."""
    params = read.get("rope_scaling") or read.get("rope_parameters") or {}
    key = "rope_scaling" if read.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ConfigError(f"{read.source}: {key!r} must be an object, got {params!r}")
    if model_type == "gemma3_text" and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # the sliding layers' own: ``_local_rope_theta``
    if any(isinstance(v, dict) for v in params.values()):
        read.refuse(key, "(per layer type)", "RoPE parameters per attention type are not mapped")
    theta = params.get("rope_theta", read.get("rope_theta"))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not (0 < theta < math.inf):
        raise ConfigError(f"{read.source}: rope_theta must be a finite number > 0, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's reading of its early files' names (convert_rope_params_to_dict)
    if model_type == "phi3" and kind not in ("default", "longrope"):
        read.refuse(f"{key} rope_type", kind, "Phi3Config accepts default and longrope only")
    if kind not in _ROPE_TYPES:
        read.refuse(f"{key} rope_type", kind, f"the RoPE types mapped are {list(_ROPE_TYPES)}")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        warnings.warn(f"{read.source}: ignoring {key} keys the {kind} RoPE does not use: {unknown}", stacklevel=3)
    if kind == "default":
        return float(theta), None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": params.get("factor")}
    if kind == "llama3":
        scaling.update(
            low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"),
            # transformers' default when absent: the model's own maximum length
            original_max_position_embeddings=params.get(
                "original_max_position_embeddings", read.get("max_position_embeddings")
            ),
        )
    if kind == "yarn":
        scaling.update(_yarn(read, params))
    elif kind == "longrope":
        scaling.update(_longrope(read, params, model_type))
    elif kind == "dynamic":
        # transformers rescales past the model's own max_position_embeddings (``_compute_dynamic_ntk_parameters``)
        scaling.update(original_max_position_embeddings=read.get("max_position_embeddings"))
    if kind != "yarn" and model_type == "deepseek_v3" and params.get("mscale_all_dim"):
        # DeepseekV3Attention's yarn_apply_mscale scales the softmax under any non-default kind; ours under yarn only
        read.refuse(f"{key} mscale_all_dim", params["mscale_all_dim"], f"it is mapped with yarn only, not {kind}")
    return float(theta), scaling


def _yarn(read: _Reader, params: Mapping[str, Any]) -> dict[str, Any]:
    """A yarn ``rope_frequency_scaling``'s numbers, with transformers' defaults (``_compute_yarn_parameters``,
    ``standardize_rope_params``): the original length is the model's own, the factor their ratio, ``beta_fast``
    32 and ``beta_slow`` 1 (also for 0); the optional ones only when set."""
    original = params.get("original_max_position_embeddings", read.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and isinstance(original, int | float) and original > 0:
        factor = read.int("max_position_embeddings") / original
    optional = {name: params[name] for name in (*YARN_OPTIONAL, "truncate") if params.get(name) is not None}
    return dict(factor=factor, original_max_position_embeddings=original, beta_fast=params.get("beta_fast") or 32,
                beta_slow=params.get("beta_slow") or 1, **optional)  # fmt: skip


def _dynamic_limit(limit: int, scaling: dict[str, Any] | None) -> int:
    """The positions a dynamic NTK model runs to here: transformers' class has no limit (the base keeps growing with
    the length) but ours needs one for its tables and its length checks, so ``factor`` times the original length,
    the extension the factor names; a sliding window shorter than the original length (``_position_limit``) stays."""
    if scaling is None or scaling["rope_type"] != "dynamic" or limit != scaling["original_max_position_embeddings"]:
        return limit
    factor = scaling["factor"]
    return int(factor * limit) if isinstance(factor, int | float) and factor >= 1 and math.isfinite(factor) else limit


def _longrope(read: _Reader, params: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """A longrope ``rope_frequency_scaling``'s numbers, read as transformers does (``standardize_rope_params``,
    ``_compute_longrope_parameters``): Phi-3's top-level ``original_max_position_embeddings`` (its class default
    4096) wins over the dict's, other families take the dict's, else the model's own length; the factor, when
    absent, is ``max_position_embeddings / original``; ``attention_factor`` only when set."""
    if model_type == "phi3":
        original = read.get("original_max_position_embeddings", 4096)
    else:
        original = params.get("original_max_position_embeddings", read.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None and isinstance(original, int | float) and original > 0:
        factor = read.int("max_position_embeddings") / original
    optional = {"attention_factor": params["attention_factor"]} if params.get("attention_factor") is not None else {}
    return dict(factor=factor, original_max_position_embeddings=original, short_factor=params.get("short_factor"),
                long_factor=params.get("long_factor"), **optional)  # fmt: skip


def _rotary_dim(read: _Reader, model_type: str, head_dim: int) -> int | None:
    """How many of each head's first dims RoPE rotates, None for all: ``int(head_dim * partial_rotary_factor)``
    (``modeling_phi3.py``), the factor read from the RoPE parameters first, as transformers 5 does. Only Phi-3's
    attention splits its heads so (Llama's would rotate a whole head with a shorter table)."""
    params = read.get("rope_scaling") or read.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", read.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return None
    if model_type != "phi3":
        read.refuse("partial_rotary_factor", factor, f"{model_type}'s attention here rotates whole heads")
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor < 1:
        raise ConfigError(f"{read.source}: 'partial_rotary_factor' must be a number in (0, 1], got {factor!r}")
    return int(head_dim * factor)


def _attention_kinds(read: _Reader, model_type: str, window: int | None) -> set[str]:
    """The kinds of attention a config's layers have when it lists no ``layer_types``: a set, not one per layer,
    since the layer count is not bounded yet. With a window, Qwen2 and Qwen3 window the layers
    ``>= max_window_layers``, Qwen2-MoE the even layers ``< max_window_layers``, the others every layer."""
    if window is None:
        return {"full_attention"}
    if model_type not in ("qwen2", "qwen3", "qwen2_moe"):
        return {"sliding_attention"}
    n_layers, first_full = read.int("num_hidden_layers"), read.get("max_window_layers")
    if not isinstance(first_full, int) or isinstance(first_full, bool):
        raise ConfigError(f"{read.source}: 'max_window_layers' must be an integer, got {first_full!r}")
    if model_type == "qwen2_moe":
        windowed, full = first_full > 0, n_layers > 1 or first_full <= 0
    else:
        windowed, full = first_full < n_layers, first_full > 0
    return {kind for kind, present in (("sliding_attention", windowed), ("full_attention", full)) if present}


def _position_limit(read: _Reader, model_type: str) -> int:
    """``max_position_embeddings``, lowered to a sliding window shorter than it.

    transformers' sliding window lets query ``q`` see key ``k`` when ``q - k < window``
    (``masking_utils.sliding_window_overlay``), so on sequences no longer than the window it is plain causal
    attention: limiting positions to the window computes the model exactly and refuses (with the usual
    max_position_embeddings errors) only what would differ. Windows on some layers only are refused.
    """
    limit = read.int("max_position_embeddings")
    if model_type in GEMMA_TYPES:
        return limit  # its windows are computed, layer by layer (``_gemma``)
    window = read.get("sliding_window")
    if model_type in ("qwen2", "qwen3", *QWEN_MOE_TYPES) and not read.get("use_sliding_window", False):
        window = None  # Qwen's window applies only with use_sliding_window
    layer_types = read.get("layer_types") or _attention_kinds(read, model_type, window)
    if not isinstance(layer_types, list | set) or not all(isinstance(kind, str) for kind in layer_types):
        read.refuse("layer_types", layer_types, "it must be a list of attention kinds")
    if set(layer_types) - {"full_attention", "sliding_attention"}:
        read.refuse("layer_types", layer_types, "only full and sliding-window attention are mapped")
    if "sliding_attention" in layer_types and "full_attention" in layer_types:
        read.refuse("layer_types", "(mixed)", "sliding-window attention on some layers only is not computed here")
    if "sliding_attention" not in layer_types or window is None:
        return limit
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{read.source}: 'sliding_window' must be a positive integer or null, got {window!r}")
    if window < limit:
        warnings.warn(
            f"{read.source}: sliding_window {window} < max_position_embeddings {limit}: positions are limited to "
            f"{window}, where the sliding window equals full causal attention",
            stacklevel=3,
        )
    return min(limit, window)


# --- weights -----------------------------------------------------------------------------------------------------

_KEY_PAIRS = [
    # (Hugging Face key, ours); {i} a layer, {j} an expert. Names from modeling_<type>.py and AstrAI's layout.
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("score.weight", "score.weight"),  # a reward model's head (``*ForSequenceClassification``)
    *[(f"model.layers.{{i}}.self_attn.{p}_proj.{t}", f"layers.{{i}}.attention.{p}_proj.{t}")
      for p in "qkvo" for t in ("weight", "bias")],
    *[(f"model.layers.{{i}}.self_attn.{p}_norm.weight", f"layers.{{i}}.attention.{p}_norm.weight") for p in "qk"],
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.weight"),
    *[(f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}.weight") for p in ("gate", "up", "down")],
]  # fmt: skip
_DEEPSEEK_V3_PAIRS = [
    ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", "layers.{i}.attention.kv_a_proj.weight"),
    ("model.layers.{i}.self_attn.kv_a_layernorm.weight", "layers.{i}.attention.kv_norm.weight"),
    ("model.layers.{i}.self_attn.kv_b_proj.weight", "layers.{i}.attention.kv_b_proj.weight"),
    ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
    ("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.score_correction_bias"),
    *[(f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight")
      for p in ("gate", "up", "down")],
    *[(f"model.layers.{{i}}.mlp.shared_experts.{p}_proj.weight", f"layers.{{i}}.mlp.shared_experts.0.{p}.weight")
      for p in ("gate", "up", "down")],
]  # fmt: skip
_MOE_KEY_PAIRS = {
    # The MoE layers' names differ by family (``moe_names``); within one family each name has one meaning.
    "mixtral": [
        ("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.router.weight"),
        # Mixtral's w1/w3/w2 are the gate/up/down projections (MixtralBlockSparseTop2MLP in transformers 4).
        *[(f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight",
           f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight")
          for w, p in (("w1", "gate"), ("w3", "up"), ("w2", "down"))],
    ],
    "qwen_moe": [  # Qwen2-MoE's and Qwen3-MoE's (which lacks the shared expert)
        ("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *[(f"model.layers.{{i}}.mlp.experts.{{j}}.{p}_proj.weight", f"layers.{{i}}.mlp.routed_experts.{{j}}.{p}.weight")
          for p in ("gate", "up", "down")],
        *[(f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight", f"layers.{{i}}.mlp.shared_experts.0.{p}.weight")
          for p in ("gate", "up", "down")],
        ("model.layers.{i}.mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
    ],
    # DeepSeek-V3's MoE and latent attention; with a compressed query, its q_b_proj is our q_proj (whose input is
    # then the normalised rank-q_lora_rank latent), found before the plain q_proj of _KEY_PAIRS.
    **{family: [*query, *_DEEPSEEK_V3_PAIRS] for family, query in (("deepseek_v3", []), ("deepseek_v3_q_lora", [
        ("model.layers.{i}.self_attn.q_a_proj.weight", "layers.{i}.attention.q_a_proj.weight"),
        ("model.layers.{i}.self_attn.q_a_layernorm.weight", "layers.{i}.attention.q_a_norm.weight"),
        ("model.layers.{i}.self_attn.q_b_proj.weight", "layers.{i}.attention.q_proj.weight"),
    ]))},
}  # fmt: skip
_OUTPUT_NORM_KEY_PAIRS = {
    # Whether the block normalises its sublayers' outputs (``norm_placement`` post or sandwich): transformers'
    # ``post_attention_layernorm`` is then the attention output's norm (OLMo 2's and Gemma 2's decoder layers),
    # otherwise the MLP's input norm (Llama's), AstrAI's ``post_attention_norm``.
    False: [("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_norm.weight")],
    True: [
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.attention_output_norm.weight"),
        ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.{i}.post_attention_norm.weight"),
        ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.mlp_output_norm.weight"),
    ],
}  # fmt: skip
_DERIVED_HF_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
"""Buffers some older checkpoints saved; recomputed from the config, never loaded."""
_ROTATED = re.compile(r"^layers\.\d+\.attention\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)") + "$")


_FAMILY_PAIRS = {
    (family, output_norms): pairs + _KEY_PAIRS + norms  # a family's own names first (DeepSeek's q_b_proj)
    for family, pairs in _MOE_KEY_PAIRS.items()
    for output_norms, norms in _OUTPUT_NORM_KEY_PAIRS.items()
}
"""Every name pair of a model, by its MoE family (``moe_names``) and whether its blocks have output norms."""
_TO_OURS = {family: [(_pattern(hf), ours) for hf, ours in pairs] for family, pairs in _FAMILY_PAIRS.items()}
_TO_HF = {family: [(_pattern(ours), hf) for hf, ours in pairs] for family, pairs in _FAMILY_PAIRS.items()}
_SHARED_TO_HF = [(_pattern(ours), hf) for hf, ours in _KEY_PAIRS]


def moe_names(config: ModelConfig) -> str:
    """Whose MoE tensor names a model's Hugging Face files carry: DeepSeek-V3's for latent attention (with or
    without its compressed query), Qwen-MoE's for a model only a Qwen-MoE class computes (a gated shared expert, or
    q/k norms), else Mixtral's; the choice ``export_model_type`` makes."""
    if config.attn_type == "mla":
        return "deepseek_v3_q_lora" if config.q_lora_rank else "deepseek_v3"
    return "qwen_moe" if config.shared_expert_gate or config.use_qk_norm else "mixtral"


def _rename(key: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(key)
        if match:
            return template.format(**match.groupdict())
    return None


def hf_key_to_ours(key: str, config: ModelConfig | None = None) -> str | None:
    """Our name for a Hugging Face tensor name of ``config``'s family (``moe_names``), or, without a config, of any
    family (no name means two things in two families); None when it has none."""
    if config is not None:
        return _rename(key, _TO_OURS[_names(config)])
    return next(filter(None, (_rename(key, table) for table in _TO_OURS.values())), None)


def is_hf_name(key: str) -> bool:
    """Whether ``key`` names a tensor of some supported family (a fused one, or one in a multimodal checkpoint's
    language model, included)."""
    key = language_model_key(key)
    return hf_key_to_ours(key) is not None or bool(_FUSED_KEY.match(key))


_LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                            "language_model.lm_head.": "lm_head."}  # fmt: skip
"""A multimodal checkpoint's language model, as transformers 5 and 4 name it (``modeling_gemma3.py``), and the
names of the same tensors in a text-only model."""
_OTHER_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
"""A multimodal checkpoint's other towers: left out (``MULTIMODAL_TEXT_TOWERS``)."""


def language_model_key(key: str) -> str:
    """``key`` as a text-only model names it (a multimodal checkpoint's language model prefix replaced)."""
    prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if key.startswith(p)), None)
    return key if prefix is None else _LANGUAGE_MODEL_PREFIXES[prefix] + key.removeprefix(prefix)


def our_key_to_hf(key: str, config: ModelConfig | None = None) -> str | None:
    """The Hugging Face name of one of our tensor names in ``config``'s family (``moe_names``), or, without a
    config, a name every family shares (an MoE router's or expert's has none); None when it has none."""
    return _rename(key, _TO_HF[_names(config)] if config is not None else _SHARED_TO_HF)


def _names(config: ModelConfig) -> tuple[str, bool]:
    """The key of a model's name table (``_FAMILY_PAIRS``)."""
    return moe_names(config), config.norm_placement != "pre"


def is_rotated(key: str, config: ModelConfig | None = None) -> bool:
    """Whether one of our tensors has q/k rows in our RoPE pairing where transformers' have rotate-half pairing
    (permuted on import and export). Never under MLA: DeepSeek-V3's checkpoints rotate interleaved pairs, as we do
    (its ``rope_interleave``, the only layout mapped), and the scores do not depend on the order of the dims."""
    return bool(_ROTATED.match(key)) and (config is None or config.attn_type != "mla")


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def multi_token_prediction_layers(keys: Iterable[str], config: ModelConfig) -> list[int]:
    """The layers of a DeepSeek-V3 checkpoint past ``num_hidden_layers``: its multi-token-prediction modules
    (``num_nextn_predict_layers``, arXiv:2412.19437 section 2.2), which the causal LM never runs (transformers skips
    them too); their tensors are left out (``import_targets``)."""
    if not moe_names(config).startswith("deepseek_v3"):
        return []
    indices = {int(match[1]) for key in keys if (match := _LAYER_INDEX.match(key))}
    return sorted(i for i in indices if i >= config.num_hidden_layers)


def rotate_half_to_interleaved(rows: Tensor, head_dim: int, rotary_dim: int | None = None) -> Tensor:
    """Reorder the rows of each head from transformers' RoPE layout to ours: row ``i`` goes to ``2i`` and row
    ``i + r/2`` to ``2i + 1``, so the pair rotated together by frequency ``i`` sits side by side. ``r`` is
    ``rotary_dim`` (the head's first rows that rotate, Phi-3's partial rotary; the rest keep their place), by default
    the whole ``head_dim``.

    ``rows`` is a q/k projection weight ``[heads * head_dim, in]``, its bias, or a q/k norm weight (per head, or
    over the whole projection).
    """
    return _permute_rotated(rows, head_dim, rotary_dim or head_dim, (2, -1))


def interleaved_to_rotate_half(rows: Tensor, head_dim: int, rotary_dim: int | None = None) -> Tensor:
    """The inverse of ``rotate_half_to_interleaved``."""
    return _permute_rotated(rows, head_dim, rotary_dim or head_dim, (-1, 2))


def _permute_rotated(rows: Tensor, head_dim: int, rotary_dim: int, split: tuple[int, int]) -> Tensor:
    """Swap the two row axes ``split`` of each head's first ``rotary_dim`` rows (a ``2 x r/2`` / ``r/2 x 2``
    transpose), keeping the other rows of the head in place."""
    heads = rows.unflatten(0, (-1, head_dim))
    rotated, passed = heads.split([rotary_dim, head_dim - rotary_dim], dim=1)
    rotated = rotated.unflatten(1, split).transpose(1, 2).flatten(1, 2)
    return torch.cat([rotated, passed], dim=1).flatten(0, 1).contiguous()


class Target(NamedTuple):
    """Where a Hugging Face tensor, or one part of it, goes (``import_targets``)."""

    name: str
    """Our tensor's name."""
    head_dim: int | None = None
    """Set when its rows are q/k rows in rotate-half pairing, permuted head by head to ours on the way in
    (``rotate_half_to_interleaved``)."""
    rotary_dim: int | None = None
    """With ``head_dim``: the rows of each head that rotate (Phi-3's partial rotary); None means all of them."""
    rows: tuple[int, int] | None = None
    """The rows ``[start, stop)`` of a fused tensor that are this one (Phi-3's ``qkv_proj`` and ``gate_up_proj``);
    None means the whole tensor."""


def import_targets(key: str, config: ModelConfig) -> list[Target]:
    """Where a Hugging Face tensor goes: one ``Target``, one per part of a fused tensor (``FUSED``), or none when it
    is derived and never loaded. A name with no equivalent keeps its Hugging Face spelling, so the strict match
    against the model (``checkpoint.load_model_weights``) names it. Lets the loader read each tensor straight into
    its place without building a renamed state dict first."""
    if _DERIVED_HF_KEYS.match(key) or _OTHER_TOWERS.match(key) or multi_token_prediction_layers([key], config):
        return []
    key = language_model_key(key)
    fused = _FUSED_KEY.match(key)
    if fused is None:
        return [_target(hf_key_to_ours(key, config) or key, config)]
    layer, parts = fused["i"], fused_parts(fused["name"], config)
    return [_target(f"layers.{layer}.{name}.weight", config, rows) for name, rows in parts.items()]


def _target(name: str, config: ModelConfig, rows: tuple[int, int] | None = None) -> Target:
    if not is_rotated(name, config):
        return Target(name, rows=rows)
    return Target(name, config.attention_head_dim, config.rope_dim, rows)


FUSED = {"self_attn.qkv_proj": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate", "mlp.up")}  # fmt: skip
"""Phi-3's fused projections (``modeling_phi3.py``: q, k and v rows stacked, then gate and up) and ours, in order."""
FUSED_MODEL_TYPES = ("phi3",)
"""The families whose files hold ``FUSED`` tensors: split on import, fused again on export."""
_FUSED_KEY = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<name>self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")


def fused_into(key: str, model_type: str) -> str | None:
    """The ``FUSED`` tensor of ``model_type``'s files that holds our tensor ``key``; None when none does."""
    match = re.match(r"^layers\.(\d+)\.(.+)\.weight$", key)
    if model_type not in FUSED_MODEL_TYPES or match is None:
        return None
    fused = next((name for name, parts in FUSED.items() if match[2] in parts), None)
    return fused and f"model.layers.{match[1]}.{fused}.weight"


def fused_parts(fused: str, config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Our layers within a ``FUSED`` tensor of ``config``'s sizes, each with its rows ``[start, stop)``."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    if fused == "self_attn.qkv_proj":
        widths = [config.num_attention_heads, kv_heads, kv_heads]
        widths = [heads * config.attention_head_dim for heads in widths]
    else:
        widths = [config.intermediate_size] * 2
    ends = list(itertools.accumulate(widths))
    return {name: (end - width, end) for name, width, end in zip(FUSED[fused], widths, ends, strict=True)}


def state_dict_from_hf(hf_state: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face tensors under our names, q/k rows in our RoPE pairing, fused tensors split; tensors are taken as
    they are (dtype included). See ``import_targets``."""
    ours = {}
    for key, tensor in hf_state.items():
        for name, head_dim, rotary_dim, rows in import_targets(key, config):
            part = tensor if rows is None else tensor[rows[0] : rows[1]]
            ours[name] = part if head_dim is None else rotate_half_to_interleaved(part, head_dim, rotary_dim)
    return ours


def state_dict_to_hf(state: Mapping[str, Tensor], config: ModelConfig, model_type: str = "") -> dict[str, Tensor]:
    """Our tensors under Hugging Face names, q/k rows in transformers' pairing, fused again where ``model_type``
    fuses them (``FUSED_MODEL_TYPES``): the inverse of ``state_dict_from_hf``. A tied model's ``lm_head.weight`` is
    left out, as transformers saves it."""
    hf = {}
    for key, tensor in state.items():
        if config.tied and key == "lm_head.weight":
            continue
        name = our_key_to_hf(key, config)
        if name is None:
            raise ValueError(f"{key}: no Hugging Face equivalent")
        if is_rotated(key, config):
            tensor = interleaved_to_rotate_half(tensor, config.attention_head_dim, config.rope_dim)
        hf[name] = tensor
    if model_type in FUSED_MODEL_TYPES:
        for layer, fused in itertools.product(range(config.num_hidden_layers), FUSED):
            parts = [hf.pop(f"model.layers.{layer}.{_hf_layer_name(ours)}.weight") for ours in FUSED[fused]]
            hf[f"model.layers.{layer}.{fused}.weight"] = torch.cat(parts)
    return hf


def _hf_layer_name(ours: str) -> str:
    """transformers' name of one of our layers within a block (``attention.q_proj`` -> ``self_attn.q_proj``)."""
    return our_key_to_hf(f"layers.0.{ours}.weight").removeprefix("model.layers.0.").removesuffix(".weight")


# --- export ------------------------------------------------------------------------------------------------------


def hf_config(config: ModelConfig, state: Mapping[str, Tensor], dtype: str, source: HFSource | None,
              token_ids: Mapping[str, int | None], where: str = "config.json") -> dict[str, Any]:  # fmt: skip
    """The Hugging Face ``config.json`` of a model: its source's config when it came from one (with the dtype
    written), else the config of the transformers class computing the same function (``export_model_type``), in the
    transformers 4 form the Hub's checkpoints carry (``rope_theta`` + ``rope_scaling``, ``torch_dtype``), which
    transformers 5 reads too. A ``ConfigError`` names what has no equivalent."""
    if source is not None:
        written = dict(source.config)
        if source.model_type in MULTIMODAL_TEXT_TOWERS:  # the language model alone: what these weights are
            written = language_model_config(written, where)
        for key in ("dtype", "torch_dtype"):
            if key in written:
                written[key] = dtype
        if "dtype" not in written and "torch_dtype" not in written:
            written["torch_dtype"] = dtype
        return _as_scored(written, config)
    model_type = export_model_type(config, state, where)
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    rope_theta = 10000.0 if config.rope_theta is None else config.rope_theta
    rope_scaling, max_positions = None, config.max_position_embeddings
    if config.rope_frequency_scaling is not None:
        rope_scaling = dict(config.rope_frequency_scaling)
    if rope_scaling is not None and rope_scaling["rope_type"] == "dynamic":
        # transformers' dynamic NTK switches at max_position_embeddings itself, and has no key for the original
        max_positions = rope_scaling.pop("original_max_position_embeddings")
    elif config.rope_scaling is not None and config.rope_scaling.get("type", "ntk") == "ntk":
        # AstrAI's NTK scaling only raises the base (model/layers.py, as AstrAI does): the default RoPE with
        # that base is the same function. Any other AstrAI rope_scaling type changes nothing there, nor here.
        rope_theta = rope_theta * config.rope_scaling.get("factor", 1.0) ** (config.rope_dim / (config.rope_dim - 2))
    written = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": config.attention_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        # None is torch's default for the input's dtype; transformers computes its RMSNorm in float32
        "rms_norm_eps": config.rms_norm_eps if config.rms_norm_eps is not None else torch.finfo(torch.float32).eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tied,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
        **{name: token_ids.get(name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")},
    }
    if model_type == "llama":
        written.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if model_type in ("qwen2", "qwen3"):
        written.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    if model_type in ("qwen3", "olmo2"):
        written.update(attention_bias=False)
    if model_type in GEMMA_TYPES:
        written.update(_gemma_fields(config, model_type, rope_theta, where))
        del written["hidden_act"]  # Gemma's configs name it hidden_activation
    if model_type == "phi3":
        written.update(partial_rotary_factor=config.rope_dim / config.attention_head_dim, resid_pdrop=0.0,
                       embd_pdrop=0.0, sliding_window=None,
                       original_max_position_embeddings=(rope_scaling or {}).get(
                           "original_max_position_embeddings", config.max_position_embeddings))  # fmt: skip
    if model_type == "mixtral":
        written.update(
            intermediate_size=config.moe_intermediate_size or config.intermediate_size,
            num_local_experts=config.n_routed_experts,
            num_experts_per_tok=config.n_activated_experts,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
            router_aux_loss_coef=config.moe_aux_loss_coef,
        )
    if model_type in QWEN_MOE_TYPES:
        written.update(_qwen_moe_fields(config, model_type))
    if model_type == "deepseek_v3":
        written.update(_deepseek_v3_fields(config))
    return _as_scored(written, config)


def _as_scored(written: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """A reward model's config: its family's ``*ForSequenceClassification`` with one label, padding with the id
    its score is read before; a language model's unchanged."""
    if not config.score_head:
        return written
    return {**written, "architectures": [sequence_classifier(written["model_type"])],
            "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": config.pad_token_id}  # fmt: skip


def _gemma_fields(config: ModelConfig, model_type: str, rope_theta: float, where: str) -> dict[str, Any]:
    """A Gemma 2 or Gemma 3 text config's own fields for ``config`` (the inverse of ``_gemma``)."""
    layer_types = config.layer_types or ["full_attention"] * config.num_hidden_layers
    fields = dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=config.query_pre_attn_scalar or config.attention_head_dim,  # head_dim ** -0.5: ours
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        layer_types=layer_types,
        sliding_window=config.sliding_window or config.max_position_embeddings,  # used by no layer when unset
        attention_bias=False,
    )
    if model_type == "gemma3_text":
        sliding = "sliding_attention" in layer_types
        if sliding and config.rope_local_theta is None and config.rope_frequency_scaling is not None:
            raise ConfigError(f"{where}: rope_frequency_scaling {config.rope_frequency_scaling!r} cannot be exported "
                              "to Hugging Face: Gemma 3's sliding layers take the default RoPE, and these share the "
                              "scaled one (rope_local_theta is not set)")  # fmt: skip
        fields.update(rope_local_base_freq=config.rope_local_theta or rope_theta)
    return fields


def _qwen_moe_fields(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """A Qwen2-MoE or Qwen3-MoE config's own fields for ``config`` (the inverse of ``_qwen_moe``)."""
    routed = config.moe_intermediate_size or config.intermediate_size
    fields = dict(
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
    if model_type == "qwen2_moe":
        shared = config.shared_expert_intermediate_size or config.intermediate_size
        fields.update(shared_expert_intermediate_size=shared, qkv_bias=config.attention_qkv_bias,
                      max_window_layers=config.num_hidden_layers)  # fmt: skip
    else:
        fields.update(attention_bias=False)
    return fields


def export_model_type(config: ModelConfig, state: Mapping[str, Tensor], where: str = "config.json") -> str:
    """The transformers model_type computing what ``config`` (with these weights) computes: dense GQA is ``llama``,
    with q/k/v biases ``qwen2``, with q/k norms ``qwen3``; an MoE with a gated shared expert ``qwen2_moe``, with q/k
    norms ``qwen3_moe``, else ``mixtral``; output norms with a q/k norm over the whole projection ``olmo2``; partial
    rotary ``phi3``; else a ``ConfigError`` naming the field that has no equivalent."""

    def refuse(field: str, value: Any, why: str) -> None:
        raise ConfigError(f"{where}: {field} {value!r} cannot be exported to Hugging Face: {why}")

    if config.attn_type == "mla":
        if not config.mla_shared_rope_key:
            refuse("attn_type", "mla", "AstrAI's latent attention differs from DeepSeek's (whose RoPE key is shared "
                   "across heads); no transformers class computes it")  # fmt: skip
        return _deepseek_v3_export(config, refuse)
    if config.use_gated_attention:
        refuse("use_gated_attention", True, "no transformers class exported here gates the attention output")
    gemma = [field for field, off in _GEMMA_OFF.items() if (getattr(config, field) or None) != (off or None)]
    if config.norm_placement == "sandwich" or gemma:
        return _the_only_class("gemma3_text" if config.use_qk_norm else "gemma2", config, refuse)
    if config.norm_placement == "post" or config.qk_norm_over_projection:
        return _the_only_class("olmo2", config, refuse)
    if config.rotary_dim is not None:
        head_dim, rotary_dim = config.attention_head_dim, config.rotary_dim
        if int(head_dim * (rotary_dim / head_dim)) != rotary_dim:
            refuse("rotary_dim", rotary_dim, f"Phi-3 rotates int(head_dim * partial_rotary_factor) dims, and no "
                   f"float factor gives {rotary_dim} of {head_dim}")  # fmt: skip
        scaling = config.rope_frequency_scaling
        if scaling is not None and scaling["rope_type"] != "longrope":
            refuse("rope_frequency_scaling", scaling, "Phi3Config accepts the default RoPE and longrope only")
        return _the_only_class("phi3", config, refuse)
    if config.norm_placement != "pre":
        refuse("norm_placement", config.norm_placement, "no transformers class exported here has these norms")
    if config.use_qk_norm and config.attention_qkv_bias:
        refuse("attention_qkv_bias", True, "no transformers class has both q/k/v biases and q/k norms")
    if config.use_qk_norm and not config.qk_norm_before_rope:
        # Qwen3 normalises before RoPE, AstrAI after; the two agree only when the two weights of every rotated
        # pair (2i, 2i+1) are equal, since then the per-dim scale commutes with the rotation.
        unequal = [k for k, v in state.items() if re.search(r"\.(q|k)_norm\.weight$", k)
                   and not torch.equal(v.float()[0::2], v.float()[1::2])]  # fmt: skip
        if unequal:
            refuse("use_qk_norm", True, f"AstrAI normalises q/k after RoPE, transformers' Qwen3 before, and "
                   f"{unequal[0]} scales the two dims of a rotated pair differently")  # fmt: skip
    if config.ffn_type == "moe":
        if config.shared_expert_gate:
            if config.n_shared_experts != 1:
                refuse("n_shared_experts", config.n_shared_experts, "Qwen2-MoE gates exactly one shared expert")
            if config.use_qk_norm:
                refuse("use_qk_norm", True, "Qwen2-MoE's attention has no q/k norms")
            return "qwen2_moe"
        if config.n_shared_experts:
            refuse("n_shared_experts", config.n_shared_experts, "shared experts added ungated (AstrAI's) have no "
                   "equivalent: Qwen2-MoE gates its one by a sigmoid, Mixtral and Qwen3-MoE have none")  # fmt: skip
        if config.use_qk_norm:
            return "qwen3_moe"
        dense = [i for i in range(config.num_hidden_layers) if config.ffn_type_of_layer(i) == "mlp"]
        if dense:
            refuse("mlp_only_layers/decoder_sparse_step", dense, "Mixtral has an MoE in every layer")
        if not config.norm_topk_prob:
            refuse("norm_topk_prob", False, "Mixtral renormalises the top-k routing weights")
        if config.attention_qkv_bias:
            refuse("attention_qkv_bias", True, "Mixtral's attention has no biases")
        return "mixtral"
    if config.attention_qkv_bias:
        return "qwen2"
    return "qwen3" if config.use_qk_norm else "llama"


_ONLY_CLASS = {
    # model_type: (what only its class computes among those exported here, the fields it needs: modeling_<type>.py)
    "olmo2": ("output norms only or a q/k norm over the whole projection",
              dict(norm_placement="post", use_qk_norm=True, qk_norm_over_projection=True, qk_norm_before_rope=True,
                   attention_qkv_bias=False, ffn_type="mlp", rotary_dim=None)),
    "phi3": ("RoPE on part of each head", dict(norm_placement="pre", use_qk_norm=None, attention_qkv_bias=False,
                                               ffn_type="mlp")),
    "gemma2": ("norms around each sublayer scaling by 1 + weight, scaled embeddings and GeGLU",
               dict(norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True,
                    mlp_activation="gelu_pytorch_tanh", use_qk_norm=None, attention_qkv_bias=False, ffn_type="mlp",
                    rotary_dim=None, rope_local_theta=None)),
    "gemma3_text": ("Gemma 2's block with per-head q/k norms",
                    dict(norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True,
                         mlp_activation="gelu_pytorch_tanh", use_qk_norm=True, qk_norm_before_rope=True,
                         qk_norm_over_projection=False, attention_qkv_bias=False, ffn_type="mlp", rotary_dim=None)),
}  # fmt: skip
_GEMMA_OFF = dict(norm_unit_offset=False, scale_embeddings=False, mlp_activation="silu", query_pre_attn_scalar=None,
                  attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=None, layer_types=None,
                  rope_local_theta=None)  # fmt: skip
"""The options only the Gemma classes compute, at their default (off); any one set leads export to Gemma's."""


_ONLY_CLASS["deepseek_v3"] = (  # here, after _GEMMA_OFF: it needs every Gemma option off
    "latent attention with a shared RoPE key",
    dict(_GEMMA_OFF, yarn_softmax_scale=True, use_qk_norm=None, use_gated_attention=None, norm_placement="pre",
         rotary_dim=None, ffn_type="moe", scoring_func="sigmoid", score_correction_bias=True, decoder_sparse_step=1,
         n_shared_experts=1, shared_expert_gate=False),
)  # fmt: skip


def _deepseek_v3_export(config: ModelConfig, refuse: Callable[[str, Any, str], None]) -> str:
    """``deepseek_v3`` for a model ``DeepseekV3ForCausalLM`` computes (``_ONLY_CLASS``, and its dense layers first,
    a shared MLP as wide as some routed ones, a key and value for every head), else the refusal."""
    _the_only_class("deepseek_v3", config, refuse)
    heads, dense = config.num_attention_heads, config.mlp_only_layers or []
    if (config.num_key_value_heads or heads) != heads:
        refuse("num_key_value_heads", config.num_key_value_heads, f"DeepSeek-V3 has a key and value per head ({heads})")
    if dense != list(range(len(dense))):
        refuse("mlp_only_layers", dense, "DeepSeek-V3's dense layers are its first first_k_dense_replace ones")
    routed = config.moe_intermediate_size or config.intermediate_size
    if (config.shared_expert_intermediate_size or config.intermediate_size) % routed:
        refuse("shared_expert_intermediate_size", config.shared_expert_intermediate_size,
               f"DeepSeek-V3's shared MLP is n_shared_experts routed experts wide ({routed} each)")  # fmt: skip
    return "deepseek_v3"


def _deepseek_v3_fields(config: ModelConfig) -> dict[str, Any]:
    """A DeepSeek-V3 config's own fields for ``config`` (the inverse of ``_deepseek_v3``)."""
    routed = config.moe_intermediate_size or config.intermediate_size
    return dict(
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


def _the_only_class(model_type: str, config: ModelConfig, refuse: Callable[[str, Any, str], None]) -> str:
    """``model_type``, when ``config`` has every field its class needs (``_ONLY_CLASS``), else the refusal."""
    what, fields = _ONLY_CLASS[model_type]
    for field, wanted in fields.items():
        if (getattr(config, field) or None) != (wanted or None):  # False and None both mean off
            refuse(field, getattr(config, field), f"{ARCHITECTURES[model_type]}, the class with {what}, has "
                   f"{field} {wanted!r}")  # fmt: skip
    return model_type


def generation_config(token_ids: Mapping[str, int | None]) -> dict[str, Any]:
    """``generation_config.json``: the special token ids transformers' ``generate`` stops and pads with."""
    return {name: token_ids[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")
            if token_ids.get(name) is not None}  # fmt: skip


_HF_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def hf_tokenizer_config(raw: Mapping[str, Any], max_length: int, path: str = "tokenizer_config.json") -> dict[str, Any]:
    """A Hugging Face ``tokenizer_config.json`` for AstrAI's (``special_tokens`` map, ``chat_template``), read from
    ``path``: transformers' fast tokenizer over the same ``tokenizer.json`` encodes the same ids.

    The chat template is rewritten so that transformers, which renders with ``trim_blocks`` and ``lstrip_blocks``,
    renders what AstrAI renders with Jinja's defaults (``for_jinja_whitespace_defaults``); one it cannot keep equal is
    left out with a warning rather than written to render other tokens."""
    special = dict(raw.get("special_tokens") or {})
    written: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                               "clean_up_tokenization_spaces": False}  # fmt: skip
    written.update({name: special[name] for name in _HF_SPECIAL_NAMES if name in special})
    others = [token for name, token in special.items() if name not in _HF_SPECIAL_NAMES]
    if others:
        written["additional_special_tokens"] = others
    template = raw.get("chat_template")
    if isinstance(template, str):
        rewritten = for_jinja_whitespace_defaults(template, path)
        if rewritten is None:
            warnings.warn(f"{path}: the chat template renders differently under transformers' "
                          "trim_blocks/lstrip_blocks and is not exported", stacklevel=2)  # fmt: skip
        else:
            written["chat_template"] = rewritten
    return written


_BLOCK_START = re.compile(r"\{([%#])(?![-+])")
_BLOCK_END = re.compile(r"(?<![-+])([%#])\}")


def for_jinja_whitespace_defaults(template: str, path: str = "tokenizer_config.json") -> str | None:
    """``template`` with every block and comment tag marked ``{%+ ... +%}``, which turns ``lstrip_blocks`` and
    ``trim_blocks`` off for that tag (Jinja's whitespace control), so it renders under transformers' settings as
    under Jinja's defaults; checked by rendering a probe conversation both ways, with the renderer training uses
    (bounded: a template past its bounds is refused, naming ``path``). None when they still differ."""
    # Here, not at the top: jinja2 adds 0.06-0.19 s (measured) to every `import astrai_fabric.checkpoint`, and only
    # exporting a chat template needs it.
    from astrai_fabric.tokenizer import TemplateLimitError, compile_template, render_template

    rewritten = _BLOCK_END.sub(r"+\1}", _BLOCK_START.sub(r"{\1+", template))
    probe = {"messages": [{"role": "system", "content": " s\n"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a "}], "add_generation_prompt": True,
             "bos_token": "<s>", "eos_token": "</s>"}  # fmt: skip
    try:
        plain = render_template(compile_template(template, path, huggingface=False), probe, path)
        as_hf = render_template(compile_template(rewritten, path, huggingface=True), probe, path)  # transformers'
    except TemplateLimitError:
        raise
    except UserError:  # a template that needs more than the probe offers: not provably equal
        return None
    return rewritten if plain == as_hf else None
