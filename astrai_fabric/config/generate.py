"""``GenerateArgs`` and ``ChatArgs``: the flags of ``astrai-fabric generate`` and ``astrai-fabric chat``
(``generate.run_generate`` and ``chat.run_chat`` read them), their sampling flags one definition (``SamplingArgs``)
checked by one ``validate``. Configs of their own, beside ``TrainArgs``, so that the options page
(``config/reference.py``) and the CLI read them without importing the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from astrai_fabric.config.devices import parse_bytes
from astrai_fabric.errors import ConfigError

DEVICE_TYPES = ("cpu", "cuda")
MAX_SAMPLES = 256
"""The most continuations of one prompt (the engine's ``n``)."""


@dataclass
class SamplingArgs:
    """The flags ``generate`` and ``chat`` share: the model, its tokenizer and how tokens are sampled."""

    param_path: str | None = None
    """Model or checkpoint directory (config.json + model.safetensors; a LoRA checkpoint's adapter is merged; a
    Hugging Face directory loads as it is); ``bundled:tiny`` needs weights first."""
    tokenizer_path: str | None = None
    """Tokenizer directory; default: the model's (``param_path``, chat's SRC)."""
    system: str | None = None
    """A system message: before each prompt (generate), at the start of the conversation (chat)."""
    max_new_tokens: int = 128
    """Most tokens to generate per prompt (generate) or reply (chat)."""
    temperature: float = 0.7
    """Sampling temperature; 0 is greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    top_p: float = 0.9
    """Keep the smallest set of tokens whose probability reaches p (1: off)."""
    seed: int = 3407
    """Sampling seed."""
    device_type: str | None = None
    """``cuda`` or ``cpu``; default: cuda when available."""
    kv_cache_memory: str | None = None
    """The generation engine's KV cache (``512MiB``, ``8GB``); default: 90% of the free memory on CUDA, 1 GiB on
    CPU, at most what the running requests can use."""

    def validate(self, command: str) -> None:
        """The sampling flags' ranges, for ``command``'s error line (whether CUDA is there is the sampler's check)."""
        ranges = 0 <= self.temperature < math.inf and 0 < self.top_p <= 1 and self.top_k >= 0
        if not ranges or self.max_new_tokens < 1:
            raise ConfigError(
                f"{command}: need a finite temperature >= 0, 0 < top_p <= 1, top_k >= 0 and max_new_tokens >= 1; got "
                f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, "
                f"max_new_tokens={self.max_new_tokens}"
            )
        if self.kv_cache_memory is not None:
            self.kv_cache_bytes()
        if self.device_type not in (None, *DEVICE_TYPES):
            raise ConfigError(f"{command}: device_type must be cpu or cuda, got {self.device_type!r}")
        try:  # Python keeps a command line's undecodable bytes as lone surrogates, which no tokenizer takes
            (self.system or "").encode("utf-8")
        except UnicodeEncodeError as err:
            raise ConfigError(
                f"{command}: system is not UTF-8 text (an undecodable byte at position {err.start})"
            ) from None

    def kv_cache_bytes(self) -> int | None:
        """``kv_cache_memory`` in bytes (None: the engine's default)."""
        if self.kv_cache_memory is None:
            return None
        size = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        if size < 2**20:
            raise ConfigError(f"kv_cache_memory {self.kv_cache_memory!r}: at least 1 MiB, got {size:,} bytes")
        return size


@dataclass
class GenerateArgs(SamplingArgs):
    """``astrai-fabric generate``: sample continuations of prompts from a model or checkpoint directory."""

    prompt: list[str] = field(default_factory=list)
    """Prompt text; repeat the flag for several prompts (all run together by the generation engine)."""
    prompts_file: str | None = None
    """A JSONL file of prompts, one object a line with a ``prompt`` string, after any ``--prompt``; a progress bar
    counts them."""
    output: str | None = None
    """Write the completions to this JSONL file (one line a prompt: ``prompt``, ``completions``,
    ``finish_reasons``) instead of printing them."""
    max_num_seqs: int = 64
    """Completions sampled at once (the engine's running batch; the others wait for a slot)."""
    chat: bool = True
    """Render each prompt as a user message with the chat template (false: continue the raw text)."""
    num_samples: int = 1
    """Continuations per prompt."""

    def validate(self, command: str = "generate") -> None:
        if self.param_path is None or not (self.prompt or self.prompts_file):
            raise ConfigError("generate needs --param_path and at least one --prompt (or --prompts_file)")
        super().validate(command)
        if not 1 <= self.num_samples <= MAX_SAMPLES:
            raise ConfigError(f"{command}: need 1 <= num_samples <= {MAX_SAMPLES}, got {self.num_samples}")
        if self.max_num_seqs < self.num_samples:
            raise ConfigError(
                f"{command}: max_num_seqs {self.max_num_seqs} must hold a prompt's num_samples {self.num_samples}"
            )


@dataclass
class ChatArgs(SamplingArgs):
    """``astrai-fabric chat SRC``: talk with a model, turn by turn with its chat template (or continuing the running
    text), each reply streamed as it is sampled. ``/reset`` clears the conversation, ``/exit`` or the end of input
    (Ctrl-D) leaves; Ctrl-C stops a reply, and at the prompt leaves (exit 130). The KV cache is kept across turns
    while the conversation, rendered again, starts with the tokens it holds. Each line of stdin is one message (at
    most --max_input_bytes); bytes that are not UTF-8 text are read as U+FFFD, said once."""

    template: bool = True
    """Render the conversation with the tokenizer's chat template (false, or a tokenizer without one: plain
    continuation, each input appended on a new line to the running text)."""
    max_input_bytes: int = 1 << 20
    """The longest line chat reads from stdin (one message), in bytes: a longer one is refused with one line and the
    chat goes on. A pipe is read in pieces of this size, so a line never holds more in memory (a terminal's line
    editor holds what was typed)."""

    def validate(self, command: str = "chat") -> None:
        if self.param_path is None:
            raise ConfigError("chat needs a model: astrai-fabric chat SRC (a checkpoint or model directory)")
        super().validate(command)
        if self.max_input_bytes < 1:
            raise ConfigError(f"{command}: need max_input_bytes >= 1, got {self.max_input_bytes}")
