"""Training losses as pure tensor functions (no Fabric, no model import). Logits are cast to float32 first.

Each returns the loss of one micro-batch; the loop divides by ``grad_accum_steps`` (AstrAI's scaling).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def causal_lm_loss(
    logits: Tensor, targets: Tensor, loss_mask: Tensor | None = None, label_smoothing: float = 0.0
) -> Tensor:
    """Next-token cross-entropy, the mean over the trained tokens of the micro-batch.

    ``seq``: no mask, every token counts (AstrAI's mean over ``B * S``). ``sft``: ``loss_mask`` (aligned with
    ``targets``) selects the tokens; a micro-batch without any trainable token gives a loss of exactly 0 with
    zero gradients, where AstrAI's ``cross_entropy`` returns NaN and poisons the step (B8).
    """
    logits = logits.flatten(0, 1).float()
    targets = targets.flatten()
    if loss_mask is None:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    mask = loss_mask.flatten().bool()
    if not mask.any():
        return logits.sum() * 0.0  # keeps the graph (and DDP/FSDP hooks) intact; gradient is zero
    masked = targets.masked_fill(~mask, IGNORE_INDEX)
    return F.cross_entropy(logits, masked, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)


def with_moe_aux_loss(task_loss: Tensor, aux_loss: Tensor | None, coef: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``task + coef * aux`` for MoE models, with AstrAI's metric names; the task loss alone otherwise."""
    metrics = {"task_loss": task_loss.detach()}
    if aux_loss is None:
        return task_loss, metrics
    metrics.update(moe_aux_loss=aux_loss.detach(), moe_aux_loss_weighted=(coef * aux_loss).detach())
    return task_loss + coef * aux_loss, metrics
