"""The layer names LoRA may adapt: read by ``TrainArgs`` to check ``--lora_targets`` and by ``lora.py`` to find the
layers. Here, in ``config/``, so the flags are checked without importing the model (``lora.py`` imports it)."""

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
"""Layer names LoRA may adapt (``--lora_targets``): the attention projections and the SwiGLU's three; the MoE
router never (AstrAI's rule)."""
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What AstrAI's ``inject_lora`` adapts when no targets are named."""
