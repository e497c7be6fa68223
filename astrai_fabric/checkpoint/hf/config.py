"""A Hugging Face ``config.json`` both ways: read into the ``ModelConfig`` computing the same function
(``model_config_from_hf``), written for a model (``hf_config``: its source's config, or the one of the transformers
class computing its function, ``export_model_type``), and the ``meta.json`` record of where an imported model came
from (``HFSource``). What is particular to a family is asked of it (``families/``); what every family shares is here:
the fields all of them read, the refusal of what none computes, sliding windows, the reward model's score head."""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from astrai_fabric.checkpoint.hf.families import BY_MODEL_TYPE, MULTIMODAL, claiming, family
from astrai_fabric.checkpoint.hf.family import Family, Reader
from astrai_fabric.checkpoint.hf.rope import dynamic_limit, read_rope, rotary_dim
from astrai_fabric.config.kinds import kind_problem
from astrai_fabric.config.model import ASTRAI_MODEL_TYPE, EXTENDED_MODEL_TYPE, ModelConfig
from astrai_fabric.errors import CheckpointError, ConfigError

SHARED_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "hidden_act", "attention_bias", "mlp_bias",
    "attention_dropout", "sliding_window", "layer_types", "router_jitter_noise", "quantization_config",
    "final_logit_softcapping", "attn_logit_softcapping", "resid_pdrop", "embd_pdrop", "use_bidirectional_attention",
}  # fmt: skip
"""The config keys read (or checked and refused) for every family; each family's own are ``Family.keys``."""
HARMLESS_KEYS = {
    # Metadata, generation defaults and training-loss settings that do not change the function of the weights.
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range", "bos_token_id",
    "eos_token_id", "pad_token_id", "pretraining_tp", "output_router_logits", "router_aux_loss_coef", "_name_or_path",
    "return_dict", "output_attentions", "output_hidden_states", "auto_map",
    # PreTrainedConfig's generic fields (in ``to_dict()``, rarely in a saved file), none used by a causal LM's forward
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "chunk_size_feed_forward",
}  # fmt: skip
SOURCE_KEY = "source"
"""``meta.json`` key of a checkpoint trained from a Hugging Face directory: its ``HFSource`` (AstrAI ignores it)."""
ARCHITECTURES = {model_type: family.architecture for model_type, family in BY_MODEL_TYPE.items()}
"""The transformers class of each supported model_type (``modeling_<type>.py``)."""


def sequence_classifier(model_type: str) -> str:
    """The transformers class of a reward model (one label) of ``model_type``: ``*ForSequenceClassification``."""
    return BY_MODEL_TYPE[model_type].sequence_classifier


@dataclass(frozen=True)
class HFSource:
    """Where an imported model came from, as the model trained from it is: enough to write the same architecture
    back (export)."""

    model_type: str
    config: dict[str, Any]
    """The Hugging Face ``config.json`` as read, or for a reward model started from a language model, that config as
    its family's classifier (``describing``)."""

    @property
    def architecture(self) -> str:
        """The transformers class named in the config (``architectures``), else the model_type's (for a multimodal
        one, its language model's: what is loaded and exported)."""
        named = self.config.get("architectures")
        if isinstance(named, list) and len(named) == 1 and isinstance(named[0], str):
            return named[0]
        if self.model_type in MULTIMODAL:
            return MULTIMODAL[self.model_type].architecture
        return ARCHITECTURES[self.model_type]

    def describing(self, model_config: ModelConfig, where: str) -> HFSource:
        """This source as the model ``model_config`` is. A reward model started from a language model (ours of a
        Hugging Face one, or the directory itself) is that network with a score head and a padding id: its source is
        the family's ``*ForSequenceClassification`` of one label padding with the reward model's id (a multimodal
        checkpoint's language model alone), which is what its weights compute and what export writes. Otherwise
        the source unchanged (a language model's, or a classifier's, checked against the model where read; as is
        one of an unknown model_type or whose ``architectures`` is no list, which the mapping refuses)."""
        known = isinstance(self.model_type, str) and (self.model_type in BY_MODEL_TYPE or self.model_type in MULTIMODAL)
        malformed = not known or not isinstance(self.config.get("architectures", []), list)
        if not model_config.score_head or malformed or _names_classifier(self.config):
            return self
        config = self.config
        if self.model_type in MULTIMODAL:  # the reward model holds the language model alone
            with warnings.catch_warnings():  # said when the checkpoint was imported
                warnings.simplefilter("ignore")
                config = language_model_config(config, where)
        return HFSource(model_type=config["model_type"], config=_as_scored(dict(config), model_config))

    def to_meta(self) -> dict[str, Any]:
        """The ``meta.json`` entry (``SOURCE_KEY``) a checkpoint trained from this model carries."""
        return {
            "format": "huggingface",
            "model_type": self.model_type,
            "architecture": self.architecture,
            "config": self.config,
        }

    @classmethod
    def from_meta(cls, value: Any, model_config: ModelConfig, where: str) -> HFSource:
        """A ``meta.json`` ``source`` entry, checked: a supported Hugging Face config whose mapping is the
        checkpoint's own model (else export would write another model's config around these weights)."""
        fits = isinstance(value, dict) and value.get("format") == "huggingface"
        fits = fits and isinstance(value.get("config"), dict) and isinstance(value.get("model_type"), str)
        if not fits or value.get("model_type") != value["config"].get("model_type"):
            raise CheckpointError(
                f"{where}: {SOURCE_KEY!r} must be {{format: 'huggingface', model_type, architecture, config}} with "
                f"the config's own model_type, got {str(value)[:200]}"
            )
        # A reward model read with the language model's source it starts from (an sft checkpoint's; a reward model's
        # own from before sources described the model trained): compared, and kept, as the reward model it became.
        label = f"{where} {SOURCE_KEY!r} config"
        recorded = cls(model_type=value["model_type"], config=value["config"]).describing(model_config, label)
        with warnings.catch_warnings():  # unknown keys were reported when the model was imported
            warnings.simplefilter("ignore")
            mapped = model_config_from_hf(recorded.config, source=label)
        ours, theirs = _architecture_fields(model_config), _architecture_fields(mapped)
        if ours != theirs:
            differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise CheckpointError(
                f"{where}: {SOURCE_KEY!r} describes another model than config.json (they differ in {differ})"
            )
        return recorded


def _architecture_fields(config: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k != "neftune_alpha"}  # NEFTune is training-time noise


def source_of(
    imported: HFSource | None, meta: Mapping[str, Any], model_config: ModelConfig, where: str
) -> HFSource | None:
    """The Hugging Face architecture of ``model_config``, the model a directory's weights become: the directory's own
    (``imported``, when it is a Hugging Face directory), else the ``source`` its ``meta.json`` records (checked),
    else None; either as ``model_config`` is (``HFSource.describing``: a reward model started from a language
    model is its family's classifier)."""
    if imported is not None:
        return imported.describing(model_config, where)
    if SOURCE_KEY in meta:
        return HFSource.from_meta(meta[SOURCE_KEY], model_config, where)
    return None


def is_hf_config(raw: Mapping[str, Any], source: str = "config.json") -> bool:
    """True when a ``config.json`` names a Hugging Face architecture (AstrAI writes ``autoregressive_lm`` or
    nothing, we also ``astrai_fabric_lm``). The first read of ``model_type``: its kind is checked here."""
    if problem := kind_problem(raw.get("model_type"), str | None):
        raise ConfigError(f"{source}: 'model_type' {problem}")
    return raw.get("model_type") not in (None, ASTRAI_MODEL_TYPE, EXTENDED_MODEL_TYPE)


# --- config.json -> ModelConfig -------------------------------------------------------------------------------------


def model_config_from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` that computes what the Hugging Face config ``raw`` describes, or a ``ConfigError`` (one
    line naming the model_type or the field) when it cannot be computed exactly."""
    if raw.get("model_type") in MULTIMODAL:
        return model_config_from_hf(language_model_config(raw, source), source)
    kind = family(raw.get("model_type"), source)
    read = Reader(raw, kind.defaults, source)
    _refuse_unmapped(read, kind)
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim = read.int("head_dim", optional=True)
    if head_dim is not None and head_dim * heads == hidden:
        head_dim = None  # AstrAI's own rule gives the same width; keep the config AstrAI-shaped
    theta, frequency_scaling = read_rope(read, kind)
    values: dict[str, Any] = dict(
        model_type=ASTRAI_MODEL_TYPE,
        vocab_size=read.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=read.int("num_hidden_layers"),
        rms_norm_eps=read.number("rms_norm_eps"),
        intermediate_size=read.int("intermediate_size"),
        tie_word_embeddings=read.bool("tie_word_embeddings", default=False),
        max_position_embeddings=dynamic_limit(_position_limit(read, kind), frequency_scaling),
        rope_theta=theta,
        num_attention_heads=heads,
        num_key_value_heads=read.int("num_key_value_heads", optional=True) or heads,
        head_dim=head_dim,
        attention_qkv_bias=False,
        use_qk_norm=None,
        qk_norm_before_rope=False,
        qk_norm_over_projection=False,
        norm_placement="pre",
        rotary_dim=rotary_dim(read, kind, head_dim or hidden // heads),
        rope_frequency_scaling=frequency_scaling,
    )
    values.update(kind.fields(read))
    values.update(_score_head(read))
    unknown = sorted(k for k in raw if k not in SHARED_KEYS | HARMLESS_KEYS | kind.keys)
    if unknown:
        warnings.warn(f"{source}: ignoring keys the {kind.model_type} mapping does not know: {unknown}", stacklevel=2)
    config = ModelConfig.from_dict(values, source=source)
    config.check_buildable(source=source)
    return config


def language_model_config(raw: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The config of a multimodal checkpoint's language model (``Family.multimodal_model_type``), what loading and
    export read in its place, with a warning that its other towers are left out."""
    text_family = MULTIMODAL[raw["model_type"]]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a multimodal {raw['model_type']} config needs a 'text_config' object")
    warnings.warn(
        f"{source}: a multimodal {raw['model_type']} checkpoint: its language model is loaded, its vision "
        f"tower and projector are left out (images are not read); export writes the language model alone, "
        f"a {text_family.architecture}",
        stacklevel=3,
    )
    shared = {key: raw[key] for key in ("tie_word_embeddings", "dtype", "torch_dtype") if key in raw}
    return {**text, **shared, "model_type": text_family.model_type, "architectures": [text_family.architecture]}


def _score_head(read: Reader) -> dict[str, Any]:
    """A ``*ForSequenceClassification`` with one label is a reward model: a score head read at the last token before
    ``pad_token_id`` (transformers' rule); a causal LM's config gives nothing."""
    architectures = read.get("architectures") or []
    if not isinstance(architectures, list):  # transformers writes a list; anything else was never one of its configs
        raise ConfigError(
            f"{read.source}: architectures {reprlib.repr(architectures)} is not supported: expected a list of "
            "transformers class names; nothing was loaded"
        )
    if not _names_classifier(read.raw):
        return {}
    labels = read.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else read.get("num_labels", 2)  # transformers' default 2
    if num_labels != 1:
        read.refuse("num_labels", num_labels, "a classifier of several labels is not a reward model (one score)")
    pad_token_id = read.get("pad_token_id")
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        read.refuse(
            "pad_token_id",
            pad_token_id,
            "a reward model reads its score at the last token before padding, which needs the padding id",
        )
    return dict(score_head=True, pad_token_id=pad_token_id)


def _names_classifier(raw: Mapping[str, Any]) -> bool:
    """Whether a config's ``architectures`` name a ``*ForSequenceClassification`` (a list: checked where read)."""
    architectures = raw.get("architectures")
    return isinstance(architectures, list) and any(
        isinstance(name, str) and name.endswith("ForSequenceClassification") for name in architectures
    )


def _refuse_unmapped(read: Reader, kind: Family) -> None:
    """Fields that change the function and that the model here does not compute."""
    act_key, act_wanted = kind.activation
    if read.get(act_key, act_wanted) != act_wanted:
        read.refuse(act_key, read.get(act_key), f"the {kind.model_type} MLP here is gated by {act_wanted}")
    if read.get("mlp_bias", False) not in (False, None):
        read.refuse("mlp_bias", read.get("mlp_bias"), "the MLP here has no biases")
    if kind.reads_attention_bias and read.get("attention_bias", False) not in (False, None):
        read.refuse("attention_bias", read.get("attention_bias"), "its o_proj bias has no equivalent here")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if read.get(key) is not None and not kind.soft_capping:
            read.refuse(key, read.get(key), f"{kind.model_type} has no logit soft-capping")
    if read.get("use_bidirectional_attention"):
        read.refuse("use_bidirectional_attention", True, "the model here is a causal language model")
    for key in ("attention_dropout", "router_jitter_noise", "resid_pdrop", "embd_pdrop"):
        value = read.get(key, 0.0)
        if value not in (0, 0.0, None):
            read.refuse(key, value, "training-time noise that the model here does not add")
    quantization = read.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "(set)") if isinstance(quantization, dict) else "(set)"
        read.refuse(
            "quantization_config",
            method,
            "FP8 block-quantised weights (DeepSeek-V3's release) are not dequantised here; use a bf16 copy"
            if method == "fp8"
            else "quantized weights are not loaded; use a floating-point copy",
        )


def _position_limit(read: Reader, kind: Family) -> int:
    """``max_position_embeddings``, lowered to a sliding window shorter than it.

    transformers' sliding window lets query ``q`` see key ``k`` when ``q - k < window``
    (``masking_utils.sliding_window_overlay``), so on sequences no longer than the window it is plain causal
    attention: limiting positions to the window computes the model exactly and refuses (with the usual
    max_position_embeddings errors) only what would differ. Windows on some layers only are refused, except by a
    family that computes its windows layer by layer (``Family.windows_per_layer``).
    """
    limit = read.int("max_position_embeddings")
    if kind.windows_per_layer:
        return limit
    window = kind.sliding_window(read)
    layer_types = read.get("layer_types") or kind.attention_kinds(read, window)
    if not isinstance(layer_types, list | set) or not all(isinstance(name, str) for name in layer_types):
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


# --- ModelConfig -> config.json -------------------------------------------------------------------------------------


def hf_config(
    config: ModelConfig,
    state: Mapping[str, Tensor],
    dtype: str,
    source: HFSource | None,
    token_ids: Mapping[str, int | None],
    where: str = "config.json",
) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a model: its source's config when it came from one (with the dtype
    written), else the config of the transformers class computing the same function (``export_model_type``), in the
    transformers 4 form the Hub's checkpoints carry (``rope_theta`` + ``rope_scaling``, ``torch_dtype``), which
    transformers 5 reads too. A ``ConfigError`` names what has no equivalent."""
    if source is not None:
        written = dict(source.config)
        if source.model_type in MULTIMODAL:  # the language model alone: what these weights are
            written = language_model_config(written, where)
        for key in ("dtype", "torch_dtype"):
            if key in written:
                written[key] = dtype
        if "dtype" not in written and "torch_dtype" not in written:
            written["torch_dtype"] = dtype
        return _as_scored(written, config)
    model_type = export_model_type(config, state, where)
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
        "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
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
    return _as_scored(BY_MODEL_TYPE[model_type].write(config, written, where), config)


def _as_scored(written: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """A reward model's config: its family's ``*ForSequenceClassification`` with one label, padding with the id
    its score is read before; a language model's unchanged."""
    if not config.score_head:
        return written
    return {
        **written,
        "architectures": [sequence_classifier(written["model_type"])],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": config.pad_token_id,
    }


def export_model_type(config: ModelConfig, state: Mapping[str, Tensor], where: str = "config.json") -> str:
    """The transformers model_type computing what ``config`` (with these weights) computes: that of the first family
    claiming it (``families.claiming``; dense GQA is ``llama``), or a ``ConfigError`` naming the field that has no
    equivalent in its class."""

    def refuse(field: str, value: Any, why: str) -> None:
        raise ConfigError(f"{where}: {field} {value!r} cannot be exported to Hugging Face: {why}")

    if config.use_gated_attention:
        refuse("use_gated_attention", True, "no transformers class exported here gates the attention output")
    chosen = claiming(config)
    chosen.check_export(config, state, refuse)
    return chosen.model_type
