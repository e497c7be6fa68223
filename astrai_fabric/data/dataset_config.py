"""AstrAI's ``dataset_config.json``: the file in a data directory saying how its records become tokens.

AstrAI's ``DatasetFactory`` reads it (``TokenizeTransform``, its ``PipelineConfig`` schema, the same one
``astrai-fabric prepare`` reads) for every JSONL directory that holds one; here a directory of any records (parquet,
arrow, CSV, JSON, ``save_to_disk``, a Hub dataset's snapshot) is read by it too, since rendering takes records from
any source (``storage.read_records``), where AstrAI's factory reads JSONL only. ``input.sections`` give seq/sft one
token stream; ``input.sources`` give dpo the outputs ``chosen``/``rejected`` (with ``chosen_mask``/
``rejected_mask``) and grpo ``prompts``, ``responses`` (a list field, mask key ``masks``) and ``rewards`` (a
``value`` section). Records
are rendered as AstrAI renders them: a BOS token (masked) before a source with a template section, each chat
message rendered alone without the generation prompt, text sections encoded with special tokens only for the
first one, each output cut to ``preprocessing.max_seq_len``; a record whose source renders nothing is dropped.
The tokenizer is AstrAI's choice too: the file's ``tokenizer_path`` (relative to the current directory), else the
data directory's own (``windows.data_tokenizer`` checks it against the run's).

Refused, each with the fix, where AstrAI's reading is a bug or silently ignores what the file asks for:
``position_ids_mode`` other than ``none`` with ``input.sources`` (AstrAI then counts its one position-id array as
one record and trains the first record only); packing, ``keep_end`` truncation and ``max_items`` (ignored by
AstrAI's JSONL route; ``prepare`` applies them); a non-string text field (AstrAI tokenises ``str(value)``, so a
null becomes the word "None"); a source or output the train type does not read. Where we depart, as everywhere:
sft masks stay aligned with their records (AstrAI B9) and plain documents end with EOS (``append_eos``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from astrai_fabric.data.prepare import (
    ACTIONS,
    GROUPS,
    PipelineConfig,
    Section,
    check_keys,
    parse_sections,
)
from astrai_fabric.data.prepare import tokenize_record as render_document
from astrai_fabric.data.records import Encoded
from astrai_fabric.data.storage import Record, detect_format
from astrai_fabric.errors import UserError
from astrai_fabric.json_files import read_json_object
from astrai_fabric.tokenizer import TOKENIZER_FILE, Tokenizer

DATASET_CONFIG_FILE = "dataset_config.json"
SOURCES = {"dpo": ("chosen", "rejected"), "grpo": ("prompts", "responses", "rewards")}
"""The outputs AstrAI's dpo and grpo datasets read (``DPODataset``/``GRPODataset.required_keys``)."""


@dataclass
class Source:
    sections: list[Section]
    list_field: bool = False
    mask_key: str | None = None


@dataclass
class DatasetConfig:
    path: Path
    pipeline: PipelineConfig
    """seq/sft: the sections and options; dpo/grpo: the options (mask roles, lengths) the sources share."""
    sources: dict[str, Source]
    tokenizer_dir: Path | None
    """AstrAI's tokenizer for these records: ``tokenizer_path``, else the data directory if it holds one."""


def read_dataset_config(data_root: Path, train_type: str) -> DatasetConfig | None:
    """``data_root/dataset_config.json``, checked for ``train_type``; None without one. ``data_root`` is a directory
    of records of any kind (``storage.detect_format``); a Hub dataset's, its snapshot."""
    path = data_root / DATASET_CONFIG_FILE
    if not (data_root.is_dir() and path.is_file()) or (kind := detect_format(data_root)) == "bin":
        return None  # bin shards win, as in AstrAI
    if train_type == "kto":  # AstrAI has no kto: its records are read as they are
        raise UserError(
            f"{path}: kto reads its records as they are (prompt, completion, label), with no "
            "dataset_config.json route (AstrAI has no kto); move the file away"
        )
    raw = read_json_object(path, "the data directory's dataset config")
    source = str(path)
    check_keys(raw, GROUPS, source, "")
    layout = raw.get("input", {})
    check_keys(layout, {"sections", "sources"}, source, "input.")
    if train_type in SOURCES:
        if "sources" not in layout:
            raise UserError(f"{source}: {train_type} needs input.sources with the outputs {list(SOURCES[train_type])}")
        if "sections" in layout:
            raise UserError(f"{source}: input has both sections and sources (AstrAI ignores sections then); keep one")
        pipeline = PipelineConfig.with_options(raw, [], source)
        sources = _parse_sources(layout["sources"], train_type, source)
        if pipeline.position_ids_mode != "none":
            raise UserError(
                f"{source}: output.position_ids_mode is {pipeline.position_ids_mode!r} (AstrAI's default): with "
                f"input.sources AstrAI counts its one position-id array as a record and trains on the first record "
                'only; add "output": {"position_ids_mode": "none"} (dpo/grpo records have no position ids)'
            )
    else:
        if "sources" in layout:
            raise UserError(f"{source}: input.sources describes dpo/grpo outputs; {train_type} reads input.sections")
        pipeline, sources = PipelineConfig.from_dict(raw, source), {}
    ignored = [
        f"{name} {value!r}"
        for name, value, default in (
            ("preprocessing.packing_strategy", pipeline.packing_strategy, "simple"),
            ("preprocessing.truncation_mode", pipeline.truncation_mode, "keep_start"),
            ("preprocessing.max_items", pipeline.max_items, None),
        )
        if value != default
    ]
    if ignored:
        inputs = f"{data_root}/*.jsonl" if kind == "jsonl" else str(data_root)
        hint = (
            f"remove it, or write shards with `astrai-fabric prepare {inputs} -o DIR -c {path}` and train on DIR"
            if not sources
            else "remove it"
        )
        raise UserError(f"{source}: {', '.join(ignored)}: AstrAI's JSONL route ignores it; {hint}")
    tokenizer_dir = None
    if pipeline.tokenizer_path is not None:
        tokenizer_dir = Path(pipeline.tokenizer_path)  # AstrAI: relative to the current directory
    elif (data_root / TOKENIZER_FILE).is_file():
        tokenizer_dir = data_root
    return DatasetConfig(path, pipeline, sources, tokenizer_dir)


def _parse_sources(raw: Any, train_type: str, source: str) -> dict[str, Source]:
    if not isinstance(raw, dict) or sorted(raw) != sorted(SOURCES[train_type]):
        names = sorted(raw) if isinstance(raw, dict) else raw
        raise UserError(f"{source}: {train_type} reads the sources {list(SOURCES[train_type])}, got {names}")
    sources = {}
    for name, spec in raw.items():
        where = f"input.sources.{name}"
        check_keys(spec, {"sections", "list_field", "mask_key"}, source, f"{where}.")
        sections = parse_sections(spec.get("sections"), source, f"{where}.sections", (*ACTIONS, "value"))
        list_field, mask_key = spec.get("list_field", False), spec.get("mask_key")
        if not isinstance(list_field, bool) or not isinstance(mask_key, str | None):
            raise UserError(f"{source}: {where}: list_field must be true or false and mask_key a string")
        values = [s.action == "value" for s in sections]
        if any(values) and (len(sections) > 1 or list_field):
            raise UserError(f"{source}: {where}: a 'value' section must be its source's only section")
        sources[name] = Source(sections, list_field, mask_key)
    # What AstrAI's datasets look up: anything else is a KeyError there, or a source silently unread.
    expected = {
        "chosen": (False, False, "chosen_mask"),
        "rejected": (False, False, "rejected_mask"),
        "prompts": (False, False, None),
        "responses": (True, False, "masks"),
        "rewards": (False, True, None),
    }
    for name, spec in sources.items():
        list_field, value, mask_key = expected[name]
        is_value = spec.sections[0].action == "value"
        renamed = mask_key is not None and (spec.mask_key or f"{name}_mask") != mask_key
        if spec.list_field != list_field or is_value != value or renamed:
            shape = "a 'value' section" if value else ("a list_field" if list_field else "token sections")
            named = f' with "mask_key": "{mask_key}"' if list_field else ""
            raise UserError(f"{source}: input.sources.{name}: {train_type} reads it as {shape}{named}")
    return sources


def render_sections(
    record: dict[str, Any],
    sections: list[Section],
    config: PipelineConfig,
    tokenizer: Tokenizer,
    where: str,
    top_level: bool = True,
) -> tuple[list[int], list[int]] | None:
    """One output's ``(ids, mask)``, as AstrAI's ``SectionRenderer.process_sections`` builds it, or None (empty)."""
    has_template = any(s.template for s in sections)
    is_text = not has_template and all(s.action == "train" for s in sections)
    ids: list[int] = []
    mask: list[int] = []
    if top_level and has_template and tokenizer.bos_token_id is not None:
        ids, mask = [tokenizer.bos_token_id], [0]
    first = True
    for section in sections:
        if section.template:
            value = record.get(section.field)
            if not isinstance(value, list) or not value:
                continue
            for message in value:
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    raise UserError(
                        f"{where}: field {section.field!r}: messages are {{role, content}}, got {message!r}"
                    )
                role_action = config.mask.get(message["role"], config.mask_default)
                trained = (role_action if section.action == "$role" else section.action) == "train"
                encoded = tokenizer.encode(tokenizer.render_chat([message], where=where), add_special_tokens=False)
                ids += encoded
                mask += [int(trained)] * len(encoded)
        else:
            text = _text(record[section.field], section.field, where) if section.field in record else ""
            if not text.strip() or (
                is_text and ((config.min_chars > 0 and len(text) < config.min_chars) or len(text) > config.max_chars)
            ):
                continue
            special = section.add_special_tokens if section.add_special_tokens is not None else first
            encoded = tokenizer.encode(text, add_special_tokens=special)
            ids += encoded
            mask += [int(section.action == "train")] * len(encoded)
        first = False
    ids, mask = ids[: config.max_seq_len], mask[: config.max_seq_len]
    if not ids or (top_level and has_template and len(ids) <= 1):
        return None
    return ids, mask


def _text(value: Any, field: str, where: str) -> str:
    """A text section's value: AstrAI tokenises ``str(value)`` (a null becomes "None"); only strings pass here."""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {field!r} is rendered as text, so it must be a string, got {value!r}")
    return value


def render_list(
    record: dict[str, Any], source: Source, config: PipelineConfig, tokenizer: Tokenizer, where: str
) -> list[tuple[list[int], list[int]]] | None:
    """A list field's outputs, one per element (AstrAI's ``process_list_field``: no BOS, no special tokens, and
    an element that renders nothing dropped from the list)."""
    outputs = []
    for section in source.sections:
        values = record.get(section.field)
        if not isinstance(values, list):
            continue
        for value in values:
            if section.template:
                rendered = (
                    render_sections(
                        {"m": value}, [Section("m", section.action, True)], config, tokenizer, where, top_level=False
                    )
                    if isinstance(value, list)
                    else None
                )
            else:
                plain = Section("t", section.action, False, False)
                rendered = render_sections(
                    {"t": _text(value, section.field, where)},
                    [plain],
                    _no_filter(config),
                    tokenizer,
                    where,
                    top_level=False,
                )
            if rendered is not None:
                outputs.append(rendered)
    return outputs or None


def _no_filter(config: PipelineConfig) -> PipelineConfig:
    """AstrAI never applies min_chars/max_chars to list elements (it renders them as a non-text config)."""
    return replace(config, min_chars=0, max_chars=2**62)


def _rewards(record: dict[str, Any], source: Source) -> Any:
    """A value section's numbers as AstrAI reads them (a scalar is a one-element list); checked by the dataset."""
    raw = record.get(source.sections[0].field)
    return None if raw is None else (raw if isinstance(raw, list) else [raw])


def render_pair(config: DatasetConfig, tokenizer: Tokenizer, record: dict[str, Any], where: str) -> Encoded | None:
    """A dpo pair: ``chosen`` and ``rejected`` whole, each with its own mask; None where AstrAI drops the record."""
    rendered = [
        render_sections(record, config.sources[k].sections, config.pipeline, tokenizer, where)
        for k in ("chosen", "rejected")
    ]
    if None in rendered:
        return None
    return Encoded([], [ids for ids, _ in rendered], [mask for _, mask in rendered])


def render_group(
    config: DatasetConfig, tokenizer: Tokenizer, record: dict[str, Any], where: str
) -> tuple[Encoded, Any] | None:
    """A grpo group: the prompt (its mask unused, as in AstrAI), the responses with their masks, the rewards."""
    prompt = render_sections(record, config.sources["prompts"].sections, config.pipeline, tokenizer, where)
    responses = render_list(record, config.sources["responses"], config.pipeline, tokenizer, where)
    rewards = _rewards(record, config.sources["rewards"])
    if prompt is None or responses is None or rewards is None:
        return None
    return Encoded(prompt[0], [ids for ids, _ in responses], [mask for _, mask in responses]), rewards


def render_stream(config: DatasetConfig, tokenizer: Tokenizer, records: list[Record]) -> tuple[dict, dict[str, int]]:
    """seq/sft: the records' token stream (``sequence``, ``loss_mask`` unless every token trains, ``position_ids``
    by ``output.position_ids_mode``) and the count of records dropped, by reason."""
    pipeline = config.pipeline
    sequence, loss_mask, positions, dropped = [], [], [], {}
    for _, record in records:
        document = render_document(record, pipeline, tokenizer)
        if isinstance(document, str):
            dropped[document] = dropped.get(document, 0) + 1
            continue
        sequence += document.ids
        loss_mask += document.mask
        positions += range(len(document.ids))
    stream = {"sequence": np.asarray(sequence, dtype=np.int32)}
    if not pipeline.is_text:
        stream["loss_mask"] = np.asarray(loss_mask, dtype=np.bool_)
    if pipeline.position_ids_mode == "doc_reset":
        stream["position_ids"] = np.asarray(positions, dtype=np.int32)
    elif pipeline.position_ids_mode == "continuous":  # AstrAI's: one document the length of the stream
        stream["position_ids"] = np.arange(len(sequence), dtype=np.int32)
    return stream, dropped


def unrendered_warning(num_unrendered: int, num_samples: int) -> str:
    """The summary's line for records a dataset_config.json route dropped (a source rendered nothing)."""
    if not num_unrendered:
        return ""
    return (
        f"\nwarning: {num_unrendered:,} record(s) dropped, as AstrAI drops them: a source rendered no token (a "
        f"missing or empty field); {num_samples:,} kept"
    )
