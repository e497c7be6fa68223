"""RoPE and grouped-query attention, as the model runs them against the forms they replaced (issue 41).

    .venv/bin/python bench/attention_kernels.py [--repeats 100]

One call each, forward and backward, one thread, the sides alternating call by call, medians in ms, at the step
benchmark's shape (``bench/step_overhead.py``: batch 4 x 256 positions, 4 query heads and 2 key/value heads of 64):

- RoPE: ``model.layers.apply_rotary_emb`` (each pair a complex number times ``cos + i sin``, AstrAI's own form)
  against the real-arithmetic form it replaced (``x * cos + swap(x) * (-sin, sin)``: three passes and a copy),
  on the query and on the key heads;
- attention: ``model.attention.sdpa`` (grouped-query heads inside torch's kernel on CPU) against the same SDPA call
  on keys and values repeated per query head first (AstrAI's ``repeat_kv``, what ran before), causal and with a
  boolean mask (sft's documents).

Each row also says how far apart the two sides' outputs are (largest absolute difference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from astrai_fabric.model.attention import sdpa
from astrai_fabric.model.layers import apply_rotary_emb, rope_factors, rope_table

BATCH, POSITIONS, HEADS, KV_HEADS, HEAD_DIM = 4, 256, 4, 2, 64


def real_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The form RoPE had before: ``x * cos + swap(x) * (-sin, sin)``, the factors made once per forward."""
    cos, sin = table.unbind(-1)
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(-2)
    sin = torch.stack([-sin, sin], dim=-1).flatten(-2).unsqueeze(-2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x * cos + swapped * sin


def repeated_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with each key/value head copied for its query heads first (what ran before)."""
    n_rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal=mask is None
    )
    return out.transpose(1, 2).flatten(2)


def timed(sides: dict, inputs: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """Median ms of each side's forward and backward, the sides alternating."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for turn in range(repeats):
        for name in list(sides)[:: 1 if turn % 2 else -1]:
            start = time.perf_counter()
            sides[name]().sum().backward()
            times[name].append(time.perf_counter() - start)
            for tensor in inputs:
                tensor.grad = None
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    options = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    table = rope_table(HEAD_DIM, POSITIONS, 10000.0)[None].expand(BATCH, -1, -1, -1)
    rotary = rope_factors(table)
    print(f"batch {BATCH} x {POSITIONS} positions, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, float32, one thread")
    print("| call (forward + backward) | before ms | now ms | now / before | largest difference |")
    print("|---|---:|---:|---:|---:|")
    for heads, what in ((HEADS, "RoPE, query heads"), (KV_HEADS, "RoPE, key heads")):
        x = torch.randn(BATCH, POSITIONS, heads, HEAD_DIM, generator=generator).requires_grad_()
        sides = {"before": lambda x=x: real_rope(x, table), "now": lambda x=x: apply_rotary_emb(x, rotary)}
        difference = (sides["before"]() - sides["now"]()).abs().max().item()
        ms = timed(sides, [x], options.repeats)
        print(f"| {what} | {ms['before']:.3f} | {ms['now']:.3f} | {ms['now'] / ms['before']:.2f} | {difference:.1e} |")
    q = torch.randn(BATCH, POSITIONS, HEADS, HEAD_DIM, generator=generator).requires_grad_()
    k, v = (torch.randn(BATCH, POSITIONS, KV_HEADS, HEAD_DIM, generator=generator).requires_grad_() for _ in "kv")
    documents = torch.ones(POSITIONS, POSITIONS, dtype=torch.bool).tril()
    documents[POSITIONS // 2 :, : POSITIONS // 2] = False  # two packed documents
    for mask, what in ((None, "attention, causal"), (documents[None, None], "attention, two documents' mask")):
        sides = {"before": lambda m=mask: repeated_sdpa(q, k, v, m), "now": lambda m=mask: sdpa(q, k, v, m)}
        difference = (sides["before"]() - sides["now"]()).abs().max().item()
        ms = timed(sides, [q, k, v], options.repeats)
        print(f"| {what} | {ms['before']:.3f} | {ms['now']:.3f} | {ms['now'] / ms['before']:.2f} | {difference:.1e} |")


if __name__ == "__main__":
    main()
