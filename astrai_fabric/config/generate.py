"""``GenerateArgs``: the flags of ``astrai-fabric generate`` (``generate.run_generate`` reads them). A config of its
own, beside ``TrainArgs``, so that the options page (``config/reference.py``) and the CLI read it without importing
the model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateArgs:
    """``astrai-fabric generate``: sample continuations of prompts from a model or checkpoint directory."""

    param_path: str | None = None
    """Model or checkpoint directory (config.json + model.safetensors); ``bundled:tiny`` needs weights first."""
    prompt: list[str] = field(default_factory=list)
    """Prompt text; repeat the flag for several prompts (sampled as one batch)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; default: ``param_path``."""
    chat: bool = True
    """Render each prompt as a user message with the chat template (false: continue the raw text)."""
    system: str | None = None
    """A system message before each chat prompt."""
    max_new_tokens: int = 128
    """Most tokens to generate per prompt."""
    temperature: float = 0.7
    """Sampling temperature; 0 is greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    top_p: float = 0.9
    """Keep the smallest set of tokens whose probability reaches p (1: off)."""
    num_samples: int = 1
    """Continuations per prompt."""
    seed: int = 3407
    """Sampling seed."""
    device_type: str | None = None
    """``cuda`` or ``cpu``; default: cuda when available."""
