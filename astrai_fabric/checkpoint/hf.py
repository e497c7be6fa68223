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
- **Tied embeddings**: a tied checkpoint has no ``lm_head.weight``.
- Both config forms: transformers 4 (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and transformers 5
  (``rope_parameters``, ``dtype``).

Reading the files stays in ``checkpoint/files.py`` (the only safetensors importer); this module maps configs and
tensors, both ways: ``state_dict_to_hf`` is the inverse of ``state_dict_from_hf``, and ``hf_config`` writes the
config of the architecture a model came from (``HFSource``, kept in ``meta.json``) or of the transformers class
computing the same function (``export_model_type``), refusing by field what has no equivalent
(``astrai_fabric.export`` writes the directory).

Over 300 lines for one responsibility: every Hugging Face convention (seven architectures, both directions,
their refusals) in one module, so no other module needs to know any of them.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from astrai_fabric.config.kinds import kind_problem
from astrai_fabric.config.model import ASTRAI_MODEL_TYPE, EXTENDED_MODEL_TYPE, ModelConfig
from astrai_fabric.errors import CheckpointError, ConfigError, UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")

REFUSED_MODEL_TYPES = {
    "gemma": "its RMSNorm scales by (1 + weight), its embeddings by sqrt(hidden_size) and its MLP uses GELU",
    "gemma2": "Gemma's norm and embedding scaling, extra norms per block, logit soft-capping and alternating "
    "sliding-window layers",
    "gemma3": "Gemma's norm and embedding scaling, extra norms per block and alternating sliding-window layers",
    "phi3": "fused qkv/gate_up projections with LongRoPE scaling and a sliding window are not mapped",
    "deepseek_v2": "multi-head latent attention with a decoupled shared RoPE key, YaRN and group-limited routing "
    "differ from ours",
    "deepseek_v3": "multi-head latent attention with a decoupled shared RoPE key, YaRN and sigmoid group routing "
    "differ from ours",
}
"""Architectures refused with the reason; any other model_type is refused as unknown."""

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
}  # fmt: skip

_READ_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "hidden_act", "attention_bias",
    "mlp_bias", "attention_dropout", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "num_local_experts", "num_experts_per_tok", "router_jitter_noise", "quantization_config",
    "final_logit_softcapping", "attn_logit_softcapping", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
}  # fmt: skip
_HARMLESS_KEYS = {
    # Metadata, generation defaults and training-loss settings that do not change the function of the weights.
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "output_router_logits",
    "router_aux_loss_coef", "_name_or_path", "return_dict", "output_attentions", "output_hidden_states",
    # PreTrainedConfig's generic fields (in ``to_dict()``, rarely in a saved file), none used by a causal LM's forward
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
}  # fmt: skip
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "partial_rotary_factor"}  # fmt: skip
_ROPE_TYPES = ("default", "linear", "llama3")


SOURCE_KEY = "source"
"""``meta.json`` key of a checkpoint trained from a Hugging Face directory: its ``HFSource`` (AstrAI ignores it)."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
"""The transformers class of each supported model_type (``modeling_<type>.py``)."""


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
        max_position_embeddings=_position_limit(read, model_type),
        rope_theta=theta,
        num_attention_heads=heads,
        num_key_value_heads=read.int("num_key_value_heads", optional=True) or heads,
        head_dim=head_dim,
        attention_qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and read.bool("qkv_bias", True)),
        use_qk_norm=model_type in ("qwen3", "qwen3_moe") or None,
        qk_norm_before_rope=model_type in ("qwen3", "qwen3_moe"),
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
    unknown = sorted(k for k in raw if k not in _READ_KEYS | _HARMLESS_KEYS)
    if unknown:
        warnings.warn(f"{source}: ignoring keys the {model_type} mapping does not know: {unknown}", stacklevel=2)
    config = ModelConfig.from_dict(values, source=source)
    config.check_buildable(source=source)
    return config


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
    act = read.get("hidden_act", "silu")
    if act != "silu":
        read.refuse("hidden_act", act, "the MLP here is SwiGLU with silu")
    if read.get("mlp_bias", False) not in (False, None):
        read.refuse("mlp_bias", read.get("mlp_bias"), "the MLP here has no biases")
    # Qwen2's and Qwen2-MoE's q/k/v biases are built in (qkv_bias); their classes never read attention_bias
    if model_type not in ("qwen2", "qwen2_moe") and read.get("attention_bias", False) not in (False, None):
        read.refuse("attention_bias", read.get("attention_bias"), "its o_proj bias has no equivalent here")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if read.get(key) is not None:
            read.refuse(key, read.get(key), "logit soft-capping is not computed here")
    if read.get("partial_rotary_factor", 1.0) != 1.0:
        read.refuse("partial_rotary_factor", read.get("partial_rotary_factor"), "RoPE here rotates whole heads")
    for key in ("attention_dropout", "router_jitter_noise"):
        value = read.get(key, 0.0)
        if value not in (0, 0.0, None):
            read.refuse(key, value, "training-time noise that the model here does not add")
    if read.get("quantization_config") is not None:
        read.refuse("quantization_config", "(set)", "quantized weights are not loaded; use a floating-point copy")


def _rope(read: _Reader, model_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_frequency_scaling)`` from either form, read as transformers 5 does
    (``PreTrainedConfig.convert_rope_params_to_dict``): transformers 4's ``rope_scaling`` wins over
    ``rope_parameters``, a theta inside the dict over the top-level ``rope_theta``, ``rope_type`` over ``type``."""
    params = read.get("rope_scaling") or read.get("rope_parameters") or {}
    key = "rope_scaling" if read.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ConfigError(f"{read.source}: {key!r} must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        read.refuse(key, "(per layer type)", "RoPE parameters per attention type are not mapped")
    theta = params.get("rope_theta", read.get("rope_theta"))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not (0 < theta < math.inf):
        raise ConfigError(f"{read.source}: rope_theta must be a finite number > 0, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        read.refuse(f"{key} rope_type", kind, f"the RoPE types mapped are {list(_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        read.refuse("partial_rotary_factor", params["partial_rotary_factor"], "RoPE here rotates whole heads")
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
    return float(theta), scaling


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
    *[(f"model.layers.{{i}}.self_attn.{p}_proj.{t}", f"layers.{{i}}.attention.{p}_proj.{t}")
      for p in "qkvo" for t in ("weight", "bias")],
    *[(f"model.layers.{{i}}.self_attn.{p}_norm.weight", f"layers.{{i}}.attention.{p}_norm.weight") for p in "qk"],
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_norm.weight"),
    *[(f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}.weight") for p in ("gate", "up", "down")],
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
}  # fmt: skip
_DERIVED_HF_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
"""Buffers some older checkpoints saved; recomputed from the config, never loaded."""
_ROTATED = re.compile(r"^layers\.\d+\.attention\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)") + "$")


_TO_OURS = {
    family: [(_pattern(hf), ours) for hf, ours in _KEY_PAIRS + pairs] for family, pairs in _MOE_KEY_PAIRS.items()
}
_TO_HF = {family: [(_pattern(ours), hf) for hf, ours in _KEY_PAIRS + pairs] for family, pairs in _MOE_KEY_PAIRS.items()}
_SHARED_TO_HF = [(_pattern(ours), hf) for hf, ours in _KEY_PAIRS]


def moe_names(config: ModelConfig) -> str:
    """Whose MoE tensor names a model's Hugging Face files carry: Qwen-MoE's for a model only a Qwen-MoE class
    computes (a gated shared expert, or q/k norms), else Mixtral's; the choice ``export_model_type`` makes."""
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
        return _rename(key, _TO_OURS[moe_names(config)])
    return next(filter(None, (_rename(key, table) for table in _TO_OURS.values())), None)


def our_key_to_hf(key: str, config: ModelConfig | None = None) -> str | None:
    """The Hugging Face name of one of our tensor names in ``config``'s family (``moe_names``), or, without a
    config, a name every family shares (an MoE router's or expert's has none); None when it has none."""
    return _rename(key, _TO_HF[moe_names(config)] if config is not None else _SHARED_TO_HF)


def is_rotated(key: str) -> bool:
    """Whether one of our tensors has q/k rows in our RoPE pairing (permuted on import and export)."""
    return bool(_ROTATED.match(key))


def rotate_half_to_interleaved(rows: Tensor, head_dim: int) -> Tensor:
    """Reorder the rows of each head from transformers' RoPE layout to ours: row ``i`` goes to ``2i`` and row
    ``i + d/2`` to ``2i + 1``, so the pair rotated together by frequency ``i`` sits side by side.

    ``rows`` is a q/k projection weight ``[heads * head_dim, in]``, its bias, or a per-head norm weight
    ``[head_dim]``.
    """
    return rows.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2).contiguous()


def interleaved_to_rotate_half(rows: Tensor, head_dim: int) -> Tensor:
    """The inverse of ``rotate_half_to_interleaved``."""
    return rows.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).flatten(0, 2).contiguous()


def import_name(key: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Where a Hugging Face tensor goes: ``(our name, head_dim)`` when its rows must be permuted from rotate-half
    pairing to ours (``rotate_half_to_interleaved`` with that ``head_dim``), ``(our name, None)`` when it is taken
    as it is, None when it is derived and never loaded. A name with no equivalent keeps its Hugging Face spelling,
    so the strict match against the model (``checkpoint.load_model_weights``) names it. Lets the loader read each
    tensor straight into its place without building a renamed state dict first."""
    if _DERIVED_HF_KEYS.match(key):
        return None
    name = hf_key_to_ours(key, config) or key
    return name, config.attention_head_dim if _ROTATED.match(name) else None


def state_dict_from_hf(hf_state: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face tensors under our names, q/k rows in our RoPE pairing; tensors are taken as they are (dtype
    included). See ``import_name``."""
    ours = {}
    for key, tensor in hf_state.items():
        target = import_name(key, config)
        if target is not None:
            name, head_dim = target
            ours[name] = tensor if head_dim is None else rotate_half_to_interleaved(tensor, head_dim)
    return ours


def state_dict_to_hf(state: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our tensors under Hugging Face names, q/k rows in transformers' pairing (the inverse of
    ``state_dict_from_hf``); a tied model's ``lm_head.weight`` is left out, as transformers saves it."""
    hf = {}
    for key, tensor in state.items():
        if config.tied and key == "lm_head.weight":
            continue
        name = our_key_to_hf(key, config)
        if name is None:
            raise ValueError(f"{key}: no Hugging Face equivalent")
        if _ROTATED.match(key):
            tensor = interleaved_to_rotate_half(tensor, config.attention_head_dim)
        hf[name] = tensor
    return hf


# --- export ------------------------------------------------------------------------------------------------------


def hf_config(config: ModelConfig, state: Mapping[str, Tensor], dtype: str, source: HFSource | None,
              token_ids: Mapping[str, int | None], where: str = "config.json") -> dict[str, Any]:  # fmt: skip
    """The Hugging Face ``config.json`` of a model: its source's config when it came from one (with the dtype
    written), else the config of the transformers class computing the same function (``export_model_type``), in the
    transformers 4 form the Hub's checkpoints carry (``rope_theta`` + ``rope_scaling``, ``torch_dtype``), which
    transformers 5 reads too. A ``ConfigError`` names what has no equivalent."""
    if source is not None:
        written = dict(source.config)
        for key in ("dtype", "torch_dtype"):
            if key in written:
                written[key] = dtype
        if "dtype" not in written and "torch_dtype" not in written:
            written["torch_dtype"] = dtype
        return written
    model_type = export_model_type(config, state, where)
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    rope_theta = 10000.0 if config.rope_theta is None else config.rope_theta
    rope_scaling = None
    if config.rope_frequency_scaling is not None:
        rope_scaling = dict(config.rope_frequency_scaling)
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
        "max_position_embeddings": config.max_position_embeddings,
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
    if model_type == "qwen3":
        written.update(attention_bias=False)
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
    return written


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
    norms ``qwen3_moe``, else ``mixtral``; else a ``ConfigError`` naming the field that has no equivalent."""

    def refuse(field: str, value: Any, why: str) -> None:
        raise ConfigError(f"{where}: {field} {value!r} cannot be exported to Hugging Face: {why}")

    if config.attn_type == "mla":
        refuse("attn_type", "mla", "AstrAI's latent attention differs from DeepSeek's (whose RoPE key is shared "
               "across heads); no transformers class computes it")  # fmt: skip
    if config.use_gated_attention:
        refuse("use_gated_attention", True, "no transformers class exported here gates the attention output")
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
