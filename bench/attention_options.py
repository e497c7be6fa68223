"""What Gemma's attention options cost on CPU: sliding-window layers and soft-capping (issue 29, part 4).

    .venv/bin/python bench/attention_options.py [--base REV] [--repeats 5] [--seq_len 8192] [--only step|layer]

1. The common case, before and after: the training step (forward, backward) of a model with none of the options
   (hidden 256, 4 layers, 4/2 heads, SwiGLU 704, vocabulary 8000, batch 2 x 512 tokens, float32, one thread: small,
   so that per-layer Python overhead weighs more than it would in a real model),
   with this tree's ``astrai_fabric`` and with ``--base``'s (``git archive REV``; 2e80602 is the tree before the
   options, ``HEAD`` the default), each in a subprocess of its
   own, alternating, 10 steps a run after 2 of warm-up; the median and the fastest step of each side (on a shared
   machine the fastest is the least disturbed). Target: no slower (the options are a few Python branches per layer,
   decided when the model is built).
2. One attention layer at ``--seq_len`` tokens (forward + backward, 2 heads of 64, batch 1): full causal attention
   (SDPA, ``is_causal``), a sliding-window layer at half the length (SDPA with the windowed boolean mask, what
   ``AutoRegressiveLM`` gives such a layer), and full attention soft-capped at 50 (Gemma 2's; its scores are
   materialised). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_CONFIG = dict(
    vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=704, max_position_embeddings=512,
)  # fmt: skip
STEPS, WARMUP, BATCH, WINDOW = 10, 2, 2, 512


def step_ms() -> list[float]:
    """The training steps of the plain model, in ms, with whichever ``astrai_fabric`` is importable."""
    import torch

    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(**STEP_CONFIG)).train()
    ids = torch.randint(0, STEP_CONFIG["vocab_size"], (BATCH, WINDOW))
    times = []
    for step in range(WARMUP + STEPS):
        start = time.perf_counter()
        logits = model(ids)["logits"]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def before_and_after(repeats: int, base: str) -> tuple[list[float], list[float]]:
    """Step times (ms) with ``base``'s package and with this tree's, runs alternating."""
    with tempfile.TemporaryDirectory() as before:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", base, "astrai_fabric"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", before], input=archive, check=True)
        runs: dict[str, list[float]] = {before: [], str(REPO): []}
        for _ in range(repeats):
            for root, times in runs.items():
                env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
                out = subprocess.run(
                    [sys.executable, __file__, "--child", root], env=env, check=True, capture_output=True, text=True
                ).stdout
                times += [float(ms) for ms in out.split()]
        return runs[before], runs[str(REPO)]


def layer_ms(seq_len: int, repeats: int) -> dict[str, float]:
    """One attention layer's forward + backward (ms) at ``seq_len``: full, sliding at half, soft-capped."""
    import torch

    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model.attention import GQA
    from astrai_fabric.model.layers import rope_table
    from astrai_fabric.model.transformer import sliding_window_mask

    base = dict(
        vocab_size=8,
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=seq_len,
    )
    rotary = rope_table(64, seq_len, 10000.0)[None]
    x = torch.randn(1, seq_len, 128, requires_grad=True)
    cases = {
        "full attention (SDPA, causal)": (ModelConfig(**base), None),
        f"sliding window {seq_len // 2} (SDPA, boolean mask)": (
            ModelConfig(**base, sliding_window=seq_len // 2, layer_types=["sliding_attention"]),
            sliding_window_mask(None, seq_len // 2, seq_len)[None, None],
        ),
        "full attention soft-capped at 50": (ModelConfig(**base, attn_logit_softcapping=50.0), None),
    }
    results = {}
    for name, (config, mask) in cases.items():
        torch.manual_seed(0)
        layer = GQA(config)
        layer.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        times = []
        for _ in range(repeats + 1):  # the first is warm-up
            start = time.perf_counter()
            layer(x, rotary, mask).sum().backward()
            times.append(time.perf_counter() - start)
        results[name] = 1e3 * statistics.median(times[1:])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the revision to compare this tree with (default HEAD)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--only", choices=("step", "layer"), help="run one part only")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the package root a step-time run must import
    args = parser.parse_args()
    if args.child:
        import astrai_fabric

        assert Path(astrai_fabric.__file__).resolve().is_relative_to(Path(args.child).resolve()), astrai_fabric.__file__
        print(" ".join(f"{ms:.2f}" for ms in step_ms()))
        return
    import torch

    torch.set_num_threads(1)
    if args.only != "layer":
        before, after = before_and_after(args.repeats, args.base)
        print("| model without the options | step ms, median | fastest |\n|---|---|---|")
        for name, times in ((f"before ({args.base})", before), ("after (this tree)", after)):
            median, fastest = statistics.median(times), min(times)
            change = "" if times is before else f" ({median / statistics.median(before) - 1:+.1%})"
            print(f"| {name} | {median:.1f}{change} | {fastest:.1f} |")
    if args.only != "step":
        print(f"\n| one attention layer, {args.seq_len} tokens, forward + backward | ms (median) |\n|---|---|")
        for name, ms in layer_ms(args.seq_len, args.repeats).items():
            print(f"| {name} | {ms:.0f} |")


if __name__ == "__main__":
    main()
