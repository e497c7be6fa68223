"""The model's seam for context parallelism: a ``ContextGroup`` that ``parallel.context`` fills from outside (the
model holds it as ``context_parallel`` and imports no ``torch.distributed``), and the tensor work around it that
needs no communication: the window padded to a length the group splits, the output gathered through the group.
Attention asks the group to attend (``ContextGroup.attend``) with its own kernel: Ulysses trades positions for heads
around it, a ring would pass keys and values round the group.

How it runs (DeepSpeed-Ulysses over the group) and why its gradients are one process's: ``parallel.context``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


class ContextGroup:
    """The ranks that share every window's positions, and this rank's place among them: what the model asks of
    context parallelism (``parallel.context.UlyssesGroup`` answers it with collectives)."""

    size: int
    rank: int

    def positions(self, seq_len: int) -> slice:
        """This rank's positions of a window of ``seq_len`` (consecutive, 1/size of them)."""
        if seq_len % self.size:
            raise ValueError(f"context parallelism over {self.size} ranks needs windows of a multiple of {self.size}")
        width = seq_len // self.size
        return slice(self.rank * width, (self.rank + 1) * width)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """Attention over the whole window from this rank's positions' ``q``/``k``/``v`` (``[B, S/C, heads, D]``,
        the mask the whole window's, bound in ``attention``): ``[B, S/C, heads, Dv]``, this rank's positions.
        ``attention(q, k, v)`` computes it over whatever positions and heads it is given (``attention.sdpa``'s
        kernel): the group decides what each rank gives it and how the parts meet."""
        raise NotImplementedError

    def gather_positions(self, x: Tensor) -> Tensor:
        """``[B, S/C, ...]`` → ``[B, S, ...]``; backward: the gradients of every rank summed, this rank's positions."""
        raise NotImplementedError

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the group, on every rank; backward: the gradients of every rank summed."""
        raise NotImplementedError


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
        name: context.gather_positions(getattr(output, name))
        for name in ("logits", "scores", "token_nll", "token_entropy")
        if getattr(output, name) is not None
    }
    if any(tensor.size(1) != length for tensor in gathered.values()):  # a copy, not a view: FSDP hooks the outputs
        gathered = {name: tensor[:, :length].clone() for name, tensor in gathered.items()}
    if output.nll_loss is not None:
        gathered["nll_loss"] = context.sum(output.nll_loss)
    return dataclasses.replace(output, **gathered)
