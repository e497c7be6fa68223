"""``astrai-fabric prepare``: JSONL records to AstrAI's offline bin shards for seq and sft (AstrAI's
``astrai/preprocessing``).

    astrai-fabric prepare INPUT.jsonl... -o DIR -c pipeline.json [--tokenizer_path DIR]

The pipeline file is AstrAI's ``PipelineConfig`` (single-output form): ``input.sections`` say which fields become
tokens and whether they are trained; ``mask``/``mask_default`` give the trained roles of chat messages;
``preprocessing`` filters, truncates and packs; ``output`` names domains, shard size, dtypes and position ids. The
output is ``DIR/<domain>/shard_NNNN/{meta.json, <key>.bin}``: flat arrays with AstrAI's ``meta.json``
(``{key: {"shape", "dtype"}}``), which AstrAI's ``MmapStore`` and this package's datasets read.

Departures from AstrAI's pipeline: every record keeps a loss mask of its own length, so masks stay aligned in any
mix of masked and unmasked records (AstrAI pads or shortens them, B9); ``loss_mask`` defaults to bool (AstrAI:
int32); text documents end with the EOS token unless ``preprocessing.append_eos`` is false (AstrAI adds none);
``input.sources`` (dpo/grpo) is refused: those train from JSONL directly (AstrAI's bin output for them holds no
record offsets and is not trainable either, and truncates float rewards to int32, B16).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from astrai_fabric.data.storage import read_jsonl
from astrai_fabric.errors import UserError
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

    @property
    def is_text(self) -> bool:
        """No chat template and every section trained: plain documents, no loss mask (AstrAI's "text config")."""
        return not any(s.template for s in self.sections) and all(s.action == "train" for s in self.sections)

    @classmethod
    def from_file(cls, path: Path) -> PipelineConfig:
        return cls.from_dict(read_json_object(path, "-c "), str(path))

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
            ("preprocessing", {"max_seq_len", "min_chars", "max_chars", "max_items", "batch_size", "packing_strategy",
                               "max_packed_len", "truncation_mode", "append_eos"}),
            ("output", {"domain_key", "storage_format", "max_tokens_per_shard", "dtype", "position_ids_mode"}),
        ):  # fmt: skip
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
            problems.append(f"preprocessing.packing_strategy {config.packing_strategy!r} (simple, bfd, bfd_split)")
        if config.truncation_mode not in ("keep_start", "keep_end"):
            problems.append(f"preprocessing.truncation_mode {config.truncation_mode!r} (keep_start, keep_end)")
        if config.position_ids_mode not in ("doc_reset", "continuous", "none"):
            problems.append(f"output.position_ids_mode {config.position_ids_mode!r} (doc_reset, continuous, none)")
        if raw.get("output", {}).get("storage_format", "bin") != "bin":
            problems.append("output.storage_format must be bin")
        if problems:
            raise UserError(f"{source}: unsupported values: " + "; ".join(problems))
        return config


GROUPS = {"version", "input", "mask", "mask_default", "preprocessing", "output", "tokenizer_path"}
"""The top-level keys of AstrAI's ``PipelineConfig``."""


def read_json_object(path: Path, what: str = "") -> dict[str, Any]:
    """A JSON object from ``path``; ``what`` prefixes the path in the not-found message."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{what}{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


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
            raise UserError(f"{source}: {key} must be an integer >= {least}, got {value!r}")
    strings = {"packing_strategy", "truncation_mode", "position_ids_mode", "mask_default"}
    for key in strings | {"domain_key", "tokenizer_path"}:
        value = options.get(key, "")
        if not isinstance(value, str) and not (value is None and key not in strings):
            raise UserError(f"{source}: {key} must be a string, got {value!r}")
    if not isinstance(options.get("append_eos", True), bool):
        raise UserError(f"{source}: append_eos must be true or false, got {options['append_eos']!r}")
    mask = options.get("mask", {})
    if not isinstance(mask, dict) or not all(isinstance(k, str) and v in ("train", "mask") for k, v in mask.items()):
        raise UserError(f'{source}: mask must map roles to "train" or "mask", got {mask!r}')
    if options.get("mask_default", "mask") not in ("train", "mask"):
        raise UserError(f'{source}: mask_default must be "train" or "mask", got {options["mask_default"]!r}')
    dtype = options.get("dtype", {})
    if not isinstance(dtype, dict) or not all(isinstance(v, str) for v in dtype.values()):
        raise UserError(f"{source}: output.dtype must map keys to dtype names, got {dtype!r}")


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


def tokenize_record(record: dict[str, Any], config: PipelineConfig, tokenizer: Tokenizer) -> Document | str:
    """One record as tokens and a same-length mask (1 = trained), or the reason it is dropped."""
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
                if not isinstance(message, dict) or "role" not in message:
                    return f"field {section.field!r}: a message without a role"
                action = (
                    config.mask.get(message["role"], config.mask_default)
                    if section.action == "$role"
                    else section.action
                )
                encoded = tokenizer.encode(tokenizer.render_chat([message]), add_special_tokens=False)
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


def pack(documents: list[Document], config: PipelineConfig) -> list[tuple[list[int], list[int], list[int]]]:
    """``(ids, mask, position_ids)`` per document, in the packing order; doc_reset positions are per document."""
    pieces = []
    for doc in documents:
        positions = list(range(len(doc.ids)))
        if config.packing_strategy == "bfd_split" and len(doc.ids) > config.max_packed_len:
            step = config.max_packed_len
            pieces += [
                (doc.ids[i : i + step], doc.mask[i : i + step], positions[i : i + step])
                for i in range(0, len(doc.ids), step)
            ]
        else:
            n = config.max_packed_len if config.packing_strategy == "simple" else len(doc.ids)
            pieces.append((doc.ids[:n], doc.mask[:n], positions[:n]))
    if config.packing_strategy == "simple":
        return pieces
    # Best-fit decreasing: longest first, each into the fullest bin it fits; bins are then laid end to end.
    bins: list[list[tuple]] = []
    room: list[int] = []
    for piece in sorted(pieces, key=lambda p: -len(p[0])):
        fits = [i for i, r in enumerate(room) if r >= len(piece[0])]
        if fits:
            best = min(fits, key=lambda i: room[i])
            bins[best].append(piece)
            room[best] -= len(piece[0])
        else:
            bins.append([piece])
            room.append(config.max_packed_len - len(piece[0]))
    return [piece for bin_ in bins for piece in bin_]


def write_shard(directory: Path, documents: list[Document], config: PipelineConfig) -> int:
    """One ``shard_NNNN`` folder; returns its token count."""
    packed = pack(documents, config)
    arrays = {"sequence": np.asarray([t for ids, _, _ in packed for t in ids])}
    if not config.is_text:
        arrays["loss_mask"] = np.asarray([m for _, mask, _ in packed for m in mask])
    if config.position_ids_mode == "doc_reset":
        arrays["position_ids"] = np.asarray([p for _, _, positions in packed for p in positions])
    elif config.position_ids_mode == "continuous":
        arrays["position_ids"] = np.arange(len(arrays["sequence"]))
    dtypes = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32", **config.dtype}
    directory.mkdir(parents=True)
    meta = {}
    for key, array in arrays.items():
        array = array.astype(dtypes[key])
        array.tofile(directory / f"{key}.bin")
        meta[key] = {"shape": list(array.shape), "dtype": str(array.dtype)}
    (directory / "meta.json").write_text(json.dumps(meta))
    return len(arrays["sequence"])


def prepare(inputs: list[Path], output: Path, config: PipelineConfig, tokenizer: Tokenizer) -> str:
    """Write the shards of ``inputs`` under ``output`` (all at once: nothing appears until the end); return a
    summary of what was read, kept and dropped."""
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise UserError(f"-o {output}: exists and is not empty; choose a new directory")
    for path in inputs:
        if not path.is_file():
            raise UserError(f"{path}: input file not found")
        if output.resolve() in (path.resolve(), *path.resolve().parents) and output.exists():
            raise UserError(f"-o {output}: holds the input {path}; choose a new directory")
    staging = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    dropped: Counter[str] = Counter()
    buffers: dict[str, list[Document]] = defaultdict(list)
    buffered_tokens: Counter[str] = Counter()
    shards: Counter[str] = Counter()
    tokens = trained = kept = read = 0
    try:
        records = [record for path in inputs for record in read_jsonl(path, "input")][: config.max_items]
        progress = tqdm(records, desc="tokenising", unit=" records", disable=not sys.stderr.isatty())
        for _, record in progress:
            read += 1
            document = tokenize_record(record, config, tokenizer)
            if isinstance(document, str):
                dropped[document] += 1
                continue
            kept += 1
            tokens += len(document.ids)
            trained += sum(document.mask)
            buffers[document.domain].append(document)
            buffered_tokens[document.domain] += len(document.ids)
            if buffered_tokens[document.domain] >= config.max_tokens_per_shard:
                _flush(staging, document.domain, buffers, buffered_tokens, shards, config)
        for domain in list(buffers):
            if buffers[domain]:
                _flush(staging, domain, buffers, buffered_tokens, shards, config)
        if not kept:
            raise UserError(f"no record was kept ({dict(dropped)}); nothing written")
        output.mkdir(parents=True, exist_ok=True)
        for child in staging.iterdir():
            os.rename(child, output / child.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.most_common()) or "none"
    per_domain = ", ".join(f"{domain}: {n}" for domain, n in sorted(shards.items()))
    return (
        f"records: {read:,} read, {kept:,} kept, dropped: {reasons}\n"
        f"tokens: {tokens:,} ({trained:,} trained)\nshards: {sum(shards.values())} ({per_domain}) in {output}"
    )


def _flush(staging: Path, domain: str, buffers: dict, buffered_tokens: Counter, shards: Counter, config) -> None:  # noqa: ANN001
    write_shard(staging / domain / f"shard_{shards[domain]:04d}", buffers[domain], config)
    shards[domain] += 1
    buffers[domain], buffered_tokens[domain] = [], 0
