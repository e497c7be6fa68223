"""Checkpoint save and load time against raw ``safetensors.save_file`` + ``torch.save`` of the same tensors.

    .venv/bin/python bench/checkpoint_io.py [--repeats 5]

Model: ~100M parameters (hidden 768, 12 layers, 12/4 heads, SwiGLU 2048, vocabulary 32000, tied), float32, with
a full AdamW state (two more tensors per parameter): 1.1 GiB per checkpoint, written to the current directory's
disk. "ours" is what a run does at every checkpoint: ``save_training_checkpoint`` (a staging folder, every file
fsync'ed, then the rename; meta.json with the resume position) and ``load_checkpoint`` (every file, ``.pt`` with
``weights_only``). "raw" writes the weights with ``safetensors.torch.save_file`` and the optimizer and scheduler
state with ``torch.save`` into a folder, and reads them back with ``load_file`` and ``torch.load``. A raw save
returns once the bytes are in the page cache, so "raw+fsync" also syncs its files: the durability of ours (a
checkpoint still in memory is lost with the machine). Every operation starts after ``os.sync()``, loads read every
tensor (a memory-mapped file is otherwise read later), operations alternate, and the table shows medians.
Target: ours <= 1.2 x raw+fsync for saves and <= 1.2 x raw for loads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file, save_file

from astrai_fabric.checkpoint import load_checkpoint
from astrai_fabric.checkpoint.state import save_training_checkpoint
from astrai_fabric.config import ModelConfig
from astrai_fabric.loop import RunPosition
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer
from astrai_fabric.schedule import build_scheduler

CONFIG = dict(
    vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=2048, max_position_embeddings=1024, tie_word_embeddings=True,
)  # fmt: skip


def trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(**CONFIG))
    optimizer = build_optimizer(model, OptimArgs("adamw", lr=1e-4, weight_decay=0.1))
    scheduler = build_scheduler(optimizer, "cosine", total_steps=100, warmup_steps=10)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()  # a full state: step, exp_avg, exp_avg_sq
    scheduler.step()
    return model, optimizer, scheduler


def timed(fn) -> float:
    os.sync()  # a clean page cache: earlier writes must not slow this one down
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def touch(obj) -> None:
    """Read every tensor in ``obj`` (a memory-mapped load has read nothing yet)."""
    if isinstance(obj, torch.Tensor):
        obj.sum()
    elif isinstance(obj, dict | list | tuple):
        for value in obj.values() if isinstance(obj, dict) else obj:
            touch(value)


def fsync_tree(folder: Path) -> None:
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    model, optimizer, scheduler = trained_state()
    num_params = sum(p.numel() for p in model.parameters())
    fabric = Fabric(accelerator="cpu", devices=1)
    config = model.config.to_dict()

    def save_ours(folder: Path) -> None:
        save_training_checkpoint(fabric, folder, model, optimizer, scheduler, RunPosition(), config, {}, {})

    def save_raw(folder: Path, sync: bool = False) -> None:
        folder.mkdir()
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        save_file(weights, str(folder / "model.safetensors"))
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        torch.save(scheduler.state_dict(), folder / "scheduler.pt")
        if sync:
            fsync_tree(folder)

    def load_ours(folder: Path) -> None:
        checkpoint = load_checkpoint(folder)
        touch([checkpoint.state_dict, checkpoint.extra])

    def load_raw(folder: Path) -> None:
        touch(
            [
                load_file(str(folder / "model.safetensors")),
                torch.load(folder / "optimizer.pt", weights_only=True),
                torch.load(folder / "scheduler.pt", weights_only=True),
            ]
        )

    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as scratch:  # the disk checkpoints go to, not a tmpfs
        for repeat in range(repeats):
            ours, raw, synced = (Path(scratch, f"{name}_{repeat}") for name in ("ours", "raw", "synced"))
            for name, operation in (
                ("ours save", partial(save_ours, ours)),
                ("raw save", partial(save_raw, raw)),
                ("raw+fsync save", partial(save_raw, synced, sync=True)),
                ("ours load", partial(load_ours, ours)),
                ("raw load", partial(load_raw, raw)),
            ):
                times.setdefault(name, []).append(timed(operation))
            size = sum(f.stat().st_size for f in ours.iterdir())
            for folder in (ours, raw, synced):
                shutil.rmtree(folder)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"\nmodel: {num_params / 1e6:.0f}M parameters, float32, AdamW state; checkpoint {size / 2**30:.2f} GiB; "
        f"median of {repeats}\n"
    )
    print(f"{'operation':<9} {'ours s':>7} {'raw s':>7} {'raw+fsync s':>12} {'ours/baseline':>14} {'ours GiB/s':>11}")
    for op, baseline in (("save", "raw+fsync save"), ("load", "raw load")):
        ratio = median[f"ours {op}"] / median[baseline]
        synced = f"{median['raw+fsync save']:>12.2f}" if op == "save" else f"{'-':>12}"
        print(
            f"{op:<9} {median[f'ours {op}']:>7.2f} {median[f'raw {op}']:>7.2f} {synced} {ratio:>13.2f}x "
            f"{size / 2**30 / median[f'ours {op}']:>11.2f}  (target <= 1.2x: {'ok' if ratio <= 1.2 else 'MISSED'})"
        )
    print("\nbaseline: raw+fsync for saves (the same durability), raw for loads")


if __name__ == "__main__":
    main()
