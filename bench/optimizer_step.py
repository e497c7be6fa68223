"""How long one optimizer step takes next to one forward+backward: ``muon_adamw`` per Newton-Schulz dtype, and
``nora_nadamw`` and ``mano_adamw`` (no iteration: one projection and normalisation per matrix).

    .venv/bin/python bench/optimizer_step.py [--repeats 7]

Model: ~5M parameters (hidden 256, 6 layers, 4/2 heads, SwiGLU 704, vocabulary 2048), micro-batch 8 windows
of 256 tokens (the model's full context, AstrAI's default window), float32 weights, torch's default threads.
The optimizer step's cost is fixed by the weights while forward+backward grows with the batch, so the ratio
is quoted for this batch. Prints a table of median seconds; the target is a step costing at most
0.6x forward+backward on CPU with ``--muon_ns_dtype auto``. The optimizers' steps are timed in turn, one of each
per round, so a change in the machine's load falls on all of them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from astrai_fabric.config import ModelConfig
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer, resolve_ns_dtype

CONFIG = dict(
    vocab_size=2048, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=704, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(**CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (8, CONFIG["max_position_embeddings"]))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        model(ids)["logits"].float().logsumexp(-1).mean().backward()

    fwd_bwd = timed(forward_backward, args.repeats)
    forward_backward()  # leave gradients for the optimizer steps below
    sides = {}  # (optimizer, muon_ns_dtype) -> its step
    for name in ("auto", "float32", "bfloat16"):
        dtype = resolve_ns_dtype(name, torch.device("cpu"))
        muon = OptimArgs("muon_adamw", lr=1e-4, weight_decay=0.1, ns_dtype=dtype)
        sides["muon_adamw", name] = build_optimizer(model, muon)
    for optimizer in ("nora_nadamw", "mano_adamw"):
        sides[optimizer, "-"] = build_optimizer(model, OptimArgs(optimizer, lr=1e-4, weight_decay=0.1))
    times = {side: [] for side in sides}
    for side in sides:
        sides[side].step()  # warm-up (and the optimizers' state)
    for _ in range(args.repeats):
        for side, optimizer in sides.items():
            start = time.perf_counter()
            optimizer.step()
            times[side].append(time.perf_counter() - start)
    rows = []
    for (optimizer, name), samples in times.items():
        seconds = statistics.median(samples)
        runs_in = str(resolve_ns_dtype(name, torch.device("cpu"))).removeprefix("torch.") if name != "-" else "-"
        rows.append((optimizer, name, runs_in, seconds, seconds / fwd_bwd))

    threads = torch.get_num_threads()
    print(f"model: {model.num_parameters() / 1e6:.1f}M parameters, batch {tuple(ids.shape)}, {threads} thread(s)")
    print(f"forward+backward: {fwd_bwd:.3f} s (median of {args.repeats})\n")
    header = f"{'optimizer':<12} {'muon_ns_dtype':<14} {'runs in':<9} {'step s':>8} {'step / fwd+bwd':>15}"
    print(f"{header}  target <= 0.6 (auto)")
    for optimizer, name, dtype, seconds, ratio in rows:
        mark = ("ok" if ratio <= 0.6 else "MISSED") if name == "auto" else ""
        print(f"{optimizer:<12} {name:<14} {dtype:<9} {seconds:>8.3f} {ratio:>15.2f}  {mark}")


if __name__ == "__main__":
    main()
