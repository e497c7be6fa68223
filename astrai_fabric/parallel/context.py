"""Context parallelism: all-to-all sequence parallelism (DeepSpeed-Ulysses, arXiv:2309.14509) over a context group.

Each rank of a group of C holds 1/C of every window's positions for everything but attention: the embedding, the
norms, the MLPs and the head run on its positions only (``AutoRegressiveLM.trunk`` takes its share; every rank of
the group reads the same samples). Attention needs every position: one all-to-all trades sequence for heads (each
rank then holds every position of 1/C of the heads), attention runs over the whole window with the whole window's
mask (causal, document boundaries, sliding windows, soft-capping: computed from the window's own positions, as one
process computes them), and a second all-to-all trades back (``sdpa``). RoPE rotates with the window's positions.

The output: per-position tensors (token losses, logits, a reward model's scores) are all-gathered over the group
and a fused head's weighted loss sum all-reduced, so each rank holds one process's output and the loss code runs
unchanged (the hidden states stay this rank's positions). Gradients: the adjoint of the gather sums what every
rank's loss (the same on each) sends back to this rank's positions, C times one loss's gradient, and FSDP's
average over the group (it shards over shard x context) divides by C again, so each parameter gets the sum over
every position, one process's gradient.

Why not ring attention: torch's ``context_parallel`` is CUDA-only in torch 2.13 (its CPU attention op has no
sharding rule), while all-to-alls run on gloo, with any attention kernel and any mask. The price: heads must split
over the group (KV heads fewer than the group are repeated to one per query head first), and each rank holds the
whole window's mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from astrai_fabric.config.combinations import knob_problem
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError
from astrai_fabric.model.context_parallel import ContextGroup
from astrai_fabric.parallel.group import RanksOf


class UlyssesGroup(RanksOf, ContextGroup):
    """A context group of process-group ranks: sequence and heads traded by all-to-all, outputs gathered."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """Keys and values repeated where their heads do not split over the group, then every tensor traded from
        this rank's positions of every head to every position of this rank's heads, attention there, and back."""
        k, v = repeat_kv_for(k, v, q.size(2), self.size)
        q, k, v = (_AllToAll.apply(t, self.group, 2, 1) for t in (q, k, v))
        return _AllToAll.apply(attention(q, k, v), self.group, 1, 2)

    def gather_positions(self, x: Tensor) -> Tensor:
        return _GatherPositions.apply(x, self.group)

    def sum(self, x: Tensor) -> Tensor:
        return _SumOver.apply(x, self.group)


def repeat_kv_for(k: Tensor, v: Tensor, query_heads: int, group_size: int) -> tuple[Tensor, Tensor]:
    """Keys and values with heads enough to split over the group: as they are when their heads split, else each
    repeated for its query heads (AstrAI's ``repeat_kv``, done before the exchange instead of after)."""
    if k.size(2) % group_size == 0:
        return k, v
    repeats = query_heads // k.size(2)
    return k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)


def enable_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Give ``model`` and its attention modules the context group (every module with a ``context_parallel``
    attribute: ``AutoRegressiveLM``, ``GQA``/``MLA`` and the MoE layers)."""
    context = UlyssesGroup.of(group)
    for module in model.modules():
        if hasattr(module, "context_parallel"):
            module.context_parallel = context


def check_context_parallel(config: ModelConfig, cp_size: int, tp_size: int = 1) -> None:
    """Refuse, in one line, a model that ``cp_size`` cannot split: heads per tensor-parallel rank that do not split
    over the group, NEFTune."""
    heads = config.num_attention_heads // tp_size
    if heads % cp_size:
        raise ConfigError(
            f"cp_size {cp_size} must divide the attention heads per tensor-parallel rank ({heads}: "
            f"num_attention_heads {config.num_attention_heads} / tp_size {tp_size})"
        )
    if config.neftune_alpha:
        raise ConfigError(knob_problem("cp", cp_size, "neftune_alpha"))


def describe_context_parallel(config: ModelConfig, cp_size: int, tp_size: int = 1) -> str:
    """The plan's words on how attention splits over the group."""
    heads = config.num_attention_heads // tp_size
    kv_heads = (config.num_key_value_heads or config.num_attention_heads) // tp_size
    kv = f"{kv_heads // cp_size} KV head(s)"
    if kv_heads % cp_size:
        kv = f"the KV heads repeated to {heads // cp_size}"
    return (
        f"context parallel over {cp_size} ranks: each holds 1/{cp_size} of every window's positions, attention "
        f"trades them for heads by all-to-all ({heads // cp_size} query head(s) and {kv} per rank)"
    )


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Part ``i`` of ``x`` along ``scatter_dim`` to rank ``i``; what arrives, concatenated along ``gather_dim`` in
    rank order."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherPositions(torch.autograd.Function):
    """``[B, S/C, ...]`` → ``[B, S, ...]``; backward: the gradients of every rank summed, this rank's positions."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank].contiguous(), None


class _SumOver(torch.autograd.Function):
    """The sum over the group, on every rank; backward: the gradients of every rank summed."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: ANN001
        ctx.group = group
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
