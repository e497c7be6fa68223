"""Where the fused head and loss is faster than the plain one: the crossover by shape (positions x vocabulary).

    .venv/bin/python bench/fused_loss.py [--repeats 15] [--hidden 256] [--threads 1]

For each shape, the head and the loss alone, forward and backward, both sides from the same final hidden states
and head weight (float32, both trained, as in full fine-tuning):

- ``plain``: ``F.cross_entropy(hidden @ weight.T, targets)``: the whole ``[positions, vocab]`` logits, kept for
  the backward;
- ``weighted``: ``losses.head_nll_loss`` in chunks of ``CHUNK_ELEMENTS`` logits, seq's and sft's fused path (the
  per-token weights known before the forward: the forward takes the gradients, nothing is recomputed);
- ``recompute``: ``losses.head_token_nll(...).mean()``, the path of dpo, kto and grpo with a trained head (their
  losses are nonlinear in the log-probabilities: the backward recomputes each chunk's logits, one more matmul).

The sides take turns within each repeat (the order alternating), so machine drift cancels; the table prints the
medians and ``plain / fused`` (above 1: the fused side is faster). ``losses.loss_chunk_positions`` turns the fused
loss on from what this table shows; docs/performance.md has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from astrai_fabric.losses import CHUNK_ELEMENTS, head_nll_loss, head_token_nll, token_nll_weights

SHAPES = [  # (positions per micro-batch, vocabulary)
    (256, 2048),
    (1024, 2048),
    (4096, 2048),
    (1024, 8192),
    (256, 32768),
    (1024, 32768),
    (4096, 32768),
    (256, 151936),
    (1024, 151936),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recompute", action="store_true", help="time the recomputing path too (dpo, kto, grpo)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sides = ["plain", "weighted", *(["recompute"] if args.recompute else [])]
    header = f"{'positions':>9} {'vocab':>7} {'logits MB':>9}" + "".join(f" {s + ' ms':>12}" for s in sides)
    print(header + "".join(f" {'plain/' + s:>16}" for s in sides[1:]))
    for positions, vocab in SHAPES:
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(positions, args.hidden, generator=generator).requires_grad_()
        weight = (0.02 * torch.randn(vocab, args.hidden, generator=generator)).requires_grad_()
        targets = torch.randint(0, vocab, (positions,), generator=generator)
        chunk = max(1, CHUNK_ELEMENTS // vocab)
        weights = token_nll_weights(targets)

        run = {
            "plain": lambda h, w, t, tw, c: F.cross_entropy(h @ w.T, t),
            "weighted": lambda h, w, t, tw, c: head_nll_loss(h, w, t, tw, c)[0],
            "recompute": lambda h, w, t, tw, c: head_token_nll(h, w, t, c).mean(),
        }
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for repeat in range(args.repeats + 2):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for side in order:
                hidden.grad = weight.grad = None
                start = time.perf_counter()
                run[side](hidden, weight, targets, weights, chunk).backward()
                if repeat >= 2:  # the first two warm the allocator and the caches
                    seconds[side].append(time.perf_counter() - start)
        medians = {side: statistics.median(seconds[side]) * 1e3 for side in sides}
        ratios = [
            statistics.median(p / f for p, f in zip(seconds["plain"], seconds[side], strict=True)) for side in sides[1:]
        ]
        line = f"{positions:>9} {vocab:>7} {positions * vocab * 4 / 2**20:>9.0f}"
        print(line + "".join(f" {medians[s]:>12.1f}" for s in sides) + "".join(f" {r:>16.3f}" for r in ratios))
    print(f"hidden {args.hidden}, {args.threads} thread(s), float32, chunks of {CHUNK_ELEMENTS:,} logits")


if __name__ == "__main__":
    main()
