"""AstrAI-compatible decoder-only transformer (no Lightning, no torch.distributed in here)."""

from astrai_fabric.model.transformer import AutoRegressiveLM, DecoderBlock, make_doc_boundary_mask

__all__ = ["AutoRegressiveLM", "DecoderBlock", "make_doc_boundary_mask"]
