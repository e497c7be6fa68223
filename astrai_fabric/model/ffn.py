"""Feed-forward layers: SwiGLU ``MLP`` and DeepSeek-style ``DeepSeekMoE`` (AstrAI's ``astrai/model/components/mlp.py``).

Both return ``(hidden_states, aux_loss, router_stats)``; the dense MLP's last two are None.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.model.layers import Linear

RouterStats = dict[str, Tensor]
"""Per-layer routing diagnostics: ``probs [tokens, experts]`` (detached) and ``topk_indices [tokens, k]``."""


class MLP(nn.Module):
    """SwiGLU: ``down(up(x) * silu(gate(x)))``."""

    def __init__(self, dim: int, ffn_dim: int, down_init_std: float = 0.02) -> None:
        super().__init__()
        self.up = Linear(dim, ffn_dim)
        self.gate = Linear(dim, ffn_dim)
        self.down = Linear(ffn_dim, dim, init_std=down_init_std)

    def forward(self, x: Tensor) -> tuple[Tensor, None, None]:
        return self.down(self.up(x) * F.silu(self.gate(x))), None, None


class DeepSeekMoE(nn.Module):
    """Shared experts (averaged, as AstrAI does: sum / n_shared) plus top-k routed experts. With
    ``shared_expert_gate`` (Qwen2-MoE) the shared experts' output is scaled per token by
    ``sigmoid(shared_expert_gate(x))``, a ``Linear(hidden, 1)``.

    Routing: ``softmax`` in float32 over the router logits, top-k, optionally renormalised. The load-balancing
    aux loss, ``E * sum_e(fraction of (token, slot) pairs sent to e * mean router prob of e)``, exists only in
    training mode with grad enabled (AstrAI's rule).

    Departure from AstrAI: every routed expert runs, on an empty slice when it receives no token, so all
    parameters stay in the autograd graph (DDP without ``find_unused_parameters`` then never fails; AstrAI
    skips such experts, B23). The values are unchanged.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.n_routed, self.n_shared = config.n_routed_experts, config.n_shared_experts
        self.top_k, self.norm_topk_prob = config.n_activated_experts, config.norm_topk_prob
        routed_dim = config.moe_intermediate_size or config.intermediate_size
        shared_dim = config.shared_expert_intermediate_size or config.intermediate_size
        scale = 1 / max(self.n_shared, 1) + 1 / self.top_k
        down_init_std = 0.02 / (2 * config.num_hidden_layers * scale) ** 0.5
        self.router = Linear(dim, self.n_routed)
        self.shared_experts = nn.ModuleList(MLP(dim, shared_dim, down_init_std) for _ in range(self.n_shared))
        self.routed_experts = nn.ModuleList(MLP(dim, routed_dim, down_init_std) for _ in range(self.n_routed))
        # Only when on: AstrAI's models have no such parameter and draw their initial weights exactly as before.
        self.shared_expert_gate = Linear(dim, 1) if config.shared_expert_gate else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None, RouterStats | None]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routed, aux_loss, stats = self._routed(tokens, with_aux=self.training and torch.is_grad_enabled())
        if self.n_shared:
            shared = sum(expert(tokens)[0] for expert in self.shared_experts) / self.n_shared
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            routed = routed + shared
        return routed.view(shape), aux_loss, stats

    def _routed(self, tokens: Tensor, with_aux: bool) -> tuple[Tensor, Tensor | None, RouterStats | None]:
        probs = torch.softmax(self.router(tokens).float(), dim=-1).to(tokens.dtype)
        weights, experts = torch.topk(probs, self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        aux_loss = stats = None
        if with_aux:
            load = F.one_hot(experts, num_classes=self.n_routed).float().mean(dim=(0, 1))
            aux_loss = self.n_routed * (load * probs.float().mean(dim=0)).sum()
            stats = {"probs": probs.detach(), "topk_indices": experts}

        # Grouped dispatch: sort (token, slot) pairs by expert so each expert reads one contiguous slice.
        sorted_experts, order = torch.sort(experts.reshape(-1))
        slot_inputs = tokens.repeat_interleave(self.top_k, dim=0)[order]
        slot_weights = weights.reshape(-1, 1)[order]
        ends = torch.bincount(sorted_experts, minlength=self.n_routed).cumsum(0).tolist()
        out = torch.zeros_like(tokens)
        start = 0
        for expert, end in zip(self.routed_experts, ends, strict=True):
            expert_out = expert(slot_inputs[start:end])[0] * slot_weights[start:end]
            out.index_add_(0, order[start:end] // self.top_k, expert_out)
            start = end
        return out, aux_loss, stats


def describe_routing(config: ModelConfig) -> str | None:
    """How an MoE model routes, in the training plan's words (``softmax top-2 of 8, renormalised, + 1 shared
    expert (sigmoid gate); MoE in 3 of 4 layers``); None for a dense model."""
    moe_layers = config.num_moe_layers
    if not moe_layers:
        return None
    words = f"softmax top-{config.n_activated_experts} of {config.n_routed_experts}"
    words += ", renormalised" if config.norm_topk_prob else ", not renormalised"
    shared = config.n_shared_experts
    if shared:
        how = [word for word, on in (("averaged", shared > 1), ("sigmoid gate", config.shared_expert_gate)) if on]
        words += f", + {shared} shared expert{'s' * (shared > 1)} ({', '.join(how) or 'ungated'})"
    return words + f"; MoE in {moe_layers} of {config.num_hidden_layers} layers"
