"""AstrAI-compatible decoder-only transformer (no Lightning, no torch.distributed in here)."""

from astrai_fabric.model.head import LanguageHead, ModelOutput, TokenLoss
from astrai_fabric.model.transformer import (
    AutoRegressiveLM,
    DecoderBlock,
    count_parameters,
    forward_window,
    make_doc_boundary_mask,
    next_token_logprobs,
    rope_table_bytes,
)

__all__ = [
    "AutoRegressiveLM",
    "DecoderBlock",
    "LanguageHead",
    "ModelOutput",
    "TokenLoss",
    "count_parameters",
    "forward_window",
    "make_doc_boundary_mask",
    "next_token_logprobs",
    "rope_table_bytes",
]
