"""Hugging Face tensors both ways: names (each family's own, ``Family.tensor_names``, before the names every family
shares, Llama's), q/k rows moved between transformers' RoPE pairing and ours, and fused tensors split and fused
again (``Family.fused``). ``state_dict_to_hf`` is the inverse of ``state_dict_from_hf``; ``import_targets`` lets the
loader (``checkpoint/files.py``) read each tensor straight into its place.

**RoPE pairing.** transformers' ``rotate_half`` pairs dims ``(i, i + d/2)`` of each head; ours (AstrAI's, Meta's
original) pairs ``(2i, 2i + 1)``, both with frequency ``i``. Importing permutes the rows of each q/k head (weights,
biases and the per-head q/k norm weights) from one layout to the other; v and o are unchanged, and the scores
``q·k`` are the same because both sides move alike (``rotate_half_to_interleaved``). A tied checkpoint has no
``lm_head.weight``.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from astrai_fabric.checkpoint.hf.families import BY_MODEL_TYPE, FAMILIES, claiming
from astrai_fabric.checkpoint.hf.family import NamePairs
from astrai_fabric.config.model import ModelConfig

SHARED_NAMES: NamePairs = (
    # (Hugging Face name, ours); {i} a layer. Names from modeling_llama.py (which the others copy) and AstrAI's.
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("score.weight", "score.weight"),  # a reward model's head (``*ForSequenceClassification``)
    *[
        (f"model.layers.{{i}}.self_attn.{p}_proj.{t}", f"layers.{{i}}.attention.{p}_proj.{t}")
        for p in "qkvo"
        for t in ("weight", "bias")
    ],
    *[(f"model.layers.{{i}}.self_attn.{p}_norm.weight", f"layers.{{i}}.attention.{p}_norm.weight") for p in "qk"],
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.weight"),
    *[(f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}.weight") for p in ("gate", "up", "down")],
)
OUTPUT_NORM_NAMES: Mapping[bool, NamePairs] = {
    # Whether the block normalises its sublayers' outputs (``norm_placement`` post or sandwich): transformers'
    # ``post_attention_layernorm`` is then the attention output's norm (OLMo 2's and Gemma 2's decoder layers),
    # otherwise the MLP's input norm (Llama's), AstrAI's ``post_attention_norm``.
    False: (("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_norm.weight"),),
    True: (
        ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.attention_output_norm.weight"),
        ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.{i}.post_attention_norm.weight"),
        ("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.mlp_output_norm.weight"),
    ),
}
_DERIVED_HF_KEYS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
"""Buffers some older checkpoints saved; recomputed from the config, never loaded."""
_ROTATED = re.compile(r"^layers\.\d+\.attention\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")
FUSED = {name: parts for family in FAMILIES for name, parts in family.fused.items()}
"""Every family's fused tensors (a name within a block -> ours, rows stacked in that order)."""
_FUSED_KEY = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<name>" + "|".join(map(re.escape, FUSED)) + r")\.weight$")
_LANGUAGE_MODEL_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
"""A multimodal checkpoint's language model, as transformers 5 and 4 name it (``modeling_gemma3.py``), and the
names of the same tensors in a text-only model."""
_OTHER_TOWERS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
"""A multimodal checkpoint's other towers: left out (``Family.multimodal_model_type``)."""
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{j\}", r"(?P<j>\d+)") + "$")


@functools.cache
def _compiled(pairs: NamePairs, to_hf: bool) -> tuple[tuple[re.Pattern[str], str], ...]:
    return tuple((_pattern(ours), hf) if to_hf else (_pattern(hf), ours) for hf, ours in pairs)


def _names(own: NamePairs, output_norms: bool) -> NamePairs:
    """Every name pair of a model: its family's own first (DeepSeek's q_b_proj), then the shared ones and those of
    its block's norms."""
    return own + SHARED_NAMES + OUTPUT_NORM_NAMES[output_norms]


def _model_names(config: ModelConfig) -> NamePairs:
    """The names of ``config``'s files: those of the family whose class computes it (the one export writes)."""
    return _names(claiming(config).tensor_names(config), config.norm_placement != "pre")


def _rename(key: str, table: Iterable[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.match(key)
        if match:
            return template.format(**match.groupdict())
    return None


def hf_key_to_ours(key: str, config: ModelConfig | None = None) -> str | None:
    """Our name for a Hugging Face tensor name of ``config``'s family, or, without a config, of any family (no name
    means two things in two families); None when it has none."""
    if config is not None:
        return _rename(key, _compiled(_model_names(config), to_hf=False))
    tables = (_compiled(_names(f.tensor_names(None), norms), False) for f in FAMILIES for norms in (False, True))
    return next(filter(None, (_rename(key, table) for table in tables)), None)


def our_key_to_hf(key: str, config: ModelConfig | None = None) -> str | None:
    """The Hugging Face name of one of our tensor names in ``config``'s family, or, without a config, a name every
    family shares (an MoE router's or expert's has none); None when it has none."""
    return _rename(key, _compiled(_model_names(config) if config is not None else SHARED_NAMES, to_hf=True))


def is_hf_name(key: str) -> bool:
    """Whether ``key`` names a tensor of some supported family (a fused one, or one in a multimodal checkpoint's
    language model, included)."""
    key = language_model_key(key)
    return hf_key_to_ours(key) is not None or bool(_FUSED_KEY.match(key))


def language_model_key(key: str) -> str:
    """``key`` as a text-only model names it (a multimodal checkpoint's language model prefix replaced)."""
    prefix = next((p for p in _LANGUAGE_MODEL_PREFIXES if key.startswith(p)), None)
    return key if prefix is None else _LANGUAGE_MODEL_PREFIXES[prefix] + key.removeprefix(prefix)


def is_rotated(key: str, config: ModelConfig | None = None) -> bool:
    """Whether one of our tensors has q/k rows in our RoPE pairing where transformers' have rotate-half pairing
    (permuted on import and export): never in a family that pairs them as we do (``Family.rotate_half``)."""
    return bool(_ROTATED.match(key)) and (config is None or claiming(config).rotate_half)


def multi_token_prediction_layers(keys: Iterable[str], config: ModelConfig) -> list[int]:
    """The layers of a checkpoint past ``num_hidden_layers`` in a family whose files carry modules there that the
    causal LM never runs (``Family.skips_trailing_layers``: DeepSeek-V3's multi-token prediction); their tensors
    are left out (``import_targets``)."""
    if not claiming(config).skips_trailing_layers:
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


def fused_into(key: str, model_type: str) -> str | None:
    """The fused tensor of ``model_type``'s files that holds our tensor ``key``; None when none does."""
    match = re.match(r"^layers\.(\d+)\.(.+)\.weight$", key)
    fused = BY_MODEL_TYPE[model_type].fused if model_type in BY_MODEL_TYPE else {}
    name = next((name for name, parts in fused.items() if match and match[2] in parts), None)
    return name and f"model.layers.{match[1]}.{name}.weight"


def fused_parts(fused: str, config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Our layers within a fused tensor (``FUSED``) of ``config``'s sizes, each with its rows ``[start, stop)``."""
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    heads = {"attention.q_proj": config.num_attention_heads, "attention.k_proj": kv_heads, "attention.v_proj": kv_heads}
    widths = [
        heads[name] * config.attention_head_dim if name in heads else config.intermediate_size for name in FUSED[fused]
    ]
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
    fuses them (``Family.fused``): the inverse of ``state_dict_from_hf``. A tied model's ``lm_head.weight`` is
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
    fused = BY_MODEL_TYPE[model_type].fused if model_type in BY_MODEL_TYPE else {}
    for layer, name in itertools.product(range(config.num_hidden_layers), fused):
        parts = [hf.pop(f"model.layers.{layer}.{_hf_layer_name(ours)}.weight") for ours in fused[name]]
        hf[f"model.layers.{layer}.{name}.weight"] = torch.cat(parts)
    return hf


def _hf_layer_name(ours: str) -> str:
    """transformers' name of one of our layers within a block (``attention.q_proj`` -> ``self_attn.q_proj``)."""
    return our_key_to_hf(f"layers.0.{ours}.weight").removeprefix("model.layers.0.").removesuffix(".weight")
