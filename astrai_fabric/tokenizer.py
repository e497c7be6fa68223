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

Departure from AstrAI: every template read from a file renders through ``render_template`` alone (training,
generate, prepare and its workers, the dry run, export's probe), in Jinja's sandbox (a template from a downloaded
model cannot reach Python internals), bounded in any thread: a meter charged by the sandbox's hooks and by the code
the template compiles to (each loop item, call, filter, operator, join and literal) holds the deadline
(``RENDER_SECONDS``; SIGALRM too on the main thread), the size of each value and of all it builds, and the depth of
macro calls. Its failures (``raise_exception``, undefined names, sandbox violations, a bound) are one clear
error naming the file and the record; for ordinary templates the output is identical. Both files are checked when
loaded, every field of ``tokenizer_config.json`` for its kind first (``_FIELD_KINDS``): ``special_tokens`` a map of
strings in the vocabulary, ``chat_template`` a string (or Hugging Face's list of named templates) that compiles.

Over 300 lines for one responsibility: both tokenizer layouts and their sandboxed chat-template rendering;
splitting the layouts apart would split the one rule that tells them apart.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, ValuesView
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import cached_property
from itertools import chain
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from astrai_fabric.errors import UserError
from astrai_fabric.json_files import MAX_JSON_BYTES, read_json_object
from astrai_fabric.regular_files import read_regular_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""transformers 5 writes the default template here, beside tokenizer_config.json."""
MAX_TOKENIZER_BYTES = 1 << 30
"""A tokenizer.json is megabytes (Gemma 3's 262k-token vocabulary: 33 MB); a file past this is not one."""
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
"""Longest rendering of a template outside a conversation (export's probe); also the largest value (characters and
items) such a render may build or print."""
CHAT_RENDER_CHARS = 65_536
"""What a chat template may add to a conversation (role headers, a default system prompt): a conversation renders
to at most this plus 16 characters per character of its messages, the bound on its values too. Relative to the
input, so a template cannot make every record a megabyte and a dataset's work unbounded."""
BUILT_CHARS_PER_OUTPUT_CHAR = 64
"""Characters one render may build in all (results of calls, filters, operators, joins), per character of output."""
MAX_CALL_DEPTH = 100
"""Deepest nesting of macro, ``caller()`` and recursive ``loop()`` calls: Python's own recursion limit would come later,
after more stack than a worker thread may have."""
"""Characters one render may build in all (results of calls, filters, operators, joins), per character of output."""


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
            if os.path.lexists(directory / TOKENIZER_FILE):
                raise  # there, but broken (a FIFO, a link to nothing among them)
            return None, str(err)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from ``directory``, in
        AstrAI's or Hugging Face's layout."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not os.path.lexists(path):
            raise UserError(
                f"{path}: file not found (a tokenizer directory holds tokenizer.json and tokenizer_config.json; "
                "point --tokenizer_path at one)"
            )
        data = read_regular_file(path, max_bytes=MAX_TOKENIZER_BYTES, what="a tokenizers file")
        try:
            tokenizer = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception for malformed files
            raise UserError(f"{path}: not a valid tokenizers file ({' '.join(str(err).split())[:200]})") from None
        config: dict[str, Any] = {}
        config_path = directory / TOKENIZER_CONFIG_FILE
        if os.path.lexists(config_path):  # optional, but one there that is no file is refused by name
            config = read_json_object(config_path, "the tokenizer's config")
        if _checked_config(config, directory, config_path) == HUGGING_FACE:
            special_tokens, chat_template = _read_hf_config(config, directory, config_path, tokenizer)
            loaded = cls(tokenizer, special_tokens, chat_template, directory, HUGGING_FACE)
        else:
            template = _named_template(config.get("chat_template"), config_path)
            loaded = cls(tokenizer, config.get("special_tokens") or {}, template, directory)
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

    def contents(self) -> dict[str, bytes]:
        """The bytes of ``files``, by name: two tokenizers with equal contents tokenise alike."""
        return {
            name: read_regular_file(path, max_bytes=MAX_TOKENIZER_BYTES, what=name) for name, path in self.files.items()
        }

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def vocab(self) -> dict[str, int]:
        """Every token string and its id, added tokens included."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

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
        step = self.decode_stream()
        return "".join(step(i) for i in ids)

    def decode_stream(self) -> Callable[[int], str]:
        """A decoder of ids given one at a time: each call returns the text its id completes (``""`` while a UTF-8
        character is unfinished, or for a special token), so the pieces join into ``decode_whole_chars``."""
        stream = DecodeStream(skip_special_tokens=True)
        return lambda token_id: stream.step(self._tokenizer, token_id) or ""

    @cached_property
    def _template(self) -> Template:
        if not self.chat_template:
            raise UserError(f"{self._config_path}: no 'chat_template'; chat data needs one")
        return compile_template(self.chat_template, self._template_path, self.layout == HUGGING_FACE)

    def _variables(self, messages: list[Message], add_generation_prompt: bool) -> dict[str, Any]:
        if self.layout == ASTRAI:  # AstrAI's ChatTemplate.render as its Tokenizer calls it
            return {"messages": messages, "add_generation_prompt": add_generation_prompt}
        # transformers' apply_chat_template: the named special tokens, then these (render_jinja_template)
        return {
            **self.special_tokens,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = False, where: str = "") -> str:
        """The chat template applied to ``messages`` (text, not ids); ``where`` names the record in errors."""
        max_chars = CHAT_RENDER_CHARS + 16 * sum(len(str(m.get("content", ""))) for m in messages)
        variables = self._variables(messages, add_generation_prompt)
        return render_template(self._template, variables, self._template_path, where, max_chars)

    def encode_chat(self, text: str) -> list[int]:
        """Ids of rendered chat text: AstrAI encodes it with the tokenizer's special tokens, transformers without
        (the template writes them)."""
        return self.encode(text, add_special_tokens=self.layout == ASTRAI)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, where: str = ""
    ) -> list[int]:
        """Token ids of the rendered conversation (AstrAI's default: with the generation prompt)."""
        return self.encode_chat(self.render_chat(messages, add_generation_prompt, where))


def _is_token(value: Any) -> bool:
    """A special token as transformers writes it: a string, or an AddedToken dict (``{"content": ..., "lstrip":
    ...}``, older files with ``"__type": "AddedToken"``)."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _token_content(value: Any) -> str | None:
    return value["content"] if isinstance(value, dict) else value


_ADDED_TOKEN = 'an AddedToken {"content": ...}'
_FIELD_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "special_tokens": ("map names to token strings",
                       lambda v: isinstance(v, dict) and all(isinstance(t, str) for t in v.values())),
    "chat_template": ("be a Jinja string or a list of {name, template}",
                      lambda v: isinstance(v, str) or isinstance(v, list) and all(
                          isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                          for t in v)),
    **{name: (f"be a token string or {_ADDED_TOKEN}", _is_token) for name in HF_SPECIAL_TOKENS},
    "added_tokens_decoder": ('map ids to AddedTokens {"content": ...}',
                             lambda v: isinstance(v, dict) and all(
                                 re.fullmatch(r"[0-9]{1,12}", k) and isinstance(t, dict) and _is_token(t)
                                 for k, t in v.items())),
    "additional_special_tokens": ("be a list of token strings or AddedTokens",
                                  lambda v: isinstance(v, list) and all(_is_token(t) for t in v)),
    "tokenizer_class": ("be a class name (a string)", lambda v: isinstance(v, str)),
    "model_max_length": ("be a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
}  # fmt: skip
"""Every field of tokenizer_config.json read here or by transformers from the exported copy, with the kind it must
have (null is unset); each is checked before it is used as a key, compared or hashed."""


def _checked_config(config: dict[str, Any], directory: Path, config_path: Path) -> str:
    """``tokenizer_config.json``'s layout, once every field of ``_FIELD_KINDS`` has its kind: the one check of the
    file's values, before any is used."""
    for name, (kind, is_kind) in _FIELD_KINDS.items():
        value = config.get(name)
        if value is not None and not is_kind(value):
            raise UserError(f"{config_path}: {name!r} must {kind}, got {json.dumps(value)[:100]}")
    hf_keys = [key for key in HF_LAYOUT_KEYS if key in config]
    if os.path.lexists(directory / CHAT_TEMPLATE_FILE):
        hf_keys.append(CHAT_TEMPLATE_FILE)
    if "special_tokens" in config and hf_keys:
        raise UserError(
            f"{config_path}: holds AstrAI's 'special_tokens' map and Hugging Face's {hf_keys[0]!r}; a tokenizer is in "
            "one layout (AstrAI's: special_tokens + chat_template; Hugging Face's: top-level bos_token, eos_token, ...)"
        )
    return HUGGING_FACE if hf_keys else ASTRAI


def _named_template(value: str | list[dict[str, str]] | None, config_path: Path) -> str | None:
    """The template itself (kind checked): a string, or the ``default`` of Hugging Face's ``[{name, template}]``."""
    if value is None or isinstance(value, str):
        return value
    named = {t["name"]: t["template"] for t in value}
    if "default" in named:
        return named["default"]
    raise UserError(f"{config_path}: 'chat_template' lists {sorted(named)}, but no 'default' template")


def _read_hf_config(
    config: dict[str, Any], directory: Path, config_path: Path, tokenizer: HFTokenizer
) -> tuple[dict[str, str], str | None]:
    """The named special tokens and the template of a Hugging Face tokenizer_config.json (kinds checked)."""
    special_tokens = {name: _token_content(config[name]) for name in HF_SPECIAL_TOKENS if config.get(name) is not None}
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        # transformers would add a token missing from tokenizer.json; here the two files must agree.
        if tokenizer.token_to_id(value["content"]) != int(key):
            raise UserError(
                f"{config_path}: added_tokens_decoder gives id {key} to {value['content']!r}, but tokenizer.json gives "
                f"it id {tokenizer.token_to_id(value['content'])}"
            )
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if os.path.lexists(jinja_path):  # transformers: the file wins over an inline template
        source = read_regular_file(jinja_path, max_bytes=MAX_JSON_BYTES, what="a chat template")
        try:
            return special_tokens, source.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{jinja_path}: not UTF-8 text ({err})") from None
    return special_tokens, _named_template(config.get("chat_template"), config_path)


class TemplateLimitError(UserError):
    """A template ran past a bound of the renderer (time, size, recursion): refused wherever it is rendered."""


def compile_template(source: str, path: str | Path, huggingface: bool) -> Template:
    """``source`` compiled in the bounded sandbox, as transformers' ``apply_chat_template`` (``huggingface``) or
    AstrAI (Jinja's defaults) renders it; invalid Jinja is one error naming ``path``."""
    try:
        return _BoundedSandbox(huggingface).from_string(source)
    except (TemplateError, RecursionError, MemoryError) as err:
        raise UserError(f"{path}: chat_template is not valid Jinja ({err})") from None


def render_template(
    template: Template, variables: dict[str, Any], path: str | Path, where: str = "", max_chars: int = MAX_RENDER_CHARS
) -> str:
    """The one render of a template read from a file (training, generate, prepare and its workers, export's probe,
    the dry run), bounded in any thread: ``RENDER_SECONDS``, ``max_chars`` of output and of any value it builds,
    ``BUILT_CHARS_PER_OUTPUT_CHAR`` times that in all, ``MAX_CALL_DEPTH``. Its failures, the template's own or
    a bound's (``TemplateLimitError``), are one error naming ``path`` and the record (``where``)."""
    meter = _Meter(RENDER_SECONDS, max_chars)
    token = _METER.set(meter)
    chunks, num_chars = [], 0
    try:
        with _alarm(RENDER_SECONDS):
            for chunk in template.generate(**variables):
                chunks.append(chunk)
                num_chars += len(chunk)
                if num_chars > max_chars:
                    raise _TemplateLimit(f"the output passed {max_chars:,} characters")
    except Exception as err:  # the template's own failure: raise_exception, undefined, sandbox; or a bound
        record = f" on {where}" if where else ""
        message = " ".join(str(err).split())[:300] or type(err).__name__
        error = TemplateLimitError if isinstance(err, _TemplateLimit | RecursionError | MemoryError) else UserError
        raise error(f"{path}: chat_template failed{record}: {message}") from None
    finally:
        _METER.reset(token)
    return "".join(chunks)


class _TemplateLimit(SecurityError):
    """A template tried to build something too large or ran too long."""


class _Meter:
    """What one render may still spend, charged by the sandbox's hooks (every call, filter, test, operator, loop
    item, join and literal): time, checked at each; the size of every value made or passed on; the characters made
    in all."""

    def __init__(self, seconds: float, max_chars: int) -> None:
        self.seconds, self.max_chars = seconds, max_chars
        self.deadline = time.monotonic() + seconds
        self.budget_chars = BUILT_CHARS_PER_OUTPUT_CHAR * max_chars
        self.depth = 0
        """Calls in progress (``_BoundedSandbox.call``)."""
        self._weights: dict[int, tuple[Any, int]] = {}
        """``id(value): (value, weight)``, the value held so that its id is not reused within the render."""

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"rendering took longer than {self.seconds:g} s")

    def weigh(self, value: Any) -> int:
        """``value``'s characters and items through nested lists, tuples, dicts and namespaces, each reference
        counted again (what printing it writes), refused past ``max_chars``; each container is weighed once."""
        weight = self._weight(value)
        if weight > self.max_chars:
            raise _TemplateLimit(f"a value of over {self.max_chars:,} characters or items is above the template limit")
        return weight

    def built(self, value: Any) -> Any:
        self.budget_chars -= self.weigh(value)
        if self.budget_chars < 0:
            total = BUILT_CHARS_PER_OUTPUT_CHAR * self.max_chars
            raise _TemplateLimit(f"building over {total:,} characters in one render is above the template limit")
        return value

    def _weight(self, value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, Namespace):  # mutable: weighed every time
            return self._sum(chain.from_iterable(value._Namespace__attrs.items()))
        if not isinstance(value, list | tuple | dict | set | frozenset | KeysView | ValuesView | ItemsView):
            return 1
        if id(value) not in self._weights:
            weight = self._sum(chain.from_iterable(value.items()) if isinstance(value, dict) else value)
            if isinstance(value, list | tuple | dict):  # the sandbox cannot change them; views are made anew
                self._weights[id(value)] = (value, weight)
            return weight
        return self._weights[id(value)][1]

    def _sum(self, items: Iterable[Any]) -> int:
        total = 0
        for item in items:
            total += 1 + self._weight(item)
            if total > self.max_chars:
                break
        return total


_METER: ContextVar[_Meter | None] = ContextVar("template_meter", default=None)
"""The render in progress in this thread (``render_template``); none while a template compiles."""


def _meter() -> _Meter:
    """The render's meter; at compile time (constants folded) one without a deadline."""
    return _METER.get() or _Meter(math.inf, MAX_RENDER_CHARS)


def _check_number(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_NUMBER:
        raise _TemplateLimit(f"the number {value} is above the template limit {MAX_TEMPLATE_NUMBER:,}")


def _check_arguments(meter: _Meter, values: Iterable[Any]) -> None:
    for value in values:
        _check_number(value)
        meter.weigh(value)


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
    """Jinja's immutable sandbox, also bounding what a template can build and how long it runs (``_Meter``, charged
    by these hooks and by the code ``_MeteredCode`` compiles): numbers passed to functions and filters, repetition
    (``'x' * n``), powers, format widths, the size of every value made or printed; ``raise_exception`` raises
    (Hugging Face templates call it).

    ``huggingface``: transformers' environment (trim_blocks, lstrip_blocks, loop controls, ``{% generation %}``, its
    ``tojson``, ``strftime_now``, ``cycler`` and ``joiner``); otherwise Jinja's defaults, as AstrAI renders."""

    intercepted_binops = frozenset(["*", "**", "%", "+"])

    def __init__(self, huggingface: bool = False) -> None:
        if huggingface:
            super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
        else:
            super().__init__()
        self.code_generator_class = _MeteredCode
        names = ("range", "dict", "namespace", *(("cycler", "joiner") if huggingface else ()))
        self.globals = {name: self.globals[name] for name in names} | {"raise_exception": _raise_exception}
        if huggingface:
            self.globals["strftime_now"] = _strftime_now
            self.filters["tojson"] = _tojson
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.tests = {name: _bounded(f) for name, f in self.tests.items()}

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.step()
        if isinstance(__obj, LoopContext) and args:  # loop(items) of a recursive loop: its items charged too
            args = (self.metered(args[0]), *args[1:])
        _check_arguments(meter, (*args, *kwargs.values()))
        if meter.depth >= MAX_CALL_DEPTH:
            raise _TemplateLimit(f"maximum recursion depth exceeded: calls nested {MAX_CALL_DEPTH} deep")
        meter.depth += 1
        try:
            return meter.built(super().call(__context, __obj, *args, **kwargs))
        finally:
            meter.depth -= 1

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.step()
        if operator == "*":
            for items, count in ((left, right), (right, left)):
                if isinstance(items, str | list | tuple) and isinstance(count, int):
                    if meter.weigh(items) * count > meter.max_chars:
                        raise _TemplateLimit(f"repeating {len(items)} items {count} times is above the template limit")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
                raise _TemplateLimit("a product of huge numbers")
        elif operator == "**":
            _check_number(right)
            if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 64:
                raise _TemplateLimit(f"the power {left} ** {right} is above the template limit")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            meter.weigh(right)
        return meter.built(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if isinstance(getattr(value, "__self__", None), str):
            _check_format(value.__self__)
        return super().wrap_str_format(value)

    def metered(self, items: Any) -> _Metered:
        """A loop's items (``_MeteredCode``); ``call`` has weighed them."""
        return _Metered(items, _meter())

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """Joins what a macro, a block ``set``, ``{% filter %}`` or a recursive loop wrote, weighed first."""
        parts = list(parts)
        _meter().built(parts)
        return "".join(parts)

    def concatenated(self, parts: tuple[Any, ...]) -> tuple[Any, ...]:
        """The parts of ``a ~ b``, weighed before they are turned into text and joined."""
        return _meter().built(parts)

    def made(self, value: list | tuple | dict) -> list | tuple | dict:
        """A list, tuple or dict written in the template, weighed (``_MeteredCode``)."""
        return _meter().built(value)


class _Metered:
    """A ``{% for %}``'s items, each charged to the render's meter (Jinja compiles the loop to a Python ``for``,
    which no hook sees); sized as the items are, for ``loop.length``."""

    __slots__ = ("items", "meter")

    def __init__(self, items: Any, meter: _Meter) -> None:
        self.items, self.meter = items, meter

    def __len__(self) -> int:
        return len(self.items)  # TypeError when unsized: LoopContext then lists the items

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            self.meter.step()
            yield item


class _MeteredCode(CodeGenerator):
    """The Python a template compiles to, with what no sandbox hook sees routed through one: every ``{% for %}``'s
    items (``_BoundedSandbox.metered``), the parts of ``a ~ b`` (``concatenated``) and every list, tuple and dict
    written in the template (``made``: nested literals would double a structure per loop, and comparing, hashing or
    printing it is work in C that no deadline interrupts)."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        items = nodes.Call(nodes.EnvironmentAttribute("metered"), [node.iter], [], None, None, lineno=node.lineno)
        metered = nodes.For(node.target, items, node.body, node.else_, node.test, node.recursive, lineno=node.lineno)
        super().visit_For(metered.set_environment(self.environment), frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:  # as Jinja's own visit_Concat chooses
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"{join}(environment.concatenated((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write(")))")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment's target: `{% for key, value in ... %}`
            return super().visit_Tuple(node, frame)
        self.write("environment.made(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.made(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.made(")
        super().visit_Dict(node, frame)
        self.write(")")


def _bounded(filter_function: Callable) -> Callable:
    @functools.wraps(filter_function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.step()
        _check_arguments(meter, (*args, *kwargs.values()))
        return meter.built(filter_function(*args, **kwargs))

    return checked


def _raise_exception(message: str) -> None:
    raise TemplateError(f"raise_exception: {message}")


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """On the main thread, also raise ``_TemplateLimit`` when the block takes longer than ``seconds`` (SIGALRM): a
    backstop to the meter's deadline, which holds in every thread."""
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
