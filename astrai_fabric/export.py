"""``astrai-fabric export``: a checkpoint or model directory written out in AstrAI's layout or in Hugging Face's.

``--format astrai`` (the default) completes a checkpoint saved with ``--sharded_checkpoint`` (gathering the
optimizer state into ``optimizer.pt``, ``checkpoint.state.export_checkpoint``), or turns a Hugging Face directory into
an AstrAI model directory, or casts a complete checkpoint to ``--dtype``. A model AstrAI's schema cannot express
(q/k/v biases, q/k norm before RoPE, ``head_dim`` of its own, Hugging Face's RoPE scaling) is refused there: AstrAI
would compute another function. ``--format hf`` writes what transformers' ``AutoModelForCausalLM`` and
``AutoTokenizer`` load (``AutoModelForSequenceClassification`` for a reward model: the family's
``*ForSequenceClassification``): the architecture the model came from (``meta.json``'s ``source``) or, for AstrAI's
own models, the transformers class computing the same function (``hf.export_model_type``), or a one-line refusal
naming what has no equivalent. Reading and writing stay in ``checkpoint.files``, the mapping in ``checkpoint.hf``.

``--out`` is checked before anything is read, for every format (``destination``): a new directory, or an empty one,
whose parent this process may write, neither inside the directory exported nor holding it. Nothing there is ever
overwritten, replaced or deleted, an earlier export included: the export is written into a hidden sibling and
renamed into place, which fails rather than replace a directory that is no longer empty.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from torch import Tensor

from astrai_fabric import hub
from astrai_fabric.checkpoint import (
    ADAPTER_FILE,
    CONFIG_FILE,
    META_FILE,
    RESERVED_META,
    WEIGHTS_FILE,
    empty_model,
    hf,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    save_model_directory,
)
from astrai_fabric.checkpoint.files import STATE_DIR, abbreviate, files_inside, read_json
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import CheckpointError, ConfigError, UserError
from astrai_fabric.quantize import QUANTIZATION_KEY, QUANTIZE_FLAG
from astrai_fabric.tokenizer import ASTRAI, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

FORMATS = ("astrai", "hf", "peft")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
GENERATION_CONFIG_FILE = "generation_config.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                      "tokenizer.model")  # fmt: skip
"""Tokenizer files a Hugging Face directory may hold, copied as they are."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes in a size as transformers' ``max_shard_size`` spells it: ``5GB`` (10^9), ``1GiB`` (2^30), or bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match[2].upper() not in _UNITS or float(match[1]) * _UNITS[match[2].upper()] < 1:
        raise UserError(f"--max_shard_size {text!r}: expected a size such as 5GB, 500MB or 1GiB (or a byte count)")
    return int(float(match[1]) * _UNITS[match[2].upper()])


class AlreadyComplete(CheckpointError):
    """``--format astrai`` (uncast, unmerged) of a directory in AstrAI's layout already: nothing to write. The CLI
    prints it and exits 0 (what was asked holds already); to a caller of ``export`` it is the CheckpointError it
    always was, since no new directory comes back."""


def export(
    source: str | Path,
    target: str | Path | None = None,
    format: str = "astrai",
    dtype: str | None = None,
    max_shard_size: str | None = None,
    merge_lora: bool = False,
) -> Path:
    """Write ``source`` (``bundled:NAME`` too, or a Hub id: its snapshot) to ``target`` (default: ``SOURCE_full``
    for astrai, ``SOURCE_hf`` for hf, ``SOURCE_peft`` for peft; for a Hub id, ``NAME_hf`` etc. in the current
    directory) and return it. ``merge_lora`` (astrai): a LoRA checkpoint's adapter merged
    into its base. ``AlreadyComplete`` where the default format has nothing to do (``check_work_to_do``)."""
    if format not in FORMATS:
        raise UserError(f"--format {format!r}: expected one of {list(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    if format != "hf" and max_shard_size is not None:
        raise UserError("--max_shard_size applies to --format hf (AstrAI's checkpoint and an adapter are one file)")
    if merge_lora and format == "peft":
        raise UserError("--merge_lora writes the merged model; --format peft writes the adapter alone: drop one")
    if merge_lora and format == "astrai" and dtype is not None:
        raise UserError(
            "--dtype does not apply to --merge_lora (the merged model keeps the checkpoint's dtype); "
            "use --format hf --dtype, or export the merged model again with --dtype"
        )
    max_shard_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE) if format == "hf" else None
    if target is None and hub.is_hub_id(str(source)):  # beside a cache snapshot is no place: here, named after it
        target = hub.HubId.parse(str(source)).repo.split("/")[1] + _DEFAULT_SUFFIX[format]
    source = hub.resolve_model(source, "export")  # a path, or a Hub id's snapshot
    target = destination(source, target, format)  # first, for every format: before anything is read
    if format == "hf":
        path = export_hf(source, target, dtype, max_shard_bytes)
    elif format == "peft":
        path = export_peft(source, target, dtype)
    elif merge_lora:
        from astrai_fabric.checkpoint.state import export_merged  # Lightning (~17 s here): only here

        path = export_merged(source, target)
    else:
        return export_astrai(source, target, dtype)
    _say_if_quantized(source, format)
    return path


def _say_if_quantized(source: Path, format: str) -> None:
    """A QLoRA checkpoint's adapter was trained over the NF4 base: what an export of it computes, said once."""
    meta = read_json(source / META_FILE, what="the run's meta data") if (source / META_FILE).is_file() else {}
    quantized = QUANTIZATION_KEY in meta or meta.get(QUANTIZE_FLAG) is not None  # peft needs no record: said anyway
    if not quantized or not (source / ADAPTER_FILE).is_file():
        return
    if format == "peft":
        note = (
            "its adapter was trained over the base quantised to NF4 (--quantize nf4); PEFT applies it to the "
            "full-precision base, a slightly different model (docs/lora.md, QLoRA)"
        )
    else:
        note = (
            "its adapter was trained over the base quantised to NF4 (--quantize nf4): merged into the "
            "dequantised base, the model the run trained"
        )
    print(f"note: {source}: {note}", file=sys.stderr)


_DEFAULT_SUFFIX = {"astrai": "_full", "hf": "_hf", "peft": "_peft"}
_STAGING_SUFFIX_BYTES = len(".") + len(".tmp-12345678")
"""What ``checkpoint.files.staging_dir`` adds to the name of the directory it stages."""


def destination(source: Path, target: str | Path | None, format: str) -> Path:
    """``target`` (default: ``SOURCE`` + ``_full``/``_hf``/``_peft`` beside it) checked as ``--ckpt_dir`` is,
    reading only: a path through directories this process may write, where nothing exists yet or an empty
    directory does; not a link, not inside ``source`` nor holding it. Refused in one line naming ``--out``."""
    if target is None:
        named = source if source.name not in ("", "..") else Path(os.path.abspath(source))
        if not named.name:
            raise UserError(f"export {source}: no name to put {_DEFAULT_SUFFIX[format]} after; give --out")
        target = named.with_name(named.name + _DEFAULT_SUFFIX[format])
    target = Path(target)
    flag = f"--out {target}"
    try:
        here = Path(os.path.abspath(target))
        if not here.name:
            raise CheckpointError(f"{flag}: names no directory to create; choose another --out")
        out_real, source_real = here.resolve(), Path(os.path.abspath(source)).resolve()
        if out_real == source_real or source_real in out_real.parents:
            where = "is" if out_real == source_real else "is inside"
            raise CheckpointError(
                f"{flag}: {where} {source}, the directory being exported; export writes a new "
                "directory, never into what it reads: choose another --out"
            )
        if out_real in source_real.parents:
            raise CheckpointError(f"{flag}: holds {source}, the directory being exported; choose another --out")
        if os.path.lexists(here):
            if here.is_symlink():
                raise CheckpointError(
                    f"{flag}: is a symbolic link; export writes a new directory, never through "
                    "a link: choose another --out"
                )
            if not here.is_dir():
                raise CheckpointError(f"{flag}: {target} is a file, not a directory; choose another --out")
            entries = sorted(os.listdir(here))
            if entries:
                raise CheckpointError(
                    f"{flag}: already exists and is not empty ({abbreviate(entries)}); export writes a new or "
                    "empty directory and never over files, an earlier export's included: choose another --out, "
                    "or remove it"
                )
        existing = next(p for p in here.parents if os.path.lexists(p))
        if not existing.is_dir():
            what = "is a file, not a directory" if existing.is_file() else "is not a directory"
            raise CheckpointError(f"{flag}: {existing} {what}; choose another --out")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise CheckpointError(f"{flag}: {existing} is not writable here; choose another --out")
        longest = os.pathconf(existing, "PC_NAME_MAX") - _STAGING_SUFFIX_BYTES  # its staging sibling's name fits
        if len(os.fsencode(here.name)) > longest:
            raise CheckpointError(f"{flag}: cannot be created or written (a name of more than {longest} bytes)")
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop (Path.resolve, Python < 3.13)
        why = getattr(err, "strerror", None) or err
        raise CheckpointError(f"{flag}: cannot be created or written ({why})") from None
    return target


def check_work_to_do(source: Path) -> None:
    """``--format astrai`` without ``--dtype`` or ``--merge_lora`` has work only for a sharded checkpoint (completed)
    or a Hugging Face directory (converted); a directory in AstrAI's layout already (its weights present) is
    ``AlreadyComplete``, saying which flag does what the user may have meant."""
    if (source / STATE_DIR).is_dir():
        return
    ckpt = load_checkpoint(source, load_extra=False)  # refuses what is no model (no weights: one line saying so)
    if ckpt.source is not None or ckpt.model_config().extensions:  # converted, or refused: AstrAI cannot load it
        return
    what = "checkpoint" if ckpt.meta else "model directory"
    if ckpt.lora is not None or (source / ADAPTER_FILE).is_file():
        formats = (
            "--format peft writes its adapter for PEFT, --merge_lora the merged model, --format hf the "
            "merged model for transformers"
        )
    else:
        formats = "--format hf writes it for transformers, --dtype casts it"
    raise AlreadyComplete(
        f"{source}: already a complete {what} in AstrAI's layout, which AstrAI loads as it is; nothing written "
        f"({formats})"
    )


def export_astrai(source: Path, target: Path, dtype: str | None = None) -> Path:
    """AstrAI's layout: a sharded checkpoint completed, a Hugging Face directory converted, or a complete
    checkpoint cast to ``dtype``; refused where AstrAI's schema cannot express the model."""
    if (source / STATE_DIR).is_dir():
        from astrai_fabric.checkpoint.state import export_checkpoint  # Lightning and DCP (~17 s here): only here

        path = export_checkpoint(source, target, cast=_caster(dtype))
        config = load_checkpoint(path, load_extra=False).model_config()
        if config.extensions:  # resumable here; AstrAI refuses its model_type (never misreads it)
            print(
                f"note: {path / CONFIG_FILE} keeps model_type {config.to_dict()['model_type']!r} for "
                f"{config.extensions}, which AstrAI's schema lacks; use --format hf for transformers",
                file=sys.stderr,
            )
        return path
    if dtype is None:  # before optimizer.pt is read: AlreadyComplete unless a Hugging Face directory, converted here
        check_work_to_do(source)
    ckpt = load_checkpoint(source)
    config = ckpt.model_config()
    if config.extensions:
        what = f"a {ckpt.source.model_type} model" if ckpt.source else "this model"
        raise ConfigError(
            f"{source / CONFIG_FILE}: {what} needs {config.extensions}, which AstrAI's schema lacks (AstrAI would "
            "compute another function); export it with --format hf"
        )
    cast = _caster(dtype)
    if ckpt.source is not None:  # a Hugging Face directory: AstrAI's model directory (no run, no meta.json)
        files: dict[str, str | Path] = dict(files_inside(source, (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)))
        files[CONFIG_FILE] = json.dumps(config.to_dict(), indent=2)
        return save_model_directory(target, cast(ckpt.state_dict), files)
    if not ckpt.meta:
        return save_model_directory(target, cast(ckpt.state_dict), {CONFIG_FILE: json.dumps(ckpt.config, indent=2)})
    names = [
        p.name
        for p in source.iterdir()
        if (p.is_file() or p.is_symlink())
        and p.suffix not in (".pt", ".safetensors")
        and p.name not in (META_FILE, CONFIG_FILE)
    ]
    copied = files_inside(source, sorted(names))
    meta = {k: v for k, v in ckpt.meta.items() if k not in RESERVED_META}
    return save_checkpoint(
        target,
        cast(ckpt.state_dict),
        ckpt.config,
        epoch=ckpt.epoch,
        consumed_samples=ckpt.consumed_samples,
        meta=meta,
        extra=ckpt.extra,
        files=copied,
    )


def export_hf(source: Path, target: Path, dtype: str | None = None, max_shard_bytes: int | None = None) -> Path:
    """A directory transformers loads: config.json, generation_config.json, safetensors (sharded above
    ``max_shard_bytes``, with transformers' ``{"format": "pt"}`` header) and the tokenizer files."""
    ckpt = load_checkpoint(source, load_extra=False)
    config = ckpt.model_config()
    config.check_buildable(source=str(source / CONFIG_FILE))
    origin = hf.source_of(ckpt.source, ckpt.meta, config, str(source / META_FILE))
    # Only to check the tensors fit the config, strictly: allocated, never written, so no memory (not the meta
    # device, whose first use imports torch._dynamo and torch.distributed.fsdp, ~1.5 s measured).
    model = empty_model(config, str(source / CONFIG_FILE))
    load_model_weights(model, ckpt.state_dict, source=source / WEIGHTS_FILE, assign=True)
    state = _caster(dtype)(model.state_dict())
    written_dtype = dtype or str(state["embed_tokens.weight"].dtype).removeprefix("torch.")
    tokenizer_files, token_ids = _tokenizer_files(source, config)
    if origin is not None:
        token_ids = {k: origin.config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    hf_config = hf.hf_config(config, state, written_dtype, origin, token_ids, where=str(source / CONFIG_FILE))
    files = {
        CONFIG_FILE: json.dumps(hf_config, indent=2),
        GENERATION_CONFIG_FILE: json.dumps(hf.generation_config(token_ids), indent=2),
        **tokenizer_files,
    }
    tensors = hf.state_dict_to_hf(state, config, hf_config["model_type"])
    return save_model_directory(target, tensors, files, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})


PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModelForCausalLM`` puts before the transformers model's own tensor names."""


def export_peft(source: Path, target: Path, dtype: str | None = None) -> Path:
    """A LoRA checkpoint's adapter as PEFT writes one for its Hugging Face base: ``adapter_config.json`` (peft_type
    LORA, r, lora_alpha, transformers' module names as target_modules, the base's directory) and
    ``adapter_model.safetensors`` under PEFT's names. ``B``'s rows are output rows, so on q/k they are permuted back
    to transformers' rotate-half pairing like the weight rows; ``A`` (input columns) is unchanged."""
    ckpt = load_checkpoint(source, load_extra=False, merge_lora=False)
    if ckpt.lora is None or ckpt.lora.base is None:
        raise CheckpointError(
            f"{source}: not a LoRA checkpoint with a base pointer (no {PEFT_WEIGHTS_FILE} and meta.json "
            "'lora_base'); --format peft writes an adapter, --format hf a model"
        )
    base = ckpt.lora.base.resolve()
    base_source = load_checkpoint(base, load_extra=False).source
    if base_source is None:
        raise ConfigError(
            f"{source}: its LoRA base {base} is not a Hugging Face directory, so PEFT has no base "
            "model to apply the adapter to; export the merged model with --format hf"
        )
    config, spec = ckpt.model_config(), ckpt.lora.spec
    tensors, modules = {}, set()
    for key, tensor in sorted(_caster(dtype)(ckpt.lora.state_dict).items()):
        layer, _, part = key.rpartition(".")
        name = hf.our_key_to_hf(f"{layer}.weight", config)  # the family's names: DeepSeek's q_proj is q_b_proj
        # an MoE layer's experts: the routed ones are no nn.Linear in transformers; the shared ones are not mapped
        if name is None or ".experts." in name or ".shared_expert" in name:
            raise ConfigError(f"{source}: adapter on {layer} has no PEFT equivalent (only dense layers are mapped)")
        if fused := hf.fused_into(f"{layer}.weight", base_source.model_type):
            raise ConfigError(
                f"{source}: adapter on {layer} has no PEFT equivalent: its base's files fuse that layer "
                f"with others ({fused}); export the merged model with --format hf"
            )
        module = name.removesuffix(".weight")
        if part == "lora_B" and hf.is_rotated(f"{layer}.weight", config):
            tensor = hf.interleaved_to_rotate_half(tensor, config.attention_head_dim, config.rope_dim)
        tensors[f"{PEFT_PREFIX}{module}.{part}.weight"] = tensor.contiguous()
        modules.add(module.rpartition(".")[2])
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **_peft_base(base),
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    files = {PEFT_CONFIG_FILE: json.dumps(peft_config, indent=2).encode("utf-8")}  # bytes: written as they are
    return save_model_directory(target, tensors, files, metadata={"format": "pt"}, weights_name=PEFT_WEIGHTS_FILE)


def _peft_base(base: Path) -> dict[str, str]:
    """How ``adapter_config.json`` names the base: a snapshot in the Hugging Face cache as its Hub id and commit
    (PEFT's ``base_model_name_or_path`` + ``revision``, which its ``AutoPeftModel`` fetches anywhere; the cache path is
    this machine's only), else the directory's absolute path."""
    if (pin := hub.portable(base)) is not None:
        repo, _, commit = pin.partition("@")
        return {"base_model_name_or_path": repo, "revision": commit}
    return {"base_model_name_or_path": str(base)}


def _tokenizer_files(source: Path, config: ModelConfig) -> tuple[dict[str, str | Path], dict[str, int | None]]:
    """The tokenizer files to write (AstrAI's ``tokenizer_config.json`` turned into Hugging Face's) and the special
    token ids; none where the directory holds no tokenizer."""
    if not (source / TOKENIZER_FILE).is_file():
        return {}, {}
    files: dict[str, str | Path] = dict(files_inside(source, HF_TOKENIZER_FILES))
    tokenizer = Tokenizer.from_dir(source)  # checks both files: JSON objects, special tokens in the vocabulary
    config_path = source / TOKENIZER_CONFIG_FILE
    raw = read_json(config_path, what="the tokenizer's config") if config_path.is_file() else {}  # a BOM is taken
    token_ids: dict[str, int | None] = {}
    if tokenizer.layout == ASTRAI:  # the loader's rule (a Hugging Face layout is copied as it is)
        written = hf.hf_tokenizer_config(raw, config.max_position_embeddings, str(config_path))
        files[TOKENIZER_CONFIG_FILE] = json.dumps(written, indent=2)
        token_ids = {f"{name}_id": tokenizer.token_id(name) for name in ("bos_token", "eos_token", "pad_token")}
    return files, token_ids


def _caster(dtype: str | None):  # noqa: ANN202 - a small closure
    def cast(state: dict[str, Tensor]) -> dict[str, Tensor]:
        if dtype is None:
            return dict(state)
        return {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}

    return cast
