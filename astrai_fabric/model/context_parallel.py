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

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError


@dataclass(frozen=True)
class ContextGroup:
    """The ranks that share every window's positions, and this rank's place among them."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> ContextGroup:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def positions(self, seq_len: int) -> slice:
        """This rank's positions of a window of ``seq_len`` (consecutive, 1/size of them)."""
        if seq_len % self.size:
            raise ValueError(f"context parallelism over {self.size} ranks needs windows of a multiple of {self.size}")
        width = seq_len // self.size
        return slice(self.rank * width, (self.rank + 1) * width)


def enable_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Give ``model`` and its attention modules the context group (every module with a ``context_parallel``
    attribute: ``AutoRegressiveLM`` and ``GQA``/``MLA``)."""
    context = ContextGroup.of(group)
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
        raise ConfigError(
            f"cp_size {cp_size} with neftune_alpha: NEFTune scales its noise by the sequence length, and each rank "
            "would see its positions' length only"
        )


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


def seq_to_heads(x: Tensor, context: ContextGroup) -> Tensor:
    """``[B, S/C, heads, D]`` (this rank's positions, every head) → ``[B, S, heads/C, D]`` (every position, this
    rank's heads)."""
    return _AllToAll.apply(x, context.group, 2, 1)


def heads_to_seq(x: Tensor, context: ContextGroup) -> Tensor:
    """The inverse of ``seq_to_heads``."""
    return _AllToAll.apply(x, context.group, 1, 2)


def repeat_kv_for(k: Tensor, v: Tensor, query_heads: int, context: ContextGroup) -> tuple[Tensor, Tensor]:
    """Keys and values with heads enough to split over the group: as they are when their heads split, else each
    repeated for its query heads (AstrAI's ``repeat_kv``, done before the exchange instead of after)."""
    if k.size(2) % context.size == 0:
        return k, v
    repeats = query_heads // k.size(2)
    return k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)


def pad_window(
    context: ContextGroup,
    input_ids: Tensor,
    input_mask: Tensor | None,
    position_ids: Tensor | None,
    nll_targets: Tensor | None,
    nll_weights: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The forward's inputs right-padded to a length the group splits evenly (samples padded to their batch's
    longest: dpo, kto, reward models, sft without packing): ids 0, positions repeating the last one (so the RoPE
    table is never read past the window), untrained (weight 0), masked from every real query (a 4-D mask, as
    ``process_attention_mask`` makes them, gets padded keys that no real position attends, and padded queries that
    attend to themselves alone; without a mask attention is causal, and padding after the last real token is
    unseen).
    ``gather_output`` cuts the outputs back."""
    extra = -input_ids.size(1) % context.size
    if extra == 0:
        return input_ids, input_mask, position_ids, nll_targets, nll_weights
    length = input_ids.size(1)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(input_ids.size(0), -1)
    position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(-1, extra)], dim=1)
    input_ids = F.pad(input_ids, (0, extra))
    nll_targets = None if nll_targets is None else F.pad(nll_targets, (0, extra))
    nll_weights = None if nll_weights is None else F.pad(nll_weights, (0, extra))
    if input_mask is not None:
        input_mask = _pad_mask(input_mask, extra)
    return input_ids, input_mask, position_ids, nll_targets, nll_weights


def _pad_mask(mask: Tensor, extra: int) -> Tensor:
    """A 4-D mask with ``extra`` padded keys no real query attends and ``extra`` padded queries attending to
    themselves only. A mask over keys alone (``[B, 1, 1, S]``) is made whole first: a padded query under it would
    see only the real keys, which a sliding window can take all away, and a query with no key gives NaN, which the
    next layer's products carry into the real positions (a weight of 0 times NaN)."""
    blocked = False if mask.dtype == torch.bool else float("-inf")
    length = mask.size(-1)
    mask = mask.expand(*mask.shape[:-2], length, length)
    padded = F.pad(mask, (0, extra, 0, extra), value=blocked)
    diagonal = torch.arange(length, length + extra, device=mask.device)
    padded[..., diagonal, diagonal] = True if mask.dtype == torch.bool else 0.0
    return padded


def gather_output(output, context: ContextGroup, length: int):  # noqa: ANN001, ANN201 - a ModelOutput
    """``output`` with its per-position tensors gathered over the group (the first ``length`` positions: what
    ``pad_window`` added is cut) and its loss sum all-reduced (see the module docstring); the hidden states stay
    this rank's positions."""
    gathered = {
        name: _GatherPositions.apply(getattr(output, name), context.group)
        for name in ("logits", "scores", "token_nll", "token_entropy")
        if getattr(output, name) is not None
    }
    if any(tensor.size(1) != length for tensor in gathered.values()):  # a copy, not a view: FSDP hooks the outputs
        gathered = {name: tensor[:, :length].clone() for name, tensor in gathered.items()}
    if output.nll_loss is not None:
        gathered["nll_loss"] = _SumOver.apply(output.nll_loss, context.group)
    return dataclasses.replace(output, **gathered)


def sum_over_group(x: Tensor, context: ContextGroup) -> Tensor:
    """``x`` summed over the group, on every rank; the backward sums the gradients as ``gather_output``'s do (an
    MoE layer's balance-loss sums: ``DeepSeekMoE``)."""
    return _SumOver.apply(x, context.group)


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
