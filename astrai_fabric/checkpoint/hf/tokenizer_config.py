"""A Hugging Face model directory's tokenizer and generation files written from AstrAI's: the special token ids
transformers' ``generate`` stops and pads with, and a ``tokenizer_config.json`` under which transformers' fast
tokenizer over the same ``tokenizer.json`` encodes the same ids and renders the same chat template."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

from astrai_fabric.errors import UserError


def generation_config(token_ids: Mapping[str, int | None]) -> dict[str, Any]:
    """``generation_config.json``: the special token ids transformers' ``generate`` stops and pads with."""
    return {
        name: token_ids[name]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id")
        if token_ids.get(name) is not None
    }


_HF_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def hf_tokenizer_config(raw: Mapping[str, Any], max_length: int, path: str = "tokenizer_config.json") -> dict[str, Any]:
    """A Hugging Face ``tokenizer_config.json`` for AstrAI's (``special_tokens`` map, ``chat_template``), read from
    ``path``: transformers' fast tokenizer over the same ``tokenizer.json`` encodes the same ids.

    The chat template is rewritten so that transformers, which renders with ``trim_blocks`` and ``lstrip_blocks``,
    renders what AstrAI renders with Jinja's defaults (``for_jinja_whitespace_defaults``); one it cannot keep equal is
    left out with a warning rather than written to render other tokens."""
    special = dict(raw.get("special_tokens") or {})
    written: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    written.update({name: special[name] for name in _HF_SPECIAL_NAMES if name in special})
    others = [token for name, token in special.items() if name not in _HF_SPECIAL_NAMES]
    if others:
        written["additional_special_tokens"] = others
    template = raw.get("chat_template")
    if isinstance(template, str):
        rewritten = for_jinja_whitespace_defaults(template, path)
        if rewritten is None:
            warnings.warn(
                f"{path}: the chat template renders differently under transformers' "
                "trim_blocks/lstrip_blocks and is not exported",
                stacklevel=2,
            )
        else:
            written["chat_template"] = rewritten
    return written


_BLOCK_START = re.compile(r"\{([%#])(?![-+])")
_BLOCK_END = re.compile(r"(?<![-+])([%#])\}")


def for_jinja_whitespace_defaults(template: str, path: str = "tokenizer_config.json") -> str | None:
    """``template`` with every block and comment tag marked ``{%+ ... +%}``, which turns ``lstrip_blocks`` and
    ``trim_blocks`` off for that tag (Jinja's whitespace control), so it renders under transformers' settings as
    under Jinja's defaults; checked by rendering a probe conversation both ways, with the renderer training uses
    (bounded: a template past its bounds is refused, naming ``path``). None when they still differ."""
    # Here, not at the top: jinja2 adds 0.06-0.19 s (measured) to every `import astrai_fabric.checkpoint`, and only
    # exporting a chat template needs it.
    from astrai_fabric.tokenizer import TemplateLimitError, compile_template, render_template

    rewritten = _BLOCK_END.sub(r"+\1}", _BLOCK_START.sub(r"{\1+", template))
    probe = {
        "messages": [
            {"role": "system", "content": " s\n"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a "},
        ],
        "add_generation_prompt": True,
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    try:
        plain = render_template(compile_template(template, path, huggingface=False), probe, path)
        as_hf = render_template(compile_template(rewritten, path, huggingface=True), probe, path)  # transformers'
    except TemplateLimitError:
        raise
    except UserError:  # a template that needs more than the probe offers: not provably equal
        return None
    return rewritten if plain == as_hf else None
