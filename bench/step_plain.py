"""The hand-written side of ``bench/step_overhead.py``: a plain PyTorch training loop, no Fabric, no framework.

    .venv/bin/python bench/step_plain.py MODEL_DIR DATA_DIR --steps 60 --batch 4 --window 256 --optimizer muon_adamw

The same work as ``astrai-fabric seq`` with ``step_overhead.py``'s flags: the model class built from the same
``config.json`` with the same seed (so the same initial weights), windows of the same bin shard in the same
(``ResumableSampler``) order, the same optimizer (Muon's Newton-Schulz in float32, the run's ``auto`` on CPU) and
schedule, clipping at 1.0, one thread. What a careful person writes by hand: forward, cross-entropy, backward,
clip, step, schedule, zero, and the loss as a Python float every step. It prints ``step S/N | loss L``, flushed,
after step 1, every ``--log_every`` steps and the last (astrai-fabric's cadence on a pipe), which the benchmark
times.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from astrai_fabric.config import ModelConfig
from astrai_fabric.data import ResumableSampler
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer
from astrai_fabric.schedule import build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--optimizer", required=True)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--log_every", type=int, default=1, help="print steps 1, k, 2k, ... and the last")
    parser.add_argument(
        "--profile",
        metavar="A:B:TRACE",
        help="torch.profiler over steps A..B (inclusive) with "
        "astrai-fabric's --profile_steps settings, written to the Chrome trace TRACE",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)

    meta = json.loads((options.data_dir / "meta.json").read_text())["sequence"]
    tokens = np.memmap(options.data_dir / "sequence.bin", dtype=meta["dtype"], mode="r", shape=tuple(meta["shape"]))
    window = options.window
    num_samples = (len(tokens) - 1 - window) // window + 1  # stride = window, as the run's default

    torch.manual_seed(options.seed)  # the run seeds the same way before it builds the model
    model = AutoRegressiveLM(ModelConfig.from_file(options.model_dir / "config.json")).train()
    optim_args = OptimArgs(options.optimizer, lr=options.lr, weight_decay=0.1, ns_dtype=torch.float32)
    optimizer = build_optimizer(model, optim_args)
    warmup = int(0.05 * options.steps)  # --warmup_ratio 0.05 of the run's planned steps
    scheduler = build_scheduler(optimizer, "cosine", total_steps=options.steps, warmup_steps=warmup)
    order = iter(ResumableSampler(num_samples, seed=options.seed))

    first_profiled, last_profiled, trace = options.profile.split(":", 2) if options.profile else (0, 0, "")
    profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True)
    for step in range(1, options.steps + 1):
        if step == int(first_profiled):
            profiler.start()
        begins = [next(order) * window for _ in range(options.batch)]
        x = torch.from_numpy(np.stack([tokens[b : b + window] for b in begins]).astype(np.int64))
        y = torch.from_numpy(np.stack([tokens[b + 1 : b + window + 1] for b in begins]).astype(np.int64))
        logits = model(x)["logits"]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # every step, as a careful loop does to notice a divergence
        if step == int(last_profiled):
            profiler.stop()
            profiler.export_chrome_trace(trace)
        if step == 1 or step % options.log_every == 0 or step == options.steps:
            print(f"step {step}/{options.steps} | loss {loss_value:.4f}", flush=True)


if __name__ == "__main__":
    main()
