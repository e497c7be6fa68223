"""Bytes each rank holds in parameters, gradients and optimizer state, and step time: full fine-tuning against LoRA.

    .venv/bin/python bench/lora_memory.py

Model: ~98M parameters (hidden 768, 12 layers, 12/12 heads, SwiGLU 2048, vocabulary 16384, tied), float32, AdamW
on both sides; LoRA r=8, alpha 32, on q_proj,k_proj,v_proj,o_proj. Run as 1 process and as 2-rank fsdp (gloo), one
thread per rank. Counted are the tensors a rank holds after the first step (local shards for FSDP's DTensors; not
process RSS). Step time is forward + backward + optimizer step on a (2, 64) batch; inside each run the two sides
alternate step by step and the medians are reported. Targets: LoRA's gradient + optimizer bytes <= 5% of full's,
LoRA's step time <= 0.8 x full's.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from spawn import run_ranks  # noqa: E402

CONFIG = dict(
    vocab_size=16384, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
    intermediate_size=2048, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
STEPS = 4  # timed steps per side, after one untimed warm-up step (the machine is shared: keep it short)
SIDES = ("full", "lora")


def local_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def worker(mode: str, nprocs: int, out: str) -> None:
    from astrai_fabric import lora
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.optim import OptimArgs, build_optimizer
    from astrai_fabric.train import build_run_fabric

    args = TrainArgs(param_path="-", data_root_path="-", parallel_mode=mode, nprocs=nprocs, device_type="cpu")
    fabric = build_run_fabric(args)
    fabric.launch()
    setups = {}
    for side in SIDES:
        torch.manual_seed(0)
        model = AutoRegressiveLM(ModelConfig(**CONFIG))
        if side == "lora":
            lora.inject(model, lora.LoRASpec(r=8), seed=0)
        model = fabric.setup_module(model)
        setups[side] = (model, fabric.setup_optimizers(build_optimizer(model, OptimArgs("adamw", 1e-4, 0.1))))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))

    def step(side: str) -> float:
        model, optimizer = setups[side]
        start = time.perf_counter()
        fabric.backward(model(ids)["logits"].float().logsumexp(-1).mean())
        optimizer.step()
        elapsed = time.perf_counter() - start
        return elapsed

    row = {"rank": fabric.global_rank}
    for side in SIDES:  # the warm-up step, which also creates the optimizer state; gradients are still held
        model, optimizer = setups[side]
        step(side)
        params = list(model.parameters())
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        row[side] = {
            "params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for v in states),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
        }
        optimizer.zero_grad()
    times = {side: [] for side in SIDES}
    for i in range(2 * STEPS):  # alternate the sides, and which goes first in each pair
        side = SIDES[(i + i // 2) % 2]
        times[side].append(step(side))
        setups[side][1].zero_grad()
    for side in SIDES:
        row[side]["step_s"] = statistics.median(times[side])
    Path(out, f"{mode}_{fabric.global_rank}.json").write_text(json.dumps(row))
    Path(out, "num_parameters").write_text(str(sum(p.numel() for p in setups["full"][0].parameters())))


def main() -> None:
    runs = (("none", 1), ("fsdp", 2))
    with tempfile.TemporaryDirectory() as out:
        for mode, nprocs in runs:
            run_ranks(worker, nprocs, mode, nprocs, out)
        rows = {mode: [json.loads(Path(out, f"{mode}_{r}.json").read_text()) for r in range(n)] for mode, n in runs}
        num = int(Path(out, "num_parameters").read_text())
    mib = 2**20
    print(f"\nmodel: {num / 1e6:.1f}M parameters, float32, adamw; lora r=8 on q,k,v,o; 1 thread per rank\n")
    header = (
        f"{'mode':<5} {'rank':>4} {'side':<5} {'params MiB':>11} {'grads MiB':>10} {'optimizer MiB':>14} {'step s':>7}"
    )
    print(header)
    worst_bytes = worst_time = 0.0
    for mode, ranks in rows.items():
        for row in ranks:
            for side in SIDES:
                r = row[side]
                print(
                    f"{mode:<5} {row['rank']:>4} {side:<5} {r['params'] / mib:>11.1f} {r['grads'] / mib:>10.2f} "
                    f"{r['optimizer'] / mib:>14.2f} {r['step_s']:>7.3f}"
                )
            full, low = row["full"], row["lora"]
            worst_bytes = max(worst_bytes, (low["grads"] + low["optimizer"]) / (full["grads"] + full["optimizer"]))
            worst_time = max(worst_time, low["step_s"] / full["step_s"])
    trainable = rows["none"][0]["lora"]["trainable"]
    print(f"\nlora trainable: {trainable:,} of {num:,} ({100 * trainable / num:.2f}%)")
    print(
        f"lora / full, gradient + optimizer bytes (worst rank): {100 * worst_bytes:.2f}% "
        f"(target <= 5%: {'ok' if worst_bytes <= 0.05 else 'MISSED'})"
    )
    print(
        f"lora / full, median step time (worst rank): {worst_time:.2f} "
        f"(target <= 0.8: {'ok' if worst_time <= 0.8 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
