"""Hostile and malformed input, file type by file type, through the real CLI entry point (in-process): recipes and
flags, a model's config.json, tokenizer files and chat templates, bin shards, JSONL records, checkpoints and their
.pt files, ckpt_dir, and the prepare, generate and plot commands.

Every case asserts the error promise: the exit code, one line naming the culprit, no traceback, nothing written or
overwritten (a byte-for-byte snapshot of the workspace), and a hang guard (faulthandler ends the test process after
60 s, so a hang fails loudly instead of running into CI's limit; a guard, not a speed assertion).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai_fabric import tokenizer as tokenizer_module
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint.weights import host_memory_bytes
from astrai_fabric.cli import main
from astrai_fabric.data import record_size
from astrai_fabric.metric_entries import MAX_LINE_BYTES

TINY_CONFIG = json.loads((TINY_MODEL_DIR / "config.json").read_text())
TINY_TOKENIZER_CONFIG = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
CHAT = TINY_TOKENIZER_CONFIG["chat_template"]
Files = dict[str, bytes | str | Callable[[Path], None]]


@dataclass
class Case:
    id: str
    argv: list[str]
    """``{c}`` is this case's directory, ``{w}`` the shared workspace (a finished 1-step run in ``{w}/run``)."""
    message: str
    files: Files = field(default_factory=dict)
    """Files written into ``{c}`` before the snapshot: text, bytes, or ``make(path)``."""
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the case (``{c}`` filled in), e.g. ``HF_HUB_CACHE``."""


def seq(*extra: str, data: str = "bundled:data/seq", model: str = "bundled:tiny") -> list[str]:
    return [
        "seq",
        "--param_path",
        model,
        "--data_root_path",
        data,
        "--window_size",
        "16",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        "{c}/out",
        *extra,
    ]


def sft(*extra: str, data: str = "bundled:data/sft", model: str = "bundled:tiny") -> list[str]:
    return ["sft", *seq(*extra, data=data, model=model)[1:]]


def dpo(*extra: str, data: str = "bundled:data/dpo", model: str = "bundled:tiny") -> list[str]:
    return ["dpo", *seq(*extra, data=data, model=model)[1:]]


def grpo(*extra: str, data: str = "bundled:data/grpo", model: str = "bundled:tiny") -> list[str]:
    return ["grpo", *seq(*extra, data=data, model=model)[1:], "--window_size", "64"]


def model_dir(name: str = "m", **config) -> Files:
    """A model directory: the tiny model's config.json with ``config`` applied (None deletes a key), its tokenizer."""
    values = {k: v for k, v in {**TINY_CONFIG, **config}.items() if v is not None}
    return {
        f"{name}/config.json": json.dumps(values),
        f"{name}/tokenizer.json": (TINY_MODEL_DIR / "tokenizer.json").read_bytes(),
        f"{name}/tokenizer_config.json": json.dumps(TINY_TOKENIZER_CONFIG),
    }


def tokenizer_dir(name: str = "t", tokenizer_json: bytes | str | None = None, **config) -> Files:
    """A tokenizer directory: the tiny tokenizer with its tokenizer_config.json changed by ``config``."""
    return {
        f"{name}/tokenizer.json": tokenizer_json or (TINY_MODEL_DIR / "tokenizer.json").read_bytes(),
        f"{name}/tokenizer_config.json": config.pop("raw", None) or json.dumps({**TINY_TOKENIZER_CONFIG, **config}),
    }


def template(text: str) -> Files:
    return tokenizer_dir(chat_template=text)


HF_EOS = {"eos_token": "<|end_of_sentence|>"}


def hf_tokenizer(config: dict, jinja: str | bytes | None = None) -> Files:
    """A tokenizer directory in Hugging Face's layout: the tiny tokenizer.json, ``config`` as tokenizer_config.json
    and, when given, ``jinja`` as chat_template.jinja."""
    files: Files = {
        "t/tokenizer.json": (TINY_MODEL_DIR / "tokenizer.json").read_bytes(),
        "t/tokenizer_config.json": json.dumps(config),
    }
    if jinja is not None:
        files["t/chat_template.jinja"] = jinja
    return files


def shards(meta: dict | str, **arrays: np.ndarray | bytes) -> Files:
    """A bin shard directory ``d/``: ``meta.json`` as given and each key's ``.bin`` bytes."""
    files: Files = {"d/meta.json": meta if isinstance(meta, str) else json.dumps(meta)}
    for key, array in arrays.items():
        files[f"d/{key}.bin"] = array if isinstance(array, bytes) else array.tobytes()
    return files


def seq_shard(tokens: np.ndarray) -> Files:
    return shards({"sequence": {"shape": [len(tokens)], "dtype": str(tokens.dtype)}}, sequence=tokens)


def sft_shard(length: int = 400, mask: int = 1, positions: np.ndarray | None = None) -> Files:
    ids = np.arange(length, dtype=np.int32) % 2000
    pos = positions if positions is not None else np.arange(length, dtype=np.int32) % 64
    loss = np.full(length, mask, dtype=np.bool_)
    meta = {
        k: {"shape": [length], "dtype": str(a.dtype)}
        for k, a in (("sequence", ids), ("position_ids", pos), ("loss_mask", loss))
    }
    return shards(meta, sequence=ids, position_ids=pos, loss_mask=loss)


def jsonl(*lines: object, name: str = "data.jsonl") -> Files:
    return {name: "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)}


TEXT_PIPELINE = {"p.json": '{"input": {"sections": [{"field": "text", "action": "train"}]}}'}
CHAT_SECTIONS = [{"field": "messages", "action": "$role", "template": True}]
CHAT_PIPELINE = {"p.json": json.dumps({"input": {"sections": CHAT_SECTIONS}, "mask": {"assistant": "train"}})}


def prepare_argv() -> list[str]:
    return ["prepare", "{c}/data.jsonl", "-o", "{c}/o", "-c", "{c}/p.json", "--tokenizer_path", "bundled:tiny"]


def data_config(config: object, *lines: object) -> Files:
    """``d/``: JSONL records beside AstrAI's ``dataset_config.json`` (an object, or raw text)."""
    return {
        "d/dataset_config.json": config if isinstance(config, str) else json.dumps(config),
        **jsonl(*lines, name="d/data.jsonl"),
    }


CHAT_SOURCE = {"sections": [{"field": "chosen", "action": "$role", "template": True}]}
DPO_CONFIG = {"input": {"sources": {"chosen": CHAT_SOURCE, "rejected": {"sections": [
    {"field": "rejected", "action": "$role", "template": True}]}}}, "mask": {"assistant": "train"},
    "output": {"position_ids_mode": "none"}}  # fmt: skip
GRPO_CONFIG = {
    "input": {
        "sources": {
            "prompts": {"sections": [{"field": "prompt", "action": "mask", "template": True}]},
            "responses": {
                "sections": [{"field": "responses", "action": "train"}],
                "list_field": True,
                "mask_key": "masks",
            },
            "rewards": {"sections": [{"field": "rewards", "action": "value"}]},
        }
    },
    "output": {"position_ids_mode": "none"},
}
SFT_CONFIG = {"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
              "mask": {"assistant": "train"}}  # fmt: skip
PAIR = {"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]}  # fmt: skip


def configured(config: dict, **changes: object) -> dict:
    """``config`` with ``changes`` applied: ``group__key=value`` sets a nested key, None deletes it."""
    out = json.loads(json.dumps(config))
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def checkpoint(change: Callable[[Path], None]) -> Files:
    """``ck/``: a copy of the workspace's 1-step checkpoint, then ``change(ck)``."""

    def make(path: Path) -> None:
        shutil.copytree(path.parents[1] / "w" / "run" / "epoch_0_step_1", path)
        change(path)

    return {"ck": make}


def edit_json(name: str, **values) -> Callable[[Path], None]:
    def change(ck: Path) -> None:
        data = json.loads((ck / name).read_text())
        (ck / name).write_text(json.dumps({**data, **values}))

    return change


def replace_pt(stem: str, obj: object) -> Callable[[Path], None]:
    return lambda ck: torch.save(obj, ck / f"{stem}.pt")


def resume(*extra: str) -> list[str]:
    return seq("--resume", "{c}/ck", *extra)


def rename_position(**values) -> Callable[[Path], None]:
    def change(ck: Path) -> None:
        meta = json.loads((ck / "meta.json").read_text())
        meta["resume_position"] = values.get("whole", {**meta["resume_position"], **values})
        (ck / "meta.json").write_text(json.dumps(meta))

    return change


NESTED = "[" * 100_000 + "]" * 100_000
"""Deeper than the interpreter's recursion limit: Python's JSON parser raises RecursionError, not ValueError."""


def sparse(size: int) -> Callable[[Path], None]:
    """A file of ``size`` zero bytes that takes no disk space."""

    def make(path: Path) -> None:
        with path.open("wb") as file:
            file.truncate(size)

    return make


def link_to(target: str) -> Callable[[Path], None]:
    """A symbolic link to ``target`` (``/dev/zero``, or a name beside it that does not exist)."""
    return lambda path: path.symlink_to(target)


def replaced(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    """A checkpoint change: its file ``name`` replaced by what ``make(path)`` puts there (a FIFO, a link)."""
    return lambda ck: ((ck / name).unlink(), make(ck / name))


def in_run(change: Callable[[Path], None]) -> Files:
    """``out/epoch_0_step_1``: the workspace's 1-step checkpoint copied into the case's ckpt_dir (what ``--resume
    auto`` finds), then ``change(ck)``."""

    def make(path: Path) -> None:
        shutil.copytree(path.parents[2] / "w" / "run" / "epoch_0_step_1", path)
        change(path)

    return {"out/epoch_0_step_1": make}


def sharded_resume(*extra: str) -> list[str]:
    """Resume ``{c}/ck``, a copy of the workspace's sharded 1-step checkpoint, as it was written (FSDP on 1 rank)."""
    return seq("--parallel_mode", "fsdp", "--resume", "{c}/ck", *extra)


def sharded(change: Callable[[Path], None], where: str = "ck") -> Files:
    """``where``: a copy of the workspace's sharded 1-step checkpoint, then ``change(its state/)``."""

    def make(path: Path) -> None:
        shutil.copytree(path.parents[where.count("/") + 1] / "w" / "sharded" / "epoch_0_step_1", path)
        change(path / "state")

    return {where: make}


class Payload:
    """Unpickled, it would run ``touch PATH`` (the case's ``{c}/pwned``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def planted_metadata(state: Path) -> None:
    import pickle

    (state / ".metadata").write_bytes(pickle.dumps(Payload(_case_dir(state) / "pwned")))


def planted_value(state: Path) -> None:
    """An optimizer setting replaced by the payload, the state saved again by torch as it saves any value."""
    import torch.distributed.checkpoint as dcp

    from astrai_fabric.checkpoint.sharded_state import read_whole_state

    whole = read_whole_state(state)
    whole["optimizer"]["adamw"]["param_groups"][0]["lr"] = Payload(_case_dir(state) / "pwned")
    shutil.rmtree(state)
    with warnings.catch_warnings():  # saving in one process is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(whole, checkpoint_id=state, no_dist=True)


def rewrite_metadata(state: Path, storage=None, tensors=None) -> None:  # noqa: ANN001 - edits of torch's classes
    """The state's index as torch wrote it, with ``storage(info)`` applied to its first storage entry and
    ``tensors(entry)`` to its first tensor entry."""
    import pickle

    metadata = pickle.loads((state / ".metadata").read_bytes())  # our own file, written by the fixture
    if storage is not None:
        storage(next(iter(metadata.storage_data.values())))
    if tensors is not None:
        tensors(next(e for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks")))
    (state / ".metadata").write_bytes(pickle.dumps(metadata))


def _case_dir(state: Path) -> Path:
    """``{c}``: the case's directory above a checkpoint's ``state/``."""
    return next(p for p in state.parents if p.name == "c")


OK_GROUP = {"prompt": "Say hi", "responses": ["hi", "hello"], "rewards": [1.0, 0.0]}
RECIPE = "param_path: bundled:tiny\ndata_root_path: bundled:data/seq\nckpt_dir: {c}/out\n"
TWO_RECIPES = ["seq", "--config", "{c}/a.yaml", "-c", "{c}/b.yaml"]


def parquet_file(path: Path, columns: dict[str, list]) -> None:
    pa = pytest.importorskip("pyarrow")  # the datasets extra brings it
    pytest.importorskip("pyarrow.parquet").write_table(pa.table(columns), path)


def saved_dict(path: Path, splits: list[str]) -> None:
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_dict({"text": ["In the beginning"]})
    datasets.DatasetDict(dict.fromkeys(splits, one)).save_to_disk(path)


TABLE_RECORD_BYTES = 256 << 10
"""The limit for one record while the table runs (``record_size.MAX_RECORD_BYTES``, 16 MiB, lowered): its cases past
the limit are a few hundred KB, not tens of MB (and past the 200 KB of NESTED)."""
PAST_THE_LIMIT = "x" * 300_000
"""A text longer than ``TABLE_RECORD_BYTES``, shorter than twice it (CSV's limit for a row as written)."""


def arrow_stream(path: Path, columns: dict[str, list]) -> None:
    pa = pytest.importorskip("pyarrow")
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def saved_dataset(path: Path, columns: dict[str, list]) -> None:
    pytest.importorskip("datasets").Dataset.from_dict(columns).save_to_disk(path)


def alias_bomb(levels: int = 20) -> str:
    """A card whose YAML header is ~1.4 KB and 10^levels values when its aliases are expanded."""
    lists = "".join(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, levels))
    configs = "configs:\n- config_name: a\n  data_files: '*.parquet'\n"
    return f"---\n{configs}levels:\n  a0: &a0 [{', '.join('x' * 10)}]\n{lists}---\n"


SUBSETS: Files = {
    "m/README.md": "---\nconfigs:\n- config_name: en\n  data_files: en/*.parquet\n- config_name: fr\n  data_files: "
    "fr/*.parquet\n---\n",
    "m/en/train.parquet": lambda p: parquet_file(p, {"text": ["In the beginning"]}),
    "m/fr/train.parquet": lambda p: parquet_file(p, {"text": ["Au commencement"]}),
}
"""A dataset repository laid out as on the Hub: two subsets named by its README's configs."""

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The commit of the Hugging Face caches ``hub_cache`` lays out."""
TINY_REPO = "{c}/home/hub/models--org--tiny"
"""The tiny model's folder in that cache (``org/tiny``), as messages name it."""
TINY_SNAPSHOT = f"{TINY_REPO}/snapshots/{HUB_COMMIT}"
HUB_OFFLINE = {"HF_HUB_CACHE": "{c}/home/hub", "HF_HUB_OFFLINE": "1"}
"""The Hub cases' environment: their cache, read without a request."""
HUB_UNREACHABLE = {"HF_HUB_CACHE": "{c}/home/hub", "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
"""Online, with a Hub that cannot be reached (nothing listens on port 9): the cache is the fallback."""
HUB_TEXTS = b'{"text": "In the beginning God created the heaven and the earth"}\n' * 8


def hub_cache(
    ref: str | None = HUB_COMMIT, change: Callable[[Path], None] | None = None, dataset: bool = False
) -> Files:
    """``home/hub/``: a Hugging Face cache as huggingface_hub writes one, holding the tiny model as ``org/tiny`` (or,
    ``dataset``, texts as the dataset ``org/texts``): each file a blob (``blobs/SHA256``) that
    ``snapshots/HUB_COMMIT/NAME`` links to by ``../../blobs/SHA256``, ``refs/main`` holding ``ref`` (``{c}`` filled
    in; None: no ref); then ``change(the repository's folder)``. Beside it, ``outside/m`` (a model) and
    ``outside/d`` (texts): where a ref or a link out of the cache would lead."""
    files = {"data/train.jsonl": HUB_TEXTS} if dataset else {p.name: p.read_bytes() for p in TINY_MODEL_DIR.iterdir()}

    def make(home: Path) -> None:
        folder = home / "hub" / ("datasets--org--texts" if dataset else "models--org--tiny")
        (folder / "blobs").mkdir(parents=True)
        (folder / "refs").mkdir()
        for name, data in files.items():
            blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = folder / "snapshots" / HUB_COMMIT / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        if ref is not None:
            (folder / "refs" / "main").write_text(ref.replace("{c}", str(home.parent)))
        if change is not None:
            change(folder)

    return {"home": make, **model_dir("outside/m"), "outside/d/train.jsonl": HUB_TEXTS}


def in_snapshot(name: str, target: str) -> Callable[[Path], None]:
    """A ``hub_cache`` change: the snapshot's ``name`` a link to ``target`` (``{hub}`` is the cache's folder)."""

    def change(folder: Path) -> None:
        link = folder / "snapshots" / HUB_COMMIT / name
        link.unlink()
        link.symlink_to(target.replace("{hub}", str(folder.parent)))

    return change


def other_repository_blob(folder: Path) -> None:
    """A ``hub_cache`` change: tokenizer.json links to the same bytes in another repository's ``blobs/``."""
    other = folder.parent / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    link = folder / "snapshots" / HUB_COMMIT / "tokenizer.json"
    (other / "tokenizer").write_bytes(link.read_bytes())
    link.unlink()
    link.symlink_to(os.path.relpath(other / "tokenizer", link.parent))


def ref_folder_outside(folder: Path) -> None:
    """A ``hub_cache`` change: ``refs/refs/`` (where huggingface_hub keeps ``refs/pr/1``) a link to ``outside/m``,
    which holds ``pr/1`` naming the snapshot."""
    outside = folder.parents[2] / "outside" / "m"
    (outside / "pr").mkdir(parents=True)
    (outside / "pr" / "1").write_text(HUB_COMMIT)
    (folder / "refs" / "refs").symlink_to(outside)


def moved_out(path_in_folder: str) -> Callable[[Path], None]:
    """A ``hub_cache`` change: ``path_in_folder`` (``snapshots/COMMIT``, or ``.`` the repository's folder itself)
    moved to ``outside/moved`` beside the cache and linked from where it was."""

    def change(folder: Path) -> None:
        inside = (folder / path_in_folder).resolve()
        outside = folder.parents[2] / "outside" / "moved"
        shutil.move(inside, outside)
        inside.symlink_to(outside)

    return change


NF4_KEYS = [f"layers.{i}.attention.{name}.weight" for i in range(4) for name in ("q_proj", "o_proj")]
"""The tiny model's weights NF4's blocks hold (``quantize.plan_quantization``: 128 x 128; the others do not fit)."""


def qlora_checkpoint(alpha: int = 32, **meta) -> Files:
    """``ck/``: an adapter-only checkpoint over the workspace's 1-step checkpoint as a QLoRA run writes one (r 4,
    ``alpha``, the default targets, adapters of zeros, ``meta.json`` pointing at its base with ``quantize: nf4`` and
    the quantization record), then ``meta`` applied to its ``meta.json`` (None deletes a key)."""
    from safetensors.torch import load_file, save_file

    from astrai_fabric.checkpoint.adapter import lora_base_entry, weight_digests
    from astrai_fabric.lora import LoRASpec

    def make(path: Path) -> None:
        base = (path.parents[1] / "w" / "run" / "epoch_0_step_1").resolve()
        shutil.copytree(base, path)
        spec = LoRASpec(4, alpha)
        adapter = {}
        for key, weight in load_file(path / "model.safetensors").items():
            if key.removesuffix(".weight").rpartition(".")[2] in spec.targets:
                adapter[key.replace(".weight", ".lora_A")] = torch.zeros(spec.r, weight.shape[1])
                adapter[key.replace(".weight", ".lora_B")] = torch.zeros(weight.shape[0], spec.r)
        (path / "model.safetensors").unlink()
        save_file(adapter, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(spec.adapter_config()))
        record = {"method": "nf4", "block_size": 64, "scaler_block_size": 256, "dtype": "float32", "keys": NF4_KEYS}
        pointer = lora_base_entry(base, path, weight_digests(base))
        values = {"lora_r": 4, "quantize": "nf4", "lora_base": pointer, "quantization": record, **meta}
        written = {**json.loads((path / "meta.json").read_text()), **values}
        (path / "meta.json").write_text(json.dumps({k: v for k, v in written.items() if v is not None}))

    return {"ck": make}


def widened_checkpoint(hidden_size: int) -> Files:
    """``ck/``: the workspace's 1-step checkpoint whose config.json says ``hidden_size`` (its weights 128 wide)."""

    def make(path: Path) -> None:
        shutil.copytree(path.parents[1] / "w" / "run" / "epoch_0_step_1", path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "hidden_size": hidden_size}))

    return {"ck": make}


CASES = [
    # --- recipes and flags: the same checks for a value from YAML as from the command line ------------------------
    Case("yaml-duplicate-key", ["seq", "--config", "{c}/r.yaml"], "duplicate key 'max_lr'",
         {"r.yaml": RECIPE + "max_lr: 1.0e-3\nmax_lr: 2.0e-3\n"}),
    Case("num-threads-a-million", seq("--num_threads", "1000000"), "num_threads must be at most 1024, got 1000000"),
    Case("num-workers-a-million", seq("--num_workers", "1000000"), "num_workers must be at most 256, got 1000000"),
    Case("yaml-int-digits", ["seq", "--config", "{c}/r.yaml"], "r.yaml: not valid YAML (Exceeds the limit (4300 "
         "digits)", {"r.yaml": RECIPE + "max_steps: " + "9" * 5000 + "\n"}),
    Case("yaml-non-string-key", ["seq", "--config", "{c}/r.yaml"], "keys must be strings, got 1",
         {"r.yaml": RECIPE + "1: 2\n"}),
    Case("yaml-list-key", ["seq", "--config", "{c}/r.yaml"], "keys must be strings",
         {"r.yaml": RECIPE + "? [a, b]\n: 2\n"}),
    Case("yaml-alias", ["seq", "--config", "{c}/r.yaml"], "aliases (*name) are not allowed in a recipe",
         {"r.yaml": RECIPE + "metrics: &m [loss]\nloggers: *m\n"}),
    Case("yaml-not-utf8", ["seq", "--config", "{c}/r.yaml"], "r.yaml: not UTF-8 text",
         {"r.yaml": "ckpt_dir: caf\xe9\n".encode("latin-1")}),
    Case("yaml-inf", ["seq", "--config", "{c}/r.yaml"], "max_lr must be a finite number, got inf",
         {"r.yaml": RECIPE + "max_lr: .inf\n"}),
    Case("yaml-nan", ["seq", "--config", "{c}/r.yaml"], "warmup_ratio must be a finite number, got nan",
         {"r.yaml": RECIPE + "warmup_ratio: .nan\n"}),
    Case("flag-inf", seq("--max_lr", "inf"), "Parser key \"max_lr\": Expected a <class 'float'>. Got value: inf"),
    Case("flag-nan", seq("--neftune_alpha", "nan"), "Parser key \"neftune_alpha\": Expected a <class 'float'>"),
    Case("flag-inf-timeout", seq("--dist_timeout", "inf"), "Parser key \"dist_timeout\": Expected a <class 'float'>"),
    Case("flag-past-float32", seq("--max_lr", "1e39"), "max_lr must be a finite number, got 1e+39"),
    Case("yaml-inf-timeout", ["seq", "--config", "{c}/r.yaml"], "dist_timeout must be a finite number, got inf",
         {"r.yaml": RECIPE + "dist_timeout: .inf\n"}),
    Case("yaml-list-for-int", ["seq", "--config", "{c}/r.yaml"], 'Parser key "batch_per_device"',
         {"r.yaml": RECIPE + "batch_per_device: [1, 2]\n"}),
    Case("yaml-mapping-for-float", ["seq", "--config", "{c}/r.yaml"], 'Parser key "max_lr"',
         {"r.yaml": RECIPE + "max_lr: {a: 1}\n"}),
    Case("yaml-string-for-bool", ["seq", "--config", "{c}/r.yaml"], 'Parser key "pin_memory"',
         {"r.yaml": RECIPE + "pin_memory: perhaps\n"}),
    Case("yaml-unknown-logger", ["seq", "--config", "{c}/r.yaml"], 'Parser key "loggers"',
         {"r.yaml": RECIPE + "loggers: [wandb2]\n"}),
    Case("yaml-section-scalar", ["seq", "--config", "{c}/r.yaml"], "unknown key(s) training",
         {"r.yaml": RECIPE + "training: 3\n"}),
    Case("yaml-scalar", ["seq", "--config", "{c}/r.yaml"], "expected a mapping of flags to values, got int",
         {"r.yaml": "42\n"}),
    Case("yaml-huge", ["seq", "--config", "{c}/r.yaml"], "a recipe is a short YAML file (at most 1 MiB)",
         {"r.yaml": "# " + "x" * (1 << 20) + "\n"}),
    Case("yaml-python-tag", ["seq", "--config", "{c}/r.yaml"], "not valid YAML",
         {"r.yaml": RECIPE + "reward: !!python/object/apply:os.system ['echo pwned']\n"}),
    Case("flag-negative-window", seq("--window_size", "-1"), "window_size must be positive, got -1"),
    Case("flag-val-split", seq("--val_split", "2"), "val_split must be in (0, 1), got 2.0"),
    Case("flag-zero-clip", seq("--max_grad_norm", "0"), "max_grad_norm must be > 0, got 0.0"),
    Case("flag-top-p", grpo("--rollout_top_p", "1.5"), "rollout_top_p must be in (0, 1], got 1.5"),
    Case("flag-no-value", seq("--max_lr"), "max_lr"),
    # --- round 4: several recipes merge in order; each file's mistakes name that file ------------------------------
    Case("recipes-second-unknown-key", TWO_RECIPES, "{c}/b.yaml: unknown key(s) max_lrr (did you mean max_lr?)",
         {"a.yaml": RECIPE, "b.yaml": "max_lrr: 1.0e-3\n"}),
    Case("recipes-second-wrong-type", TWO_RECIPES, '{c}/b.yaml: Parser key "batch_per_device"',
         {"a.yaml": RECIPE, "b.yaml": "batch_per_device: two\n"}),
    Case("recipes-second-null", TWO_RECIPES, "{c}/b.yaml: n_epoch must be int, got null",
         {"a.yaml": RECIPE, "b.yaml": "n_epoch: null\n"}),
    Case("recipes-second-duplicate-key", TWO_RECIPES, "{c}/b.yaml: not valid YAML at line 2, column 1: duplicate key",
         {"a.yaml": RECIPE, "b.yaml": "max_lr: 1.0e-3\nmax_lr: 2.0e-3\n"}),
    Case("recipes-second-train-type", TWO_RECIPES, "{c}/b.yaml: train_type is not 'seq'",
         {"a.yaml": RECIPE, "b.yaml": "train_type: dpo\n"}),
    Case("recipes-second-trust-code", TWO_RECIPES, "{c}/b.yaml: trust_code can only be given on the command line",
         {"a.yaml": RECIPE, "b.yaml": "trust_code: true\n"}),
    Case("recipes-second-missing", TWO_RECIPES, "--config {c}/b.yaml: file not found", {"a.yaml": RECIPE}),
    Case("recipe-names-a-recipe", ["seq", "--config", "{c}/a.yaml"],
         "{c}/a.yaml: config can only be given on the command line",
         {"a.yaml": RECIPE + "config: [{c}/b.yaml]\n", "b.yaml": "max_lr: 1.0e-3\n"}),
    Case("config-without-a-path", ["seq", "--config"], "--config needs a recipe path"),
    Case("config-before-a-flag", ["seq", "--config", "--max_lr", "1e-3"], "--config needs a recipe path"),
    Case("astrai-recipes-disagree", ["-c", "{c}/a.yaml", "-c", "{c}/b.yaml"],
         "{c}/b.yaml: train_type 'dpo' contradicts {c}/a.yaml's",
         {"a.yaml": RECIPE + "train_type: seq\n", "b.yaml": "train_type: dpo\n"}),
    Case("astrai-train-type-list", ["--config", "{c}/a.yaml"], "{c}/a.yaml: train_type must be str",
         {"a.yaml": RECIPE + "train_type: [seq]\n"}),
    Case("prepare-two-configs", ["prepare", "{c}/d.jsonl", "-o", "{c}/o", "-c", "{c}/p.json", "-c", "{c}/q.json",
         "--tokenizer_path", "bundled:tiny"], "prepare takes one -c/--config, got 2: {c}/p.json, {c}/q.json",
         {**jsonl({"text": "x"}, name="d.jsonl"), **TEXT_PIPELINE, "q.json": TEXT_PIPELINE["p.json"]}),
    # --- a recipe is data: code is opted into on the command line only ---------------------------------------------
    Case("reward-popen", ["grpo", "--config", "{c}/r.yaml"], "needs --trust_code on the command line",
         {"r.yaml": RECIPE.replace("seq", "grpo_online") + "reward: {class_path: subprocess.Popen, init_args: "
          "{args: 'touch {c}/pwned', shell: true}}\n"}),
    Case("reward-os-system", grpo("--reward", "os.system", data="bundled:data/grpo_online"),
         "'os.system' is not one of the bundled rewards"),
    Case("trust-code-in-recipe", ["grpo", "--config", "{c}/r.yaml"], "trust_code can only be given on the command line",
         {"r.yaml": RECIPE + "trust_code: true\nreward: os.system\n"}),
    Case("trusted-popen-is-no-reward", grpo("--trust_code", "--reward", '{"class_path": "subprocess.Popen", '
         '"init_args": {"args": "touch pwned", "shell": true}}', data="bundled:data/grpo_online"),
         "'subprocess.Popen' is a class whose instances are not rewards"),
    Case("trusted-builtin-is-no-reward", grpo("--trust_code", "--reward", "os.system",
         data="bundled:data/grpo_online"), "'os.system' is neither a function of (prompts, responses, records)"),
    Case("trusted-missing-module", grpo("--trust_code", "--reward", "no_such_module.score",
         data="bundled:data/grpo_online"), "'no_such_module.score' cannot be imported"),
    Case("reward-bad-init-args", grpo("--reward", '{"class_path": "astrai_fabric.rewards.LengthReward", '
         '"init_args": [1]}', data="bundled:data/grpo_online"), "reward init_args must be a mapping"),
    Case("reward-extra-keys", grpo("--reward", '{"class_path": "astrai_fabric.rewards.LengthReward", "x": 1}',
         data="bundled:data/grpo_online"), "reward must be an import path or {class_path, init_args}"),
    # --- the model's config.json -------------------------------------------------------------------------------
    Case("config-nan-eps", seq(model="{c}/m"), "'rms_norm_eps' must be a finite number, got nan",
         {**model_dir(), "m/config.json": json.dumps(TINY_CONFIG).replace("1e-06", "NaN")}),
    Case("config-negative-eps", seq(model="{c}/m"), "'rms_norm_eps' must be > 0, got -1.0", model_dir(rms_norm_eps=-1)),
    Case("config-zero-theta", seq(model="{c}/m"), "'rope_theta' must be > 0, got 0.0", model_dir(rope_theta=0)),
    Case("config-infinite-theta", seq(model="{c}/m"), "'rope_theta' must be a finite number",
         {**model_dir(), "m/config.json": json.dumps(TINY_CONFIG).replace("10000.0", "Infinity")}),
    Case("config-rope-scaling-string", seq(model="{c}/m"), "'rope_scaling' must be dict or null, got \"2x\"",
         model_dir(rope_scaling="2x")),
    Case("config-rope-factor-string", seq(model="{c}/m"), "'rope_scaling' factor must be a finite number > 0",
         model_dir(rope_scaling={"type": "ntk", "factor": "big"})),
    Case("config-rope-factor-zero", seq(model="{c}/m"), "'rope_scaling' factor must be a finite number > 0, got 0",
         model_dir(rope_scaling={"factor": 0})),
    Case("config-rope-type-number", seq(model="{c}/m"), "'rope_scaling' type must be a string, got 3",
         model_dir(rope_scaling={"type": 3})),
    Case("config-heads-not-dividing", seq(model="{c}/m"), "hidden_size (128) must be a multiple of num_attention_heads",
         model_dir(num_attention_heads=5, num_key_value_heads=5)),
    Case("config-kv-heads-zero", seq(model="{c}/m"), "'num_key_value_heads' must be positive, got 0",
         model_dir(num_key_value_heads=0)),
    Case("config-vocab-string", seq(model="{c}/m"), "'vocab_size' must be int or null, got \"big\"",
         model_dir(vocab_size="big")),
    Case("config-layers-bool", seq(model="{c}/m"), "'num_hidden_layers' must be int or null, got true",
         model_dir(num_hidden_layers=True)),
    Case("config-no-positions", seq(model="{c}/m"), "'max_position_embeddings' is required",
         model_dir(max_position_embeddings=None)),
    Case("config-moe-topk", seq(model="{c}/m"), "n_activated_experts (3) exceeds n_routed_experts (2)",
         model_dir(ffn_type="moe", n_routed_experts=2, n_shared_experts=0, n_activated_experts=3)),
    Case("config-moe-width", seq(model="{c}/m"), "'moe_intermediate_size' must be positive, got 0",
         model_dir(ffn_type="moe", n_routed_experts=2, n_shared_experts=0, n_activated_experts=1,
                   moe_intermediate_size=0)),
    Case("config-gate-without-shared-experts", seq(model="{c}/m"), "'shared_expert_gate' needs shared experts to gate",
         model_dir(ffn_type="moe", n_routed_experts=2, n_shared_experts=0, n_activated_experts=1,
                   shared_expert_gate=True)),
    Case("config-window-layers-without-window", seq(model="{c}/m"),
         "'layer_types' has sliding_attention layers but 'sliding_window' is not set",
         model_dir(layer_types=["sliding_attention", "full_attention", "full_attention", "full_attention"])),
    Case("config-rotary-wider-than-head", seq(model="{c}/m"), "'rotary_dim' (80) needs gqa attention and at most",
         model_dir(rotary_dim=80)),
    Case("config-norm-placement", seq(model="{c}/m"), "norm_placement must be one of ['pre', 'post', 'sandwich']",
         model_dir(norm_placement="middle")),
    Case("config-dense-layer-outside", seq(model="{c}/m"), "'mlp_only_layers' [9] are not layers of a 4-layer model",
         model_dir(ffn_type="moe", n_routed_experts=2, n_shared_experts=0, n_activated_experts=1, mlp_only_layers=[9])),
    Case("config-attn-type", seq(model="{c}/m"), "attn_type must be one of ['gqa', 'mla'], got 'flash'",
         model_dir(attn_type="flash")),
    Case("config-list", seq(model="{c}/m"), "expected a JSON object, got list", {**model_dir(), "m/config.json": "[]"}),
    Case("config-not-utf8", seq(model="{c}/m"), "config.json: not valid JSON",
         {**model_dir(), "m/config.json": b'{"vocab_size": "\xff"}'}),
    Case("window-past-positions", seq("--window_size", "300"),
         "window_size 300 exceeds max_position_embeddings 256"),
    # --- tokenizer files and chat templates -----------------------------------------------------------------------
    Case("tokenizer-json-garbage", seq("--tokenizer_path", "{c}/t"), "tokenizer.json: not a valid tokenizers file",
         tokenizer_dir(tokenizer_json="{not json")),
    Case("tokenizer-config-list", seq("--tokenizer_path", "{c}/t"), "tokenizer_config.json: expected a JSON object",
         tokenizer_dir(raw="[1, 2]")),
    Case("special-tokens-list", seq("--tokenizer_path", "{c}/t"), "'special_tokens' must map names to token strings",
         tokenizer_dir(special_tokens=["<s>"])),
    Case("special-token-int", seq("--tokenizer_path", "{c}/t"), "'special_tokens' must map names to token strings",
         tokenizer_dir(special_tokens={"eos_token": 2})),
    Case("special-token-unknown", seq("--tokenizer_path", "{c}/t"), "special tokens not in the vocabulary: ['<nope>']",
         tokenizer_dir(special_tokens={"eos_token": "<nope>"})),
    Case("template-int", seq("--tokenizer_path", "{c}/t"), "'chat_template' must be a Jinja string",
         tokenizer_dir(chat_template=7)),
    Case("template-list-no-default", seq("--tokenizer_path", "{c}/t"), "lists ['tool_use'], but no 'default'",
         tokenizer_dir(chat_template=[{"name": "tool_use", "template": CHAT}])),
    Case("template-syntax", seq("--tokenizer_path", "{c}/t"), "chat_template is not valid Jinja",
         template("{% for m in messages %}")),
    Case("template-raise", sft("--tokenizer_path", "{c}/t"), "chat_template failed on ",
         template("{{ raise_exception('system messages are not supported') }}")),
    Case("template-undefined-call", sft("--tokenizer_path", "{c}/t"), "'nothing' is undefined",
         template("{{ nothing() }}")),
    Case("template-sandbox", sft("--tokenizer_path", "{c}/t"), "attribute '__class__' of 'str' object is unsafe",
         template("{{ ''.__class__.__mro__ }}")),
    Case("template-mutation", sft("--tokenizer_path", "{c}/t"), "is unsafe", template("{{ messages.append(1) }}")),
    Case("template-huge-repeat", sft("--tokenizer_path", "{c}/t"), "above the template limit",
         template("{{ 'x' * 1000000000 }}")),
    Case("template-huge-filter", sft("--tokenizer_path", "{c}/t"), "the number 1000000000 is above the template limit",
         template("{{ 'x' | center(1000000000) }}")),
    Case("template-huge-format", dpo("--tokenizer_path", "{c}/t"), "is above the template limit",
         template("{{ '%0999999999d' % 1 }}")),
    Case("template-huge-output", sft("--tokenizer_path", "{c}/t"), "tasks.jsonl:1: the output passed 66,064 characters",
         template("{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}")),
    Case("template-endless-loop", sft("--tokenizer_path", "{c}/t"), "rendering took longer than",
         template("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")),
    Case("template-recursion", sft("--tokenizer_path", "{c}/t"), "maximum recursion depth exceeded",
         template("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")),
    # --- Hugging Face's tokenizer layout ---------------------------------------------------------------------------
    Case("hf-token-int", seq("--tokenizer_path", "{c}/t"), "'eos_token' must be a token string or an AddedToken",
         hf_tokenizer({"eos_token": 1})),
    Case("hf-token-dict-no-content", seq("--tokenizer_path", "{c}/t"),
         "'bos_token' must be a token string or an AddedToken", hf_tokenizer({"bos_token": {"lstrip": False}})),
    Case("hf-token-unknown", seq("--tokenizer_path", "{c}/t"), "special tokens not in the vocabulary: ['<nope>']",
         hf_tokenizer({**HF_EOS, "pad_token": {"content": "<nope>"}})),
    Case("hf-added-tokens-list", seq("--tokenizer_path", "{c}/t"), "'added_tokens_decoder' must map ids to AddedTokens",
         hf_tokenizer({"added_tokens_decoder": [1]})),
    Case("hf-added-token-key", seq("--tokenizer_path", "{c}/t"), "'added_tokens_decoder' must map ids to AddedTokens",
         hf_tokenizer({"added_tokens_decoder": {"-3": {"content": "<|im_start|>"}}})),
    Case("hf-added-token-id", seq("--tokenizer_path", "{c}/t"),
         "added_tokens_decoder gives id 7 to '<|im_start|>', but tokenizer.json gives it id 3",
         hf_tokenizer({"added_tokens_decoder": {"7": {"content": "<|im_start|>"}}})),
    Case("hf-mixed-layout", seq("--tokenizer_path", "{c}/t"),
         "holds AstrAI's 'special_tokens' map and Hugging Face's 'eos_token'", tokenizer_dir(**HF_EOS)),
    Case("hf-template-not-utf8", seq("--tokenizer_path", "{c}/t"), "chat_template.jinja: not UTF-8 text",
         hf_tokenizer(HF_EOS, b"\xff\xfe{{ x }}")),
    Case("hf-template-syntax", seq("--tokenizer_path", "{c}/t"), "chat_template.jinja: chat_template is not valid",
         hf_tokenizer(HF_EOS, "{% for m in messages %}")),
    Case("hf-template-raise", sft("--tokenizer_path", "{c}/t"), "chat_template.jinja: chat_template failed on ",
         hf_tokenizer(HF_EOS, "{{ raise_exception('system messages are not supported') }}")),
    Case("hf-template-sandbox", sft("--tokenizer_path", "{c}/t"), "attribute '__class__' of 'str' object is unsafe",
         hf_tokenizer(HF_EOS, "{{ ''.__class__.__mro__ }}")),
    Case("hf-template-huge-tojson", sft("--tokenizer_path", "{c}/t"), "the number 1000000000 is above the template",
         hf_tokenizer(HF_EOS, "{{ messages | tojson(indent=1000000000) }}")),
    Case("hf-template-huge-strftime", sft("--tokenizer_path", "{c}/t"), "is above the template limit",
         hf_tokenizer(HF_EOS, "{{ strftime_now('%0999999999d') }}")),
    Case("hf-template-endless-loop", sft("--tokenizer_path", "{c}/t"), "rendering took longer than",
         hf_tokenizer(HF_EOS, "{% for a in range(100000) %}{% for b in range(100000) %}{% continue %}{% endfor %}"
                              "{% endfor %}")),
    Case("hf-template-not-a-prefix", sft("--tokenizer_path", "{c}/t"),
         "renders the first 1 messages differently once message 2 follows",
         hf_tokenizer(HF_EOS, "{{ messages | length }}")),
    # --- bin shards ----------------------------------------------------------------------------------------------
    Case("shard-object-dtype", seq(data="{c}/d"), "'dtype' must be an integer dtype (int32, uint16, ...), got 'O'",
         shards({"sequence": {"shape": [64], "dtype": "O"}}, sequence=bytes(512))),
    Case("shard-float-ids", seq(data="{c}/d"), "'dtype' must be an integer dtype", seq_shard(np.ones(64, np.float32))),
    Case("shard-unknown-dtype", seq(data="{c}/d"), "got 'int33'",
         shards({"sequence": {"shape": [64], "dtype": "int33"}}, sequence=bytes(256))),
    Case("shard-structured-dtype", seq(data="{c}/d"), "'dtype' must be",
         shards({"sequence": {"shape": [64], "dtype": [["a", "i4"]]}}, sequence=bytes(256))),
    Case("shard-2d-shape", seq(data="{c}/d"), "'shape' must be [length], one non-negative integer, got [8, 8]",
         shards({"sequence": {"shape": [8, 8], "dtype": "int32"}}, sequence=bytes(256))),
    Case("shard-negative-shape", seq(data="{c}/d"), "got [-4]",
         shards({"sequence": {"shape": [-4], "dtype": "int32"}}, sequence=bytes(16))),
    Case("shard-size-mismatch", seq(data="{c}/d"), "sequence.bin: expected 400 bytes for shape [100] int32, found 256",
         shards({"sequence": {"shape": [100], "dtype": "int32"}}, sequence=bytes(256))),
    Case("shard-entry-not-object", seq(data="{c}/d"), "entry 'sequence' needs 'shape' and 'dtype'",
         shards({"sequence": "int32"}, sequence=bytes(256))),
    Case("shard-meta-list", seq(data="{c}/d"), "expected a JSON object {key: {shape, dtype}}, got list",
         shards("[]", sequence=bytes(256))),
    Case("shard-meta-not-json", seq(data="{c}/d"), "meta.json: not valid JSON", shards("{", sequence=bytes(256))),
    Case("shard-token-past-vocab", seq(data="{c}/d"), "holds sequence values in [0, 5000]; token ids must be below "
         "the model's vocab_size 2,048", seq_shard(np.r_[np.zeros(99, np.int32), 5000].astype(np.int32))),
    Case("shard-negative-token", seq(data="{c}/d"), "holds sequence values in [-1, 0]",
         seq_shard(np.r_[np.zeros(99), -1].astype(np.int64))),
    Case("shard-position-past-rope", sft(data="{c}/d"), "position ids must be below the model's "
         "max_position_embeddings 256", sft_shard(positions=np.arange(400, dtype=np.int32))),
    Case("shard-sft-nothing-trained", sft(data="{c}/d"), "no window of 16 tokens holds a trained token",
         sft_shard(mask=0)),
    Case("shard-sft-missing-key", sft(data="{c}/d"), "sft data needs keys ['loss_mask', 'position_ids']",
         seq_shard(np.zeros(64, np.int32))),
    Case("shard-too-short", seq(data="{c}/d"), "tokens hold no window of window_size=16",
         seq_shard(np.zeros(10, np.int32))),
    # --- AstrAI's dataset_config.json beside JSONL records ----------------------------------------------------
    Case("dataset-config-not-json", dpo(data="{c}/d"), "dataset_config.json: not valid JSON", data_config("{", PAIR)),
    Case("dataset-config-list", dpo(data="{c}/d"), "dataset_config.json: expected a JSON object, got list",
         data_config("[]", PAIR)),
    Case("dataset-config-unknown-key", dpo(data="{c}/d"), "unknown key(s) inptu",
         data_config({**DPO_CONFIG, "inptu": {}}, PAIR)),
    Case("dataset-config-dpo-sections", dpo(data="{c}/d"), "dpo needs input.sources with the outputs",
         data_config(SFT_CONFIG, PAIR)),
    Case("dataset-config-both-layouts", dpo(data="{c}/d"), "input has both sections and sources",
         data_config(configured(DPO_CONFIG, input__sections=SFT_CONFIG["input"]["sections"]), PAIR)),
    Case("dataset-config-position-ids", dpo(data="{c}/d"), "trains on the first record only; add",
         data_config(configured(DPO_CONFIG, output=None), PAIR)),
    Case("dataset-config-wrong-sources", grpo(data="{c}/d"), "grpo reads the sources ['prompts', 'responses', "
         "'rewards'], got ['prompts', 'rewards']",
         data_config(configured(GRPO_CONFIG, input__sources__responses=None))),
    Case("dataset-config-not-a-list-field", grpo(data="{c}/d"),
         'responses: grpo reads it as a list_field with "mask_key": "masks"',
         data_config(configured(GRPO_CONFIG, input__sources__responses__list_field=False))),
    Case("dataset-config-renamed-mask", dpo(data="{c}/d"), "input.sources.chosen: dpo reads it as token sections",
         data_config(configured(DPO_CONFIG, input__sources__chosen__mask_key="m"), PAIR)),
    Case("dataset-config-value-mixed", grpo(data="{c}/d"), "a 'value' section must be its source's only section",
         data_config(configured(GRPO_CONFIG, input__sources__rewards__sections=[
             {"field": "rewards", "action": "value"}, {"field": "x", "action": "mask"}]))),
    Case("dataset-config-bad-action", dpo(data="{c}/d"), "needs a 'field' and an 'action' in",
         data_config(configured(DPO_CONFIG, input__sources__chosen__sections=[{"field": "c", "action": "keep"}]))),
    Case("dataset-config-mask-value", dpo(data="{c}/d"), 'mask must map roles to "train" or "mask"',
         data_config(configured(DPO_CONFIG, mask={"assistant": 1}), PAIR)),
    Case("dataset-config-length-type", dpo(data="{c}/d"), "max_seq_len must be an integer >= 1, got '64'",
         data_config(configured(DPO_CONFIG, preprocessing__max_seq_len="64"), PAIR)),
    Case("dataset-config-packing", sft(data="{c}/d"),
         "'bfd': AstrAI's JSONL route ignores it; remove it, or write shards with `astrai-fabric prepare",
         data_config(configured(SFT_CONFIG, preprocessing__packing_strategy="bfd"))),
    Case("dataset-config-sft-sources", sft(data="{c}/d"), "input.sources describes dpo/grpo outputs; sft reads "
         "input.sections", data_config(DPO_CONFIG, PAIR)),
    Case("dataset-config-null-text", dpo(data="{c}/d"),
         "d/data.jsonl:1: field 'chosen' is rendered as text, so it must be a string, got None",
         data_config(configured(DPO_CONFIG, input__sources__chosen__sections=[{"field": "chosen", "action": "train"}]),
                     {**PAIR, "chosen": None})),
    Case("dataset-config-reward-text", grpo(data="{c}/d"), "'rewards' must be numbers finite in float32",
         data_config(GRPO_CONFIG, {"prompt": [{"role": "user", "content": "hi"}], "responses": ["a", "b"],
                                   "rewards": ["1", 0]})),
    Case("dataset-config-other-tokenizer", dpo(data="{c}/d"), "differs from the run's tokenizer",
         {**data_config(configured(DPO_CONFIG, tokenizer_path="{c}/t"), PAIR),
          **tokenizer_dir(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")}),
    # --- JSONL records -------------------------------------------------------------------------------------------
    Case("jsonl-array-line", seq(data="{c}/data.jsonl"), "data.jsonl:2: expected a JSON object, got list",
         jsonl({"text": "a"}, [1, 2])),
    Case("jsonl-bad-json", seq(data="{c}/data.jsonl"), "data.jsonl:1: not valid JSON", jsonl("{'text': 1}")),
    Case("jsonl-seq-text-number", seq(data="{c}/data.jsonl"),
         "data.jsonl:1: a seq record needs a string field 'text', got int 3", jsonl({"text": 3})),
    Case("jsonl-sft-role", sft(data="{c}/data.jsonl"), "data.jsonl:1: each message needs a role in",
         jsonl({"messages": [{"role": "wizard", "content": "x"}]})),
    Case("jsonl-sft-content", sft(data="{c}/data.jsonl"), "message content must be a string, got ['x']",
         jsonl({"messages": [{"role": "user", "content": ["x"]}]})),
    Case("jsonl-sft-no-assistant", sft(data="{c}/data.jsonl"), "holds a trained token",
         jsonl(*[{"messages": [{"role": "user", "content": "only a question " * 4}]}] * 8)),
    # Found by the fuzz tier: a conversation longer than the model's positions was named "position_ids (part 0)".
    Case("jsonl-sft-past-positions", sft(data="{c}/data.jsonl"), "data.jsonl: holds position_ids values in [0, ",
         jsonl({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "an answer " * 600}]})),
    Case("jsonl-dpo-missing", dpo(data="{c}/data.jsonl"), "data.jsonl:1: a dpo record needs ['rejected']",
         jsonl({"prompt": "p", "chosen": "a"})),
    Case("jsonl-dpo-number", dpo(data="{c}/data.jsonl"), "'chosen' must be a string or a list of messages, got 5",
         jsonl({"prompt": "p", "chosen": 5, "rejected": "b"})),
    Case("jsonl-dpo-prompt", dpo(data="{c}/data.jsonl"), "'prompt' must be a string or a list of {role, content}",
         jsonl({"prompt": {"a": 1}, "chosen": "a", "rejected": "b"})),
    Case("jsonl-grpo-float32-overflow", grpo(data="{c}/data.jsonl"), "'rewards' must be numbers finite in float32",
         jsonl({**OK_GROUP, "rewards": [1e39, 0.0]})),
    Case("jsonl-grpo-nan", grpo(data="{c}/data.jsonl"), "'rewards' must be numbers finite in float32",
         jsonl('{"prompt": "p", "responses": ["a", "b"], "rewards": [NaN, 1]}')),
    Case("jsonl-grpo-string-reward", grpo(data="{c}/data.jsonl"), "'rewards' must be numbers",
         jsonl({**OK_GROUP, "rewards": ["1", 0]})),
    Case("jsonl-grpo-ragged", grpo(data="{c}/data.jsonl"), "data.jsonl:2: 3 responses; earlier records have 2",
         jsonl(OK_GROUP, {**OK_GROUP, "responses": ["a", "b", "c"], "rewards": [1, 2, 3]})),
    # --- checkpoints: meta.json and .pt contents checked before any is applied ----------------------------------
    Case("meta-position-keys", resume(), "'resume_position' must hold ['epoch', 'sample_index'",
         checkpoint(rename_position(whole={"epoch": 0}))),
    Case("meta-position-negative", resume(), "'resume_position' needs non-negative integers, got sample_index=-5",
         checkpoint(rename_position(sample_index=-5))),
    Case("meta-position-string", resume(), "got optimizer_step='1'", checkpoint(rename_position(optimizer_step="1"))),
    Case("meta-position-beyond-data", resume(), "but an epoch of this data has",
         checkpoint(rename_position(sample_index=10**9))),
    Case("meta-epoch-negative", resume(), "'epoch' must be a non-negative integer, got -1",
         checkpoint(edit_json("meta.json", epoch=-1))),
    Case("meta-not-object", resume(), "meta.json: expected a JSON object, got list",
         checkpoint(lambda ck: (ck / "meta.json").write_text("[]"))),
    Case("meta-reference", ["dpo", *resume()[1:]], "'reference' must be {param_path, random_seed}",
         checkpoint(edit_json("meta.json", reference="base", train_type="dpo"))),
    Case("rng-wrong-shape", resume(), "rng.pt: expected {'torch': uint8 [ranks, 5056]} RNG states, got torch.uint8",
         checkpoint(replace_pt("rng", {"torch": torch.zeros(1, 7, dtype=torch.uint8)}))),
    Case("rng-not-a-mapping", resume(), "rng.pt: expected {'torch'", checkpoint(replace_pt("rng", [1, 2]))),
    Case("scheduler-list", resume(), "scheduler.pt: scheduler state must be a mapping, got list",
         checkpoint(replace_pt("scheduler", [1, 2]))),
    Case("scheduler-wrong-kind", resume(), "scheduler.pt: scheduler state has values of the wrong kind: last_epoch='x'",
         checkpoint(lambda ck: torch.save({**torch.load(ck / "scheduler.pt"), "last_epoch": "x"},
                                          ck / "scheduler.pt"))),
    Case("optimizer-wrong-shape", resume(), "optimizer.pt: does not fit this run's optimizer",
         checkpoint(lambda ck: torch.save(_reshaped_optimizer_state(ck), ck / "optimizer.pt"))),
    Case("optimizer-groups", resume(), "optimizer.pt: does not fit this run's optimizer",
         checkpoint(lambda ck: torch.save(_extra_group(ck), ck / "optimizer.pt"))),
    Case("optimizer-muon-entries-deleted", resume(), "ck/optimizer.pt: its muon part holds state for 14 parameters "
         "where meta.json records 28 written", checkpoint(lambda ck: torch.save(_half_muon(ck), ck / "optimizer.pt"))),
    Case("checkpoint-config-missing", resume(), "config.json: file not found",
         checkpoint(lambda ck: (ck / "config.json").unlink())),
    # --- ckpt_dir and the other commands -------------------------------------------------------------------------
    Case("ckpt-dir-is-a-file", [*seq()[:-1], "{c}/file"], "ckpt_dir {c}/file: {c}/file is a file, not a directory",
         {"file": "x"}),
    Case("ckpt-dir-under-a-file", [*seq()[:-1], "{c}/file/run"], "is a file, not a directory", {"file": "x"}),
    Case("prepare-output-is-input", ["prepare", "{c}/data.jsonl", "-o", "{c}/data.jsonl", "-c", "{c}/p.json",
         "--tokenizer_path", "bundled:tiny"], "-o {c}/data.jsonl: exists and is not empty",
         {**jsonl({"text": "a"}), "p.json": '{"input": {"sections": [{"field": "text", "action": "train"}]}}'}),
    Case("prepare-config-not-json", ["prepare", "{c}/data.jsonl", "-o", "{c}/o", "-c", "{c}/p.json",
         "--tokenizer_path", "bundled:tiny"], "p.json", {**jsonl({"text": "a"}), "p.json": "{"}),
    Case("prepare-num-proc-zero", [*prepare_argv(), "--num_proc", "0"], "--num_proc must be an integer >= 1, got 0",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE}),
    Case("prepare-malformed-last-record", prepare_argv(), "data.jsonl:3: not valid JSON",
         {**jsonl({"text": "a"}, {"text": "b"}, '{"text": "c"'), **TEXT_PIPELINE}),
    Case("prepare-role-an-object", prepare_argv(), "no record was kept ({\"field 'messages': a message without a "
         "role (a string)\": 1})", {**jsonl({"messages": [{"role": {"a": 1}, "content": "x"}]}), **CHAT_PIPELINE}),
    Case("prepare-float-sequence", prepare_argv(), "output.dtype.sequence must be an integer dtype",
         {**jsonl({"text": "a"}), "p.json": json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]},
                                                       "output": {"dtype": {"sequence": "float32"}}})}),
    Case("prepare-unfinished-without-resume", prepare_argv(), "unfinished prepare of it is in {c}/.o.prepare-partial",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE, ".o.prepare-partial/prepare_state.json": "{}"}),
    Case("prepare-resume-other-run", [*prepare_argv(), "--resume"], "holds a prepare of a different pipeline (-c), "
         "tokenizer, list of inputs", {**jsonl({"text": "a"}), **TEXT_PIPELINE, ".o.prepare-partial/prepare_state.json":
         json.dumps({"identity": {"inputs": [], "pipeline": "x", "tokenizer": "y"}, "num_records": 1})}),
    Case("prepare-resume-state-not-json", [*prepare_argv(), "--resume"], "prepare_state.json: not a prepare state",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE, ".o.prepare-partial/prepare_state.json": "[1]"}),
    # --- prepare reads record shapes as training does (data/shapes.py, --data_format, --data_columns) ------------
    Case("prepare-shape-format-other-type", [*prepare_argv(), "--data_format", "alpaca"],
         "data_format 'alpaca' is an sft shape; seq reads text (or auto) (the pipeline (-c) writes seq data)",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE}),
    Case("prepare-shape-format-unknown", [*prepare_argv(), "--data_format", "alpacca"],
         "--data_format 'alpacca': expected one of auto, text, messages, sharegpt, alpaca,",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE}),
    Case("prepare-shape-columns-own-fields", [*prepare_argv(), "--data_columns", "answer=output"],
         "--data_columns: the pipeline (-c) reads the fields ['answer', 'prompt'] as they are; record shapes become",
         {**jsonl({"prompt": "a", "answer": "b"}), "p.json": json.dumps({"input": {"sections": [
             {"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]}})}),
    Case("prepare-shape-mixed-in-one-file", prepare_argv(),
         "data.jsonl:2: the record has the alpaca shape (instruction, output), but {c}/data.jsonl:1, the source's "
         "first record, has the messages shape", {**jsonl({"messages": [{"role": "user", "content": "a"}]},
                                                          {"instruction": "a", "output": "b"}), **CHAT_PIPELINE}),
    Case("prepare-shape-alpaca-without-output", prepare_argv(),
         "data.jsonl:2: an sft record needs ['output'] (alpaca shape), got keys ['input', 'instruction']",
         {**jsonl({"instruction": "a", "output": "b"}, {"instruction": "a", "input": "c"}), **CHAT_PIPELINE}),
    Case("prepare-shape-forced-not-there", [*prepare_argv(), "--data_format", "sharegpt"],
         "data.jsonl:1: an sft record needs ['conversations'] (sharegpt shape), got keys ['instruction', 'output']",
         {**jsonl({"instruction": "a", "output": "b"}), **CHAT_PIPELINE}),
    Case("generate-negative-top-k", ["generate", "--param_path", "{w}/run/epoch_0_step_1", "--prompt", "x",
         "--top_k", "-1"], "top_k >= 0"),
    Case("generate-device", ["generate", "--param_path", "{w}/run/epoch_0_step_1", "--prompt", "x",
         "--device_type", "gpu"], "device_type must be cpu or cuda, got 'gpu'"),
    Case("generate-nan-temperature", ["generate", "--param_path", "{w}/run/epoch_0_step_1", "--prompt", "x",
         "--temperature", "nan"], "Parser key \"temperature\": Expected a <class 'float'>. Got value: nan"),
    Case("generate-huge-temperature", ["generate", "--param_path", "{w}/run/epoch_0_step_1", "--prompt", "x",
         "--temperature", "-1"], "need a finite temperature >= 0"),
    Case("plot-format", ["plot", "{w}/run", "-o", "{c}/plot.xyz"], "-o {c}/plot.xyz: not an image file name"),
    Case("plot-missing-dir", ["plot", "{w}/run", "-o", "{c}/no/plot.png"], "the directory {c}/no does not exist"),
    Case("plot-bad-entry", ["plot", "{c}/metric.jsonl"], "metric.jsonl:1: not a metric entry",
         {"metric.jsonl": '{"type": "step", "step": "one"}\n'}),
    # --- round 4: what we wrote, read back checked: metric history, meta.json's QLoRA record ------------------------
    Case("plot-step-bool", ["plot", "{c}/metric.jsonl"], "metric.jsonl:2: not a metric entry (step True, expected an "
         "integer in [0, 2^63))", {"metric.jsonl": '{"type": "step", "step": 1}\n{"type": "step", "step": true}\n'}),
    Case("plot-step-past-int64", ["plot", "{c}/metric.jsonl"], "metric.jsonl:1: not a metric entry (step 1000",
         {"metric.jsonl": '{"type": "step", "step": 1' + "0" * 400 + "}\n"}),
    Case("plot-type-a-path", ["plot", "{c}/metric.jsonl"], "metric.jsonl:1: not a metric entry (type '",
         {"metric.jsonl": json.dumps({"type": "../" * 100 + "etc/passwd", "step": 1}) + "\n"}),
    Case("qlora-record-missing", ["generate", "--param_path", "{c}/ck", "--prompt", "x", "--max_new_tokens", "1"],
         "ck/meta.json: 'quantize' is 'nf4' (the adapter was trained over the base quantised to NF4), but the "
         "'quantization' record of which weights were quantised, and from which dtype, is missing",
         qlora_checkpoint(quantization=None)),
    Case("qlora-record-emptied", ["generate", "--param_path", "{c}/ck", "--prompt", "x", "--max_new_tokens", "1"],
         "ck/meta.json: 'quantization' keys is empty, but a QLoRA run quantises its block linear weights",
         qlora_checkpoint(quantization={"method": "nf4", "block_size": 64, "scaler_block_size": 256,
                                        "dtype": "float32", "keys": []})),
    Case("qlora-dtype-an-object", ["generate", "--param_path", "{c}/ck", "--prompt", "x", "--max_new_tokens", "1"],
         "ck/meta.json: 'quantization' dtype must be one of ['float32', 'bfloat16', 'float16'], got {'a': 1}",
         qlora_checkpoint(quantization={"method": "nf4", "block_size": 64, "scaler_block_size": 256,
                                        "dtype": {"a": 1}, "keys": NF4_KEYS})),
    Case("lora-base-pointer-names-no-place", ["export", "{c}/ck", "--out", "{c}/o"],
         "ck/meta.json: a LoRA checkpoint without merged weights needs 'lora_base' {path, absolute, sha256}",
         qlora_checkpoint(quantize=None, quantization=None, lora_base={"sha256": {}})),
    # Found by the fuzz tier's hour (2026-12-05): a base pointer naming a directory without weights was reported as
    # that directory alone ("/: no model.safetensors ..."), not as the pointer that leads there.
    Case("lora-base-pointer-to-a-directory-without-weights", ["export", "{c}/ck", "--format", "hf", "--out", "{c}/o"],
         "ck/meta.json: 'lora_base' points at /: no model.safetensors, model.safetensors.index.json or "
         "adapter_model.safetensors (expected weights)",
         qlora_checkpoint(lora_base={"path": None, "absolute": "/", "sha256": {}})),
    Case("qlora-flag-not-a-method", ["export", "{c}/ck", "--out", "{c}/o"],
         "ck/meta.json: 'quantize' must be null or 'nf4', got ['nf4']", qlora_checkpoint(quantize=["nf4"])),
    # Found by the fuzz tier: a scaling of 2**34 trained to a NaN gradient norm every step (exit 1).
    Case("lora-adapter-scaling-past-bound", ["export", "{c}/ck", "--out", "{c}/o"],
         "adapter_config.json: 'alpha' / 'r', the adapter's scaling, must be at most 4,096 (typical: 0.5 to 16), got "
         "1.72e+10", qlora_checkpoint(alpha=2**36, quantize=None, quantization=None)),
    Case("lora-scaling-flag-past-bound", sft("--lora_r", "4", "--lora_alpha", "100000"),
         "lora_alpha / lora_r, the adapter's scaling, must be at most 4,096 (typical: 0.5 to 16), got 2.5e+04"),
    Case("qlora-resumed-without-quantize", seq("--resume", "{c}/ck", "--lora_r", "4", model="{w}/run/epoch_0_step_1"),
         "ck holds an adapter trained over the base in NF4; resume it with --quantize nf4", qlora_checkpoint()),
    Case("lora-resumed-with-quantize", seq("--resume", "{c}/ck", "--lora_r", "4", "--quantize", "nf4",
                                               model="{w}/run/epoch_0_step_1"),
         "ck holds an adapter trained over the base in its float dtype; resume it without --quantize",
         qlora_checkpoint(quantize=None, quantization=None)),
    # --- JSON the parser itself cannot take: nesting past the recursion limit, a file too large to read ------------
    Case("config-nested", seq(model="{c}/m"), "config.json: not valid JSON (nested too deeply)",
         {**model_dir(), "m/config.json": NESTED}),
    Case("config-huge", seq(model="{c}/m"), "config.json: 67108865 bytes, too large for a model config.json",
         {**model_dir(), "m/config.json": sparse((64 << 20) + 1)}),
    # --- round 4: every file opened as what it is (regular_files): a FIFO, a device, a link to nothing, a directory --
    # Each refused by name before a byte is read (a FIFO would block the open, /dev/zero never end); links found by a
    # scan (a checkpoint's *.pt) only within it; "file not found" only where nothing is.
    Case("config-fifo", seq(model="{c}/m"), "m/config.json: is a FIFO, not a file (expected a model config.json)",
         {**model_dir(), "m/config.json": os.mkfifo}),
    Case("config-dev-zero", seq(model="{c}/m"), "m/config.json: links to /dev/zero, a character device, not a file",
         {**model_dir(), "m/config.json": link_to("/dev/zero")}),
    Case("config-dangling-link", seq(model="{c}/m"), "m/config.json: a link to gone.json, which does not exist",
         {**model_dir(), "m/config.json": link_to("gone.json")}),
    Case("config-a-directory", seq(model="{c}/m"), "m/config.json: is a directory, not a file",
         {**model_dir(), "m/config.json": Path.mkdir}),
    Case("meta-fifo", resume(), "ck/meta.json: is a FIFO, not a file (expected the run's meta data)",
         checkpoint(replaced("meta.json", os.mkfifo))),
    Case("meta-dev-zero", resume(), "ck/meta.json: links to /dev/zero, a character device, not a file",
         checkpoint(replaced("meta.json", link_to("/dev/zero")))),
    Case("meta-dangling-link", resume(), "ck/meta.json: a link to gone.json, which does not exist",
         checkpoint(replaced("meta.json", link_to("gone.json")))),
    Case("pt-fifo", resume(), "ck/rng.pt: is a FIFO, not a file", checkpoint(replaced("rng.pt", os.mkfifo))),
    Case("pt-links-out", resume(), "ck/rng.pt: links to {c}/rng.pt, outside {c}/ck; its files are read only from",
         {"rng.pt": lambda p: torch.save({}, p), **checkpoint(replaced("rng.pt", link_to("../rng.pt")))}),
    Case("resume-auto-pt-fifo", seq("--resume", "auto"), "out/epoch_0_step_1/rng.pt: is a FIFO, not a file",
         in_run(replaced("rng.pt", os.mkfifo))),
    Case("resume-auto-pt-dev-zero", seq("--resume", "auto"),
         "out/epoch_0_step_1/optimizer.pt: links to /dev/zero, a character device, not a file",
         in_run(replaced("optimizer.pt", link_to("/dev/zero")))),
    Case("resume-auto-weights-dev-zero", seq("--resume", "auto"),
         "out/epoch_0_step_1/model.safetensors: links to /dev/zero, a character device, not a file",
         in_run(replaced("model.safetensors", link_to("/dev/zero")))),
    Case("resume-auto-pt-dangling-link", seq("--resume", "auto"),
         "out/epoch_0_step_1/scheduler.pt: a link to gone.pt, which does not exist",
         in_run(replaced("scheduler.pt", link_to("gone.pt")))),
    Case("resume-auto-pt-links-out", seq("--resume", "auto"),
         "out/epoch_0_step_1/rng.pt: links to {c}/rng.pt, outside {c}/out/epoch_0_step_1; its files are read only "
         "from inside it", {"rng.pt": lambda p: torch.save({}, p),
                            **in_run(replaced("rng.pt", link_to("../../rng.pt")))}),
    Case("resume-auto-pt-a-directory", seq("--resume", "auto"), "epoch_0_step_1/extra.pt: is a directory, not a file",
         in_run(lambda ck: (ck / "extra.pt").mkdir())),
    Case("ckpt-dir-manifest-fifo", seq(), "out/.astrai_fabric.json: is a FIFO, not a file (expected astrai-fabric's",
         {"out/.astrai_fabric.json": os.mkfifo}),
    Case("tokenizer-fifo", seq("--tokenizer_path", "{c}/t"),
         "t/tokenizer.json: is a FIFO, not a file (expected a tokenizers file)",
         {**tokenizer_dir(), "t/tokenizer.json": os.mkfifo}),
    Case("tokenizer-dev-zero", seq("--tokenizer_path", "{c}/t"),
         "t/tokenizer.json: links to /dev/zero, a character device, not a file",
         {**tokenizer_dir(), "t/tokenizer.json": link_to("/dev/zero")}),
    Case("tokenizer-dangling-link", seq("--tokenizer_path", "{c}/t"),
         "t/tokenizer.json: a link to gone.json, which does not exist",
         {**tokenizer_dir(), "t/tokenizer.json": link_to("gone.json")}),
    Case("tokenizer-config-fifo", seq("--tokenizer_path", "{c}/t"),
         "t/tokenizer_config.json: is a FIFO, not a file (expected the tokenizer's config)",
         {**tokenizer_dir(), "t/tokenizer_config.json": os.mkfifo}),
    Case("hf-template-file-dev-zero", seq("--tokenizer_path", "{c}/t"),
         "t/chat_template.jinja: links to /dev/zero, a character device, not a file",
         {**hf_tokenizer(HF_EOS), "t/chat_template.jinja": link_to("/dev/zero")}),
    Case("recipe-fifo", ["seq", "--config", "{c}/r.yaml"], "--config {c}/r.yaml: is a FIFO, not a file",
         {"r.yaml": os.mkfifo}),
    Case("recipe-dev-zero", ["seq", "--config", "{c}/r.yaml"],
         "--config {c}/r.yaml: links to /dev/zero, a character device, not a file", {"r.yaml": link_to("/dev/zero")}),
    Case("recipe-dangling-link", ["seq", "--config", "{c}/r.yaml"],
         "--config {c}/r.yaml: a link to gone.yaml, which does not exist", {"r.yaml": link_to("gone.yaml")}),
    Case("recipe-a-directory", ["seq", "--config", "{c}/r.yaml"], "--config {c}/r.yaml: is a directory, not a file",
         {"r.yaml": Path.mkdir}),
    Case("data-fifo", sft(data="{c}/data.jsonl"), "data_root_path {c}/data.jsonl: is a FIFO, not a file (expected "
         "records or a folder of them)", {"data.jsonl": os.mkfifo}),
    Case("data-dev-zero", sft(data="{c}/data.jsonl"),
         "data_root_path {c}/data.jsonl: links to /dev/zero, a character device, not a file",
         {"data.jsonl": link_to("/dev/zero")}),
    Case("prepare-input-in-folder-fifo", ["prepare", "{c}/in", "-o", "{c}/o", "-c", "{c}/p.json", "--tokenizer_path",
         "bundled:tiny"], "in/b.jsonl: is a FIFO, not a file (expected JSONL records)",
         {"in/a.jsonl": '{"text": "a"}\n', "in/b.jsonl": os.mkfifo, **TEXT_PIPELINE}),
    Case("plot-metric-fifo", ["plot", "{c}/run"], "run/epoch_0_step_1/metric.jsonl: is a FIFO, not a file (expected "
         "a metric history)", {"run/epoch_0_step_1/metric.jsonl": os.mkfifo}),
    Case("plot-metric-dev-zero", ["plot", "{c}/metric.jsonl"],
         "metric.jsonl: links to /dev/zero, a character device, not a file", {"metric.jsonl": link_to("/dev/zero")}),
    Case("plot-metric-links-out", ["plot", "{c}/run"], "run/metric.jsonl: links to {c}/metric.jsonl, outside {c}/run",
         {"metric.jsonl": '{"type": "step", "step": 1}\n', "run/metric.jsonl": link_to("../metric.jsonl")}),
    Case("plot-metric-line-too-long", ["plot", "{c}/metric.jsonl"],
         "metric.jsonl:2: a line longer than 1,048,576 bytes, not a metric entry",
         {"metric.jsonl": '{"type": "step", "step": 1}\n' + "x" * (2 << 20)}),
    # --- the hour of fuzzing (issue 39): what it found --------------------------------------------------------------
    Case("config-rope-type-a-list", seq(model="{c}/m"), "'rope_frequency_scaling' rope_type must be one of",
         model_dir(rope_frequency_scaling={"rope_type": [-8.2e127]})),
    Case("reward-model-config-wider-than-weights", ["reward_model", *dpo(model="{c}/ck")[1:]],
         "ck: does not match the model built from its config.json: hidden_size 2147483640, but embed_tokens.weight",
         widened_checkpoint(2**31 - 8)),
    Case("recipe-max-lr-infinite", ["dpo", "--config", "{c}/r.yaml"],
         "{c}/r.yaml: invalid training arguments: max_lr must be a finite number, got inf",
         {"r.yaml": RECIPE.replace("data/seq", "data/dpo") + "max_lr: !!float 1e400\n"}),
    Case("config-int-digits", seq(model="{c}/m"), "config.json: not valid JSON (Exceeds the limit (4300 digits)",
         {**model_dir(), "m/config.json": '{"vocab_size": ' + "9" * 5000 + "}"}),
    Case("config-int-past-int64", seq(model="{c}/m"), "'vocab_size' must fit in 64 bits (at most "
         "9223372036854775807), got about 10^400", model_dir(vocab_size=10**400)),
    Case("config-int-past-int32", seq(model="{c}/m"), "'vocab_size' must be at most 2147483647, got 2147483648",
         model_dir(vocab_size=2**31)),
    # Sizes within bounds whose model no machine here holds: counted from the config before anything is built
    # (the embedding alone is 512 TiB), the run and its dry run alike.
    Case("config-past-memory", seq(model="{c}/m"), "param_path {c}/m: this model does not fit in memory here: "
         "140,789,305,311,232 parameters x 4 bytes, and 0.5 GiB of the process's own, x 1 process(es) per machine "
         "need 524,481.6 GiB",
         model_dir(vocab_size=2**31 - 1, hidden_size=2**16)),
    Case("tokenizer-config-nested", seq("--tokenizer_path", "{c}/t"),
         "tokenizer_config.json: not valid JSON (nested too deeply)", tokenizer_dir(raw=NESTED)),
    Case("shard-meta-nested", seq(data="{c}/d"), "meta.json: not valid JSON (nested too deeply)",
         shards(NESTED, sequence=bytes(256))),
    Case("jsonl-nested", seq(data="{c}/data.jsonl"), "data.jsonl:1: not valid JSON (nested too deeply)",
         jsonl('{"text": ' + NESTED + "}")),
    Case("dataset-config-nested", dpo(data="{c}/d"), "dataset_config.json: not valid JSON (nested too deeply)",
         data_config(NESTED, {"chosen": [], "rejected": []})),
    Case("meta-nested", resume(), "meta.json: not valid JSON (nested too deeply)",
         checkpoint(lambda ck: (ck / "meta.json").write_text(NESTED))),
    Case("prepare-config-nested", prepare_argv(), "p.json: not valid JSON (nested too deeply)",
         {**jsonl({"text": "a"}), "p.json": NESTED}),
    Case("prepare-state-nested", [*prepare_argv(), "--resume"], "prepare_state.json: not a prepare state",
         {**jsonl({"text": "a"}), **TEXT_PIPELINE, ".o.prepare-partial/prepare_state.json": NESTED}),
    Case("ckpt-dir-manifest-nested", seq(), "is not astrai-fabric's manifest of the files it wrote",
         {"out/.astrai_fabric.json": NESTED}),
    Case("plot-nested-entry", ["plot", "{c}/metric.jsonl"], "metric.jsonl:1: not a metric entry",
         {"metric.jsonl": NESTED + "\n"}),
    # --- round 3: templates, every render bounded --------------------------------------------------------------
    Case("export-template-endless-loop", ["export", "{c}/ck", "--format", "hf", "--out", "{c}/hf"],
         "ck/tokenizer_config.json: chat_template failed: rendering took longer than 0.5 s",
         checkpoint(edit_json("tokenizer_config.json", chat_template="{% for i in range(100000) %}{% for j in "
                                                                     "range(100000) %}{% endfor %}{% endfor %}"))),
    Case("export-template-doubling", ["export", "{c}/ck", "--format", "hf", "--out", "{c}/hf"],
         "ck/tokenizer_config.json: chat_template failed: a value of over 1,000,000 characters or items is above",
         checkpoint(edit_json("tokenizer_config.json", chat_template="{% set ns = namespace(s='x') %}{% for i in "
                                                                     "range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                                                                     "{% endfor %}"))),
    Case("template-nested-literals-compared", sft("--tokenizer_path", "{c}/t"), "characters or items is above the",
         template("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(64) %}{% set ns.a = [ns.a, ns.a] %}"
                  "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}")),
    Case("hf-template-list-join", sft("--tokenizer_path", "{c}/t"), "in one render is above the template limit",
         hf_tokenizer(HF_EOS, "{{ range(100000) | map('string') | map('center', 60000) | join | length }}")),
    Case("tokenizer-class-list", seq("--tokenizer_path", "{c}/t"), "'tokenizer_class' must be a class name",
         hf_tokenizer({**HF_EOS, "tokenizer_class": ["PreTrainedTokenizerFast"]})),
    Case("model-max-length-map", seq("--tokenizer_path", "{c}/t"), "'model_max_length' must be a number, got {",
         hf_tokenizer({**HF_EOS, "model_max_length": {"tokens": 2048}})),
    # --- round 3: export's destination; Hugging Face directories loaded exactly or refused -----------------------
    # Every format (astrai, hf, peft, --merge_lora) checks --out, given or default, before reading anything.
    *[case for flags in ([], ["--format", "hf"], ["--format", "peft"], ["--merge_lora"]) for case in [
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-under-a-file",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{c}/file/x"],
             "--out {c}/file/x: {c}/file is a file, not a directory", {"file": "x"}),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-inside-the-source",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{w}/run/epoch_0_step_1/x"],
             "is inside {w}/run/epoch_0_step_1, the directory being exported"),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-is-the-source",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{w}/run/epoch_0_step_1"],
             "--out {w}/run/epoch_0_step_1: is {w}/run/epoch_0_step_1, the directory being exported"),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-holds-the-source",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{w}/run"],
             "--out {w}/run: holds {w}/run/epoch_0_step_1, the directory being exported"),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-not-empty",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{c}/o"],
             "--out {c}/o: already exists and is not empty ([notes.txt])", {"o/notes.txt": "mine"}),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-a-link",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{c}/o"],
             "--out {c}/o: is a symbolic link; export writes a new directory",
             {"o": lambda path: path.symlink_to(path.parent / "elsewhere")}),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-unwritable",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "/proc/self/x"],
             "--out /proc/self/x: /proc/self is not writable here"),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-out-name-too-long",
             ["export", "{w}/run/epoch_0_step_1", *flags, "--out", "{c}/" + "x" * 250],
             "--out {c}/" + "x" * 250 + ": cannot be created or written (a name of more than 241 bytes)"),
        Case(f"export{'-'.join(['', *flags]).replace('--', '')}-default-out-a-file", ["export", "{c}/ck", *flags],
             "{c}/ck" + {"hf": "_hf", "peft": "_peft"}.get(flags[-1] if flags else "", "_full") + " is a file",
             {"ck": lambda path: path.symlink_to(path.parents[1] / "w" / "run" / "epoch_0_step_1"),
              "ck" + {"hf": "_hf", "peft": "_peft"}.get(flags[-1] if flags else "", "_full"): "x"}),
    ]],
    Case("export-default-out-of-the-root", ["export", "/"], "export /: no name to put _full after; give --out"),
    Case("export-out-the-root", ["export", "{w}/run/epoch_0_step_1", "--format", "hf", "--out", "/"],
         "--out /: names no directory to create"),
    Case("export-copies-a-link-out", ["export", "{c}/ck", "--format", "hf", "--out", "{c}/o"],
         "ck/tokenizer.model: links to {c}/secret.txt, outside the model directory",
         {"secret.txt": "not for the Hub", **checkpoint(lambda ck: (ck / "tokenizer.model").symlink_to(
             ck.parent / "secret.txt"))}),
    Case("export-dtype-copies-a-link-out", ["export", "{c}/ck", "--dtype", "bfloat16", "--out", "{c}/o"],
         "ck/notes.txt: links to {c}/secret.txt, outside the model directory",
         {"secret.txt": "not for the Hub", **checkpoint(lambda ck: (ck / "notes.txt").symlink_to(
             ck.parent / "secret.txt"))}),
    Case("export-merge-lora-as-peft", ["export", "{w}/run/epoch_0_step_1", "--merge_lora", "--format", "peft",
         "--out", "{c}/o"], "--merge_lora writes the merged model; --format peft writes the adapter alone"),
    Case("export-merge-lora-dtype", ["export", "{w}/run/epoch_0_step_1", "--merge_lora", "--dtype", "bfloat16",
         "--out", "{c}/o"], "--dtype does not apply to --merge_lora"),
    # A Hugging Face directory binds transformers' tensor names exactly; its shard index is read exactly.
    Case("hf-astrai-tensor-names", ["generate", "--param_path", "{c}/ck", "--prompt", "x", "--max_new_tokens", "1"],
         "are not tensor names of a Hugging Face llama model (transformers would not load them)",
         checkpoint(lambda ck: (ck / "config.json").write_text(json.dumps({
             **{k: TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                            "rms_norm_eps", "rope_theta", "tie_word_embeddings")},
             "model_type": "llama"})))),
    *[Case(f"index-{name}", ["generate", "--param_path", "{c}/ck", "--prompt", "x", "--max_new_tokens", "1"], message,
           checkpoint(lambda ck, move=move, weight_map=weight_map, link=link: (
               move and (ck / "model.safetensors").rename(ck / move),
               link and (ck / link).symlink_to(ck / move),
               (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
                   "embed_tokens.weight": weight_map.replace("{ck}", str(ck))}})))))
      for name, move, link, weight_map, message in [
          ("parent-path", "../outside.safetensors", None, "../outside.safetensors",
           "maps 'embed_tokens.weight' to '../outside.safetensors', expected the file name of a shard beside"),
          ("absolute-path", "../outside.safetensors", None, "{ck}/../outside.safetensors",
           "(no path: nothing is read from outside the model directory)"),
          ("link-out", "../outside.safetensors", "model-00001-of-00001.safetensors",
           "model-00001-of-00001.safetensors", "ck/model-00001-of-00001.safetensors: links to "),
          ("beside-a-single-file", None, None, "model-00001-of-00002.safetensors",
           "lists shards beside a model.safetensors, so which file holds the model is ambiguous"),
          ("tensor-not-listed", "model-00001-of-00001.safetensors", None, "model-00001-of-00001.safetensors",
           "model-00001-of-00001.safetensors: holds 'layers.0.attention.k_proj.weight', but "
           "model.safetensors.index.json does not list it"),
      ]],
    Case("index-value-not-a-string", ["generate", "--param_path", "{c}/ck", "--prompt", "x"],
         "'weight_map' maps 'embed_tokens.weight' to a list, expected the file name of a shard",
         checkpoint(lambda ck: ((ck / "model.safetensors").unlink(), (ck / "model.safetensors.index.json").write_text(
             json.dumps({"weight_map": {"embed_tokens.weight": ["model.safetensors"]}}))))),
    # --- round 4: found by the fuzz tier (tests/test_fuzz.py's timed mode) ----------------------------------------
    Case("hf-config-architectures-a-number", seq(model="{c}/h"),
         "h/config.json: architectures 9007199254740993 is not supported: expected a list of transformers class names",
         {"h/config.json": json.dumps({**{k: TINY_CONFIG[k] for k in (
             "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")},
             "model_type": "llama", "architectures": 2**53 + 1, "id2label": {"0": "LABEL_0"}})}),
    # --- round 4: the Hub cache's refs, revisions and snapshot files stay inside it (hub_cache.py) -------------------
    # One resolver (hub._cached, hub.snapshot) serves every id: a model, tokenizer or reference flag, generate, chat,
    # evaluate, export and download; a dataset reads its card first (its own path). Offline, then with a Hub that
    # cannot be reached (the online fallback to the cache), and through an @commit (no ref read).
    Case("hub-ref-dot-dot", seq(model="org/tiny"),
         f"{TINY_REPO}/refs/main holds '../../../../outside/m', not a commit (expected 40 hex characters naming a "
         f"folder of {TINY_REPO}/snapshots)", hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-ref-dot-dot-hub-unreachable", seq(model="org/tiny"),
         f"{TINY_REPO}/refs/main holds '../../../../outside/m', not a commit", hub_cache("../../../../outside/m"),
         env=HUB_UNREACHABLE),
    Case("hub-ref-absolute", seq(model="org/tiny"), f"{TINY_REPO}/refs/main holds '/", hub_cache("{c}/outside/m"),
         env=HUB_OFFLINE),
    Case("hub-ref-not-a-commit", seq(model="org/tiny"),
         f"the Hub cache's ref {TINY_REPO}/refs/main holds 'main', not a commit", hub_cache("main"), env=HUB_OFFLINE),
    Case("hub-ref-commit-and-newline", seq(model="org/tiny"), f"refs/main holds '{HUB_COMMIT}\\n', not a commit",
         hub_cache(HUB_COMMIT + "\n"), env=HUB_OFFLINE),
    Case("hub-ref-fifo", seq(model="org/tiny"), f"the Hub cache's ref {TINY_REPO}/refs/main is a FIFO, not a file",
         hub_cache(None, lambda folder: os.mkfifo(folder / "refs" / "main")), env=HUB_OFFLINE),
    Case("hub-ref-folder-a-link", seq(model="org/tiny@refs/pr/1"),
         f"the Hub cache's ref {TINY_REPO}/refs/refs/pr/1 leads to {{c}}/outside/m/pr/1, outside {TINY_REPO}/refs",
         hub_cache(change=ref_folder_outside), env=HUB_OFFLINE),
    Case("hub-ref-folder-a-loop", seq(model="org/tiny@refs/pr/1"),
         f"the Hub cache's ref {TINY_REPO}/refs/refs/pr/1 cannot be read (Too many levels of symbolic links)",
         hub_cache(change=lambda folder: (folder / "refs" / "refs").symlink_to("refs")), env=HUB_OFFLINE),
    Case("hub-ref-names-no-snapshot", seq(model="org/tiny"),
         "HF_HUB_OFFLINE=1 with no cached copy of the Hub model org/tiny in {c}/home/hub "
         f"(its ref {TINY_REPO}/refs/main names {'f' * 40}, but the snapshot {TINY_REPO}/snapshots/{'f' * 40} is "
         "not there)", hub_cache("f" * 40), env=HUB_OFFLINE),
    Case("hub-snapshot-file-to-etc-passwd", seq(model="org/tiny"),
         "the Hub cache's "
         f"snapshot file {TINY_SNAPSHOT}/config.json links to /etc/passwd, outside the repository's folder "
         f"{TINY_REPO} (expected a link into {TINY_REPO}/blobs)",
         hub_cache(change=in_snapshot("config.json", "/etc/passwd")), env=HUB_OFFLINE),
    Case("hub-snapshot-file-to-another-repository", seq(model="org/tiny"),
         "tokenizer.json links to {c}/home/hub/models--org--other/blobs/tokenizer, outside the repository's folder",
         hub_cache(change=other_repository_blob), env=HUB_OFFLINE),
    Case("hub-snapshot-file-out-hub-unreachable", seq(model="org/tiny"),
         "config.json links to {c}/outside/m/config.json, outside",
         hub_cache(change=in_snapshot("config.json", "{hub}/../../outside/m/config.json")), env=HUB_UNREACHABLE),
    Case("hub-commit-snapshot-file-out", seq(model=f"org/tiny@{HUB_COMMIT}"),
         f"param_path org/tiny@{HUB_COMMIT}: the Hub cache's snapshot file {TINY_SNAPSHOT}/config.json links to",
         hub_cache(change=in_snapshot("config.json", "/etc/passwd")), env=HUB_OFFLINE),
    Case("hub-snapshot-folder-a-link", seq(model="org/tiny"),
         f"the Hub cache's snapshot {TINY_SNAPSHOT} is a link to {{c}}/outside/moved (expected a folder of {TINY_REPO}",
         hub_cache(change=moved_out(f"snapshots/{HUB_COMMIT}")), env=HUB_OFFLINE),
    Case("hub-repository-folder-a-link", seq(model="org/tiny"),
         f"the Hub cache's folder {TINY_REPO} leads to {{c}}/outside/moved, outside the cache {{c}}/home/hub",
         hub_cache(change=moved_out(".")), env=HUB_OFFLINE),
    Case("hub-download-revision-dot-dot", ["download", "org/tiny", "--revision", "../../../../outside/m"],
         "download org/tiny@../../../../outside/m: "
         "revision '../../../../outside/m' is not a branch, tag or commit name", hub_cache(), env=HUB_OFFLINE),
    Case("hub-download-revision-absolute", ["download", "org/tiny", "--revision", "{c}/outside/m"],
         "download org/tiny@{c}/outside/m: revision '/", hub_cache(), env=HUB_OFFLINE),
    Case("hub-download-ref-dot-dot", ["download", "org/tiny"], "download org/tiny: the Hub cache's ref",
         hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-dataset-ref-dot-dot", seq(data="org/texts"),
         "data_root_path org/texts: the Hub cache's ref {c}/home/hub/datasets--org--texts/refs/main holds "
         "'../../../../outside/d', not a commit", hub_cache("../../../../outside/d", dataset=True), env=HUB_OFFLINE),
    Case("hub-dataset-snapshot-file-out", seq(data="org/texts"),
         f"snapshots/{HUB_COMMIT}/data/train.jsonl links to {{c}}/outside/d/train.jsonl, outside the repository's "
         "folder {c}/home/hub/datasets--org--texts",
         hub_cache(change=in_snapshot("data/train.jsonl", "{hub}/../../outside/d/train.jsonl"), dataset=True),
         env=HUB_OFFLINE),
    Case("hub-tokenizer-ref-dot-dot", seq("--tokenizer_path", "org/tiny"),
         "tokenizer_path org/tiny: the Hub cache's ref", hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-generate-ref-dot-dot", ["generate", "--param_path", "org/tiny", "--prompt", "x"],
         "param_path org/tiny: the Hub cache's ref", hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-chat-ref-dot-dot", ["chat", "org/tiny"], "param_path org/tiny: the Hub cache's ref",
         hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-evaluate-ref-dot-dot", ["evaluate", "org/tiny", "--data_root_path", "{c}/outside/d/train.jsonl"],
         "org/tiny: the Hub cache's ref", hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    Case("hub-export-ref-dot-dot", ["export", "org/tiny", "--out", "{c}/exported"],
         "export org/tiny: the Hub cache's ref", hub_cache("../../../../outside/m"), env=HUB_OFFLINE),
    # --- round 3: sizes bounded before work; one type check per field; whose fault ------------------------------
    # Counts that say how many modules a model has are bounded before any loop over them (these hung, building
    # per-layer lists and the meta-device model one layer at a time).
    Case("config-layers-int32", seq(model="{c}/m"), "'num_hidden_layers' must be at most 4,096, got 2,147,483,647",
         model_dir(num_hidden_layers=2**31 - 1)),
    Case("config-experts-int32", seq(model="{c}/m"), "4 MoE layers x 2,147,483,647 experts",
         model_dir(ffn_type="moe", n_routed_experts=2**31 - 2, n_shared_experts=1, n_activated_experts=1)),
    *[Case(f"hf-{kind}-layers-int32", seq(model="{c}/m"),
           "'num_hidden_layers' must be at most 4,096, got 2,147,483,647",
           {**model_dir(), "m/config.json": json.dumps({
               **{k: TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                              "num_attention_heads", "num_key_value_heads", "max_position_embeddings")},
               "model_type": kind, "num_hidden_layers": 2**31 - 1, "sliding_window": 8, "use_sliding_window": True,
               "max_window_layers": 0})})
      for kind in ("mistral", "qwen2")],
    # A value of the wrong kind is one line naming its field, wherever it is first used as a key or compared.
    Case("recipe-train-type-list", ["seq", "--config", "{c}/r.yaml"], "r.yaml: train_type must be str, got [\"seq\"]",
         {"r.yaml": RECIPE + "train_type: [seq]\n"}),
    Case("recipe-null-size", ["seq", "--config", "{c}/r.yaml"], "batch_per_device must be int, got null",
         {"r.yaml": RECIPE + "batch_per_device: null\n"}),
    Case("recipe-null-list", ["seq", "--config", "{c}/r.yaml"], "lora_targets must be list of str, got null",
         {"r.yaml": RECIPE + "lora_targets: null\n"}),
    Case("lora-rank-past-memory", sft("--lora_r", "100000000000", model="{w}/run/epoch_0_step_1"),
         "this model does not fit in memory here: 1,000,576 parameters x 4 bytes and 358,400,000,000,000 adapter "
         "parameters x 4 bytes"),
    Case("recipe-lora-rank-past-int64", ["seq", "--config", "{c}/r.yaml"], "lora_r must fit in 64 bits",
         {"r.yaml": RECIPE + "lora_r: " + "9" * 30 + "\n"}),
    Case("config-model-type-list", seq(model="{c}/m"), "config.json: 'model_type' must be str or null, got [\"llama\"]",
         model_dir(model_type=["llama"])),
    Case("generate-prompt-rendered-empty", ["generate", "--param_path", "{w}/run/epoch_0_step_1",
         "--tokenizer_path", "{c}/t", "--prompt", "hi", "--max_new_tokens", "1"],
         "--prompt 'hi': with the tokenizer in {c}/t, its chat_template renders it as no token",
         tokenizer_dir(chat_template="{{ '' }}")),
    Case("checkpoint-model-type-dict", resume(), "config.json: 'model_type' must be str or null, got {\"a\": 1}",
         checkpoint(edit_json("config.json", model_type={"a": 1}))),
    # --- round 3: record shapes (alpaca, ShareGPT, prompt/completion, TRL's forms); --data_format, --data_columns ----
    # One line naming the record and the column, for every shape's columns of the wrong kind, a missing column (the
    # closest one named), mixed shapes in one file, and the two flags, checked before anything is read.
    Case("shape-sharegpt-not-a-list", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: column 'conversations' must be a list of {from, value} turns (sharegpt shape), got 'hi'",
         jsonl({"conversations": "hi"})),
    Case("shape-sharegpt-turn-without-from", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: 'conversations' turn 1 needs 'from' and 'value' (sharegpt shape), got {'value': 'y'}",
         jsonl({"conversations": [{"from": "human", "value": "x"}, {"value": "y"}]})),
    Case("shape-sharegpt-unknown-role", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: 'conversations' turn 0: unknown 'from' role 'bot'; sharegpt roles are human, gpt and system",
         jsonl({"conversations": [{"from": "bot", "value": "x"}]})),
    Case("shape-sharegpt-unhashable-role", sft(data="{c}/data.jsonl"), "turn 0: unknown 'from' role ['gpt']",
         jsonl({"conversations": [{"from": ["gpt"], "value": "x"}]})),
    Case("shape-sharegpt-value-list", sft(data="{c}/data.jsonl"), "turn 0: 'value' must be a string, got ['x']",
         jsonl({"conversations": [{"from": "gpt", "value": ["x"]}]})),
    Case("shape-sharegpt-empty", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: column 'conversations' is an empty conversation (sharegpt shape)",
         jsonl({"conversations": []})),
    Case("shape-alpaca-missing-output", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: an sft record needs ['output'] (alpaca shape), got keys ['instruction', 'outptu']; "
         "the closest column to 'output' is 'outptu': --data_columns output=outptu reads it",
         jsonl({"instruction": "x", "outptu": "y"})),
    Case("shape-alpaca-number", sft(data="{c}/data.jsonl"),
         "data.jsonl:2: column 'instruction' must be a string (alpaca shape), got 5",
         jsonl({"instruction": "x", "output": "y"}, {"instruction": 5, "output": "y"})),
    Case("shape-mixed-in-one-file", sft(data="{c}/data.jsonl"),
         "data.jsonl:2: the record has the sharegpt shape (conversations), but {c}/data.jsonl:1, the source's first "
         "record, has the alpaca shape", jsonl({"instruction": "x", "output": "y"}, {"conversations": []})),
    Case("shape-prompt-completion-number", sft(data="{c}/data.jsonl"),
         "data.jsonl:1: column 'prompt' "
         "must be a string or a non-empty list of {role, content} messages (prompt_completion shape), got 5",
         jsonl({"prompt": 5, "completion": "c"})),
    Case("shape-implicit-no-shared-prompt", dpo(data="{c}/data.jsonl"),
         "data.jsonl:1: 'chosen' and 'rejected' start with different messages, so there is no prompt",
         jsonl({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "b"}]})),
    Case("shape-implicit-two-turns-after", dpo(data="{c}/data.jsonl"),
         "'chosen' must hold one assistant message, got roles ['assistant', 'user'] (implicit_preference shape)",
         jsonl({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}],
                "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "d"}]})),
    Case("shape-null-text", seq(data="{c}/data.jsonl"),
         "data.jsonl:1: a seq record needs a string field 'text', got keys ['text']; column 'text' is null",
         jsonl({"text": None})),
    Case("shape-grpo-prompt-with-responses", grpo("--data_format", "prompt"),
         "groups.jsonl:1: the prompt shape reads records without a 'responses' column, and this one has it"),
    Case("shape-format-forced", sft("--data_format", "alpaca"),
         "tasks.jsonl:1: an sft record needs ['instruction', 'output'] (alpaca shape), got keys ['messages']"),
    Case("shape-columns-missing", seq("--data_columns", "text=body", data="{c}/data.jsonl"),
         "data.jsonl:1: a seq record needs a string field 'body', got keys ['text']", jsonl({"text": "x"})),
    Case("shape-format-bin-shards", seq("--data_format", "text", data="{c}/s"),
         "--data_format: data_root_path {c}/s holds bin shards (tokens); "
         "record shapes apply to records read as they are",
         {f"s/{name}": data for name, data in seq_shard(np.arange(64, dtype=np.int32)).items()}),
    Case("shape-columns-dataset-config", sft("--data_columns", "messages=chat", data="{c}/d"),
         "--data_columns: {c}/d/dataset_config.json renders these records",
         data_config({"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
                      "mask": {"assistant": "train"}}, {"messages": [{"role": "assistant", "content": "x"}]})),
    Case("shape-format-other-type", seq("--data_format", "alpaca"),
         "invalid training arguments: data_format 'alpaca' is an sft shape; seq reads text (or auto)"),
    Case("shape-columns-unknown-field", sft("--data_columns", "instruktion=q"),
         "data_columns: 'instruktion' is not a field of the sft shapes (did you mean 'instruction'?); fields: "),
    Case("shape-columns-no-equals", sft("--data_columns", "prompt"),
         "data_columns entry 'prompt' must be field=column (e.g. prompt=question)"),
    Case("shape-columns-twice", dpo("--data_columns", "prompt=a,prompt=b"),
         "data_columns names the field 'prompt' twice"),
    Case("shape-columns-one-column-two-fields", sft("--data_columns", "prompt=a,completion=a"),
         "data_columns reads the column 'a' for two fields"),
    Case("shape-columns-empty", sft("--data_columns", ""), "data_columns is empty: give field=column pairs"),
    # --- round 3: sources read through datasets (data/sources.py): files, directories, subsets, splits ----------
    Case("parquet-corrupt", seq(data="{c}/d.parquet"), "{c}/d.parquet: not a readable parquet file (",
         {"d.parquet": b"PAR1 not a parquet file PAR1"}),
    Case("parquet-empty-split", seq(data="{c}/d.parquet"), "d.parquet: split 'train' is empty (no records)",
         {"d.parquet": lambda p: parquet_file(p, {"text": []})}),
    Case("parquet-text-not-a-string", sft(data="{c}/d.parquet"), "{c}/d.parquet row 1: an sft record needs",
         {"d.parquet": lambda p: parquet_file(p, {"messages": [[{"role": "user", "content": "hi"}], None]})}),
    Case("data-dir-mixing-kinds", seq(data="{c}/d"), "d: holds data files of several kinds (parquet ({c}/d/a.parquet), "
         "csv ({c}/d/b.csv)); keep one kind", {"d/a.parquet": lambda p: parquet_file(p, {"text": ["a"]}),
                                                       "d/b.csv": "text\nhello\n"}),
    Case("subset-not-chosen", seq(data="{c}/m"), "m: has subsets 'en', 'fr'; choose one with --data_subset",
         SUBSETS),
    Case("prepare-subset-unknown", ["prepare", "{c}/m", "-o", "{c}/o", "-c", "{c}/p.json", "--tokenizer_path",
         "bundled:tiny", "--data_subset", "de"], "--data_subset 'de': input {c}/m has no such subset; it has 'en', "
         "'fr'", {**SUBSETS, **TEXT_PIPELINE}),
    Case("prepare-split-unknown", ["prepare", "{c}/s", "-o", "{c}/o", "-c", "{c}/p.json", "--tokenizer_path",
         "bundled:tiny", "--data_split", "test"], "--data_split 'test': input {c}/s has no such split; it has "
         "'train', 'validation'", {"s": lambda p: saved_dict(p, ["train", "validation"]), **TEXT_PIPELINE}),
    Case("prepare-parquet-corrupt", ["prepare", "{c}/d.parquet", "-o", "{c}/o", "-c", "{c}/p.json",
         "--tokenizer_path", "bundled:tiny"], "{c}/d.parquet: not a readable parquet file (",
         {"d.parquet": b"PAR1" + b"\0" * 64 + b"PAR1", **TEXT_PIPELINE}),
    # --- round 4: one record bounded (record_size, TABLE_RECORD_BYTES here); a card's aliases bounded -------------
    Case("record-jsonl-line-past-the-limit", sft(data="{c}/data.jsonl"),
         "{c}/data.jsonl:2: a line longer than 256 KiB (the limit for one record, docs/data.md)",
         jsonl({"messages": [{"role": "user", "content": "hi"}]},
               {"messages": [{"role": "user", "content": PAST_THE_LIMIT}]})),
    Case("record-csv-row-past-the-limit", seq(data="{c}/d.csv"),
         "{c}/d.csv row 1: a row longer than 512 KiB as written, more than 256 KiB",
         {"d.csv": f'text\nhello\n"{PAST_THE_LIMIT * 2}"\n'}),
    Case("record-csv-cell-past-the-limit", sft(data="{c}/d.csv"),
         "{c}/d.csv row 1: a record of 300,002 bytes, more than 256 KiB",
         {"d.csv": f"instruction,output\nhi,ok\n{PAST_THE_LIMIT},ok\n"}),
    Case("record-parquet-one-row-past-the-limit", seq(data="{c}/d.parquet"),
         "{c}/d.parquet row 0: 293 KiB per record, more than 256 KiB",
         {"d.parquet": lambda p: parquet_file(p, {"text": [PAST_THE_LIMIT]})}),
    Case("record-parquet-row-group-past-the-limit", sft(data="{c}/d.parquet"),
         "{c}/d.parquet row 1200: a record of 300,002 bytes, more than 256 KiB",
         {"d.parquet": lambda p: parquet_file(p, {"instruction": ["hi"] * 1200 + [PAST_THE_LIMIT] + ["hi"] * 300,
                                                  "output": ["ok"] * 1501})}),
    Case("record-arrow-past-the-limit", seq(data="{c}/d.arrow"),
         "{c}/d.arrow row 1: a record of 300,000 bytes, more than 256 KiB",
         {"d.arrow": lambda p: arrow_stream(p, {"text": ["hello", PAST_THE_LIMIT]})}),
    Case("record-saved-past-the-limit", seq(data="{c}/s"),
         "{c}/s (train) row 1: a record of 300,000 bytes, more than 256 KiB",
         {"s": lambda p: saved_dataset(p, {"text": ["hello", PAST_THE_LIMIT]})}),
    Case("card-alias-bomb", seq(data="{c}/m"),
         "data_root_path {c}/m: README.md: its YAML header's aliases (*name) expand it to more than 4,194,304 values "
         "(line 12); not a dataset card",
         {"m/README.md": alias_bomb(), "m/d.parquet": lambda p: parquet_file(p, {"text": ["hello"]})}),
    Case("prepare-record-jsonl-line-past-the-limit", prepare_argv(),
         "{c}/data.jsonl:1: a line longer than 256 KiB (the limit for one record",
         {**jsonl({"text": PAST_THE_LIMIT}), **TEXT_PIPELINE}),
    Case("prepare-record-parquet-row-group-past-the-limit", ["prepare", "{c}/d.parquet", "-o", "{c}/o", "-c",
         "{c}/p.json", "--tokenizer_path", "bundled:tiny"],
         "{c}/d.parquet row 1200: a record of 300,000 bytes, more than 256 KiB",
         {"d.parquet": lambda p: parquet_file(p, {"text": ["hi"] * 1200 + [PAST_THE_LIMIT] + ["hi"] * 300}),
          **TEXT_PIPELINE}),
    Case("prepare-card-alias-bomb", ["prepare", "{c}/m", "-o", "{c}/o", "-c", "{c}/p.json", "--tokenizer_path",
         "bundled:tiny"], "input {c}/m: README.md: its YAML header's aliases (*name) expand it to more than",
         {"m/README.md": alias_bomb(), "m/d.parquet": lambda p: parquet_file(p, {"text": ["hello"]}),
          **TEXT_PIPELINE}),
    # a column of the wrong kind, from the file's schema before any row is read (Shaper.check_schema)
    Case("parquet-text-column-of-numbers", seq(data="{c}/d.parquet"), "{c}/d.parquet: column 'text' is int64 in the "
         "file's schema, but the text shape reads it as a string", {"d.parquet": lambda p: parquet_file(
             p, {"text": [1, 2]})}),
    Case("parquet-alpaca-output-of-numbers", sft(data="{c}/d"), "{c}/d/b.parquet: column 'output' is double in the "
         "file's schema, but the alpaca shape reads it as a string",
         {"d/a.parquet": lambda p: parquet_file(p, {"instruction": ["x"], "output": ["y"]}),
          "d/b.parquet": lambda p: parquet_file(p, {"instruction": ["x"], "output": [1.5]})}),
    Case("parquet-mapped-column-of-numbers", dpo("--data_columns", "prompt=question", data="{c}/d.parquet"),
         "column 'question' is int64 in the file's schema, but the preference shape reads it as a string or a list "
         "of messages", {"d.parquet": lambda p: parquet_file(p, {"question": [1], "chosen": ["c"],
                                                                   "rejected": ["r"]})}),
    Case("prepare-parquet-text-column-of-numbers", ["prepare", "{c}/d.parquet", "-o", "{c}/o", "-c", "{c}/p.json",
         "--tokenizer_path", "bundled:tiny"], "{c}/d.parquet: column 'text' is int64 in the file's schema",
         {"d.parquet": lambda p: parquet_file(p, {"text": [7]}), **TEXT_PIPELINE}),
    Case("data-split-not-a-name", seq("--data_split", "train[:10%]"), "data_split must be a split name"),
    Case("data-subset-blank", seq("--data_subset", " "), "data_subset must be a subset name, got ' '"),
    # --- round 5: a model this machine cannot hold refused from its config, before its RoPE table is computed ------
    *[Case(f"{command}-rope-table-past-memory", argv, "ck/config.json: this model does not fit in memory here: its "
           "RoPE table alone takes 2,384.2 GiB", checkpoint(edit_json("config.json", head_dim=10**9)))
      for command, argv in (("export-hf", ["export", "{c}/ck", "--format", "hf", "--out", "{c}/hf"]),
                            ("generate", ["generate", "--param_path", "{c}/ck", "--prompt", "Hi"]),
                            ("evaluate", ["evaluate", "{c}/ck", "--data_root_path", "bundled:data/seq"]))],
    # --- round 5: the dry run refuses what the run refuses, from the same checks -----------------------------------
    Case("seed-negative", seq("--random_seed", "-1"), "random_seed must be between 0 and 4,294,967,295, got -1"),
    Case("seed-past-numpy", seq("--random_seed", str(2**32)), "random_seed must be between 0 and 4,294,967,295"),
    # --- round 5: the planner bounded: ranks per machine, machines and ranks capped before any plan is made ---------
    Case("nprocs-past-the-cap", seq("--nprocs", "5000"), "nprocs (devices) must be at most 4,096, got 5,000"),
    Case("num-nodes-past-the-cap", seq("--num_nodes", "1000000000"),
         "num_nodes must be at most 100,000, got 1,000,000,000"),
    Case("world-past-the-cap", seq("--nprocs", "1000", "--num_nodes", "1000"),
         "nprocs x num_nodes must be at most 100,000 ranks, got 1,000,000"),
    # --- round 5: a sharded state (torch distributed checkpoint) runs nothing it holds (checkpoint/sharded_state.py) --
    # Torch's reader would unpickle state/.metadata whole and every stored value with weights_only=False.
    Case("sharded-metadata-runs-code", sharded_resume(), "ck/state/.metadata: not a sharded state's index "
         "(UnpicklingError: \"it names 'posix'.'system', which torch's checkpoint metadata never holds\")",
         sharded(planted_metadata)),
    Case("sharded-metadata-runs-code-resume-auto", seq("--parallel_mode", "fsdp", "--resume", "auto"),
         "out/epoch_0_step_1/state/.metadata: not a sharded state's index",
         sharded(planted_metadata, "out/epoch_0_step_1")),
    Case("sharded-metadata-runs-code-astrai-resume", seq("--parallel_mode", "fsdp", "--resume", model="{c}/ck"),
         "ck/state/.metadata: not a sharded state's index", sharded(planted_metadata)),
    Case("sharded-metadata-runs-code-export", ["export", "{c}/ck", "--out", "{c}/ex"],
         "ck/state/.metadata: not a sharded state's index", sharded(planted_metadata)),
    Case("sharded-value-runs-code", sharded_resume(), "'optimizer.adamw.param_groups.0.lr' in __0_0.distcp: a stored "
         "value that is not plain data (UnpicklingError", sharded(planted_value)),
    Case("sharded-value-runs-code-export", ["export", "{c}/ck", "--out", "{c}/ex"],
         "'optimizer.adamw.param_groups.0.lr' in __0_0.distcp: a stored value that is not plain data",
         sharded(planted_value)),
    Case("sharded-distcp-missing", sharded_resume(),
         "ck/state/__0_0.distcp: file not found; the optimizer's sharded state is damaged",
         sharded(lambda state: (state / "__0_0.distcp").unlink())),
    Case("sharded-distcp-cut-short", sharded_resume(), "of __0_0.distcp, which holds 1,000 (cut short); the "
         "optimizer's sharded state is damaged", sharded(lambda state: os.truncate(state / "__0_0.distcp", 1000))),
    Case("sharded-metadata-cut-short-export", ["export", "{c}/ck", "--out", "{c}/ex"],
         "ck/state/.metadata: not a sharded state's index (UnpicklingError",
         sharded(lambda state: os.truncate(state / ".metadata", 5000))),
    Case("sharded-metadata-dev-zero", sharded_resume(), "ck/state/.metadata: links to /dev/zero, a character device",
         sharded(replaced(".metadata", link_to("/dev/zero")))),
    Case("sharded-metadata-names-a-file-outside", sharded_resume(), "not a file of the state's own folder",
         sharded(lambda state: rewrite_metadata(state, lambda info: setattr(info, "relative_path", "../config.json")))),
    Case("sharded-metadata-tensor-past-its-files", ["export", "{c}/ck", "--out", "{c}/ex"],
         "its files hold; the optimizer's sharded state is damaged",  # a momentum a million times its size
         sharded(lambda state: rewrite_metadata(state, tensors=lambda entry: setattr(
             entry, "size", torch.Size([entry.size[0] * 1_000_000, *entry.size[1:]]))))),
]  # fmt: skip


def _reshaped_optimizer_state(ck: Path) -> dict:
    state = torch.load(ck / "optimizer.pt")
    part = next(iter(state.values()))
    entry = next(iter(part["state"].values()))
    key = next(k for k, v in entry.items() if v.dim() > 0)
    entry[key] = torch.zeros(3, 3)
    return state


def _half_muon(ck: Path) -> dict:
    """Muon's state with every other parameter's entry deleted (torch loads it, their momentum reset silently)."""
    state = torch.load(ck / "optimizer.pt")
    state["muon"]["state"] = {k: v for i, (k, v) in enumerate(state["muon"]["state"].items()) if i % 2}
    return state


def _extra_group(ck: Path) -> dict:
    state = torch.load(ck / "optimizer.pt")
    part = next(iter(state.values()))
    part["param_groups"].append({**part["param_groups"][0], "params": [10_000]})
    return state


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A finished 1-step seq run, for the cases that read a checkpoint, and one writing a sharded state."""
    root = tmp_path_factory.mktemp("hostile") / "w"
    argv = seq("--max_steps", "1", "--ckpt_dir", str(root / "run"))
    assert main([a.replace("{c}/out", str(root / "unused")) for a in argv]) == 0
    sharded = [*argv, "--parallel_mode", "fsdp", "--sharded_checkpoint", "true", "--ckpt_dir", str(root / "sharded")]
    assert main([a.replace("{c}/out", str(root / "unused")) for a in sharded]) == 0
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_the_dry_run_refuses_a_tensor_parallel_split_the_run_refuses(tmp_path, capsys):
    """Tensor parallelism over 3 ranks splits none of the tiny model's 4 heads, 2 KV heads and 352 MLP units evenly:
    the dry run says so from the run's own check (it planned it before). Not a table case: the run launches its 3
    ranks before the check, and a launch from inside pytest would start pytest again."""
    argv = [a.replace("{c}", str(tmp_path)) for a in seq("--parallel_mode", "fsdp", "--nprocs", "3", "--tp_size", "3")]
    assert main([*argv, "--dry_run"]) == 2
    out = capsys.readouterr().out
    assert "tp_size 3 must divide num_attention_heads (4), num_key_value_heads (2), intermediate_size (352)" in out
    assert not (tmp_path / "out").exists()


def test_more_processes_than_this_machine_holds_are_refused_before_one_starts(tmp_path, capsys, monkeypatch):
    """Each rank's process takes ~0.5 GiB before any model (``train.checks.PROCESS_BYTES``): 3 ranks on a machine
    of 1 GiB are refused by the launcher before it starts one, and by the dry run from the same check. Not a table
    case: were the check gone, the run would launch its ranks from inside pytest (here a tripwire stops it)."""
    import astrai_fabric.train as train_package
    from astrai_fabric.train import checks

    def launched(args):  # noqa: ANN001, ANN202
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(checks, "host_memory_bytes", lambda: 2**30)
    monkeypatch.setattr(train_package, "build_run_fabric", launched)
    argv = [a.replace("{c}", str(tmp_path)) for a in seq("--parallel_mode", "ddp", "--nprocs", "3")]
    message = (
        "nprocs 3: 3 processes on this machine take 1.5 GiB of their own (0.5 GiB each: Python, torch, Lightning) "
        "before any model; this machine has 1.0 GiB"
    )
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("astrai-fabric: error:") == 1 and message in err, err[-2000:]
    assert main([*argv, "--dry_run"]) == 2
    out = capsys.readouterr().out
    assert f"  - {message}" in out and "does not fit in memory here" not in out, out[-2000:]  # said once
    assert not (tmp_path / "out").exists()


def test_a_planted_sharded_state_runs_nothing_where_the_state_is_not_read(workspace, tmp_path, capsys, monkeypatch):
    """generate, chat and evaluate read a sharded checkpoint's weights, never its ``state/``: with the payload planted
    there each runs as usual, and nothing it holds runs (the commands that read the state refuse it: the table)."""
    from test_chat import piped

    here = tmp_path / "c"
    here.mkdir()
    (tmp_path / "w").symlink_to(workspace)
    ck = here / "ck"
    sharded(planted_metadata)["ck"](ck)
    (here / "held_out.jsonl").write_text(json.dumps({"text": "In the beginning was the word. " * 8}) + "\n")
    generate = ["generate", "--param_path", str(ck), "--prompt", "Hi", "--max_new_tokens", "2", "--chat", "false"]
    assert main(generate) == 0
    monkeypatch.setattr("sys.stdin", piped("hello\n"))
    assert main(["chat", str(ck), "--max_new_tokens", "2", "--template", "false"]) == 0
    evaluate = ["evaluate", str(ck), "--data_root_path", str(here / "held_out.jsonl"), "--window_size", "16"]
    assert main(evaluate) == 0, capsys.readouterr().err[-2000:]
    assert not (here / "pwned").exists()


def test_the_table_covers_every_input():
    assert len(CASES) >= 80 and len({case.id for case in CASES}) == len(CASES)


def lay_out(case: Case, workspace: Path, tmp_path: Path) -> tuple[Path, dict[str, str], list[str]]:
    """The case's files written into ``{c}`` (``tmp_path/c``; ``tmp_path/w`` links the shared workspace, which
    ``checkpoint()`` copies from): returns ``{c}``, the fill-ins, and the command line."""
    here = tmp_path / "c"
    here.mkdir()
    (tmp_path / "w").symlink_to(workspace)
    fill = {"{c}": str(here), "{w}": str(workspace)}
    for name, content in case.files.items():
        path = here / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path)
        else:
            path.write_bytes(content if isinstance(content, bytes) else _fill(content, fill).encode())
    return here, fill, [_fill(arg, fill) for arg in case.argv]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_hostile_input_gets_one_line(case, workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)  # the endless template: a short wait is enough
    monkeypatch.setattr(record_size, "MAX_RECORD_BYTES", TABLE_RECORD_BYTES)
    here, fill, argv = lay_out(case, workspace, tmp_path)
    for name, value in case.env.items():
        monkeypatch.setenv(name, _fill(value, fill))
    before = snapshot(here), snapshot(workspace)
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert code == case.code, err[-3000:] + out[-1000:]
    assert len(lines) == 1 and _fill(case.message, fill) in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert (snapshot(here), snapshot(workspace)) == before  # nothing written, nothing overwritten
    assert not (here / "pwned").exists()


TRAIN_COMMANDS = ("seq", "sft", "dpo", "grpo")
DRY_RUN_CASES = [case for case in CASES if case.argv[0] in TRAIN_COMMANDS and "--print_config" not in case.argv]


@pytest.mark.parametrize("case", DRY_RUN_CASES, ids=lambda case: case.id)
def test_the_dry_run_refuses_what_the_run_refuses(case, workspace, tmp_path, capsys, monkeypatch):
    """One set of start-up checks (``train.checks``): the dry run of each hostile training command exits as the
    run does (2), naming the same problem, as a line of its list or, for mistakes found before any plan can be
    made (a flag, a recipe), as the same one error line; and it writes nothing either."""
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)
    monkeypatch.setattr(record_size, "MAX_RECORD_BYTES", TABLE_RECORD_BYTES)
    here, fill, argv = lay_out(case, workspace, tmp_path)
    for name, value in case.env.items():
        monkeypatch.setenv(name, _fill(value, fill))
    before = snapshot(here), snapshot(workspace)
    code = main([*argv, "--dry_run"])
    out, err = capsys.readouterr()
    assert code == case.code, out[-3000:] + err[-2000:]
    assert _fill(case.message, fill) in out + err, out[-3000:] + err[-2000:]
    assert "Traceback" not in err
    assert (snapshot(here), snapshot(workspace)) == before


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def test_a_hub_cache_as_huggingface_hub_writes_it_trains_offline_and_is_recorded_by_its_commit(
    tmp_path, capsys, monkeypatch
):
    """The layout the ``hub-`` cases tamper with, untampered (``refs/main`` holding the commit, the snapshot's files
    linking into ``../../blobs/``): a model and a dataset read from it offline, and what the run read recorded as
    ``org/name@COMMIT``, never the branch."""
    for files in (hub_cache(), hub_cache(dataset=True)):
        files["home"](tmp_path / "home")
    for name, value in HUB_OFFLINE.items():
        monkeypatch.setenv(name, value.replace("{c}", str(tmp_path)))
    argv = seq("--max_steps", "1", model="org/tiny", data="org/texts")
    assert main([a.replace("{c}", str(tmp_path)) for a in argv]) == 0, capsys.readouterr().err[-2000:]
    meta = json.loads((tmp_path / "out" / "epoch_0_step_1" / "meta.json").read_text())
    recipe = (tmp_path / "out" / "recipe.yaml").read_text()
    for flag, repo in (("param_path", "org/tiny"), ("data_root_path", "org/texts")):
        assert meta[flag] == f"{repo}@{HUB_COMMIT}"
        assert f"{flag}: {repo}@{HUB_COMMIT}\n" in recipe


def test_a_printed_recipe_does_not_carry_the_trust_code_opt_in(tmp_path, capsys):
    argv = grpo("--reward", "mypackage.score", "--trust_code", data="bundled:data/grpo_online")
    assert main([*(a.replace("{c}", str(tmp_path)) for a in argv), "--print_config"]) == 0
    printed = capsys.readouterr().out
    assert "mypackage.score" in printed and "trust_code" not in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert main(["grpo", "--config", str(tmp_path / "printed.yaml")]) == 2
    assert "needs --trust_code on the command line" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, files, warning",
    [
        (
            sft(data="{c}/data.jsonl"),
            jsonl(
                {"messages": [{"role": "user", "content": "a question " * 12}]},
                {"messages": [{"role": "assistant", "content": "an answer " * 12}]},
            ),
            r"warning: (\d+) of (\d+) windows hold no trained token",
        ),
        (
            dpo(data="{c}/data.jsonl"),
            jsonl(
                {"prompt": "p", "chosen": "same", "rejected": "same"},
                {"prompt": "p", "chosen": "yes", "rejected": "no"},
            ),
            r"warning: 1 of 2 pairs have chosen equal to rejected",
        ),
        (
            grpo(data="{c}/data.jsonl"),
            jsonl(OK_GROUP, {**OK_GROUP, "rewards": [0.5, 0.5]}),
            r"warning: 1 of 2 groups have all-equal rewards",
        ),
    ],
    ids=["sft-untrained-windows", "dpo-identical-pairs", "grpo-flat-groups"],
)
def test_data_that_trains_nothing_in_places_is_counted_at_start(tmp_path, capsys, argv, files, warning):
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    assert main([a.replace("{c}", str(tmp_path)) for a in argv] + ["--dry_run"]) == 0
    found = re.search(warning, capsys.readouterr().out)
    assert found, warning
    if found.groups():  # sft: the count is of the windows that really lack a trained token
        untrained, total = map(int, found.groups())
        assert 0 < untrained < total


def test_a_malformed_metric_history_line_is_skipped_with_a_warning(workspace, tmp_path, capsys):
    """Not JSON, or an object that is not a metric entry (its step a string: what plot reads of it), is dropped,
    so the history the resumed run carries on plots whole; a line past ``MAX_LINE_BYTES`` ends what is read of it
    (the run has begun writing by then: it goes on, saying so)."""
    run = tmp_path / "run"
    shutil.copytree(workspace / "run", run)
    with open(run / "epoch_0_step_1" / "metric.jsonl", "a") as file:
        file.write('{not json\n{"type": "step", "step": "two", "loss": 1.0}\n' + "x" * (MAX_LINE_BYTES + 1))
    argv = [a.replace("{c}/out", str(run)) for a in seq("--resume", "auto", "--max_steps", "2")]
    with pytest.warns(UserWarning) as caught:
        assert main(argv) == 0
    dropped = [str(w.message) for w in caught if "this metric history line is dropped" in str(w.message)]
    assert len(dropped) == 2 and "not a JSON object; this metric history line is dropped" in dropped[0], dropped
    message = "not a metric entry (step 'two', expected an integer in [0, 2^63)); this metric history line is dropped"
    assert re.search(r"metric.jsonl:\d+: ", dropped[1]) and message in dropped[1], dropped
    cut = [
        str(w.message) for w in caught if "the metric history is carried on from the lines before it" in str(w.message)
    ]
    assert (
        len(cut) == 1
        and "bytes, not a metric entry; the metric history is carried on from the lines before it" in cut[0]
    ), cut
    entries = [json.loads(line) for line in (run / "epoch_0_step_2" / "metric.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if e["type"] == "step"] == [1, 2]


@pytest.fixture(scope="module")
def evaluated(workspace, tmp_path_factory) -> Path:
    """``run/``: a copy of the workspace's run, its checkpoint evaluated for perplexity with 95% intervals (in its
    ``eval/``), beside a tasks result stored as evaluate stores one; ``held_out.jsonl``, the data evaluated."""
    from astrai_fabric.evaluate.results import result_path, write_result

    root = tmp_path_factory.mktemp("evaluated")
    shutil.copytree(workspace / "run", root / "run")
    texts = ("In the beginning God created", "the heaven and the earth.", "And the earth was without form")
    (root / "held_out.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    assert main(evaluate_argv(root / "run", root / "held_out.jsonl")) == 0
    checkpoint = root / "run" / "epoch_0_step_1"
    settings = {"tasks": ["tiny_mc"]}
    metrics = {"tiny_mc/acc": 0.5, "tiny_mc/acc_stderr": 0.25}
    write_result(
        result_path(checkpoint, "tasks", settings),
        {"format": 1, "kind": "tasks", "source": str(checkpoint), "step": 1, "settings": settings, "metrics": metrics},
    )
    return root


def evaluate_argv(run: Path, data: Path) -> list[str]:
    return ["evaluate", str(run), "--data_root_path", str(data), "--window_size", "16", "--bootstrap_iters", "20"]


def stored(run: Path, kind: str) -> Path:
    (path,) = (run / "epoch_0_step_1" / "eval").glob(f"{kind}-*.json")
    return path


TAMPERED_RESULTS = [
    ("perplexity", {"metrics__loss_ci95": 2.5}, "metric loss_ci95 2.5, expected a pair [low, high] of numbers in "
     "[0, 700]"),
    ("perplexity", {"kind": "../../../etc/passwd"}, "kind '../../../etc/passwd' where its name says 'perplexity'"),
    ("perplexity", {"metrics__loss": float("nan")}, "a number that is not finite (nan)"),
    ("perplexity", {"metrics__perplexity": float("inf")}, "a number that is not finite (inf)"),
    ("perplexity", {"metrics__perplexity": 1e308}, "metric perplexity 1e+308, expected a number in [1, 1.014e+304]"),
    ("perplexity", {"metrics__loss": -0.5}, "metric loss -0.5, expected a number in [0, 700]"),
    ("perplexity", {"metrics__perplexity": 0.5}, "metric perplexity 0.5, expected a number in [1, "),
    ("perplexity", {"metrics__loss_ci95": [3.0, 2.0]}, "metric loss_ci95 [3.0, 2.0], expected a pair [low, high]"),
    ("perplexity", {"metrics__loss_ci95": [1.0, "2"]}, "metric loss_ci95 [1.0, '2'], expected a pair"),
    ("perplexity", {"metrics__tokens": -1}, "metric tokens -1, expected a positive integer"),
    ("perplexity", {"metrics__units": 2.5}, "metric units 2.5, expected a positive integer"),
    ("perplexity", {"metrics__loss": None}, "metrics without loss"),
    ("perplexity", {"metrics__bleu": 1.0}, "metrics ['bleu'] perplexity does not write"),
    ("perplexity", {"metrics": "low"}, "metrics 'low', expected an object of numbers by name"),
    ("perplexity", {"format": True}, "format True, expected 1"),
    ("perplexity", {"settings__window_size": 8}, "settings that are not those its name's digest"),
    ("perplexity", {"settings": None}, "settings that are not those its name's digest"),
    ("perplexity", {"step": -1}, "step -1, expected a non-negative integer or null"),
    ("perplexity", {"source": ["x"]}, "source ['x'], expected a path or Hub id"),
    ("perplexity", {"source": json.loads("[" * 100 + "]" * 100)}, "nested more than 64 levels deep"),
    ("tasks", {"metrics__tiny_mc/acc_stderr": -0.25}, "metric 'tiny_mc/acc_stderr' -0.25, expected a finite "
     "number >= 0"),
    ("tasks", {"metrics__tiny_mc/acc": "0.5"}, "metric 'tiny_mc/acc' '0.5', expected a finite number"),
    ("tasks", {"metrics__tiny_mc/acc": True}, "metric 'tiny_mc/acc' True, expected a finite number"),
    ("tasks", {"metrics__acc": 0.5}, "metric name 'acc', expected TASK/METRIC"),
    ("tasks", {"metrics__tiny_mc/acc": 10**400}, "metric 'tiny_mc/acc' 1000"),
    ("tasks", "{", "not valid JSON"),
    ("tasks", "[1]", "expected a JSON object, got list"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "change", "problem"), TAMPERED_RESULTS)
def test_a_stored_result_read_back_is_checked_field_by_field(evaluated, tmp_path, kind, change, problem):
    """What evaluate stored, changed one field at a time: not read as a result (so not printed, drawn or written to
    --output), one warning naming the file and what is wrong. The file as written reads back whole."""
    from astrai_fabric.evaluate.results import read_result

    path = tmp_path / stored(evaluated / "run", kind).name
    written = json.loads(stored(evaluated / "run", kind).read_text())
    path.write_text(json.dumps(written))
    assert read_result(path, "evaluated again") == written
    path.write_text(change if isinstance(change, str) else json.dumps(configured(written, **change)))
    with pytest.warns(UserWarning) as caught:
        assert read_result(path, "evaluated again") is None
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"{path}: not a stored result of ours (") and message.endswith("); evaluated again")
    assert problem in message and "\n" not in message


def test_a_tampered_stored_result_is_evaluated_again_and_left_out_of_the_plot(evaluated, tmp_path, capsys):
    from astrai_fabric.plot import read_evaluations

    run = tmp_path / "run"
    shutil.copytree(evaluated / "run", run)
    path = stored(run, "perplexity")
    written = json.loads(path.read_text())
    path.write_text(json.dumps(configured(written, kind="/etc/passwd", metrics__loss_ci95=2.5)))
    with pytest.warns(UserWarning) as caught:
        drawn = read_evaluations(run)
    problem = "kind '/etc/passwd' where its name says 'perplexity'"
    assert [str(w.message) for w in caught] == [
        f"{path}: not a stored result of ours ({problem}); left out of the plot"
    ]
    assert sorted(drawn) == ["tiny_mc/acc"]  # the tasks result beside it is drawn; the tampered one left out
    argv = [*evaluate_argv(run, evaluated / "held_out.jsonl"), "--output", str(tmp_path / "results.json")]
    with pytest.warns(
        UserWarning, match=re.escape(f"{path}: not a stored result of ours ({problem}); evaluated again")
    ):
        assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and f"stored: {path}" in out
    again = json.loads(path.read_text())  # evaluated again and stored over it: the result first written
    assert again["kind"] == "perplexity" and again["metrics"] == written["metrics"]
    assert json.loads((tmp_path / "results.json").read_text())["results"][0]["metrics"] == written["metrics"]


@pytest.mark.parametrize("train_type", ["grpo", "dpo"])
def test_a_reward_model_scoring_nan_stops_online_training_in_one_line(tmp_path, capsys, train_type):
    """A reward model whose score head is NaN (the user's model: its scores are values we compute from it) stops
    online grpo and online dpo at the first rollout, as a reward function returning NaN does, before any step."""
    from astrai_fabric.checkpoint import save_checkpoint
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.reward_model import reward_model_config

    config = reward_model_config(ModelConfig.from_dict({**TINY_CONFIG, "num_hidden_layers": 1}), 0)
    model = AutoRegressiveLM(config)
    torch.nn.init.constant_(model.score.weight, float("nan"))
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(tmp_path / "rm", model.state_dict(), config.to_dict(), files=files)
    flags = ["--reward_model", "{c}/rm", "--max_steps", "1", "--batch_per_device", "1", "--rollout_max_tokens", "2"]
    if train_type == "grpo":
        argv = grpo(*flags, "--group_size", "2", data="bundled:data/grpo_online")
    else:
        argv = dpo(*flags, "--window_size", "64", data="bundled:data/grpo_online")
    assert main([_fill(arg, {"{c}": str(tmp_path)}) for arg in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert lines == [
        f"astrai-fabric: error: reward model {tmp_path / 'rm'} returned float (nan) for response 0 of prompt 0: "
        "rewards must be finite in float32 (|r| <= 3.4e38)"
    ], err[-2000:]
    assert "Traceback" not in err and not list((tmp_path / "out").glob("epoch_*"))


def test_a_bom_before_tokenizer_config_is_taken_at_export_as_where_it_loads(workspace, tmp_path, capsys):
    """A UTF-8 BOM before a checkpoint's ``tokenizer_config.json``: every reader of the package reads JSON as bytes
    through ``json_files``, whose parser takes one (the tokenizer loads it), so ``export --format hf`` does too, and
    writes the file without it, as from the same file without one."""
    for name, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        shutil.copytree(workspace / "run" / "epoch_0_step_1", tmp_path / name)
        config = tmp_path / name / "tokenizer_config.json"
        config.write_bytes(bom + config.read_bytes())
        assert main(["export", str(tmp_path / name), "--format", "hf", "--out", str(tmp_path / f"{name}_hf")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    written = [(tmp_path / f"{name}_hf" / "tokenizer_config.json").read_bytes() for name in ("plain", "bom")]
    assert written[0] == written[1] and not written[1].startswith(b"\xef\xbb\xbf")


def test_a_model_past_memory_is_in_the_dry_runs_list(tmp_path, capsys):
    """A model whose every tensor could be allocated but not all of them (what the run itself would find only when
    the kernel kills it): the dry run counts it on the meta device against this machine's memory."""
    # Layers of ~4.5 GiB (three 8192 x 32768 float32 matrices and attention), none over 1 GiB, enough of them
    # for twice this machine's memory.
    num_layers = 2 * host_memory_bytes() // (4 << 30) + 1
    config = model_dir(vocab_size=2**16, hidden_size=2**13, intermediate_size=2**15, num_hidden_layers=num_layers)
    for name, content in config.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    argv = [_fill(arg, {"{c}": str(tmp_path)}) for arg in seq("--dry_run", model="{c}/m")]
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "cannot start:" in out
    assert re.search(
        r"param_path \S+/m: this model does not fit in memory here: [\d,]+ parameters x 4 bytes, and 0.5 GiB of the "
        r"process's own, x 1 process\(es\) per machine need [\d,.]+ GiB before any optimizer state",
        out,
    ), out[-2000:]
