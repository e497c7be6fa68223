"""AstrAI's attention: grouped-query (``GQA``) and multi-head latent (``MLA``), both on torch SDPA.

Shapes: ``B`` batch, ``S`` sequence, ``H`` query heads, ``K`` key/value heads, ``D`` head width.
``attn_mask`` is what AstrAI's ``process_attention_mask`` produces: ``None`` (causal) or a 4-D mask broadcastable
to ``[B, H, S, S_keys]``, boolean True = attend, or additive float. With a ``KVCache`` the keys are the cached
positions followed by the new ones, and the model always passes a mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.model.context_parallel import ContextGroup
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.model.layers import Linear, RMSNorm, apply_rotary_emb, yarn_mscale


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    scale: float | None = None,
    softcap: float | None = None,
    context: ContextGroup | None = None,
) -> Tensor:
    """``q``/``k [B,S,H|K,D]``, ``v [B,S,K,Dv]`` → ``[B,S,H*Dv]``; causal exactly when no mask is given (AstrAI);
    ``scale`` multiplies ``q.k`` before the softmax, None meaning ``1/sqrt(D)``; ``softcap`` c caps the scaled scores
    to ``c * tanh(scores / c)`` before the mask (Gemma 2), which torch's fused kernels cannot, so only then are the
    scores materialised. With a ``context`` group, ``S`` is this rank's positions and ``attn_mask`` the whole
    window's: the group attends over the whole window (``ContextGroup.attend``, ``parallel.context``), running this
    attention where it needs it."""

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return local_attention(q, k, v, attn_mask, scale, softcap)

    out = attend(q, k, v) if context is None else context.attend(q, k, v, attend)
    return out.flatten(2)


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float | None, softcap: float | None
) -> Tensor:
    """``sdpa`` over the positions and heads given, ``[B,S,H,Dv]`` (heads not flattened)."""
    n_rep = q.size(2) // k.size(2)
    # AstrAI's repeat_kv: each key/value head serves n_rep consecutive query heads. On CPU torch's kernel does that
    # itself (``enable_gqa``: the same outputs, the key/value gradients summed in another order, ~1e-7), without
    # the copies (measured faster: docs/performance.md); elsewhere the copies, as some CUDA kernels lack it.
    in_kernel = n_rep > 1 and softcap is None and q.device.type == "cpu"
    if n_rep > 1 and not in_kernel:
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if softcap is None:
        causal = attn_mask is None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=in_kernel)
    else:
        out = _softcapped_attention(q, k, v, attn_mask, q.size(-1) ** -0.5 if scale is None else scale, softcap)
    return out.transpose(1, 2)


def _softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float, softcap: float
) -> Tensor:
    """Attention over ``[B,H,S,D]`` with capped scores, softmax in float32 (as transformers' Gemma 2 does)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is None:
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    else:
        scores = scores + attn_mask
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


class GQA(nn.Module):
    """Grouped-query attention; RoPE on q and k, then optional QK-norm (after RoPE), then optional gating.

    Options for Hugging Face architectures (defaults are AstrAI's): biases on q/k/v (Qwen2), QK-norm before RoPE
    (Qwen3) or over the whole projection, all heads in one RMS (OLMo 2), RoPE on each head's first ``rotary_dim``
    dims only (Phi-3), a head width of its own, so ``heads * head_dim`` may differ from ``hidden_size`` (Qwen3), and
    Gemma's softmax scale (``query_pre_attn_scalar``) and score soft-capping. A sliding-window layer is the same
    module: the model gives it the windowed mask.
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, self.n_heads = config.hidden_size, config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = config.attention_head_dim
        self.norm_before_rope = config.qk_norm_before_rope
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        bias = config.attention_qkv_bias
        # Registration order is AstrAI's: it fixes state_dict order and the random stream at initialisation.
        self.q_proj = Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        width = self.n_heads * self.head_dim  # == dim unless head_dim is set
        self.o_proj = Linear(width, dim, init_std=0.02 / (2 * config.num_hidden_layers) ** 0.5)
        self.rotary_dim = config.rope_dim
        self.norm_over_projection = config.qk_norm_over_projection
        q_norm_dim = width if self.norm_over_projection else self.head_dim
        k_norm_dim = self.n_kv_heads * self.head_dim if self.norm_over_projection else self.head_dim
        offset = config.norm_unit_offset
        self.q_norm = RMSNorm(q_norm_dim, config.rms_norm_eps, offset) if config.use_qk_norm else None
        self.k_norm = RMSNorm(k_norm_dim, config.rms_norm_eps, offset) if config.use_qk_norm else None
        self.gate = Linear(dim, width) if config.use_gated_attention else None
        self.context_parallel: ContextGroup | None = None  # set by parallelize (``--cp_size``)

    def forward(self, x: Tensor, rotary: Tensor, attn_mask: Tensor | None, kv_cache: KVCache | None = None) -> Tensor:
        # Heads counted from the tensors, not the config: tensor parallelism leaves each rank a slice of them.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None and self.norm_before_rope:
            q, k = self._qk_norm(q), self._qk_norm(k, key=True)
        q, k = self._rope(q, rotary), self._rope(k, rotary)
        if self.q_norm is not None and not self.norm_before_rope:
            q, k = self._qk_norm(q), self._qk_norm(k, key=True)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, k, v)
        context = self.context_parallel if kv_cache is None else None  # generation: every position on each rank
        out = sdpa(q, k, v, attn_mask, self.scale, self.softcap, context)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        return self.o_proj(out)

    def _rope(self, x: Tensor, rotary: Tensor) -> Tensor:
        """RoPE on the first ``rotary_dim`` dims of each head of ``x [B,S,heads,D]``; the others pass as they are."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary_emb(x, rotary)
        rotated, passed = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([apply_rotary_emb(rotated, rotary), passed], dim=-1)

    def _qk_norm(self, x: Tensor, key: bool = False) -> Tensor:
        """``x [B,S,heads,D]`` normalised per head, or over all of a token's heads at once."""
        norm = self.k_norm if key else self.q_norm
        if self.norm_over_projection:
            return norm(x.flatten(-2)).unflatten(-1, (-1, self.head_dim))
        return norm(x)


class MLA(nn.Module):
    """Multi-head latent attention: keys and values come from a rank-``kv_lora_rank`` compression of ``x``.

    Each head's query/key is ``[nope | rope]``; RoPE rotates the ``rope`` part only, QK-norm (if on) follows the
    concatenation. Values have the full head width.

    DeepSeek-V2/V3's layout (arXiv:2405.04434, section 2.1; ``modeling_deepseek_v3.py``), option by option, each off
    by default: the query through a rank-``q_lora_rank`` compression (``q_a_proj``, ``q_a_norm``, then ``q_proj``),
    values of their own width (``v_head_dim``), the key's rotated part one head shared by all
    (``mla_shared_rope_key``: ``kv_a_proj``'s last ``qk_rope_head_dim`` outputs, so ``kv_b_proj`` gives each head
    ``[k_nope | v]``), and YaRN's softmax scale (``yarn_softmax_scale``). DeepSeek rotates interleaved pairs as we
    do (transformers' ``rope_interleave``), so its weights are taken with their rows as they are.
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, self.n_heads = config.hidden_size, config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.head_dim = config.attention_head_dim
        self.v_dim = config.v_head_dim or self.head_dim
        self.kv_rank, self.shared_rope_key = config.kv_lora_rank, config.mla_shared_rope_key
        q_rank = config.q_lora_rank
        # Only when set: AstrAI's models have no such parameters and draw their initial weights exactly as before.
        self.q_a_proj = Linear(dim, q_rank) if q_rank else None
        self.q_a_norm = RMSNorm(q_rank, config.rms_norm_eps) if q_rank else None
        self.q_proj = Linear(q_rank or dim, self.n_heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.kv_a_proj = Linear(dim, self.kv_rank + (self.rope_dim if self.shared_rope_key else 0))
        self.kv_norm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.rope_key_heads = HeadBroadcast(self.n_kv_heads) if self.shared_rope_key else None
        self.kv_head_width = (self.nope_dim if self.shared_rope_key else self.head_dim) + self.v_dim
        self.kv_b_proj = Linear(self.kv_rank, self.n_kv_heads * self.kv_head_width)
        width = self.n_heads * self.v_dim  # == dim in AstrAI's layout
        self.o_proj = Linear(width, dim, init_std=0.02 / (2 * config.num_hidden_layers) ** 0.5)
        self.gate = Linear(dim, width) if config.use_gated_attention else None
        self.softmax_scale = _softmax_scale(config)
        self.context_parallel: ContextGroup | None = None  # set by parallelize (``--cp_size``)

    def forward(self, x: Tensor, rotary: Tensor, attn_mask: Tensor | None, kv_cache: KVCache | None = None) -> Tensor:
        q = self.q_proj(x if self.q_a_proj is None else self.q_a_norm(self.q_a_proj(x)))
        q = q.unflatten(-1, (-1, self.head_dim))  # local heads under tensor parallelism
        latent = self.kv_a_proj(x)
        if self.shared_rope_key:
            latent, shared_k_rope = latent.split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_norm(latent)).unflatten(-1, (-1, self.kv_head_width))
        if self.shared_rope_key:  # one rotated key head, the same for every head
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k_rope = self.rope_key_heads(apply_rotary_emb(shared_k_rope.unsqueeze(-2), rotary))
        else:
            k_nope, k_rope, v = kv.split([self.nope_dim, self.rope_dim, self.head_dim], dim=-1)
            k_rope = apply_rotary_emb(k_rope, rotary)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_rope, rotary)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is not None:  # caches the full keys and values (not the latent), simple and exact
            k, v = kv_cache.update(self.layer_id, k, v)
        context = self.context_parallel if kv_cache is None else None
        out = sdpa(q, k, v, attn_mask, self.softmax_scale, context=context)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        return self.o_proj(out)


class HeadBroadcast(nn.Module):
    """One head ``[B, S, 1, D]`` as ``heads`` heads (MLA's shared RoPE key): a module of its own so that tensor
    parallelism can hand each rank its heads' share and sum every head's gradient back into the one head
    (``parallelize.apply_tensor_parallel``); a plain ``expand`` per rank would keep each rank's share only."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, head: Tensor) -> Tensor:
        return head.expand(-1, -1, self.heads, -1)


def _softmax_scale(config: ModelConfig) -> float | None:
    """MLA's softmax scale: None (SDPA's ``1/sqrt(head width)``), or with ``yarn_softmax_scale`` and a yarn
    ``mscale_all_dim`` that times ``yarn_mscale(factor, mscale_all_dim)^2`` (DeepSeek-V2/V3: the YaRN temperature
    applies to every dim of q.k, not only the rotated ones the cos/sin factor reaches)."""
    scaling = config.rope_frequency_scaling or {}
    if not (config.yarn_softmax_scale and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim")):
        return None
    mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return config.attention_head_dim**-0.5 * mscale * mscale
