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

from astrai_fabric import hub, lora
from astrai_fabric.checkpoint.files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    META_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    StoredStateDict,
    abbreviate,
    inside,
    read_json,
    tensor_files,
)
from astrai_fabric.errors import CheckpointError, brief

LORA_BASE_KEY = "lora_base"
"""``meta.json`` key of a LoRA checkpoint: where its base weights are (``path`` relative to the checkpoint,
``absolute``; or, for a Hub snapshot, ``hub``: ``org/name@commit``, resolved again where it loads) and the
``sha256`` of each base weight file."""


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
        raise CheckpointError(
            f"{path / ADAPTER_FILE}: expected only <layer>.lora_A / <layer>.lora_B keys, got "
            f"{abbreviate(odd or ['nothing'])}"
        )
    ranks = {tuple(v.shape)[0 if k.endswith("lora_A") else 1] for k, v in tensors.items() if v.dim() == 2}
    if ranks != {spec.r} or any(v.dim() != 2 for v in tensors.values()):
        raise CheckpointError(
            f"{path / ADAPTER_FILE}: adapter ranks {sorted(ranks)} do not match r={spec.r} of {ADAPTER_CONFIG_FILE}"
        )
    return LoRAAdapter(spec, tensors)


def weight_files(directory: Path) -> list[Path]:
    """The files a model directory's weights are read from (what a LoRA checkpoint's ``sha256`` covers)."""
    # Every file checked as the weights' reader checks them (files.inside, tensor_files): hashing reads them all, so
    # a link out of the directory (or to /dev/zero) is refused before a byte is read.
    if os.path.lexists(directory / WEIGHTS_FILE) or os.path.lexists(directory / WEIGHTS_INDEX_FILE):
        shards = tensor_files(directory)
        if os.path.lexists(directory / WEIGHTS_FILE):
            return [inside(directory, WEIGHTS_FILE)]
        return [inside(directory, WEIGHTS_INDEX_FILE), *shards]
    if os.path.lexists(directory / ADAPTER_FILE):  # a LoRA checkpoint as base: its own base is checked when it loads
        return [inside(directory, ADAPTER_FILE), inside(directory, ADAPTER_CONFIG_FILE)]
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
    """The ``meta.json`` pointer from ``checkpoint`` to its base: relative where the two share a root, absolute too;
    a snapshot in the Hugging Face cache as ``org/name@commit`` alone (a cache path is this machine's only)."""
    if (source := hub.portable(base)) is not None:
        return {"path": None, "absolute": None, "hub": source, "sha256": digests}
    base = base.resolve()
    try:
        relative = os.path.relpath(base, checkpoint.resolve())
    except ValueError:  # another drive (Windows)
        relative = None
    return {"path": relative, "absolute": str(base), "sha256": digests}


MAX_BASE_CHAIN = 16
"""Adapter checkpoints without weights (each the base of the one before) a chain of base pointers may hold."""


def resolve_lora_base(path: Path, meta: Mapping[str, Any]) -> Path:
    """The base directory a LoRA checkpoint points to, its weight files checked against the recorded sha256. A
    pointer that leads back to ``path`` (itself, or adapters pointing at each other) is refused before anything is
    hashed."""
    entry = _base_entry(path, meta)
    candidates, found = _pointed_base(path, entry)
    if found is None:
        raise CheckpointError(
            f"{path}: its LoRA base weights are missing (looked in {', '.join(map(str, candidates))}); "
            "put the base model back there, or resume from a checkpoint written with --lora_save_full"
        )
    _refuse_a_loop(path, found)
    try:
        digests = weight_digests(found)
    except CheckpointError as err:  # the base the pointer names holds no weights: name the pointer, not only it
        raise CheckpointError(f"{path / META_FILE}: '{LORA_BASE_KEY}' points at {err}") from None
    if digests != entry["sha256"]:
        differ = sorted(k for k in {*digests, *entry["sha256"]} if digests.get(k) != entry["sha256"].get(k))
        raise CheckpointError(
            f"{path}: the LoRA base at {found} is not the one this adapter was trained on (sha256 of "
            f"{', '.join(differ)} differs); restore that base model, or start a new run from it"
        )
    return found


def _base_entry(path: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    entry = meta.get(LORA_BASE_KEY)
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), dict)
        and all(isinstance(entry.get(k), str | None) for k in ("path", "absolute", "hub"))
        and (entry.get("hub") is None or hub.looks_like_hub_id(entry["hub"]))
        and any(entry.get(k) for k in ("path", "absolute", "hub"))
    ):
        raise CheckpointError(
            f"{path / META_FILE}: a LoRA checkpoint without merged weights needs '{LORA_BASE_KEY}' "
            f"{{path, absolute, sha256}} (or {{hub: org/name@commit, sha256}}) naming its base weights, got "
            f"{brief(entry)}"
        )
    return entry


def _pointed_base(path: Path, entry: Mapping[str, Any]) -> tuple[list[Path | str], Path | None]:
    """Where a pointer says the base is (relative to ``path``, then absolute, or a Hub snapshot: from the cache,
    else fetched), and the first that is a directory."""
    candidates = [Path(entry[k]) if k == "absolute" else path / entry[k] for k in ("path", "absolute") if entry.get(k)]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None and entry.get("hub"):
        candidates.append(entry["hub"])
        found = hub.resolve_model(entry["hub"], f"{path}: its LoRA base")
    return candidates, found


def _refuse_a_loop(path: Path, base: Path) -> None:
    """Follow the base pointers from ``path`` as loading would (through adapter-only checkpoints, to the first
    directory with weights) and refuse a chain that comes back to a directory it passed, or runs past
    ``MAX_BASE_CHAIN``: loading it would recurse, hashing every adapter on the way, until the interpreter gave up."""
    chain, here = [path.resolve()], base
    while True:
        resolved = here.resolve()
        if resolved in chain:
            loop = " -> ".join(map(str, [*chain[chain.index(resolved) :], resolved]))
            raise CheckpointError(
                f"{path}: its LoRA base pointer ({META_FILE} '{LORA_BASE_KEY}') loops back: {loop}; an adapter's "
                "base must be the model it was trained on, not itself or an adapter pointing back to it"
            )
        chain.append(resolved)
        if (here / WEIGHTS_FILE).is_file() or not (here / ADAPTER_FILE).is_file() or not (here / META_FILE).is_file():
            return  # weights (a model, or a LoRA checkpoint with its merged weights): loading stops here
        if len(chain) > MAX_BASE_CHAIN:  # all adapters without weights so far, ``path`` included
            raise CheckpointError(
                f"{path}: its LoRA base pointer leads through more than {MAX_BASE_CHAIN} adapter checkpoints without "
                f"weights ({chain[1]} ... {resolved}); point it at the model the adapter was trained on"
            )
        try:
            entry = _base_entry(here, read_json(here / META_FILE, what="the run's meta data"))
        except CheckpointError:
            return  # loading that checkpoint says what is wrong with it
        here = _pointed_base(here, entry)[1]
        if here is None:
            return


def check_resumed_base(checkpoint: Path, base: Path, digests: Mapping[str, str], param_path: Path) -> None:
    """A resumed LoRA checkpoint trains on the base its pointer names (``base``, checked against ``digests``): a
    ``param_path`` that is neither that directory, nor the checkpoint itself (AstrAI's ``--resume true``), nor a
    copy of the same weights is refused, rather than one of the two silently not used. Hashes ``param_path`` only
    where its weight files have the base's names and sizes."""
    if param_path.resolve() in (checkpoint.resolve(), base.resolve()):
        return
    try:
        ours = [(f.name, f.stat().st_size) for f in weight_files(param_path)]
    except (CheckpointError, OSError):  # no weights there (a config alone), or a shard its index names is missing
        ours = None
    theirs = [(f.name, f.stat().st_size) for f in weight_files(base)]  # there: just hashed
    if ours != theirs or weight_digests(param_path) != dict(digests):
        base = base.resolve()
        raise CheckpointError(
            f"--resume: {checkpoint} is a LoRA adapter trained on the base {base}, but --param_path is {param_path}, "
            f"whose weights differ; resume with --param_path {base}, or drop --resume to train a new adapter on "
            f"{param_path}"
        )
