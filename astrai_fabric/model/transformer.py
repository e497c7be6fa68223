"""``AutoRegressiveLM``: AstrAI's decoder-only transformer with AstrAI's exact ``state_dict`` keys
(AstrAI's ``astrai/model/transformer.py``).

The model knows nothing of Lightning or ``torch.distributed``; parallelism is applied from outside
(``astrai_fabric.parallelize``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.losses import logits_entropy, token_logprobs
from astrai_fabric.model.attention import GQA, MLA
from astrai_fabric.model.context_parallel import ContextGroup, gather_output, pad_window
from astrai_fabric.model.ffn import MLP, DeepSeekMoE
from astrai_fabric.model.head import LanguageHead, ModelOutput, TokenLoss
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding

LM_HEAD_KEY = "lm_head.weight"
EMBED_KEY = "embed_tokens.weight"


class DecoderBlock(nn.Module):
    """``x + attention_output_norm(attention(input_norm(x)))``, then the same around the MLP, with
    ``post_attention_norm`` and ``mlp_output_norm``.

    ``config.norm_placement`` says which norms exist, the others being identities: ``pre`` (AstrAI's) has the input
    norms only (``post_attention_norm`` is AstrAI's name for the MLP's input norm), ``post`` (OLMo 2) the output norms
    only, ``sandwich`` (Gemma 2 and 3) all four.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.attention = MLA(config, layer_id) if config.attn_type == "mla" else GQA(config, layer_id)
        inputs, outputs = config.norm_placement != "post", config.norm_placement != "pre"
        self.input_norm = _norm_or_identity(config, inputs)
        self.post_attention_norm = _norm_or_identity(config, inputs)
        if config.ffn_type_of_layer(layer_id) == "moe":
            self.mlp = DeepSeekMoE(config)
        else:
            down_init_std = 0.02 / (2 * config.num_hidden_layers) ** 0.5
            self.mlp = MLP(config.hidden_size, config.intermediate_size, down_init_std, config.mlp_activation)
        # After the MLP: AstrAI's modules keep their registration (hence state_dict) order.
        self.attention_output_norm = _norm_or_identity(config, outputs)
        self.mlp_output_norm = _norm_or_identity(config, outputs)

    def forward(
        self,
        x: Tensor,
        rotary: Tensor,
        attn_mask: Tensor | None,
        kv_cache: KVCache | None = None,
        real_positions: int | None = None,
    ) -> tuple[Tensor, Tensor | None, Any]:
        """``real_positions``: under context parallelism, how many of ``x``'s positions are the window's, for an MoE
        layer's routing statistics (``DeepSeekMoE.forward``)."""
        x = x + self.attention_output_norm(self.attention(self.input_norm(x), rotary, attn_mask, kv_cache))
        mlp_out, aux_loss, router_stats = self.mlp(self.post_attention_norm(x), real_positions)
        return x + self.mlp_output_norm(mlp_out), aux_loss, router_stats


def _norm_or_identity(config: ModelConfig, present: bool) -> nn.Module:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset) if present else nn.Identity()


def process_attention_mask(input_mask: Tensor | None) -> Tensor | None:
    """AstrAI's mask shapes: 2-D ``[B,S]`` → ``[B,1,1,S]``, 3-D ``[B,S,S]`` → ``[B,1,S,S]``, 4-D as is.

    As in AstrAI, any mask replaces causality: a 2-D padding mask alone gives bidirectional attention over the
    kept positions. Pass a 3-D/4-D causal mask (e.g. ``make_doc_boundary_mask``) for causal training with masks.
    """
    if input_mask is None or input_mask.dim() == 4:
        return input_mask
    if input_mask.dim() == 2:
        return input_mask[:, None, None, :]
    if input_mask.dim() == 3:
        return input_mask[:, None, :, :]
    raise ValueError(f"attention mask must be 2-D, 3-D or 4-D, got shape {tuple(input_mask.shape)}")


def sliding_window_mask(
    attn_mask: Tensor | None, window: int, seq_len: int, past: int = 0, device: torch.device | None = None
) -> Tensor:
    """``attn_mask`` (None: causal) restricted to the keys fewer than ``window`` positions before each query, as
    transformers' ``sliding_window_overlay`` (``q - k < window``); queries are ``past .. past + seq_len - 1`` of the
    keys ``0 .. past + seq_len - 1`` (those of a ``KVCache`` first). Composes with document-boundary masks."""
    queries = torch.arange(past, past + seq_len, device=device)[:, None]
    keys = torch.arange(past + seq_len, device=device)
    band = queries - keys < window
    if attn_mask is None:
        return band & (keys <= queries)
    if attn_mask.dtype == torch.bool:
        return attn_mask & band
    return attn_mask.masked_fill(~band, float("-inf"))


def make_doc_boundary_mask(position_ids: Tensor) -> Tensor:
    """Causal mask that stops attention at document boundaries: bool ``[B,1,S,S]``, True = attend.

    A new document starts wherever a position id does not increase (``pos[t+1] <= pos[t]``), as in AstrAI's
    packed SFT streams.
    """
    starts = position_ids[:, 1:] <= position_ids[:, :-1]
    doc_ids = torch.cat([torch.zeros_like(position_ids[:, :1]), starts.long().cumsum(dim=1)], dim=1)
    same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    seq_len = position_ids.size(1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=position_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)


def forward_window(model: nn.Module, input_ids: Tensor, position_ids: Tensor | None = None, **head: Any) -> ModelOutput:
    """The model on a window of a token stream: causal throughout, or, given the stream's ``position_ids`` (sft's
    packed documents), with positions restarting and attention stopping at each document boundary. Training's
    forward and evaluation's, one definition. ``head``: the fused loss's arguments (``nll_targets``, ...)."""
    if position_ids is None:
        return model(input_ids, **head)
    return model(input_ids, input_mask=make_doc_boundary_mask(position_ids), position_ids=position_ids, **head)


def next_token_logprobs(
    model: nn.Module, ids: Tensor, loss_chunk_size: int = 0, entropy: bool = False
) -> tuple[Tensor, ModelOutput]:
    """``log p`` of every next token of right-padded sequences ``ids [N, L]`` → ``[N, L - 1]``, and the model's
    output (dpo's and grpo's log-probabilities); with ``loss_chunk_size``, through the fused head (no whole
    logits). ``entropy``: the output's ``token_entropy`` holds each position's softmax entropy, no gradient."""
    if not loss_chunk_size:
        out = model(ids)
        if entropy:
            out.token_entropy = logits_entropy(out.logits)
        return token_logprobs(out.logits[:, :-1], ids[:, 1:]), out
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the last position predicts nothing read: any id will do
    out = model(ids, nll_targets=targets, nll_chunk_size=loss_chunk_size, nll_entropy=entropy)
    return -out.token_nll[:, :-1], out


class AutoRegressiveLM(nn.Module):
    """AstrAI's language model: embeddings, decoder blocks, final RMSNorm, ``lm_head`` (tied when configured).

    ``state_dict()`` omits ``lm_head.weight`` when tied and ``load_state_dict`` re-ties it, exactly as AstrAI.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.check_buildable()
        with cycle_collection_paused():
            self._build(config)

    def _build(self, config: ModelConfig) -> None:
        self.config = config
        rope_base = config.rope_theta if config.rope_theta is not None else 10000.0
        self.rotary_embedding = RotaryEmbedding(
            config.rope_dim,
            config.max_position_embeddings,
            rope_base,
            config.rope_scaling,
            frequency_scaling=config.rope_frequency_scaling,
        )
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, config.neftune_alpha, config.scale_embeddings
        )
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        if config.score_head:  # a reward model: a scalar head in the LM head's place (transformers' ``score``)
            self.score = Linear(config.hidden_size, 1)
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)
            if config.tied:
                self.lm_head.weight = self.embed_tokens.weight
        self.local_rotary_embedding = None  # the sliding-window layers' own RoPE (Gemma 3), after AstrAI's modules
        if config.rope_local_theta is not None:
            self.local_rotary_embedding = RotaryEmbedding(
                config.rope_dim, config.max_position_embeddings, config.rope_local_theta
            )
        self.gradient_checkpointing = False  # recompute each block in the backward pass (less memory)
        self.context_parallel: ContextGroup | None = None  # set by parallelize (``--cp_size``)
        # Same traversal as AstrAI's `self.apply(_init_weights)`, hence the same random stream per seed.
        self.apply(_reset)
        if config.score_head:  # every pair starts level (loss log 2), on any sharding: transformers draws N(0, 0.02)
            nn.init.zeros_(self.score.weight)

    def forward(
        self,
        input_ids: Tensor,
        input_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        nll_targets: Tensor | None = None,
        nll_chunk_size: int = 0,
        label_smoothing: float = 0.0,
        nll_weights: Tensor | None = None,
        nll_entropy: bool = False,
        logits_at: Tensor | None = None,
    ) -> ModelOutput:
        """``input_ids [B,S]`` → ``ModelOutput``: ``logits`` and ``hidden_states`` (+ ``aux_loss``, ``router_stats``
        for MoE); a reward model (``score_head``) gives ``scores [B,S]``, its head's output at every position, for
        logits. The trunk (``trunk``) then the head (``LanguageHead``), in one forward so that FSDP gathers a sharded
        head once.

        ``position_ids [B,S]`` default to ``0..S-1`` (after the cached positions, with a ``kv_cache``);
        ``input_mask`` is 2-D, 3-D or 4-D (see ``process_attention_mask``), over all keys (cached and new) when a
        cache is used; without one, a cache gets the causal mask. Logits are in the model's dtype; take ``.float()``
        before a loss.

        With ``nll_targets [B,S]`` and ``nll_chunk_size`` N > 0, the head is fused with the cross-entropy
        (``TokenLoss``, N positions at a time): ``token_nll [B,S]`` float32 instead of ``logits``, never the whole
        ``[B,S,V]``. With ``nll_weights [B,S]`` as well (the loss's per-token weights, ``losses.token_nll_weights``),
        also ``nll_loss``, ``sum(nll_weights * token_nll)``, whose gradients the fused head takes in its forward
        (``losses.head_nll_loss``: no logits recomputed in the backward); ``token_nll`` is then detached. With
        ``nll_entropy``, each position's softmax entropy too (``token_entropy``, no gradient).

        ``logits_at [B]``: the one position of each row whose logits (or score) the head computes, ``[B, 1, V]``
        (the generation engine's prefill, which samples after each prompt's last position only).

        Under context parallelism (``model.context_parallel``, without a cache) each rank runs its share of the
        positions, a window the group does not split padded first (``pad_window``); the outputs are the whole
        window's (gathered, the padding cut), except ``hidden_states``: this rank's positions.
        """
        context = self.context_parallel if kv_cache is None else None
        if context is not None:  # a length the group splits; the trunk keeps this rank's positions, the head too
            length = input_ids.size(-1)
            input_ids, input_mask, position_ids, nll_targets, nll_weights = pad_window(
                context, input_ids, process_attention_mask(input_mask), position_ids, nll_targets, nll_weights
            )
            mine = context.positions(input_ids.size(1))
            nll_targets = None if nll_targets is None else nll_targets[:, mine]
            nll_weights = None if nll_weights is None else nll_weights[:, mine]
        hidden_states, aux_loss, router_stats = self.trunk(
            input_ids, input_mask, position_ids, kv_cache, num_positions=None if context is None else length
        )
        fused = nll_targets is not None and nll_chunk_size > 0
        if logits_at is not None:
            hidden_states = hidden_states[torch.arange(hidden_states.size(0), device=logits_at.device), logits_at, None]
        if self.config.score_head:  # a reward model: one score per position (``reward_model.sequence_scores``)
            if nll_targets is not None:
                raise ValueError("a reward model (score_head) has no LM head to take token losses from")
            output = ModelOutput(hidden_states, scores=self.score(hidden_states).squeeze(-1))
        else:
            loss = TokenLoss(nll_targets, nll_chunk_size, label_smoothing, nll_weights, nll_entropy) if fused else None
            output = self.head(hidden_states, loss)
        if context is not None:
            output = gather_output(output, context, length)
        return dataclasses.replace(output, aux_loss=aux_loss, router_stats=router_stats)

    @property
    def head(self) -> LanguageHead:
        """The LM head as an object of its own (``LanguageHead``): logits, or the fused head's token losses."""
        return LanguageHead(self.lm_head, self.config.final_logit_softcapping)

    def trunk(
        self,
        input_ids: Tensor,
        input_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        num_positions: int | None = None,
    ) -> tuple[Tensor, Tensor | None, list[dict[str, Tensor]] | None]:
        """Everything before the head: ``(hidden_states [B,S,H]`` after the final norm, the MoE layers' mean
        ``aux_loss`` and their ``router_stats``; both None without MoE layers). See ``forward``. Under context
        parallelism (without a cache) the hidden states are this rank's positions only, ``S / cp`` of them, the
        masks and RoPE positions the whole window's (``model.context_parallel``); ``num_positions``, the window's
        length before ``pad_window``, keeps the padding out of the MoE layers' routing statistics."""
        if input_ids.dim() != (2 if self.embed_tokens is not None else 3):
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        batch, seq_len = input_ids.shape[:2]
        if kv_cache is not None:
            past = torch.arange(kv_cache.length, kv_cache.length + seq_len, device=input_ids.device)
            if position_ids is None:
                position_ids = past.expand(batch, -1)
            if input_mask is None:  # causal over the cached and the new positions
                input_mask = (torch.arange(kv_cache.length + seq_len, device=input_ids.device) <= past[:, None])[None]
        if kv_cache is not None and self.rotary_embedding.freqs_cis_long is not None:
            kv_cache.check_positions(self.rotary_embedding.switch_length, seq_len)
        context = self.context_parallel if kv_cache is None else None
        mine = slice(None) if context is None else context.positions(seq_len)
        # A pipeline stage after the first holds no embedding: what it is given are the hidden states.
        x = self.embed_tokens(input_ids[:, mine]) if self.embed_tokens is not None else input_ids
        rotary = self.rotary_embedding(batch, seq_len, position_ids)
        attn_mask = process_attention_mask(input_mask)
        # Sliding-window layers (Gemma, ``layer_types``): the same mask cut to the window, their own RoPE if any.
        local_rotary, window_mask = rotary, None
        if self.local_rotary_embedding is not None:
            local_rotary = self.local_rotary_embedding(batch, seq_len, position_ids)
        if self.config.sliding_window is not None:
            past = kv_cache.length if kv_cache is not None else 0
            window_mask = sliding_window_mask(attn_mask, self.config.sliding_window, seq_len, past, input_ids.device)
        rotary, local_rotary = rotary[:, mine], local_rotary[:, mine]
        real_positions = None
        if context is not None and num_positions is not None:
            real_positions = min(max(num_positions - mine.start, 0), mine.stop - mine.start)
        aux_losses, router_stats = [], []
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in self.numbered_blocks():
            sliding = self.config.sliding_layer(i)
            layer_rotary, layer_mask = (local_rotary, window_mask) if sliding else (rotary, attn_mask)
            if recompute:  # keep only the block's input; recompute its activations in the backward pass
                x, aux_loss, stats = checkpoint(
                    layer, x, layer_rotary, layer_mask, None, real_positions, use_reentrant=False
                )
            else:
                x, aux_loss, stats = layer(x, layer_rotary, layer_mask, kv_cache, real_positions)
            if stats is not None:
                aux_losses.append(aux_loss)
                router_stats.append(stats)
        if kv_cache is not None:
            kv_cache.length += seq_len
        if self.norm is not None:  # a pipeline stage before the last hands its hidden states on unnormalised
            x = self.norm(x)
        if not aux_losses:
            return x, None, None
        return x, torch.stack(aux_losses).mean(), router_stats

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.config.tied:
            state.pop(prefix + LM_HEAD_KEY, None)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """AstrAI's tie rules: tied → ``lm_head`` is the embedding; untied with no ``lm_head`` → a clone of it."""
        state_dict = dict(state_dict)
        if self.config.score_head:  # no LM head to tie or clone
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.config.tied and EMBED_KEY in state_dict:
            state_dict[LM_HEAD_KEY] = state_dict[EMBED_KEY]
        elif LM_HEAD_KEY not in state_dict and EMBED_KEY in state_dict:
            state_dict[LM_HEAD_KEY] = state_dict[EMBED_KEY].clone()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.config.tied and assign:
            self.lm_head.weight = self.embed_tokens.weight  # `assign` replaced both Parameters: tie them again
        return result

    @property
    def decoder_blocks(self) -> list[nn.Module]:
        """The repeated blocks, for sharding and activation checkpointing applied from outside."""
        return [layer for _, layer in self.numbered_blocks()]

    def numbered_blocks(self) -> list[tuple[int, nn.Module]]:
        """``(layer index, block)`` in order: every block, or a pipeline stage's (``model.pipeline``: kept in a
        ``ModuleDict`` under their indices, so their names stay the whole model's)."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(index), layer) for index, layer in self.layers.items()]
        return list(enumerate(self.layers))

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied matrix counts once; a DTensor its global size), or only those that train
        (``requires_grad``: LoRA's adapters)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


@dataclass(frozen=True)
class ParameterCounts:
    """A model's parameters by how the parallel layouts split them (``parameter_counts``)."""

    embeddings: int
    """The embedding, an untied LM head, a reward model's score head: whole on the tensor axis."""
    attention: int
    """Every layer's attention (projections, biases, q/k norms): split by tensor parallelism."""
    dense_mlp: int
    """The dense layers' MLPs: split by tensor parallelism."""
    routed_experts: int
    """The MoE layers' routed experts: dealt out by expert parallelism, whole on the tensor axis."""
    moe_other: int
    """The MoE layers' routers, shared experts and shared-expert gates."""
    norms: int
    """The blocks' norms and the final one."""

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.dense_mlp + self.routed_experts + self.moe_other + self.norms


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """``AutoRegressiveLM(config)``'s parameters from the config alone, without building a layer (a config's sizes
    are checked against memory before anything is built, and the footprint plans clusters from them;
    tests/test_model.py holds the total equal to the built model's)."""
    config.check_buildable()
    dim, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv_heads, head_dim = config.num_key_value_heads or heads, config.attention_head_dim
    width = heads * head_dim
    if config.attn_type == "mla":
        rank, q_rank, v_dim = config.kv_lora_rank, config.q_lora_rank, config.v_head_dim or head_dim
        shared_rope = config.qk_rope_head_dim if config.mla_shared_rope_key else 0
        query = dim * q_rank + q_rank + q_rank * width if q_rank else dim * width
        kv_head_width = head_dim - shared_rope + v_dim
        attention = query + dim * (rank + shared_rope) + rank + rank * kv_heads * kv_head_width + heads * v_dim * dim
        attention += dim * heads * v_dim if config.use_gated_attention else 0
    else:
        attention = dim * width + 2 * dim * kv_heads * head_dim + width * dim
        attention += (width + 2 * kv_heads * head_dim) if config.attention_qkv_bias else 0
        attention += dim * width if config.use_gated_attention else 0
    if config.use_qk_norm:
        attention += width + kv_heads * head_dim if config.qk_norm_over_projection else 2 * head_dim
    mlp = 3 * dim * config.intermediate_size if config.intermediate_size else 0
    routed = moe_other = 0
    if config.num_moe_layers:
        routed_dim = config.moe_intermediate_size or config.intermediate_size
        shared_dim = config.shared_expert_intermediate_size or config.intermediate_size
        routed = 3 * dim * config.n_routed_experts * routed_dim
        moe_other = dim * config.n_routed_experts + 3 * dim * config.n_shared_experts * shared_dim
        moe_other += dim if config.shared_expert_gate else 0
    norms = dim * (4 if config.norm_placement == "sandwich" else 2)
    embeddings = config.vocab_size * dim * (1 if config.tied or config.score_head else 2)
    embeddings += dim if config.score_head else 0
    moe_layers = config.num_moe_layers
    return ParameterCounts(
        embeddings=embeddings,
        attention=layers * attention,
        dense_mlp=(layers - moe_layers) * mlp,
        routed_experts=moe_layers * routed,
        moe_other=moe_layers * moe_other,
        norms=layers * norms + dim,
    )


def count_parameters(config: ModelConfig) -> int:
    """``AutoRegressiveLM(config).num_parameters()`` from the config alone (``parameter_counts``)."""
    return parameter_counts(config).total


def rope_table_bytes(config: ModelConfig) -> int:
    """Bytes the RoPE table takes while it is built (every rank builds its own): float32 (cos, sin) for each
    position and rotated dimension, with the float32 angles, cos and sin it is stacked from; longrope builds two
    (its short and long factors')."""
    scaling = config.rope_frequency_scaling
    tables = 2 if scaling is not None and scaling["rope_type"] == "longrope" else 1
    return 10 * config.max_position_embeddings * config.rope_dim * tables


def _reset(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Python's cycle collector off inside, as it was after: for building a model and walking it. A growing tree
    of modules triggers collection after collection, each walking every object alive: 80% of the time to build
    DeepSeek-V3's 60,000 modules on the meta device (``bench/planner.py``), which leave no garbage cycles to find."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
