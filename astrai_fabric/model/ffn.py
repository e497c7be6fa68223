"""Feed-forward layers: SwiGLU ``MLP`` and DeepSeek-style ``DeepSeekMoE`` (AstrAI's ``astrai/model/components/mlp.py``).

Both return ``(hidden_states, aux_loss, router_stats)``; the dense MLP's last two are None.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from astrai_fabric import torch_private
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.model.context_parallel import ContextGroup
from astrai_fabric.model.expert_parallel import ExpertGroup
from astrai_fabric.model.layers import Linear

RouterStats = dict[str, Tensor]
"""Per-layer routing diagnostics, detached: ``expert_tokens [experts]``, the (token, slot) pairs each expert was
given, and ``entropy``, the mean entropy of the tokens' balance distributions (``DeepSeekMoE.balance_probs``); over
the context group's positions under context parallelism."""


class MLP(nn.Module):
    """SwiGLU: ``down(up(x) * silu(gate(x)))``; with ``activation="gelu_pytorch_tanh"`` GeGLU, GELU's tanh
    approximation in place of silu (Gemma; transformers' ``gelu_pytorch_tanh``)."""

    def __init__(self, dim: int, ffn_dim: int, down_init_std: float = 0.02, activation: str = "silu") -> None:
        super().__init__()
        self.up = Linear(dim, ffn_dim)
        self.gate = Linear(dim, ffn_dim)
        self.down = Linear(ffn_dim, dim, init_std=down_init_std)
        self.gelu = activation == "gelu_pytorch_tanh"

    def forward(self, x: Tensor, real_positions: int | None = None) -> tuple[Tensor, None, None]:
        """``real_positions``: read by ``DeepSeekMoE`` alone (a decoder block calls either alike)."""
        gate = self.gate(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(self.up(x) * gate), None, None


class DeepSeekMoE(nn.Module):
    """Shared experts (averaged, as AstrAI does: sum / n_shared) plus top-k routed experts. With
    ``shared_expert_gate`` (Qwen2-MoE) the shared experts' output is scaled per token by
    ``sigmoid(shared_expert_gate(x))``, a ``Linear(hidden, 1)``.

    Routing: ``softmax`` in float32 over the router logits, top-k, optionally renormalised. The load-balancing
    aux loss, ``E * sum_e(fraction of (token, slot) pairs sent to e * mean router prob of e)``, exists only in
    training mode with grad enabled (AstrAI's rule).

    DeepSeek-V3's routing (arXiv:2412.19437, section 2.1.2; ``DeepseekV3TopkRouter``), option by option, each off by
    default: a ``sigmoid`` score per expert (``scoring_func``), a per-expert bias added for choosing only
    (``score_correction_bias``, a buffer), the choice limited to the ``topk_group`` best of ``n_group`` expert
    groups, and the weights scaled by ``routed_scaling_factor``. For a sigmoid router the aux loss's "router prob"
    is the scores normalised over the experts per token, DeepSeek-V3's complementary balance loss (its eq. 17-20)
    taken over the batch rather than per sequence; DeepSeek-V3 itself trains with a tiny coefficient on it.

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
        self.routed_experts = RoutedExperts({j: MLP(dim, routed_dim, down_init_std) for j in range(self.n_routed)})
        # Only when on: AstrAI's models have no such parameter and draw their initial weights exactly as before.
        self.shared_expert_gate = Linear(dim, 1) if config.shared_expert_gate else None
        self.scoring_func, self.routed_scaling_factor = config.scoring_func, config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group
        # A buffer: it is never trained by gradients (topk's choice has none), yet it is part of the weights.
        bias = torch.zeros(self.n_routed) if config.score_correction_bias else None
        self.register_buffer("score_correction_bias", bias)
        self.expert_parallel: ExpertGroup | None = None  # set by parallelize (``--ep_size``)
        self.context_parallel: ContextGroup | None = None  # set by parallelize (``--cp_size``)
        self.grouped: bool | None = None
        """How the routed experts run (``run_experts``): None together off the CPU where they can, True together,
        False one by one."""

    def reset_parameters(self) -> None:
        if self.score_correction_bias is not None:
            nn.init.zeros_(self.score_correction_bias)

    def forward(self, x: Tensor, real_positions: int | None = None) -> tuple[Tensor, Tensor | None, RouterStats | None]:
        """``x [B, S, H]``; ``real_positions``: under context parallelism, how many of this rank's ``S`` positions
        are the window's (the rest ``pad_window``'s padding, left out of the routing statistics); None: all."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        real = None
        if real_positions is not None and real_positions < shape[1]:
            real = (torch.arange(shape[1], device=x.device) < real_positions).expand(shape[0], -1).reshape(-1)
        routed, aux_loss, stats = self._routed(tokens, real, with_aux=self.training and torch.is_grad_enabled())
        if self.n_shared:
            shared = sum(expert(tokens)[0] for expert in self.shared_experts) / self.n_shared
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            routed = routed + shared
        return routed.view(shape), aux_loss, stats

    def route(self, router_logits: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(scores, choice)``, each ``[tokens, experts]``: the float32 scores, whose chosen entries are the
        weights, and what the top-k is taken over: the scores in ``dtype``, the tokens' (AstrAI's), or, with a
        score-correction bias or groups, the float32 scores plus the bias, every expert outside the token's
        ``topk_group`` best groups at -inf (a group scoring the sum of its two best)."""
        logits = router_logits.float()
        scores = torch.sigmoid(logits) if self.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
        if self.score_correction_bias is None and self.n_group == 1:
            return scores, scores.to(dtype)
        choice = scores if self.score_correction_bias is None else scores + self.score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.unflatten(-1, (self.n_group, -1))
            best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False).indices
            outside = torch.ones(grouped.shape[:-1], dtype=torch.bool, device=choice.device).scatter_(-1, best, False)
            choice = grouped.masked_fill(outside.unsqueeze(-1), -math.inf).flatten(-2)
        return scores, choice

    def balance_probs(self, scores: Tensor, probs: Tensor) -> Tensor:
        """A distribution over the experts per token, for the balance loss and the entropy: softmax's own
        (``probs``), or the sigmoid ``scores`` normalised."""
        return probs if self.scoring_func == "softmax" else (scores / scores.sum(-1, keepdim=True)).to(probs)

    def _routed(
        self, tokens: Tensor, real: Tensor | None, with_aux: bool
    ) -> tuple[Tensor, Tensor | None, RouterStats | None]:
        scores, choice = self.route(self.router(tokens), tokens.dtype)
        probs = scores.to(tokens.dtype)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor

        # Dispatch: sort the (token, slot) pairs by expert, so each expert's inputs are one contiguous slice.
        sorted_experts, order = torch.sort(experts.reshape(-1))
        slot_inputs = tokens.repeat_interleave(self.top_k, dim=0)[order]
        # Counted by scatter: CUDA's bincount reads its input's maximum back to the host first.
        counts = torch.zeros(self.n_routed, dtype=torch.long, device=tokens.device)
        counts.index_add_(0, sorted_experts, torch.ones_like(sorted_experts))
        aux_loss = stats = None
        if with_aux:
            aux_loss, stats = self._balance(self.balance_probs(scores, probs), experts, counts, real)
        if self.expert_parallel is None:
            slot_outputs = self.routed_experts(slot_inputs, counts, self.grouped)
        else:  # the pairs go to the ranks holding their experts and come back (``expert_parallel``)
            run = functools.partial(self.routed_experts, grouped=self.grouped)
            slot_outputs = self.expert_parallel.exchange_and_run(run, slot_inputs, counts)
        slot_outputs = slot_outputs * weights.reshape(-1, 1)[order]
        out = torch.zeros_like(tokens).index_add_(0, order // self.top_k, slot_outputs)
        return out, aux_loss, stats

    def _balance(
        self, balance: Tensor, experts: Tensor, counts: Tensor, real: Tensor | None
    ) -> tuple[Tensor, RouterStats]:
        """The balance loss, ``E * sum_e(counts_e / (tokens * k) * mean balance prob of e)``, and the statistics.
        Under context parallelism the sums are the group's (one all-reduce, its backward one more), so every rank
        computes one process's loss over the whole window; ``pad_window``'s padding (``real`` False) is left out."""
        if real is not None:
            balance, experts = balance[real], experts[real]
            counts = torch.zeros_like(counts).index_add_(0, experts.reshape(-1), torch.ones_like(experts.reshape(-1)))
        entropy = -(balance.detach().float() * balance.detach().float().clamp_min(1e-8).log()).sum()
        num_tokens = torch.tensor([balance.size(0)], dtype=torch.float32, device=balance.device)
        sums = torch.cat([balance.float().sum(dim=0), counts.float(), entropy[None], num_tokens])
        if self.context_parallel is not None:
            sums = self.context_parallel.sum(sums)
        prob_sums, counts, (entropy, num_tokens) = sums.split([self.n_routed, self.n_routed, 2])
        load = counts.detach() / (num_tokens * self.top_k)
        aux_loss = self.n_routed * (load * prob_sums / num_tokens).sum()
        return aux_loss, {"expert_tokens": counts.detach(), "entropy": entropy.detach() / num_tokens}


class RoutedExperts(nn.ModuleDict):
    """A layer's routed experts keyed by their index among all of the layer's (``routed_experts.{j}``, the names a
    list would give): every one, or under expert parallelism this rank's (``keep``). Called on inputs sorted by
    expert, it runs them (``run_experts``): a module of its own so that FSDP can gather an expert rank's experts
    apart from the rest of the layer."""

    def __init__(self, experts: dict[int, MLP]) -> None:
        super().__init__({str(j): expert for j, expert in experts.items()})

    def forward(self, inputs: Tensor, counts: Tensor | Sequence[int], grouped: bool | None = None) -> Tensor:
        return run_experts(list(self.values()), inputs, counts, grouped)

    def keep(self, indices: Sequence[int]) -> RoutedExperts:
        """The experts of ``indices`` alone, under the same names."""
        return RoutedExperts({j: self[str(j)] for j in indices})


def run_experts(
    experts: Sequence[MLP], inputs: Tensor, counts: Tensor | Sequence[int], grouped: bool | None = None
) -> Tensor:
    """The experts on their inputs, ``inputs [N, H]`` sorted by expert, ``counts[e]`` rows for ``experts[e]``
    (a tensor, or the host's numbers where it has read them already: expert parallelism's exchange).

    Two ways, the same values: every expert on its slice in turn (one host read of the counts, three matmuls per
    expert), or all together (``grouped``): each projection's weights stacked over the experts, one grouped matmul
    (``torch_private.grouped_mm``) that finds the slices on the device, so nothing waits for the host. The
    parameters stay one 2-D tensor per expert projection (the checkpoint's, LoRA's and Muon's unit): the stacks are
    made in the forward, their gradients flowing back to each expert's weight.

    On the CPU the host read costs nothing and the stacking does (bench/moe.py: the loop was the faster there at 16
    and 128 experts), so ``grouped`` None computes together only off the CPU, and only where it fits
    (``grouped_experts_fit``: plain ``Linear`` projections, not LoRA's or NF4); True insists, False never does.
    """
    fits = grouped_experts_fit(experts, inputs.dtype)
    if grouped and not fits:
        raise ValueError("these experts cannot be computed as one grouped matmul (see model.ffn.grouped_experts_fit)")
    if grouped is None:
        grouped = fits and inputs.device.type != "cpu"
    if not grouped:
        outputs, start = [], 0
        ends = counts.cumsum(0).tolist() if isinstance(counts, Tensor) else accumulate(counts)
        for expert, end in zip(experts, ends, strict=True):
            outputs.append(expert(inputs[start:end])[0])
            start = end
        return torch.cat(outputs)
    if not isinstance(counts, Tensor):
        counts = torch.tensor(counts, device=inputs.device)
    ends = counts.cumsum(0).to(torch.int32)

    def project(name: str, x: Tensor) -> Tensor:
        return torch_private.grouped_mm(
            x, torch.stack([getattr(e, name).weight for e in experts]).transpose(1, 2), ends
        )

    gate = project("gate", inputs)
    gate = F.gelu(gate, approximate="tanh") if experts[0].gelu else F.silu(gate)
    return project("down", project("up", inputs) * gate)


def grouped_experts_fit(experts: Sequence[MLP], dtype: torch.dtype) -> bool:
    """Whether ``run_experts`` can compute ``experts`` on inputs of ``dtype`` together: each projection a plain
    ``Linear`` without bias whose weight is a local tensor (FSDP's unsharded one; not a DTensor, not NF4), one
    activation, and widths the grouped kernel takes."""
    projections = [p for e in experts for p in (e.up, e.gate, e.down)]
    if not projections or any(type(p) is not Linear or p.bias is not None for p in projections):
        return False
    if any(type(p.weight) not in (Tensor, nn.Parameter) or p.weight.dtype != dtype for p in projections):
        return False
    hidden, width = experts[0].up.in_features, experts[0].up.out_features
    same = all((e.up.in_features, e.up.out_features, e.gelu) == (hidden, width, experts[0].gelu) for e in experts)
    return same and torch_private.grouped_mm_fits(dtype, hidden, width)


def describe_routing(config: ModelConfig) -> str | None:
    """How an MoE model routes, in the training plan's words (``softmax top-2 of 8, renormalised, + 1 shared
    expert (sigmoid gate); MoE in 3 of 4 layers``); None for a dense model."""
    moe_layers = config.num_moe_layers
    if not moe_layers:
        return None
    words = f"{config.scoring_func} top-{config.n_activated_experts} of {config.n_routed_experts}"
    if config.n_group > 1:
        words += f" in the best {config.topk_group} of {config.n_group} groups"
    if config.score_correction_bias:
        words += ", chosen with a score-correction bias"
    words += ", renormalised" if config.norm_topk_prob else ", not renormalised"
    if config.routed_scaling_factor != 1.0:
        words += f", scaled by {config.routed_scaling_factor:g}"
    shared = config.n_shared_experts
    if shared:
        how = [word for word, on in (("averaged", shared > 1), ("sigmoid gate", config.shared_expert_gate)) if on]
        words += f", + {shared} shared expert{'s' * (shared > 1)} ({', '.join(how) or 'ungated'})"
    return words + f"; MoE in {moe_layers} of {config.num_hidden_layers} layers"
