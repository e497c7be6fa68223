"""What a resume needs, moved between live (possibly sharded) training objects and AstrAI's checkpoint files:
gathered, sharded (torch distributed checkpoint) or exported. Imports Lightning and torch.distributed.checkpoint,
so the package's ``__init__`` does not import it (``import astrai_fabric.checkpoint`` stays light); import it as
``astrai_fabric.checkpoint.state``.

Saving: every rank takes part in gathering (a DTensor's ``full_tensor()`` is a collective); rank 0 keeps full
CPU tensors and writes AstrAI's directory, so ``model.safetensors`` and ``optimizer.pt`` are the same whether the
run was one process or FSDP over many (AstrAI saves rank 0's optimizer shard only, B6). Loading: every rank reads
the full state and keeps its own shard. The data position goes to ``meta.json`` under ``resume_position``; AstrAI
ignores that key and uses its own ``epoch``/``consumed_samples``, which we write as AstrAI counts them.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from astrai_fabric.checkpoint import hf
from astrai_fabric.checkpoint.files import (
    CONFIG_FILE,
    META_FILE,
    NOTHING_KEPT,
    RESERVED_META,
    STATE_DIR,
    WEIGHTS_FILE,
    files_inside,
    save_checkpoint,
    staging_dir,
    write_failure,
)
from astrai_fabric.checkpoint.gather import (
    gather_optimizer_state,
    gather_state,
    local_optimizer_state,
    numbered_as_whole,
)
from astrai_fabric.checkpoint.position import RESUME_KEY, RunPosition
from astrai_fabric.checkpoint.sharded_state import load_sharded_state, read_whole_state
from astrai_fabric.checkpoint.weights import Checkpoint, load_checkpoint, load_model_weights, weights_source
from astrai_fabric.errors import CheckpointError
from astrai_fabric.lora import LoRASpec, adapter_state_dict, base_state_dict, merge_state_dict

ENTRIES_KEY = "optimizer_entries"
"""``meta.json``: how many parameters' entries each part of ``optimizer.pt`` holds, as written (AstrAI ignores it), so
a resume knows a file with entries missing from one cut short or edited (``check_optimizer_coverage``)."""
SHARDED_KEY = "optimizer_state"
SHARDED_NOTE = "sharded in state/ (torch distributed checkpoint); `astrai-fabric export` writes optimizer.pt"
"""``meta.json`` says where the optimizer state is when ``optimizer.pt`` is left out."""
CHECKPOINT_FILES = (META_FILE, CONFIG_FILE, WEIGHTS_FILE)


def optimizer_parts(optimizer: Optimizer) -> dict[str | None, Optimizer | None]:
    """The torch optimizers inside a composite by part name (``muon``/``adamw`` for ``MuonAdamW``; None for a part
    without parameters, saved as None); ``{None: optimizer}`` for a plain torch optimizer."""
    return getattr(optimizer, "sub_optimizers", {None: optimizer})


def save_training_checkpoint(
    fabric: Fabric,
    directory: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Any,
    position: RunPosition,
    config: dict[str, Any],
    meta: dict[str, Any],
    files: dict[str, Any],
    sharded: bool = False,
    lora: LoRASpec | None = None,
    lora_save_full: bool = False,
) -> None:
    """Write ``directory`` with the state after the last optimizer step (all ranks must call).

    Rank 0 writes AstrAI's files. ``sharded``: every rank also writes its shard of the optimizer state into
    ``state/`` with torch distributed checkpoint (into the same staging directory, so the checkpoint still
    appears complete or not at all), and no rank gathers the whole optimizer; ``optimizer.pt`` is left out.
    ``lora``: only the adapters are gathered and written (``adapter_model.safetensors``), the frozen base is not
    copied (``meta`` points to it); ``lora_save_full`` adds the merged ``model.safetensors``.
    """
    keep = fabric.global_rank == 0
    adapter = None
    state = model.state_dict()
    if lora is None:
        weights = gather_state(model, state, keep)
    else:
        adapter = gather_state(model, adapter_state_dict(state), keep)
        weights = None
        if lora_save_full:
            base = gather_state(model, base_state_dict(state), keep)
            weights = merge_state_dict(base, adapter, lora.scaling) if keep else None
    rng = _gather_rng_states(fabric.world_size)
    extra = {"scheduler": scheduler.state_dict(), "rng": {"torch": rng}}
    meta = {**meta, RESUME_KEY: asdict(position)}
    staging = None
    if sharded:
        staging = Path(fabric.broadcast(str(staging_dir(directory)) if keep else None))
        with warnings.catch_warnings():  # one process writing a sharded state is fine too
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            state_dict = numbered_as_whole(optimizer, optimizer_parts(optimizer), model)
            try:
                dcp.save({"optimizer": state_dict}, checkpoint_id=staging / STATE_DIR)
            except dcp.CheckpointException as err:  # every rank's, once all of them have written
                # Each rank's own exception; torch's file writer reports a failed write as "unexpected pos".
                causes = [getattr(failure, "exc", failure) for failure in err.failures.values()]
                if not any(isinstance(c, OSError) or "unexpected pos" in str(c) for c in causes):
                    # Not the writing's (a lost rank's collective, a bug): an Exception the run's handlers know,
                    # where torch's is a BaseException that would pass them as a traceback.
                    raise RuntimeError(f"torch's distributed checkpoint failed: {causes[0]}") from err
                failure = write_failure(causes[0], staging, directory, staging / STATE_DIR)  # while the disk is full
                if keep:
                    shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointError(f"{directory}: {failure}; {NOTHING_KEPT}") from None
        meta[SHARDED_KEY] = SHARDED_NOTE
    else:
        extra = {"optimizer": gather_optimizer_state(optimizer, optimizer_parts(optimizer), model, keep), **extra}
        if keep:
            meta[ENTRIES_KEY] = optimizer_entries(extra["optimizer"])
    if keep:
        # A same-step save replaces an existing directory only after the new one is complete.
        save_checkpoint(
            directory,
            weights,
            config,
            epoch=position.last_epoch,
            consumed_samples=position.consumed_samples,
            meta=meta,
            extra=extra,
            files=files,
            overwrite=True,
            staging=staging,
            adapter=adapter,
            adapter_config=lora.adapter_config() if lora is not None else None,
        )
    fabric.barrier()


def initialize_optimizer_state(optimizer: Optimizer) -> None:
    """Create every parameter's optimizer state with a step that changes nothing (rate 0, zero gradients), so a
    loaded sharded state has tensors to land in; torch's ``set_optimizer_state_dict`` does the same."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate


def load_sharded_optimizer_state(optimizer: Optimizer, state_dir: Path, model: nn.Module) -> None:
    """Each rank reads its shard of ``state/`` (resharded by torch distributed checkpoint to this run's layout;
    under expert parallelism its own experts' entries, numbered as the whole model's: ``numbered_as_whole``)."""
    initialize_optimizer_state(optimizer)
    parts = optimizer_parts(optimizer)
    template = {"optimizer": numbered_as_whole(optimizer, parts, model)}
    load_sharded_state(template, state_dir)
    state = _integer_state_keys(template["optimizer"])
    optimizer.load_state_dict(local_optimizer_state(state, parts, model, state_dir))


def export_checkpoint(source: str | Path, target: str | Path, cast: Any = None) -> Path:
    """Write a checkpoint with a sharded ``state/`` as a complete AstrAI directory (with ``optimizer.pt``), in one
    process without a process group: ``astrai-fabric export``. ``cast`` maps the weights (``--dtype``)."""
    source = Path(source)
    ckpt = load_checkpoint(source)
    if not (source / STATE_DIR).is_dir():
        raise CheckpointError(f"{source}: no {STATE_DIR}/ folder: not a sharded checkpoint (it is complete already)")
    optimizer_state = _integer_state_keys(read_whole_state(source / STATE_DIR)["optimizer"])
    meta = {k: v for k, v in ckpt.meta.items() if k not in (*RESERVED_META, SHARDED_KEY)}
    names = [
        p.name
        for p in source.iterdir()
        if (p.is_file() or p.is_symlink()) and p.name not in CHECKPOINT_FILES and p.suffix != ".pt"
    ]
    copied = files_inside(source, names)  # a link pointing out of the checkpoint is refused, never copied
    return save_checkpoint(
        target,
        cast(ckpt.state_dict) if cast else ckpt.state_dict,
        ckpt.config,
        epoch=ckpt.epoch,
        consumed_samples=ckpt.consumed_samples,
        meta=meta,
        extra={"optimizer": optimizer_state, **ckpt.extra},
        files=copied,
    )


def export_merged(source: str | Path, target: str | Path) -> Path:
    """Write a LoRA checkpoint as a plain AstrAI model directory, the adapter merged into the base
    (``astrai-fabric export --merge_lora``): ``config.json``, ``model.safetensors``, the tokenizer, ``meta.json``."""
    source = Path(source)
    ckpt = load_checkpoint(source, load_extra=False)
    if ckpt.lora is None:
        raise CheckpointError(f"{source}: no adapter_model.safetensors: not a LoRA checkpoint (nothing to merge)")
    copied = files_inside(source, ("tokenizer.json", "tokenizer_config.json"))  # never a file outside it
    meta = {"merged_from": str(source.resolve()), "lora": ckpt.lora.spec.adapter_config()}
    origin = hf.source_of(ckpt.source, ckpt.meta, ckpt.model_config(), str(source / META_FILE))
    if origin is not None:  # the merged model is its base's architecture, which later runs and export follow
        meta[hf.SOURCE_KEY] = origin.to_meta()
    return save_checkpoint(target, ckpt.state_dict, ckpt.config, meta=meta, files=copied)


def _integer_state_keys(state: Any) -> Any:
    """Torch optimizer states index ``state`` by integers; distributed checkpoint's flattening made them strings.
    Loading into a template, it fills tensors in place but puts any other value (NAdamW's int ``step``) under the
    string key beside the integer one: folded here, the loaded value winning."""
    if isinstance(state, dict) and "state" in state and "param_groups" in state:
        merged: dict[int, Any] = {}
        for key in sorted(state["state"], key=lambda k: isinstance(k, str)):  # the loaded (string) entries last
            merged.setdefault(int(key), {}).update(state["state"][key])
        return {**state, "state": merged}
    if isinstance(state, dict):
        return {k: _integer_state_keys(v) for k, v in state.items()}
    return state


def _gather_rng_states(world_size: int) -> Tensor:
    """Every rank's torch RNG state, one row per rank (collective)."""
    state = torch.get_rng_state()
    if world_size == 1:
        return state.unsqueeze(0)
    states = [None] * world_size
    torch.distributed.all_gather_object(states, state)
    return torch.stack(states)


def load_weights(
    model: nn.Module,
    ckpt: Checkpoint,
    dtype: torch.dtype | None = None,
    adapter: dict[str, Tensor] | None = None,
    quantized: Collection[str] = (),
) -> None:
    """Weights into a model: one on the meta device takes new tensors of ``dtype``; a materialised one (sharded
    or not) gets them copied into its parameters, each rank its own part (``weights.load_model_weights``);
    ``adapter``: a LoRA run's adapters, which the base's file lacks; ``quantized``: the weights stored as NF4."""
    load_model_weights(
        model, ckpt.state_dict, source=weights_source(ckpt), dtype=dtype, adapter=adapter, quantized=quantized
    )


def optimizer_entries(state: Any) -> dict[str, int]:
    """Parameters with state in each part of a whole optimizer state (``""``: a plain torch optimizer's)."""
    parts = {"": state} if isinstance(state, dict) and "state" in state else state
    if not isinstance(parts, dict):
        return {}
    return {
        str(name): len(part["state"])
        for name, part in parts.items()
        if isinstance(part, dict) and isinstance(part.get("state"), dict)
    }


def check_optimizer_coverage(state: Any, recorded: Any, source: Path) -> None:
    """``CheckpointError`` where ``optimizer.pt`` holds fewer parameters' entries in a part than ``meta.json`` recorded
    when it was written (torch would load it, and the missing momentum start again from zero, silently). A
    checkpoint without the record (AstrAI's, or ours before it) is not checked."""
    if not isinstance(recorded, dict):
        return
    held = optimizer_entries(state)
    for part, count in recorded.items():
        if isinstance(count, int) and held.get(part, 0) < count:
            name = f"its {part} part" if part else "it"
            raise CheckpointError(
                f"{source}: {name} holds state for {held.get(part, 0):,} parameters where meta.json records "
                f"{count:,} written (entries deleted, or the file replaced); --resume_optimizer false resumes from "
                "the weights with a fresh optimizer"
            )


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any], source: Path) -> None:
    """A full optimizer state into a live optimizer, each tensor sharded like its parameter."""
    parts = optimizer_parts(optimizer)
    single = None in parts  # one torch optimizer: {state, param_groups}; a composite: one such dict per part
    expected = ["param_groups", "state"] if single else sorted(parts)
    if not (isinstance(state, dict) and (set(expected) <= set(state) if single else set(state) == set(parts))):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{source}: optimizer state has keys {found}, but this run's optimizer saves {expected}: the "
            "checkpoint was trained with another --optimizer"
        )
    states = {None: state} if single else state
    for name, part in parts.items():
        if part is None or states[name] is None:
            continue  # a part without parameters: the composite's load says whether both sides agree
        params = [p for group in part.param_groups for p in group["params"]]
        sub_state = states[name]
        if not isinstance(sub_state, dict):
            raise CheckpointError(f"{source}: the optimizer state of {name!r} is missing")
        if any(isinstance(v, DTensor) for entry in sub_state.get("state", {}).values() for v in entry.values()):
            raise CheckpointError(
                f"{source}: holds sharded (DTensor) optimizer state: AstrAI's FSDP saves only rank 0's shard (its "
                "bug B6), which cannot restore the optimizer. To continue from this checkpoint's weights, schedule "
                "and data position with a fresh optimizer, add --resume_optimizer false"
            )
        if len(sub_state.get("state", {})) > len(params):
            raise CheckpointError(f"{source}: optimizer state covers more parameters than the model has")
        try:
            for index, entry in sub_state.get("state", {}).items():
                param = params[index]
                for key, value in entry.items():
                    if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ValueError(
                            f"state {key!r} of parameter {index} has shape {list(value.shape)}, the "
                            f"parameter {list(param.shape)}"
                        )
                    if isinstance(value, Tensor) and isinstance(param, DTensor) and value.shape == param.shape:
                        value = value.to(device=param.device, dtype=param.dtype)
                        entry[key] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise CheckpointError(f"{source}: does not fit this run's optimizer ({err})") from None
    try:
        optimizer.load_state_dict(state)
    except (CheckpointError, ValueError, KeyError, TypeError, IndexError, RuntimeError) as err:  # torch's and ours
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"{source}: does not fit this run's optimizer ({detail})") from None


def check_rng_state(rng: Any, source: Path) -> None:
    """``rng.pt`` holds ``{"torch": uint8 [ranks, state]}``, one torch RNG state per rank."""
    states = rng.get("torch") if isinstance(rng, dict) else None
    size = torch.get_rng_state().numel()
    fits = isinstance(states, Tensor) and states.dtype == torch.uint8 and states.dim() == 2
    if not (fits and states.size(1) == size):
        found = f"{states.dtype} {list(states.shape)}" if isinstance(states, Tensor) else type(states).__name__
        raise CheckpointError(f"{source}: expected {{'torch': uint8 [ranks, {size}]}} RNG states, got {found}")


def restore_rng(rng: dict[str, Tensor] | None, rank: int, world_size: int) -> bool:
    """This rank's torch RNG state, when the checkpoint has one saved by the same number of ranks (checked on
    reading by ``check_rng_state``)."""
    if not rng or "torch" not in rng or rng["torch"].size(0) != world_size:
        return False
    torch.set_rng_state(rng["torch"][rank].to(torch.uint8).clone())  # own storage: a row view crashes it
    return True
