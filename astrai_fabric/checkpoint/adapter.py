"""The checkpoint side of LoRA: reading an adapter directory (``adapter_model.safetensors`` +
``adapter_config.json``, ours or AstrAI's ``save_lora``), and the pointer from an adapter-only checkpoint to its base
weights, checked by sha256. Named ``adapter`` so that ``lora`` stays the model-level module
(``astrai_fabric/lora.py``: the layers, injection, merging).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from astrai_fabric import lora
from astrai_fabric.checkpoint.files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    META_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    StoredStateDict,
    abbreviate,
    read_json,
)
from astrai_fabric.errors import CheckpointError

LORA_BASE_KEY = "lora_base"
"""``meta.json`` key of a LoRA checkpoint: where its base weights are (``path`` relative to the checkpoint,
``absolute``) and the ``sha256`` of each base weight file."""


@dataclass
class LoRAAdapter:
    """An adapter read from ``adapter_model.safetensors`` + ``adapter_config.json``."""

    spec: lora.LoRASpec
    state_dict: dict[str, Tensor]
    base: Path | None = None
    """The directory of the base weights it was trained on (found through ``meta.json``), if it has one."""


def read_adapter(directory: str | Path) -> LoRAAdapter:
    """``adapter_model.safetensors`` + ``adapter_config.json`` of a directory (ours, or AstrAI's ``save_lora``)."""
    path = Path(directory)
    spec = lora.LoRASpec.from_adapter_config(
        read_json(path / ADAPTER_CONFIG_FILE, what="the LoRA adapter's config"), str(path / ADAPTER_CONFIG_FILE)
    )
    tensors = dict(StoredStateDict.from_files([path / ADAPTER_FILE]))  # small: read whole
    odd = [k for k in tensors if not lora.is_adapter_key(k)]
    if odd or not tensors:
        raise CheckpointError(f"{path / ADAPTER_FILE}: expected only <layer>.lora_A / <layer>.lora_B keys, got "
                              f"{abbreviate(odd or ['nothing'])}")  # fmt: skip
    ranks = {tuple(v.shape)[0 if k.endswith("lora_A") else 1] for k, v in tensors.items() if v.dim() == 2}
    if ranks != {spec.r} or any(v.dim() != 2 for v in tensors.values()):
        raise CheckpointError(f"{path / ADAPTER_FILE}: adapter ranks {sorted(ranks)} do not match r={spec.r} of "
                              f"{ADAPTER_CONFIG_FILE}")  # fmt: skip
    return LoRAAdapter(spec, tensors)


def weight_files(directory: Path) -> list[Path]:
    """The files a model directory's weights are read from (what a LoRA checkpoint's ``sha256`` covers)."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / WEIGHTS_INDEX_FILE).is_file():
        index = read_json(directory / WEIGHTS_INDEX_FILE, what="a sharded safetensors index")
        shards = sorted(set((index.get("weight_map") or {}).values()))
        return [directory / WEIGHTS_INDEX_FILE, *(directory / shard for shard in shards)]
    if (directory / ADAPTER_FILE).is_file():  # a LoRA checkpoint as base: its own base is checked when it loads
        return [directory / ADAPTER_FILE, directory / ADAPTER_CONFIG_FILE]
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE}, {WEIGHTS_INDEX_FILE} or {ADAPTER_FILE} (expected weights)")


def weight_digests(directory: Path) -> dict[str, str]:
    """``{file name: sha256}`` of a model directory's weight files."""
    digests = {}
    for file in weight_files(directory):
        digest = hashlib.sha256()
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
        digests[file.name] = digest.hexdigest()
    return digests


def lora_base_entry(base: Path, checkpoint: Path, digests: dict[str, str]) -> dict[str, Any]:
    """The ``meta.json`` pointer from ``checkpoint`` to its base: relative where the two share a root, absolute too."""
    base = base.resolve()
    try:
        relative = os.path.relpath(base, checkpoint.resolve())
    except ValueError:  # another drive (Windows)
        relative = None
    return {"path": relative, "absolute": str(base), "sha256": digests}


def resolve_lora_base(path: Path, meta: Mapping[str, Any]) -> Path:
    """The base directory a LoRA checkpoint points to, its weight files checked against the recorded sha256."""
    entry = meta.get(LORA_BASE_KEY)
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), dict)
        and all(isinstance(entry.get(k), str | None) for k in ("path", "absolute"))
    ):
        raise CheckpointError(
            f"{path / META_FILE}: a LoRA checkpoint without merged weights needs '{LORA_BASE_KEY}' "
            f"{{path, absolute, sha256}} naming its base weights, got {entry!r}"
        )
    candidates = [Path(entry[k]) if k == "absolute" else path / entry[k] for k in ("path", "absolute") if entry[k]]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        raise CheckpointError(
            f"{path}: its LoRA base weights are missing (looked in {', '.join(map(str, candidates))}); "
            "put the base model back there, or resume from a checkpoint written with --lora_save_full"
        )
    digests = weight_digests(found)
    if digests != entry["sha256"]:
        differ = sorted(k for k in {*digests, *entry["sha256"]} if digests.get(k) != entry["sha256"].get(k))
        raise CheckpointError(
            f"{path}: the LoRA base at {found} is not the one this adapter was trained on (sha256 of "
            f"{', '.join(differ)} differs); restore that base model, or start a new run from it"
        )
    return found
