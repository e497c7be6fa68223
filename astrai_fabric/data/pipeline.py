"""AstrAI's ``PipelineConfig`` for ``astrai-fabric prepare`` (single-output form, seq and sft), each key checked,
and one record rendered as tokens and a same-length loss mask (AstrAI's ``astrai/preprocessing`` transforms).

``input.sections`` say which fields become tokens and whether they are trained; ``mask``/``mask_default`` give the
trained roles of chat messages; ``preprocessing`` filters, truncates and packs; ``output`` names domains, shard
size, dtypes and position ids. ``data/dataset_config.py`` reads AstrAI's ``dataset_config.json`` with the same
parts. How records become shards is ``data/prepare.py``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from astrai_fabric.data.storage import ID_KEYS
from astrai_fabric.errors import UserError, brief
from astrai_fabric.json_files import read_json_object
from astrai_fabric.tokenizer import Tokenizer

ACTIONS = ("train", "mask", "$role")


@dataclass
class Section:
    field: str
    action: str
    template: bool = False
    add_special_tokens: bool | None = None


@dataclass
class PipelineConfig:
    """AstrAI's pipeline options that apply to seq and sft output (names and defaults are AstrAI's)."""

    sections: list[Section]
    mask: dict[str, str] = field(default_factory=dict)
    mask_default: str = "mask"
    max_seq_len: int = 2048
    min_chars: int = 50
    max_chars: int = 2_000_000
    max_items: int | None = None
    packing_strategy: str = "simple"
    max_packed_len: int = 8192
    truncation_mode: str = "keep_start"
    append_eos: bool = True
    domain_key: str | None = None
    max_tokens_per_shard: int = 100_000_000
    dtype: dict[str, str] = field(default_factory=dict)
    position_ids_mode: str = "doc_reset"
    tokenizer_path: str | None = None

    def fingerprint(self) -> str:
        """A hash of every option (``--resume`` continues only the run of the same pipeline)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    @property
    def is_text(self) -> bool:
        """No chat template and every section trained: plain documents, no loss mask (AstrAI's "text config")."""
        return not any(s.template for s in self.sections) and all(s.action == "train" for s in self.sections)

    @classmethod
    def from_file(cls, path: Path) -> PipelineConfig:
        return cls.from_dict(read_json_object(path, "the pipeline config -c names"), str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> PipelineConfig:
        check_keys(raw, GROUPS, source, "")
        if "sources" in raw.get("input", {}):
            raise UserError(f"{source}: input.sources (dpo/grpo outputs) is not supported; those train from JSONL")
        check_keys(raw.get("input", {}), {"sections"}, source, "input.")
        sections = parse_sections(raw.get("input", {}).get("sections"), source, "input.sections")
        return cls.with_options(raw, sections, source)

    @classmethod
    def with_options(cls, raw: dict[str, Any], sections: list[Section], source: str) -> PipelineConfig:
        """``sections`` with the options of ``raw`` (every group but ``input``), each checked."""
        options: dict[str, Any] = {"sections": sections}
        for group, names in (
            (
                "preprocessing",
                {
                    "max_seq_len",
                    "min_chars",
                    "max_chars",
                    "max_items",
                    "batch_size",
                    "packing_strategy",
                    "max_packed_len",
                    "truncation_mode",
                    "append_eos",
                },
            ),
            ("output", {"domain_key", "storage_format", "max_tokens_per_shard", "dtype", "position_ids_mode"}),
        ):
            values = raw.get(group, {})
            check_keys(values, names, source, f"{group}.")
            options.update({k: v for k, v in values.items() if k not in ("batch_size", "storage_format")})
        for key in ("mask", "mask_default", "tokenizer_path"):
            if key in raw:
                options[key] = raw[key]
        _check_types(options, source)
        config = cls(**options)
        problems = []
        if config.packing_strategy not in ("simple", "bfd", "bfd_split"):
            problems.append(f"preprocessing.packing_strategy {brief(config.packing_strategy)} (simple, bfd, bfd_split)")
        if config.truncation_mode not in ("keep_start", "keep_end"):
            problems.append(f"preprocessing.truncation_mode {brief(config.truncation_mode)} (keep_start, keep_end)")
        if config.position_ids_mode not in ("doc_reset", "continuous", "none"):
            problems.append(f"output.position_ids_mode {brief(config.position_ids_mode)} (doc_reset, continuous, none)")
        if raw.get("output", {}).get("storage_format", "bin") != "bin":
            problems.append("output.storage_format must be bin")
        if problems:
            raise UserError(f"{source}: unsupported values: " + "; ".join(problems))
        return config


GROUPS = {"version", "input", "mask", "mask_default", "preprocessing", "output", "tokenizer_path"}
"""The top-level keys of AstrAI's ``PipelineConfig``."""


def parse_sections(sections: Any, source: str, where: str, actions: tuple[str, ...] = ACTIONS) -> list[Section]:
    """AstrAI's section list ``[{field, action, template, add_special_tokens}, ...]``, each key checked."""
    if not isinstance(sections, list) or not sections:
        raise UserError(f"{source}: {where} must be a non-empty list of sections")
    parsed = []
    for i, section in enumerate(sections):
        check_keys(section, {"field", "action", "template", "add_special_tokens"}, source, f"{where}[{i}].")
        if not isinstance(section.get("field"), str) or section.get("action") not in actions:
            raise UserError(f"{source}: {where}[{i}] needs a 'field' and an 'action' in {list(actions)}")
        if not isinstance(section.get("template", False), bool) or not isinstance(
            section.get("add_special_tokens", False), bool
        ):
            raise UserError(f"{source}: {where}[{i}]: 'template' and 'add_special_tokens' must be true or false")
        parsed.append(Section(**section))
    return parsed


_INTS = {"max_seq_len": 1, "min_chars": 0, "max_chars": 0, "max_items": 0, "max_packed_len": 1,
         "max_tokens_per_shard": 1}  # fmt: skip
"""Integer options and their least value."""


def _check_types(options: dict[str, Any], source: str) -> None:
    """Each option's JSON type (the values are then used as they are)."""
    for key, least in _INTS.items():
        value = options.get(key, least)
        if (key != "max_items" or value is not None) and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            raise UserError(f"{source}: {key} must be an integer >= {least}, got {brief(value)}")
    strings = {"packing_strategy", "truncation_mode", "position_ids_mode", "mask_default"}
    for key in strings | {"domain_key", "tokenizer_path"}:
        value = options.get(key, "")
        if not isinstance(value, str) and not (value is None and key not in strings):
            raise UserError(f"{source}: {key} must be a string, got {brief(value)}")
    if not isinstance(options.get("append_eos", True), bool):
        raise UserError(f"{source}: append_eos must be true or false, got {brief(options['append_eos'])}")
    mask = options.get("mask", {})
    if not isinstance(mask, dict) or not all(isinstance(k, str) and v in ("train", "mask") for k, v in mask.items()):
        raise UserError(f'{source}: mask must map roles to "train" or "mask", got {brief(mask)}')
    if options.get("mask_default", "mask") not in ("train", "mask"):
        raise UserError(f'{source}: mask_default must be "train" or "mask", got {brief(options["mask_default"])}')
    dtype = options.get("dtype", {})
    if not isinstance(dtype, dict) or not all(isinstance(v, str) for v in dtype.values()):
        raise UserError(f"{source}: output.dtype must map keys to dtype names, got {brief(dtype)}")
    for key, name in dtype.items():  # the kinds the shard reader accepts (data/storage.py), found before writing
        kinds = "iu" if key in ID_KEYS else "biuf"
        try:
            valid = np.dtype(name).kind in kinds and np.dtype(name).fields is None
        except TypeError:
            valid = False
        if not valid:
            expected = "an integer dtype" if kinds == "iu" else "a bool, integer or float dtype"
            raise UserError(f"{source}: output.dtype.{key} must be {expected} (int32, int64, ...), got {brief(name)}")


def check_keys(values: Any, allowed: set[str], source: str, prefix: str) -> None:
    if not isinstance(values, dict):
        raise UserError(f"{source}: {prefix.rstrip('.') or 'the file'} must be a JSON object")
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise UserError(f"{source}: unknown key(s) {', '.join(prefix + k for k in unknown)}")


@dataclass
class Document:
    ids: list[int]
    mask: list[int]
    domain: str


def tokenize_record(
    record: dict[str, Any], config: PipelineConfig, tokenizer: Tokenizer, where: str = ""
) -> Document | str:
    """One record as tokens and a same-length mask (1 = trained), or the reason it is dropped; ``where`` names the
    record in a chat template's error."""
    ids: list[int] = []
    mask: list[int] = []
    if any(s.template for s in config.sections) and tokenizer.bos_token_id is not None:
        ids, mask = [tokenizer.bos_token_id], [0]
    text_length, first = 0, True
    for section in config.sections:
        value = record.get(section.field)
        if section.template:
            if not isinstance(value, list) or not value:
                continue
            for message in value:
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    return f"field {section.field!r}: a message without a role (a string)"
                action = (
                    config.mask.get(message["role"], config.mask_default)
                    if section.action == "$role"
                    else section.action
                )
                encoded = tokenizer.encode(tokenizer.render_chat([message], where=where), add_special_tokens=False)
                ids += encoded
                mask += [int(action == "train")] * len(encoded)
        else:
            if value is None or not str(value).strip():
                continue
            text = str(value)
            text_length += len(text)
            add_special = section.add_special_tokens if section.add_special_tokens is not None else first
            encoded = tokenizer.encode(text, add_special_tokens=add_special)
            ids += encoded
            mask += [int(section.action == "train")] * len(encoded)
        first = False
    if config.is_text:
        if text_length < config.min_chars:
            return "shorter than min_chars"
        if text_length > config.max_chars:
            return "longer than max_chars"
        if config.append_eos and tokenizer.eos_token_id is not None and ids:
            ids, mask = ids + [tokenizer.eos_token_id], mask + [1]
    if len(ids) > config.max_seq_len:
        keep = (
            slice(None, config.max_seq_len)
            if config.truncation_mode == "keep_start"
            else slice(-config.max_seq_len, None)
        )
        ids, mask = ids[keep], mask[keep]
    if not ids or (ids == [tokenizer.bos_token_id] and mask == [0]):
        return "no tokens"
    if not config.is_text and not any(mask):
        return "no trained token"
    domain = record.get(config.domain_key) if config.domain_key else None
    return Document(ids, mask, domain if isinstance(domain, str) and domain else "__default__")
