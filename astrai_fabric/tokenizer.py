"""AstrAI's tokenizer contract: ``tokenizer.json`` (Hugging Face ``tokenizers``) plus ``tokenizer_config.json``
holding a ``"special_tokens"`` map (``bos_token``, ``eos_token``, ``pad_token``, ...) and a ``"chat_template"``
Jinja string rendered with ``messages`` and ``add_generation_prompt``.

Departure from AstrAI: the template renders in Jinja's sandbox (a template from a downloaded model cannot reach
Python internals); for ordinary templates the output is identical.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from astrai_fabric.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


class Tokenizer:
    """Encode, decode and chat-template rendering over a ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        directory: Path | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.directory = directory
        missing = sorted(t for t in self.special_tokens.values() if tokenizer.token_to_id(t) is None)
        if missing:
            raise UserError(f"{self._config_path}: special tokens not in the vocabulary: {missing}")

    def __getstate__(self) -> dict[str, Any]:
        # The compiled template does not pickle (a tokenizer is sent to other ranks); it is rebuilt on first use.
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from ``directory``."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise UserError(
                f"{path}: file not found (a tokenizer directory holds tokenizer.json and tokenizer_config.json; "
                "point --tokenizer_path at one)"
            )
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise UserError(f"{path}: not a valid tokenizers file ({err})") from None
        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as err:
                raise UserError(f"{config_path}: not valid JSON ({err})") from None
        return cls(tokenizer, config.get("special_tokens"), config.get("chat_template"), directory)

    @property
    def _config_path(self) -> str:
        return str(self.directory / TOKENIZER_CONFIG_FILE) if self.directory else "tokenizer config"

    @property
    def files(self) -> dict[str, Path]:
        """The files this tokenizer was loaded from, by name (copied into every checkpoint)."""
        if self.directory is None:
            return {}
        names = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
        return {name: self.directory / name for name in names if (self.directory / name).is_file()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def token_id(self, name: str) -> int | None:
        """Id of a named special token (``"bos_token"``, ``"eos_token"``, ``"pad_token"``, ...), or None."""
        token = self.special_tokens.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id("pad_token")

    @property
    def stop_ids(self) -> list[int]:
        """Ids of every named special token (AstrAI stops generation at any of them)."""
        return sorted({self._tokenizer.token_to_id(t) for t in self.special_tokens.values()})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> Any:
        if not self.chat_template:
            raise UserError(f"{self._config_path}: no 'chat_template'; chat data needs one")
        try:
            return ImmutableSandboxedEnvironment().from_string(self.chat_template)
        except TemplateError as err:
            raise UserError(f"{self._config_path}: chat_template is not valid Jinja ({err})") from None

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        """The chat template applied to ``messages`` (text, not ids)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation (AstrAI's default: with the generation prompt)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))
