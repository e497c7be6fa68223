"""Tokenizer directories in two layouts, both ``tokenizer.json`` (Hugging Face ``tokenizers``) plus
``tokenizer_config.json``:

- AstrAI's: a ``"special_tokens"`` map (``bos_token``, ``eos_token``, ``pad_token``, ...) and a ``"chat_template"``
  Jinja string rendered with ``messages`` and ``add_generation_prompt`` under Jinja's defaults (AstrAI's
  ``jinja2.Template``), its ids encoded with the tokenizer's special tokens (AstrAI's ``encode``);
- Hugging Face's (transformers): named special tokens at the top level (strings or AddedToken dicts), an optional
  ``added_tokens_decoder``, the template inline (a string or a list of named templates) or in
  ``chat_template.jinja`` beside it (which wins, as in transformers). Templates render as transformers'
  ``apply_chat_template`` renders them (``utils/chat_template_utils.py``): ``trim_blocks``, ``lstrip_blocks``, loop
  controls, ``{% generation %}`` blocks, its ``tojson`` and ``strftime_now``, the named special tokens, ``tools``
  and ``documents`` as None; ids are encoded without adding special tokens (the template writes them).

Which layout a directory has is told by its keys: ``special_tokens`` is AstrAI's, a top-level named token,
``added_tokens_decoder`` or ``tokenizer_class`` (or a ``chat_template.jinja``) is Hugging Face's; a file with both is
refused. A tokenizer without a pad token pads with its EOS token (else id 0); padding is always masked
(``padding_id``).

Departure from AstrAI: the template renders in Jinja's sandbox (a template from a downloaded model cannot reach
Python internals), bounded in time (``RENDER_SECONDS``), output size and the size of anything it builds, and its
failures (``raise_exception``, undefined names, sandbox violations) are one clear error naming the record; for
ordinary templates the output is identical. Both files are checked when loaded: ``special_tokens`` a map of strings
in the vocabulary, ``chat_template`` a string (or Hugging Face's list of named templates) that compiles.

Over 300 lines for one responsibility: both tokenizer layouts and their sandboxed chat-template rendering;
splitting the layouts apart would split the one rule that tells them apart.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from astrai_fabric.errors import UserError
from astrai_fabric.json_files import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""transformers 5 writes the default template here, beside tokenizer_config.json."""
ASTRAI, HUGGING_FACE = "astrai", "huggingface"
"""The two tokenizer layouts (``Tokenizer.layout``)."""
HF_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers reads from the top level of tokenizer_config.json and passes to templates
(``SPECIAL_TOKENS_ATTRIBUTES``)."""
HF_LAYOUT_KEYS = (*HF_SPECIAL_TOKENS, "added_tokens_decoder", "tokenizer_class")
Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""
RENDER_SECONDS = 5.0
"""Longest one conversation may take to render (ordinary templates take microseconds)."""
MAX_TEMPLATE_NUMBER = 100_000
"""Largest number a template may pass to a function or filter, or repeat a string by (Jinja's own ``range`` cap)."""
MAX_RENDER_CHARS = 1_000_000
"""Longest rendering of a conversation, or 16 characters per input character when that is more."""


class Tokenizer:
    """Encode, decode and chat-template rendering over a ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        directory: Path | None = None,
        layout: str = ASTRAI,
    ) -> None:
        self._tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.directory = directory
        self.layout = layout
        """``"astrai"`` or ``"huggingface"``: how templates render and chat ids are encoded (module docstring)."""
        missing = sorted(t for t in self.special_tokens.values() if tokenizer.token_to_id(t) is None)
        if missing:
            raise UserError(f"{self._config_path}: special tokens not in the vocabulary: {missing}")

    def __getstate__(self) -> dict[str, Any]:
        # The compiled template does not pickle (a tokenizer is sent to other ranks); it is rebuilt on first use.
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    @classmethod
    def from_dir_if_present(cls, directory: Path) -> tuple[Tokenizer | None, str | None]:
        """``directory``'s tokenizer, or None and the reason when it holds no ``tokenizer.json``; one that is there
        but broken is an error (``from_dir``'s)."""
        try:
            return cls.from_dir(directory), None
        except UserError as err:
            if (directory / TOKENIZER_FILE).exists():
                raise  # there, but broken
            return None, str(err)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from ``directory``, in
        AstrAI's or Hugging Face's layout."""
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
            raise UserError(f"{path}: not a valid tokenizers file ({' '.join(str(err).split())[:200]})") from None
        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if config_path.is_file():
            config = read_json_object(config_path, "the tokenizer's config")
        if _layout(config, directory, config_path) == HUGGING_FACE:
            special_tokens, chat_template = _read_hf_config(config, directory, config_path, tokenizer)
            loaded = cls(tokenizer, special_tokens, chat_template, directory, HUGGING_FACE)
        else:
            special_tokens = config.get("special_tokens") or {}
            if not isinstance(special_tokens, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in special_tokens.items()
            ):
                raise UserError(
                    f"{config_path}: 'special_tokens' must map names to token strings, got {special_tokens!r}"
                )
            template = _named_template(config.get("chat_template"), config_path)
            loaded = cls(tokenizer, special_tokens, template, directory)
        if loaded.chat_template:
            _ = loaded._template  # compiled now: a broken template is found when it is read
        return loaded

    @property
    def _config_path(self) -> str:
        return str(self.directory / TOKENIZER_CONFIG_FILE) if self.directory else "tokenizer config"

    @property
    def _template_path(self) -> str:
        """The file the template came from, for its errors."""
        if self.layout == HUGGING_FACE and self.directory and (self.directory / CHAT_TEMPLATE_FILE).is_file():
            return str(self.directory / CHAT_TEMPLATE_FILE)
        return self._config_path

    @property
    def files(self) -> dict[str, Path]:
        """The files this tokenizer was loaded from, by name (copied into every checkpoint)."""
        if self.directory is None:
            return {}
        names = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE) + ((CHAT_TEMPLATE_FILE,) if self.layout == HUGGING_FACE else ())
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
    def padding_id(self) -> int:
        """The id batches are padded with: the pad token, else EOS (many Hugging Face models, Llama's among them,
        have no pad token; TRL's choice), else 0. Padding is always masked out of attention and loss, so the choice
        changes no result; it only keeps a missing pad token from being an error."""
        for token_id in (self.pad_token_id, self.eos_token_id):
            if token_id is not None:
                return token_id
        return 0

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

    def decode_whole_chars(self, ids: list[int]) -> str:
        """``decode`` without special tokens and without a trailing incomplete UTF-8 character: a sample cut off
        inside a multi-byte character would end in U+FFFD. Invalid bytes elsewhere still show as U+FFFD."""
        stream = DecodeStream(skip_special_tokens=True)
        return "".join(piece for i in ids if (piece := stream.step(self._tokenizer, i)) is not None)

    @cached_property
    def _template(self) -> Any:
        if not self.chat_template:
            raise UserError(f"{self._config_path}: no 'chat_template'; chat data needs one")
        try:
            return _BoundedSandbox(self.layout == HUGGING_FACE).from_string(self.chat_template)
        except (TemplateError, RecursionError, MemoryError) as err:
            raise UserError(f"{self._template_path}: chat_template is not valid Jinja ({err})") from None

    def _variables(self, messages: list[Message], add_generation_prompt: bool) -> dict[str, Any]:
        if self.layout == ASTRAI:  # AstrAI's ChatTemplate.render as its Tokenizer calls it
            return {"messages": messages, "add_generation_prompt": add_generation_prompt}
        # transformers' apply_chat_template: the named special tokens, then these (render_jinja_template)
        return {**self.special_tokens, "messages": messages, "tools": None, "documents": None,
                "add_generation_prompt": add_generation_prompt}  # fmt: skip

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = False, where: str = "") -> str:
        """The chat template applied to ``messages`` (text, not ids); ``where`` names the record in errors."""
        max_chars = max(MAX_RENDER_CHARS, 16 * sum(len(str(m.get("content", ""))) for m in messages))
        chunks, num_chars = [], 0
        try:
            with _deadline(RENDER_SECONDS):
                for chunk in self._template.generate(**self._variables(messages, add_generation_prompt)):
                    chunks.append(chunk)
                    num_chars += len(chunk)
                    if num_chars > max_chars:
                        raise SecurityError(f"the output passed {max_chars:,} characters")
        except UserError:
            raise
        except Exception as err:  # the template's own failure: raise_exception, undefined, sandbox, recursion, limits
            record = f" on {where}" if where else ""
            message = " ".join(str(err).split())[:300] or type(err).__name__
            raise UserError(f"{self._template_path}: chat_template failed{record}: {message}") from None
        return "".join(chunks)

    def encode_chat(self, text: str) -> list[int]:
        """Ids of rendered chat text: AstrAI encodes it with the tokenizer's special tokens, transformers without
        (the template writes them)."""
        return self.encode(text, add_special_tokens=self.layout == ASTRAI)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, where: str = ""
    ) -> list[int]:
        """Token ids of the rendered conversation (AstrAI's default: with the generation prompt)."""
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, where))


def _named_template(value: Any, config_path: Path) -> str | None:
    """The template itself: a string, or the ``default`` of Hugging Face's ``[{name, template}, ...]`` list."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise UserError(f"{config_path}: 'chat_template' lists {sorted(named)}, but no 'default' template")
    raise UserError(f"{config_path}: 'chat_template' must be a Jinja string or a list of {{name, template}}")


def _layout(config: dict[str, Any], directory: Path, config_path: Path) -> str:
    hf_keys = [key for key in HF_LAYOUT_KEYS if key in config]
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        hf_keys.append(CHAT_TEMPLATE_FILE)
    if "special_tokens" in config and hf_keys:
        raise UserError(
            f"{config_path}: holds AstrAI's 'special_tokens' map and Hugging Face's {hf_keys[0]!r}; a tokenizer is in "
            "one layout (AstrAI's: special_tokens + chat_template; Hugging Face's: top-level bos_token, eos_token, ...)"
        )
    return HUGGING_FACE if hf_keys else ASTRAI


def _hf_token(value: Any) -> str | None:
    """A special token as transformers writes it: a string, or an AddedToken dict (``{"content": ..., "lstrip":
    ...}``, older files with ``"__type": "AddedToken"``); None when unset."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TypeError


def _read_hf_config(
    config: dict[str, Any], directory: Path, config_path: Path, tokenizer: HFTokenizer
) -> tuple[dict[str, str], str | None]:
    """The named special tokens and the template of a Hugging Face tokenizer_config.json, every field checked."""
    special_tokens = {}
    for name in HF_SPECIAL_TOKENS:
        try:
            token = _hf_token(config.get(name))
        except TypeError:
            raise UserError(
                f'{config_path}: {name!r} must be a token string or an AddedToken {{"content": ...}}, '
                f"got {json.dumps(config[name])[:100]}"
            ) from None
        if token is not None:
            special_tokens[name] = token
    added = config.get("added_tokens_decoder")
    if added is not None:
        if not isinstance(added, dict):
            raise UserError(f"{config_path}: 'added_tokens_decoder' must map ids to AddedTokens, got {added!r:.100}")
        for key, value in added.items():
            try:
                content = _hf_token(value) if isinstance(value, dict) else None
            except TypeError:
                content = None
            if not re.fullmatch(r"[0-9]{1,12}", key) or content is None:
                raise UserError(
                    f"{config_path}: 'added_tokens_decoder' must map ids to AddedTokens {{\"content\": ...}}, got "
                    f"{key!r}: {json.dumps(value)[:100]}"
                )
            # transformers would add a token missing from tokenizer.json; here the two files must agree.
            if tokenizer.token_to_id(content) != int(key):
                raise UserError(
                    f"{config_path}: added_tokens_decoder gives id {key} to {content!r}, but tokenizer.json gives "
                    f"it id {tokenizer.token_to_id(content)}"
                )
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():  # transformers: the file wins over an inline template
        try:
            return special_tokens, jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{jinja_path}: not UTF-8 text ({err})") from None
    return special_tokens, _named_template(config.get("chat_template"), config_path)


class _TemplateLimit(SecurityError):
    """A template tried to build something too large or ran too long."""


def _check_number(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_NUMBER:
        raise _TemplateLimit(f"the number {value} is above the template limit {MAX_TEMPLATE_NUMBER:,}")


def _check_format(text: str) -> None:
    """A %- or {}-format string whose widths would build a huge string."""
    for number in re.findall(r"\d+", text):
        _check_number(int(number))


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body: transformers uses the tag to locate assistant
    tokens (``return_assistant_tokens_mask``), which is not used here; without it such templates would not compile."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes ``<``, ``>``, ``&``, ``'`` for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    _check_format(format)
    return datetime.now().strftime(format)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, also bounding what a template can build: numbers passed to functions and filters,
    repetition (``'x' * n``), powers, format widths; ``raise_exception`` raises (Hugging Face templates call it).

    ``huggingface``: transformers' environment (trim_blocks, lstrip_blocks, loop controls, ``{% generation %}``, its
    ``tojson``, ``strftime_now``, ``cycler`` and ``joiner``); otherwise Jinja's defaults, as AstrAI renders."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def __init__(self, huggingface: bool = False) -> None:
        if huggingface:
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
        else:
            super().__init__()
        names = ("range", "dict", "namespace", *(("cycler", "joiner") if huggingface else ()))
        self.globals = {name: self.globals[name] for name in names} | {"raise_exception": _raise_exception}
        if huggingface:
            self.globals["strftime_now"] = _strftime_now
            self.filters["tojson"] = _tojson
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_number(value)
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for items, count in ((left, right), (right, left)):
                if isinstance(items, str | list | tuple) and isinstance(count, int):
                    if len(items) * count > MAX_RENDER_CHARS:
                        raise _TemplateLimit(f"repeating {len(items)} items {count} times is above the template limit")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise _TemplateLimit("a product of huge numbers")
        elif operator == "**":
            _check_number(right)
            if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 64:
                raise _TemplateLimit(f"the power {left} ** {right} is above the template limit")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if isinstance(getattr(value, "__self__", None), str):
            _check_format(value.__self__)
        return super().wrap_str_format(value)


def _bounded(filter_function: Callable) -> Callable:
    @functools.wraps(filter_function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_number(value)
        return filter_function(*args, **kwargs)

    return checked


def _raise_exception(message: str) -> None:
    raise TemplateError(f"raise_exception: {message}")


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise ``_TemplateLimit`` in the main thread when the block takes longer than ``seconds`` (SIGALRM); elsewhere
    (no signals off the main thread) the other bounds still hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _TemplateLimit(f"rendering took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
