"""The layer names LoRA may adapt and the bound on its scaling: read by ``TrainArgs`` to check ``--lora_targets`` and
``--lora_alpha``, and by ``lora.py`` to find the layers and check ``adapter_config.json``. Here, in ``config/``, so the
flags are checked without importing the model (``lora.py`` imports it)."""

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
"""Layer names LoRA may adapt (``--lora_targets``): the attention projections and the SwiGLU's three; the MoE
router never (AstrAI's rule)."""
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What AstrAI's ``inject_lora`` adapts when no targets are named."""

MAX_SCALING = 4096
"""The largest adapter scaling ``alpha / r`` taken (typical ones are 0.5 to 16): the fuzz tier's 2**34 made every
gradient norm NaN, and no recipe means a scaling past this."""


def check_scaling(alpha: float, r: int, what: str) -> str | None:
    """Why the adapter scaling ``alpha / r`` (``what`` names it) is refused, or None (``MAX_SCALING``)."""
    if alpha / r <= MAX_SCALING:
        return None
    return f"{what}, the adapter's scaling, must be at most {MAX_SCALING:,} (typical: 0.5 to 16), got {alpha / r:.3g}"
