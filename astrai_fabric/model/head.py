"""The model's output (``ModelOutput``) and its head (``LanguageHead``): what turns the final hidden states into
logits, a reward model's scores, or, fused with the cross-entropy, token losses without the whole ``[B, S, V]``
logits.

The head is an object of its own so that whatever holds the last hidden states can apply it: the model's forward
(``AutoRegressiveLM.forward``, which keeps it inside its own forward so that FSDP gathers a sharded head once, as it
does for the logits), or, later, a pipeline's last stage, where no root forward holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai_fabric.losses import head_nll_loss, head_token_entropy, head_token_nll, logits_entropy


@dataclass  # not frozen: Fabric's precision plugins convert a module's outputs field by field, in place
class ModelOutput:
    """What ``AutoRegressiveLM.forward`` returns. Read by attribute (``out.logits``) or, as AstrAI's model returns a
    dict, by key (``out["logits"]``; a field this forward did not compute is a ``KeyError``, as a missing key)."""

    hidden_states: Tensor
    """``[B, S, H]`` after the final norm."""
    logits: Tensor | None = None
    """``[B, S, V]`` in the model's dtype (take ``.float()`` before a loss); None when the head was fused with the
    loss or the model is a reward model."""
    scores: Tensor | None = None
    """A reward model's (``score_head``) score at every position, ``[B, S]``."""
    token_nll: Tensor | None = None
    """The fused head's cross-entropy of each position, ``[B, S]`` float32 (``TokenLoss``)."""
    nll_loss: Tensor | None = None
    """With ``TokenLoss.weights``: ``sum(weights * token_nll)``, whose gradients the fused head took in its forward
    (``token_nll`` is then detached)."""
    token_entropy: Tensor | None = None
    """With ``TokenLoss.entropy``: each position's softmax entropy, ``[B, S]`` float32, without a gradient."""
    aux_loss: Tensor | None = None
    """An MoE model's load-balancing loss, the mean over its MoE layers."""
    router_stats: list[dict[str, Tensor]] | None = None
    """An MoE model's routing statistics, one dict per MoE layer (``losses.moe_diagnostics``)."""

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key) if key in _FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in _FIELDS and getattr(self, str(key)) is not None

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


_FIELDS = frozenset(field.name for field in fields(ModelOutput))


@dataclass(frozen=True)
class TokenLoss:
    """What the fused head computes in place of logits: each position's cross-entropy against ``targets``,
    ``chunk_size`` positions at a time (``losses.head_token_nll``), never the whole logits."""

    targets: Tensor
    """``[B, S]`` token ids, one per position."""
    chunk_size: int
    """Positions per chunk of logits (> 0)."""
    label_smoothing: float = 0.0
    weights: Tensor | None = None
    """``[B, S]``: the loss's per-token weights (``losses.token_nll_weights``); then the weighted sum is returned
    too, its gradients taken in the forward (``losses.head_nll_loss``: no logits recomputed in the backward)."""
    entropy: bool = False
    """Each position's softmax entropy too (``losses.head_token_entropy``, chunk by chunk, no gradient)."""


@dataclass(frozen=True)
class LanguageHead:
    """The LM head applied to the final hidden states: logits (soft-capped as Gemma 2's when ``softcap`` is set),
    or token losses (``TokenLoss``)."""

    lm_head: nn.Module
    """The model's ``lm_head`` (a ``Linear`` without bias; tied to the embedding or not, sharded or not)."""
    softcap: float | None = None
    """``final_logit_softcapping``: logits become ``softcap * tanh(logits / softcap)``."""

    def __call__(self, hidden_states: Tensor, loss: TokenLoss | None = None) -> ModelOutput:
        if loss is None:
            return ModelOutput(hidden_states, logits=self.logits(hidden_states))
        output = self._token_losses(hidden_states, loss)
        if loss.entropy:
            if self.softcap is None:
                output.token_entropy = head_token_entropy(hidden_states, self.lm_head.weight, loss.chunk_size)
            else:  # capped logits, made whole as for their losses
                output.token_entropy = logits_entropy(self.logits(hidden_states))
        return output

    def _token_losses(self, hidden_states: Tensor, loss: TokenLoss) -> ModelOutput:
        if self.softcap is not None:
            # The fused head's chunks are linear logits: capped ones are made whole and the same token losses taken
            # from them (exact, without the fused head's memory saving).
            nll = F.cross_entropy(
                self.logits(hidden_states).float().flatten(0, 1),
                loss.targets.flatten(),
                reduction="none",
                label_smoothing=loss.label_smoothing,
            ).view_as(loss.targets)
            weighted = None if loss.weights is None else (nll * loss.weights).sum()
            return ModelOutput(hidden_states, token_nll=nll, nll_loss=weighted)
        weight = self.lm_head.weight
        if loss.weights is not None:
            weighted, nll = head_nll_loss(
                hidden_states, weight, loss.targets, loss.weights, loss.chunk_size, loss.label_smoothing
            )
            return ModelOutput(hidden_states, token_nll=nll, nll_loss=weighted)
        nll = head_token_nll(hidden_states, weight, loss.targets, loss.chunk_size, loss.label_smoothing)
        return ModelOutput(hidden_states, token_nll=nll)

    def logits(self, hidden_states: Tensor) -> Tensor:
        logits = self.lm_head(hidden_states)
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)
