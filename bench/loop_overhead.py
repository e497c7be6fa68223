"""Throughput of our ``fit()`` against a plain PyTorch loop doing the same work, single process on CPU.

    .venv/bin/python bench/loop_overhead.py [--pairs 5] [--steps 12]

Both train the bundled tiny model (seq, windows of 128, 8 per micro-batch, 2 micro-batches per step, AdamW,
float32, clipping at 1.0) on the same samples in the same order. The plain loop is what one would write by hand:
forward, loss / accumulation, backward, clip, step, schedule, and the loss as a Python float every step. Runs
alternate (ours, plain, ours, ...) so machine drift cancels; each pair gives a tokens/s ratio (median over steps
after the first two) and the table reports every pair and their median. Target: ratio >= 0.97.

``fit()`` runs without the ``grad_snr`` metric here, which the plain loop does not compute either (it is on by
default, as in AstrAI, and costs about 1% of a step: four passes over gradient-sized memory, see
``bench/step_overhead.py --grad_snr_cost``); ``--grad_snr`` measures with it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from astrai_fabric.assets import SEQ_DATA_DIR, TINY_MODEL_DIR
from astrai_fabric.config import ModelConfig
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler, load_window_dataset
from astrai_fabric.losses import causal_lm_loss
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer
from astrai_fabric.schedule import build_scheduler
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train import run

WINDOW, BATCH, ACCUM, SEED = 128, 8, 2, 3407


def ours(steps: int, grad_snr: bool = False) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        args = TrainArgs(
            param_path=str(TINY_MODEL_DIR),
            data_root_path=str(SEQ_DATA_DIR),
            train_type="seq",
            ckpt_dir=out,
            window_size=WINDOW,
            batch_per_device=BATCH,
            grad_accum_steps=ACCUM,
            max_steps=steps,
            max_lr=1e-3,
            optimizer="adamw",
            parallel_mode="none",
            num_workers=0,
            random_seed=SEED,
            ckpt_interval=10**9,
            metrics=["loss", "lr", "grad_norm", "tokens_per_sec", *(["grad_snr"] if grad_snr else [])],
        )
        return [r["tokens_per_sec"] for r in run(args)]


def plain(steps: int) -> list[float]:
    torch.manual_seed(SEED)
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json")).train()
    dataset = load_window_dataset("seq", SEQ_DATA_DIR, WINDOW, None, Tokenizer.from_dir(TINY_MODEL_DIR))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=ResumableSampler(len(dataset), seed=SEED))
    optimizer = build_optimizer(model, OptimArgs("adamw", lr=1e-3, weight_decay=0.1))
    scheduler = build_scheduler(optimizer, "cosine", total_steps=1000, warmup_steps=50)
    rates, tokens, start = [], 0, time.perf_counter()
    for micro_step, batch in enumerate(loader, start=1):
        loss = causal_lm_loss(model(batch["input_ids"])["logits"], batch["target_ids"])
        (loss / ACCUM).backward()
        tokens += batch["input_ids"].numel()
        if micro_step % ACCUM:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
        rates.append(tokens / (time.perf_counter() - start))
        tokens, start = 0, time.perf_counter()
        if len(rates) == steps:
            return rates
    raise RuntimeError("not enough data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--grad_snr", action="store_true", help="fit() also computes the grad_snr metric")
    args = parser.parse_args()
    rows = []
    for pair in range(args.pairs):
        a = statistics.median(ours(args.steps, args.grad_snr)[2:])
        b = statistics.median(plain(args.steps)[2:])
        rows.append((pair, a, b, a / b))
    print(f"\n{'pair':>4} {'fit() tok/s':>12} {'plain tok/s':>12} {'ratio':>7}")
    for pair, a, b, ratio in rows:
        print(f"{pair:>4} {a:>12,.0f} {b:>12,.0f} {ratio:>7.3f}")
    median = statistics.median(r[3] for r in rows)
    print(
        f"median ratio {median:.3f} (target >= 0.97: {'ok' if median >= 0.97 else 'MISSED'}), "
        f"{torch.get_num_threads()} thread(s), {Path(TINY_MODEL_DIR).name} model"
    )


if __name__ == "__main__":
    main()
