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
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.model.layers import Linear, RMSNorm, apply_rotary_emb


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """``q [B,S,H,D]``, ``k``/``v [B,S,K,D]`` → ``[B,S,H*D]``; causal exactly when no mask is given (AstrAI)."""
    n_rep = q.size(2) // k.size(2)
    if n_rep > 1:  # AstrAI's repeat_kv: each key/value head serves n_rep consecutive query heads
        k = k.repeat_interleave(n_rep, dim=2)
        v = v.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask, is_causal=attn_mask is None
    )
    return out.transpose(1, 2).flatten(2)


class GQA(nn.Module):
    """Grouped-query attention; RoPE on q and k, then optional QK-norm (after RoPE), then optional gating.

    Options for Hugging Face architectures (defaults are AstrAI's): biases on q/k/v (Qwen2), QK-norm before RoPE
    (Qwen3), and a head width of its own, so ``heads * head_dim`` may differ from ``hidden_size`` (Qwen3).
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, self.n_heads = config.hidden_size, config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = config.attention_head_dim
        self.norm_before_rope = config.qk_norm_before_rope
        bias = config.attention_qkv_bias
        # Registration order is AstrAI's: it fixes state_dict order and the random stream at initialisation.
        self.q_proj = Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        width = self.n_heads * self.head_dim  # == dim unless head_dim is set
        self.o_proj = Linear(width, dim, init_std=0.02 / (2 * config.num_hidden_layers) ** 0.5)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.gate = Linear(dim, width) if config.use_gated_attention else None

    def forward(self, x: Tensor, rotary: Tensor, attn_mask: Tensor | None, kv_cache: KVCache | None = None) -> Tensor:
        # Heads counted from the tensors, not the config: tensor parallelism leaves each rank a slice of them.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None and self.norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, rotary), apply_rotary_emb(k, rotary)
        if self.q_norm is not None and not self.norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_id, k, v)
        out = sdpa(q, k, v, attn_mask)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        return self.o_proj(out)


class MLA(nn.Module):
    """Multi-head latent attention: keys and values come from a rank-``kv_lora_rank`` compression of ``x``.

    Each head's query/key is ``[nope | rope]``; RoPE rotates the ``rope`` part only, QK-norm (if on) follows the
    concatenation. Values have the full head width.
    """

    def __init__(self, config: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, self.n_heads = config.hidden_size, config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.head_dim = config.attention_head_dim
        self.q_proj = Linear(dim, self.n_heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.kv_a_proj = Linear(dim, config.kv_lora_rank)
        self.kv_norm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(config.kv_lora_rank, self.n_kv_heads * 2 * self.head_dim)
        self.o_proj = Linear(dim, dim, init_std=0.02 / (2 * config.num_hidden_layers) ** 0.5)
        self.gate = Linear(dim, dim) if config.use_gated_attention else None

    def forward(self, x: Tensor, rotary: Tensor, attn_mask: Tensor | None, kv_cache: KVCache | None = None) -> Tensor:
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))  # local heads under tensor parallelism
        kv = self.kv_b_proj(self.kv_norm(self.kv_a_proj(x))).unflatten(-1, (-1, 2 * self.head_dim))
        k_nope, k_rope, v = kv.split([self.nope_dim, self.rope_dim, self.head_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_rope, rotary)], dim=-1)
        k = torch.cat([k_nope, apply_rotary_emb(k_rope, rotary)], dim=-1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is not None:  # caches the full keys and values (not the latent), simple and exact
            k, v = kv_cache.update(self.layer_id, k, v)
        out = sdpa(q, k, v, attn_mask)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        return self.o_proj(out)
