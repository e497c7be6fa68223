"""``ModelConfig``: AstrAI's model ``config.json``, field for field (AstrAI's ``astrai/config/model_config.py``).

Reading is AstrAI's: unknown keys are ignored (with a warning, since Hugging Face configs carry many), missing
keys take AstrAI's defaults, and ``to_dict`` writes every field in AstrAI's declaration order, which is the key set
AstrAI's ``save_pretrained`` writes (plus, only where they are not at their default, the extension fields that
Hugging Face architectures need, ``EXTENSION_FIELDS``). Where AstrAI accepts anything (its pydantic model coerces or
ignores), we check each value's type and name the field in one error, and ``check_buildable`` reports every missing
architecture field at once instead of the ``TypeError`` AstrAI raises deep inside model construction.

Over 300 lines for one responsibility: every field of AstrAI's ``config.json`` (and the extensions) with its
docstring, type check and buildability check, kept together as the schema they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai_fabric.config.kinds import kind_problem, wants_float
from astrai_fabric.errors import ConfigError, brief
from astrai_fabric.json_files import read_json_object

MAX_SIZE = 2**31 - 1
"""The largest size (width, count, length) a config may give: token ids are int32 in AstrAI's shards, and a larger
width or count describes no model that fits any machine."""
MAX_LAYERS = 4096
"""The most decoder blocks a config may ask for (the deepest published models have about a thousand): every
layer is a module built, one at a time, before anything can be trained or checked."""
MAX_EXPERT_MLPS = 2**16
"""The most expert MLPs (routed and shared, over all MoE layers) a config may ask for: each is a module built one
at a time (DeepSeek-V3 has 58 x 257 = 14,906)."""
ATTN_TYPES = ("gqa", "mla")
FFN_TYPES = ("mlp", "moe")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
MLP_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ASTRAI_MODEL_TYPE = "autoregressive_lm"
"""The ``model_type`` AstrAI writes; a ``config.json`` with another one is a Hugging Face architecture (or ours,
``EXTENDED_MODEL_TYPE``)."""
EXTENDED_MODEL_TYPE = "astrai_fabric_lm"
"""The ``model_type`` written when an extension field is set (a model AstrAI's schema cannot express). AstrAI's
``ConfigFactory`` and ``AutoModel`` refuse a type they do not know (``Unknown component``): under
``autoregressive_lm`` AstrAI would ignore the extension fields and silently compute another function."""
EXTENSION_FIELDS = (
    "head_dim",
    "attention_qkv_bias",
    "qk_norm_before_rope",
    "rope_frequency_scaling",
    "shared_expert_gate",
    "q_lora_rank",
    "v_head_dim",
    "mla_shared_rope_key",
    "yarn_softmax_scale",
    "scoring_func",
    "score_correction_bias",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_placement",
    "qk_norm_over_projection",
    "rotary_dim",
    "norm_unit_offset",
    "scale_embeddings",
    "mlp_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
    "rope_local_theta",
    "score_head",
    "pad_token_id",
)
"""Our fields beyond AstrAI's schema: written to config.json only when they differ from their default."""
ROPE_FREQUENCY_TYPES = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
    "longrope": ("factor", "original_max_position_embeddings"),
    "dynamic": ("factor", "original_max_position_embeddings"),
}
"""``rope_frequency_scaling`` kinds and the numbers each needs (Hugging Face's names)."""
YARN_OPTIONAL = ("mscale", "mscale_all_dim", "attention_factor")
"""The numbers a ``yarn`` scaling may add (each >= 0; absent or 0 means unset, as in transformers)."""
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass
class ModelConfig:
    """Architecture of an AstrAI ``AutoRegressiveLM``; defaults are AstrAI's."""

    model_type: str | None = None
    """Model family for AstrAI's factory; None means ``"autoregressive_lm"``. Written as ``"astrai_fabric_lm"`` when
    an extension field is set (AstrAI refuses that type rather than misread the file)."""
    neftune_alpha: float = 0.0
    """NEFTune noise scale; 0 disables it. Noise is added to embeddings in training mode only."""
    vocab_size: int | None = None
    """Number of token ids (rows of the embedding and of ``lm_head``)."""
    hidden_size: int | None = None
    """Width of the residual stream."""
    num_hidden_layers: int | None = None
    """Number of decoder blocks."""
    rms_norm_eps: float | None = None
    """RMSNorm epsilon; None means torch's default for the dtype."""
    intermediate_size: int | None = None
    """Width of the dense SwiGLU MLP (and the fallback width of MoE experts)."""
    tie_word_embeddings: bool | None = None
    """Share one matrix between ``embed_tokens`` and ``lm_head``; tied only when exactly true."""
    max_position_embeddings: int | None = None
    """Length of the RoPE table; positions must stay below it."""
    rope_theta: float | None = None
    """RoPE base frequency; None means 10000."""
    rope_scaling: dict | None = None
    """RoPE scaling; only ``{"type": "ntk", "factor": f}`` changes anything (a dict without ``type`` counts as NTK).
    AstrAI's meaning, kept so its files compute what AstrAI computes; Hugging Face's kinds are
    ``rope_frequency_scaling``."""
    attn_type: str = "gqa"
    """Attention: ``gqa`` (grouped-query) or ``mla`` (multi-head latent)."""
    num_attention_heads: int | None = None
    """Number of query heads."""
    num_key_value_heads: int | None = None
    """Number of key/value heads; must divide ``num_attention_heads``."""
    use_qk_norm: bool | None = None
    """RMSNorm on each query/key head, applied after RoPE (AstrAI's order)."""
    use_gated_attention: bool | None = None
    """Multiply the attention output by ``sigmoid(gate(x))`` before ``o_proj``."""
    kv_lora_rank: int | None = None
    """MLA: rank of the compressed key/value projection."""
    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int | None = None
    """MLA: per-head query/key width with RoPE."""
    ffn_type: str = "mlp"
    """Feed-forward: ``mlp`` (dense SwiGLU) or ``moe`` (DeepSeek-style mixture of experts)."""
    n_routed_experts: int | None = None
    """MoE: number of routed experts."""
    n_shared_experts: int | None = None
    """MoE: number of always-on shared experts (0 allowed); their outputs are averaged."""
    n_activated_experts: int | None = None
    """MoE: experts chosen per token (top-k)."""
    topk_method: str | None = None
    """MoE: accepted for compatibility and unused (routing is always plain top-k, as in AstrAI)."""
    moe_intermediate_size: int | None = None
    """MoE: width of each routed expert; None means ``intermediate_size``."""
    shared_expert_intermediate_size: int | None = None
    """MoE: width of each shared expert; None means ``intermediate_size``."""
    norm_topk_prob: bool = True
    """MoE: renormalise the top-k routing weights to sum to one."""
    decoder_sparse_step: int = 1
    """MoE: every ``decoder_sparse_step``-th layer is MoE, the others dense (1 = every layer)."""
    mlp_only_layers: list[int] | None = None
    """MoE: layer indices that stay dense."""
    moe_aux_loss_coef: float = 0.01
    """Recorded for AstrAI; training reads ``--moe_aux_loss_coef`` instead (as AstrAI does)."""

    # Fields AstrAI's schema lacks, for architectures imported from Hugging Face (``checkpoint/hf/``). Their
    # defaults are AstrAI's behaviour and ``to_dict`` leaves them out while they hold it, so an AstrAI config.json
    # reads and writes back with exactly AstrAI's keys.
    head_dim: int | None = None
    """GQA: per-head query/key/value width; None means ``hidden_size // num_attention_heads`` (AstrAI's rule)."""
    attention_qkv_bias: bool = False
    """GQA: the query, key and value projections have biases (Qwen2); the output projection has none."""
    qk_norm_before_rope: bool = False
    """With ``use_qk_norm``: normalise each query/key head *before* RoPE (Qwen3's order) instead of after (AstrAI's)."""
    rope_frequency_scaling: dict | None = None
    """Hugging Face's RoPE frequency scaling (``modeling_rope_utils.py``): ``{"rope_type": "linear", "factor": f}``
    divides every frequency by f; ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` divides the low frequencies by f, keeps the high ones and blends between;
    ``{"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}`` (with optional
    ``YARN_OPTIONAL`` numbers and ``truncate``) blends the same way by rotations over the original length and scales
    cos and sin by its attention factor (Peng et al. 2023, arXiv:2309.00071). Two depend on each forward's length
    (its largest position + 1): ``{"rope_type": "longrope", "factor", "original_max_position_embeddings",
    "short_factor", "long_factor"}`` (optional ``attention_factor``) divides pair i's frequency by
    ``short_factor[i]`` in forwards up to the original length and by ``long_factor[i]`` in longer ones, cos and sin
    times ``sqrt(1 + ln(factor) / ln(original))`` (Phi-3); ``{"rope_type": "dynamic", "factor",
    "original_max_position_embeddings"}`` is the default RoPE up to the original length and raises the base with the
    length past it (dynamic NTK)."""
    shared_expert_gate: bool = False
    """MoE: scale the shared experts' output by ``sigmoid(shared_expert_gate(x))``, a learned ``Linear(hidden, 1)``
    per token (Qwen2-MoE); AstrAI adds it unscaled."""
    q_lora_rank: int | None = None
    """MLA: rank of the query's low-rank compression, ``q_proj(q_a_norm(q_a_proj(x)))`` (DeepSeek-V2/V3's
    ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``); None means one ``q_proj(x)`` (AstrAI's)."""
    v_head_dim: int | None = None
    """MLA: per-head value width; None means ``qk_nope_head_dim + qk_rope_head_dim`` (AstrAI's, which then needs
    ``heads * that == hidden_size``). Set, the output projection reads ``heads * v_head_dim`` (DeepSeek-V2/V3)."""
    mla_shared_rope_key: bool = False
    """MLA: the key's rotated part is one head, the last ``qk_rope_head_dim`` outputs of ``kv_a_proj`` (not
    normalised), shared by every head: DeepSeek-V2's decoupled RoPE key (arXiv:2405.04434, section 2.1.3). AstrAI's
    comes per head out of ``kv_b_proj``."""
    yarn_softmax_scale: bool = False
    """MLA under a ``yarn`` ``rope_frequency_scaling`` with ``mscale_all_dim``: the softmax scale
    ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` is multiplied by ``(0.1 * mscale_all_dim * ln(factor) + 1)^2``
    (DeepSeek-V2/V3's attention; transformers' ``yarn_apply_mscale`` in ``modeling_deepseek_v3.py``)."""
    scoring_func: str = "softmax"
    """MoE: the router's scores (``SCORING_FUNCS``): ``softmax`` over the experts (AstrAI's) or a ``sigmoid`` per
    expert (DeepSeek-V3); a chosen expert's weight is its score."""
    score_correction_bias: bool = False
    """MoE: a per-expert bias added to the scores for *choosing* the top-k experts, never to their weights: the
    buffer ``score_correction_bias`` of each MoE layer, set by DeepSeek-V3's auxiliary-loss-free balancing
    (arXiv:2412.19437, section 2.1.2), never by gradients."""
    n_group: int = 1
    """MoE: the routed experts form ``n_group`` equal groups, and a token chooses among the experts of its
    ``topk_group`` best groups only, a group scoring the sum of its two best (bias-corrected) scores
    (DeepSeek-V3's group-limited routing); 1 means no groups."""
    topk_group: int = 1
    """MoE: how many of the ``n_group`` groups a token's experts may come from."""
    routed_scaling_factor: float = 1.0
    """MoE: the routed experts' weights are multiplied by this after ``norm_topk_prob`` (DeepSeek-V3: 2.5)."""
    norm_placement: str = "pre"
    """Where each block's RMSNorms sit (``NORM_PLACEMENTS``): ``pre`` normalises each sublayer's input (AstrAI's,
    Llama's); ``post`` each sublayer's output before the residual add, inputs unnormalised (OLMo 2); ``sandwich``
    both (Gemma 2 and 3)."""
    qk_norm_over_projection: bool = False
    """With ``use_qk_norm``: one RMSNorm over each token's whole query (key) projection, every head together, with a
    weight of ``heads * head_dim`` (OLMo 2), instead of one per head of ``head_dim``."""
    rotary_dim: int | None = None
    """GQA: RoPE rotates each query/key head's first ``rotary_dim`` dims only, the others pass unrotated (Phi-3's
    ``partial_rotary_factor * head_dim``); None means the whole head."""
    norm_unit_offset: bool = False
    """Every RMSNorm scales by ``1 + weight``, its weight starting at zeros (Gemma), instead of by ``weight``."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by ``sqrt(hidden_size)``, rounded to the embedding's dtype (Gemma)."""
    mlp_activation: str = "silu"
    """The dense MLP's gate activation (``MLP_ACTIVATIONS``): ``silu`` (SwiGLU, AstrAI's) or ``gelu_pytorch_tanh``
    (GeGLU with GELU's tanh approximation, Gemma)."""
    query_pre_attn_scalar: int | None = None
    """GQA: the attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 2 and 3; an integer in
    transformers' configs) instead of ``head_dim ** -0.5``."""
    attn_logit_softcapping: float | None = None
    """GQA: attention scores become ``c * tanh(scores / c)`` before the mask and softmax (Gemma 2); None: uncapped."""
    final_logit_softcapping: float | None = None
    """The logits become ``c * tanh(logits / c)`` (Gemma 2); None: uncapped."""
    sliding_window: int | None = None
    """The layers ``layer_types`` marks ``sliding_attention`` let a query see only the keys less than this many
    positions before it (Mistral's and Gemma's window, ``q - k < sliding_window``), within the mask they are given."""
    layer_types: list[str] | None = None
    """Each layer's attention (``LAYER_TYPES``): ``full_attention`` or ``sliding_attention`` (with
    ``sliding_window``); None means full attention in every layer."""
    rope_local_theta: float | None = None
    """The RoPE base of the sliding-window layers, without frequency scaling (Gemma 3's ``rope_local_base_freq``);
    None means they share the model's RoPE."""
    score_head: bool = False
    """A reward model: the network ends in ``score``, one scalar per position (``[1, hidden_size]``, read at each
    sequence's last token that is not ``pad_token_id``), instead of the LM head (transformers'
    ``*ForSequenceClassification`` with one label). Trained by ``astrai-fabric reward_model``."""
    pad_token_id: int | None = None
    """A reward model's padding id: its score is read at the rightmost token that is not this id (transformers'
    rule, so its export scores the same); None for a language model."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Keys of the source file this schema does not know; kept only to report them, never written."""

    def __post_init__(self) -> None:
        problems = []
        if self.attn_type not in ATTN_TYPES:
            problems.append(f"attn_type must be one of {list(ATTN_TYPES)}, got {self.attn_type!r}")
        if self.ffn_type not in FFN_TYPES:
            problems.append(f"ffn_type must be one of {list(FFN_TYPES)}, got {self.ffn_type!r}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            problems.append(f"mlp_activation must be one of {list(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            problems.append(f"norm_placement must be one of {list(NORM_PLACEMENTS)}, got {self.norm_placement!r}")
        if self.scoring_func not in SCORING_FUNCS:
            problems.append(f"scoring_func must be one of {list(SCORING_FUNCS)}, got {self.scoring_func!r}")
        if self.decoder_sparse_step < 1:
            problems.append(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")
        if self.neftune_alpha < 0:
            problems.append(f"neftune_alpha must be non-negative, got {self.neftune_alpha}")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    # --- reading and writing -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        """Build from a ``config.json`` dict; ``source`` names the file in error messages."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls) if f.name != "extra"}
        values, problems = {}, []
        for key, value in raw.items():
            if key not in known:
                continue
            problem = kind_problem(value, hints[key])
            if problem:
                problems.append(f"{key!r} {problem}")
            else:
                values[key] = float(value) if wants_float(hints[key]) and isinstance(value, int) else value
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        unknown = {k: v for k, v in raw.items() if k not in known}
        if unknown:
            warnings.warn(f"{source}: ignoring keys AstrAI's model config lacks: {sorted(unknown)}", stacklevel=2)
        try:
            return cls(**values, extra=unknown)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read an AstrAI ``config.json``; a missing or malformed file is a ``ConfigError`` naming it.

        (``checkpoint.read_model_config`` reads a model directory of either kind, AstrAI's or Hugging Face's.)
        """
        return cls.from_dict(read_config_json(path), source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """Every AstrAI field in AstrAI's order (what AstrAI's ``save_pretrained`` writes), then the extension fields
        that differ from their default (none for a model AstrAI can describe). With any of those the ``model_type``
        is ``EXTENDED_MODEL_TYPE``, so AstrAI refuses the file instead of computing another function."""
        values = {
            f.name: _plain(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name != "extra" and not (f.name in EXTENSION_FIELDS and getattr(self, f.name) == f.default)
        }
        if self.extensions:
            values["model_type"] = EXTENDED_MODEL_TYPE
        elif self.model_type == EXTENDED_MODEL_TYPE:
            values["model_type"] = ASTRAI_MODEL_TYPE
        return values

    def to_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    # --- derived values ------------------------------------------------------------------------------------------

    @property
    def extensions(self) -> list[str]:
        """The extension fields set away from their default: what AstrAI's schema cannot express (empty for a model
        AstrAI computes exactly)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in EXTENSION_FIELDS if getattr(self, name) != defaults[name]]

    @property
    def tied(self) -> bool:
        """AstrAI ties only when the flag is exactly ``True``."""
        return self.tie_word_embeddings is True

    @property
    def attention_head_dim(self) -> int:
        """Per-head query/key/value width (the ``head_dim`` field when set)."""
        if self.attn_type == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim is not None:
            return self.head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        """Width rotated by RoPE in each head."""
        if self.attn_type == "mla":
            return self.qk_rope_head_dim
        return self.rotary_dim or self.attention_head_dim

    def ffn_type_of_layer(self, layer_id: int) -> str:
        """``mlp`` or ``moe`` for one layer, by AstrAI's rule (``mlp_only_layers``, ``decoder_sparse_step``)."""
        if self.ffn_type != "moe" or layer_id in (self.mlp_only_layers or []):
            return "mlp"
        if self.decoder_sparse_step > 1 and (layer_id + 1) % self.decoder_sparse_step != 0:
            return "mlp"
        return "moe"

    @property
    def num_moe_layers(self) -> int:
        """How many layers ``ffn_type_of_layer`` makes MoE, counted without visiting each layer (a config's layer
        count is not bounded yet when this is first asked): every ``decoder_sparse_step``-th, less the
        ``mlp_only_layers`` among them."""
        layers = self.num_hidden_layers or 0
        if self.ffn_type != "moe" or layers < 1 or self.decoder_sparse_step < 1:
            return 0
        step = self.decoder_sparse_step
        dense = {i for i in self.mlp_only_layers or [] if 0 <= i < layers and (i + 1) % step == 0}
        return layers // step - len(dense)

    def check_buildable(self, source: str = "config") -> None:
        """Raise one ``ConfigError`` listing every field a model needs but this config lacks or gets wrong. Sizes
        are bounded before anything is built or counted layer by layer (``MAX_SIZE``, ``MAX_LAYERS``,
        ``MAX_EXPERT_MLPS``)."""
        self._check_counts(source)
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"]
        num_moe_layers = self.num_moe_layers
        has_mlp, has_moe = num_moe_layers < (self.num_hidden_layers or 1), num_moe_layers > 0
        expert_widths = (self.moe_intermediate_size, self.n_shared_experts and self.shared_expert_intermediate_size)
        if has_mlp or (has_moe and None in expert_widths):
            required.append("intermediate_size")  # dense width, and the fallback width of experts
        if self.attn_type == "mla":
            required += ["kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"]
        if self.ffn_type == "moe":
            required += ["n_routed_experts", "n_shared_experts", "n_activated_experts"]
        problems = [f"{name!r} is required" for name in required if getattr(self, name) is None]
        for name in required + ["num_key_value_heads", "head_dim", "rotary_dim"]:
            value = getattr(self, name)
            if value is not None and value < (0 if name == "n_shared_experts" else 1):
                problems.append(f"{name!r} must be positive, got {value}")
        if not problems:
            kv_heads = self.num_key_value_heads or self.num_attention_heads
            if self.num_attention_heads % kv_heads:
                problems.append(
                    f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                    f"num_key_value_heads ({kv_heads})"
                )
            if self.attn_type == "gqa" and self.head_dim is None and self.hidden_size % self.num_attention_heads:
                problems.append(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads})"
                )
            mla_width = self.num_attention_heads * self.attention_head_dim
            if self.attn_type == "mla" and self.v_head_dim is None and mla_width != self.hidden_size:
                problems.append(
                    "MLA needs num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim) == hidden_size, got "
                    f"{self.num_attention_heads} * {self.attention_head_dim} != {self.hidden_size}"
                )
            problems += self._latent_attention_and_routing_problems()
            if self.attn_type == "mla" and (self.head_dim is not None or self.attention_qkv_bias):
                problems.append("'head_dim' and 'attention_qkv_bias' apply to gqa attention only, not mla")
            if self.rope_dim % 2:
                problems.append(f"the RoPE width per head must be even, got {self.rope_dim}")
            if self.ffn_type == "moe" and self.n_activated_experts > self.n_routed_experts:
                problems.append(
                    f"n_activated_experts ({self.n_activated_experts}) exceeds n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            if self.qk_norm_over_projection and not (self.use_qk_norm and self.attn_type == "gqa"):
                problems.append("'qk_norm_over_projection' needs gqa attention with use_qk_norm")
            problems += self._window_problems()
            if self.rotary_dim is not None and (self.attn_type != "gqa" or self.rotary_dim > self.attention_head_dim):
                problems.append(
                    f"'rotary_dim' ({self.rotary_dim}) needs gqa attention and at most head_dim "
                    f"({self.attention_head_dim}) per head"
                )
            if self.shared_expert_gate and not (self.ffn_type == "moe" and self.n_shared_experts):
                problems.append(
                    "'shared_expert_gate' needs shared experts to gate (ffn_type moe, n_shared_experts >= 1)"
                )
            if self.score_head and self.pad_token_id is None:
                problems.append("'score_head' needs 'pad_token_id': the score is read at the last token before it")
            if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
                problems.append(
                    f"'pad_token_id' {self.pad_token_id} is not an id of the {self.vocab_size}-token vocabulary"
                )
            problems += self._value_problems()  # after the checks above: it divides by head counts
        if problems:
            raise ConfigError(f"{source}: cannot build a model: " + "; ".join(problems))

    def _latent_attention_and_routing_problems(self) -> list[str]:
        """DeepSeek-V3's options: MLA's need MLA, the routing ones an MoE whose experts split into groups that
        leave a token enough experts to choose from."""
        mla_options = ("q_lora_rank", "v_head_dim", "mla_shared_rope_key", "yarn_softmax_scale")
        moe_options = ("score_correction_bias", "n_group", "topk_group", "routed_scaling_factor", "scoring_func")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        set_away = [name for name in mla_options + moe_options if getattr(self, name) != defaults[name]]
        problems = [
            f"{name!r} applies to mla attention only"
            for name in set_away
            if name in mla_options and self.attn_type != "mla"
        ]
        problems += [
            f"{name!r} applies to ffn_type moe only"
            for name in set_away
            if name in moe_options and self.ffn_type != "moe"
        ]
        if not 0 < self.routed_scaling_factor < math.inf:
            problems.append(f"'routed_scaling_factor' must be a finite number > 0, got {self.routed_scaling_factor}")
        if self.ffn_type != "moe" or self.n_group < 1 or self.topk_group < 1:
            return problems  # group counts below 1 are reported as sizes
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or self.topk_group > groups:
            problems.append(
                f"n_group ({groups}) must divide n_routed_experts ({experts}) and be at least "
                f"topk_group ({self.topk_group})"
            )
        elif groups > 1 and experts // groups < 2:
            problems.append(f"n_group ({groups}) leaves fewer than 2 experts per group; a group scores its best two")
        elif self.n_activated_experts > self.topk_group * (experts // groups):
            problems.append(
                f"n_activated_experts ({self.n_activated_experts}) exceeds the experts of topk_group "
                f"({self.topk_group}) groups of {experts // groups}"
            )
        return problems

    def _window_problems(self) -> list[str]:
        """Sliding windows, per-layer RoPE and soft-capping: in range, and only where they mean something."""
        problems = []
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
                problems.append(
                    f"'layer_types' must give one of {list(LAYER_TYPES)} for each of the "
                    f"{self.num_hidden_layers} layers, got {self.layer_types}"
                )
            elif "sliding_attention" in self.layer_types and self.sliding_window is None:
                problems.append("'layer_types' has sliding_attention layers but 'sliding_window' is not set")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"'sliding_window' must be positive, got {self.sliding_window}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name!r} must be > 0, got {value}")
        gqa_only = ("query_pre_attn_scalar", "attn_logit_softcapping", "sliding_window", "rope_local_theta")
        if self.attn_type != "gqa":
            problems += [f"{name!r} applies to gqa attention only" for name in gqa_only if getattr(self, name)]
        return problems

    def sliding_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` attends through the sliding window."""
        return self.layer_types is not None and self.layer_types[layer_id] == "sliding_attention"

    def _check_counts(self, source: str) -> None:
        """The sizes that say how many modules a model has, bounded first: everything after may count or build
        them one by one."""
        sizes = [f.name for f in dataclasses.fields(self) if type(getattr(self, f.name)) is int]
        problems = [
            f"{name!r} must be at most {MAX_SIZE}, got {_short(getattr(self, name))}"
            for name in sizes
            if getattr(self, name) > MAX_SIZE
        ]
        if not problems and (self.num_hidden_layers or 0) > MAX_LAYERS:
            problems.append(f"'num_hidden_layers' must be at most {MAX_LAYERS:,}, got {self.num_hidden_layers:,}")
        experts = (self.n_routed_experts or 0) + (self.n_shared_experts or 0)
        if not problems and self.num_moe_layers * experts > MAX_EXPERT_MLPS:
            problems.append(
                f"{self.num_moe_layers:,} MoE layers x {experts:,} experts (n_routed_experts + n_shared_experts) "
                f"= {self.num_moe_layers * experts:,} expert MLPs; at most {MAX_EXPERT_MLPS:,} are built"
            )
        if problems:
            raise ConfigError(f"{source}: cannot build a model: " + "; ".join(problems))

    def _value_problems(self) -> list[str]:
        """Ranges of the optional fields (their types are checked on reading): finite, positive where a size."""
        problems = [
            f"{f.name!r} must be a finite number, got {getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))
        ]
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name!r} must be > 0, got {value}")
        sizes = ("moe_intermediate_size", "shared_expert_intermediate_size", "q_lora_rank", "v_head_dim")
        if self.ffn_type == "moe":
            sizes += ("n_routed_experts", "n_activated_experts", "n_group", "topk_group")
        problems += [
            f"{name!r} must be positive, got {getattr(self, name)}"
            for name in sizes
            if getattr(self, name) is not None and getattr(self, name) < 1
        ]
        if self.mlp_only_layers and self.num_hidden_layers:
            outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if outside:
                problems.append(f"'mlp_only_layers' {outside} are not layers of a {self.num_hidden_layers}-layer model")
        if self.rope_scaling is not None:
            problems += self._rope_scaling_problems()
        if self.rope_frequency_scaling is not None:
            problems += self._rope_frequency_problems()
        return problems

    def _rope_scaling_problems(self) -> list[str]:
        scaling = self.rope_scaling
        kind = scaling.get("type", "ntk")
        if not isinstance(kind, str):
            return [f"'rope_scaling' type must be a string, got {json.dumps(kind)}"]
        factor = scaling.get("factor", 1.0)
        is_number = isinstance(factor, int | float) and not isinstance(factor, bool)
        if not is_number or not (math.isfinite(factor) and factor > 0):
            return [f"'rope_scaling' factor must be a finite number > 0, got {json.dumps(factor)}"]
        if kind == "ntk" and self.rope_dim <= 2:
            return [f"'rope_scaling' ntk needs a RoPE width per head above 2, got {self.rope_dim}"]
        return []

    def _rope_frequency_problems(self) -> list[str]:
        scaling = self.rope_frequency_scaling
        kind = scaling.get("rope_type")
        if not isinstance(kind, str) or kind not in ROPE_FREQUENCY_TYPES:
            return [
                f"'rope_frequency_scaling' rope_type must be one of {list(ROPE_FREQUENCY_TYPES)}, got {brief(kind)}"
            ]
        if self.rope_scaling is not None:
            return ["'rope_scaling' and 'rope_frequency_scaling' cannot both be set"]
        names = ROPE_FREQUENCY_TYPES[kind]
        values = [scaling.get(name) for name in names]
        if not all(_positive(v) for v in values):
            return [f"'rope_frequency_scaling' {kind} needs finite numbers > 0 for {list(names)}, got {values}"]
        if kind == "llama3" and not values[1] < values[2]:
            return [f"'rope_frequency_scaling' llama3 needs low_freq_factor < high_freq_factor, got {values[1:3]}"]
        if kind == "yarn":
            optional = {name: scaling[name] for name in YARN_OPTIONAL if scaling.get(name) is not None}
            if not all(
                isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf for v in optional.values()
            ):
                return [f"'rope_frequency_scaling' yarn needs finite numbers >= 0 for {list(optional)}, got {optional}"]
            if not isinstance(scaling.get("truncate", True), bool):
                return [f"'rope_frequency_scaling' yarn truncate must be true or false, got {scaling['truncate']!r}"]
        if kind == "dynamic" and self.rope_dim <= 2:
            return [f"'rope_frequency_scaling' dynamic needs a RoPE width per head above 2, got {self.rope_dim}"]
        if kind == "longrope":
            pairs = self.rope_dim // 2
            for name in ("short_factor", "long_factor"):
                value = scaling.get(name)
                if not (isinstance(value, list) and len(value) == pairs and all(_positive(v) for v in value)):
                    return [
                        f"'rope_frequency_scaling' longrope needs {name}: {pairs} finite numbers > 0 (one per "
                        f"rotated pair), got {value!r}"
                    ]
            if scaling.get("attention_factor") is not None and not _positive(scaling["attention_factor"]):
                return [
                    f"'rope_frequency_scaling' longrope attention_factor must be a finite number > 0, got "
                    f"{scaling['attention_factor']!r}"
                ]
        return []


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path``; a missing or malformed file is a ``ConfigError`` naming it."""
    return read_json_object(Path(path), "a model config.json", ConfigError)


def _positive(value: Any) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def _short(number: int) -> str:
    """``number``, or its size where writing it out would fill the line (str() refuses past 4300 digits)."""
    return str(number) if number < 10**20 else f"about 10^{round(number.bit_length() * math.log10(2))}"


def _plain(value: Any) -> Any:
    """JSON-ready copy: tuples become lists, as in AstrAI's ``to_dict``."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
