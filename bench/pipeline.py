"""Pipeline parallelism's bubble and memory: time per optimizer step's forward and backward at pp 1, 2 and 4 with 1, 4
and 8 micro-batches, against the schedule's formula, and the peak live bytes per stage (issue 46).

    .venv/bin/python bench/pipeline.py [--pps 1,2,4] [--micro_batches 1,4,8] [--steps 5] [--layers 8]

A decoder of ``--layers`` blocks (hidden ``--hidden``, untied head), micro-batches of 2 windows of ``--window``
tokens, float32, one thread per rank. pp 1 is one process running the micro-batches in turn (forward, backward:
what one stage does without a pipeline); pp > 1 runs the same micro-batches through ``parallel.pipeline.Pipeline`` over
that many gloo ranks, the blocks split by ``model.pipeline.stage_layers``, with GPipe (any micro-batch count), 1F1B
(micro-batches >= stages) and interleaved 1F1B (2 stages per rank, looped). Per layout:

- step ms: the median of ``--steps`` windows' forward and backward (the slowest rank's), no optimizer step;
- bubble measured: ``1 - T1 / (pp x T)``, the share of a stage's time not spent computing, where ``T1`` is pp 1's
  time for the same micro-batches (the work the stages share) and ``T`` the pipeline's; the formula's is
  ``(pp - 1) / (V M + pp - 1)`` for M micro-batches and V stages per rank (GPipe and 1F1B, V = 1: 1F1B moves the
  same bubble, holding fewer micro-batches' activations; interleaved 1F1B, V = 2: each rank's idle time is split
  over twice the stages, each half as long);
- saved MiB per rank: the activations autograd holds for backward passes still to run, at their peak
  (``SavedActivations``; torch's ``MemTracker`` follows one forward per module), first and last pipeline rank.

On a 2-core machine 4 ranks oversubscribe the cores: their times are printed but are not the bubble's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from spawn import run_ranks  # noqa: E402

from astrai_fabric.config.pipeline import stages_per_rank  # noqa: E402


def build(settings: dict):
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=2048,
        hidden_size=settings["hidden"],
        num_hidden_layers=settings["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=settings["hidden"] * 8 // 3,
        max_position_embeddings=settings["window"],
        tie_word_embeddings=False,
    )
    return AutoRegressiveLM(config).train()


def micro_batches(settings: dict, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (count, 2, settings["window"] + 1), generator=generator)
    return [{"input_ids": window[:, :-1], "target_ids": window[:, 1:]} for window in ids]


def timed_steps(step, steps: int) -> list[float]:
    step()  # warm-up (and the pipeline's buffers)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


class SavedActivations:
    """The bytes autograd holds for backward passes still to run, at their peak: each saved tensor counted once per
    storage (parameters excluded) from when a forward saves it until its graph is freed by its backward. What a
    pipeline's schedule decides: how many micro-batches' activations a stage holds at once."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [saves still held, bytes]
        self.total = self.peak = 0

    def __enter__(self) -> SavedActivations:
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        held = _Held(tensor)
        if tensor.is_leaf and tensor.requires_grad:  # a parameter: not an activation
            return held
        key = tensor.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.total += entry[1]
            self.peak = max(self.peak, self.total)
        entry[0] += 1
        weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.total -= entry[1]
            del self.live[key]


class _Held:
    """A saved tensor as autograd keeps it: freed with the graph that saved it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def peak_bytes(step) -> int:
    with SavedActivations() as saved:
        step()
    return saved.peak


def single(settings: dict, count: int) -> dict:
    """pp 1: the micro-batches' forwards and backwards in one process, as the loop runs them."""
    from astrai_fabric.losses import causal_lm_loss

    torch.set_num_threads(1)
    model, batches = build(settings), micro_batches(settings, count)

    def step() -> None:
        for batch in batches:
            out = model(batch["input_ids"])
            (causal_lm_loss(out.logits, batch["target_ids"]) / count).backward()
        model.zero_grad(set_to_none=True)

    times = timed_steps(step, settings["steps"])
    return dict(ms=1e3 * statistics.median(times), peak=[peak_bytes(step)])


def worker(settings: dict, count: int, schedule: str, out: str) -> None:
    import dataclasses

    import torch.distributed as dist
    from lightning.fabric import Fabric

    from astrai_fabric.model.pipeline import StageLoss, keep_stages
    from astrai_fabric.parallel.pipeline import Pipeline

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = keep_stages(build(settings), rank, size, stages_per_rank(schedule, None))
    model.place = dataclasses.replace(model.place, group=dist.group.WORLD)
    fabric = Fabric(accelerator="cpu", devices=1)  # the device and autocast the pipeline asks of it
    pipeline = Pipeline(fabric, model, schedule, count, 2, torch.float32, StageLoss())
    batches = micro_batches(settings, count)

    def step() -> None:
        pipeline.train_window(batches)
        model.zero_grad(set_to_none=True)

    times = torch.tensor(timed_steps(step, settings["steps"]))
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest stage
    peaks = [None] * size
    dist.all_gather_object(peaks, peak_bytes(step))
    if rank == 0:
        Path(out).write_text(json.dumps(dict(ms=1e3 * times.median().item(), peak=peaks)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pps", default="1,2,4")
    parser.add_argument("--micro_batches", default="1,4,8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--window", type=int, default=256)
    options = parser.parse_args()
    settings = dict(steps=options.steps, layers=options.layers, hidden=options.hidden, window=options.window)
    counts = [int(m) for m in options.micro_batches.split(",")]
    pps = [int(p) for p in options.pps.split(",")]
    baseline = {count: single(settings, count) for count in counts}
    print(f"{options.layers} blocks, hidden {options.hidden}, micro-batches of 2 x {options.window} tokens, float32")
    print("| pp | schedule | micro-batches | step ms | bubble | formula | saved MiB, first / last rank |")
    print("|---|---|---|---|---|---|---|")
    for pp in pps:
        for count in counts:
            if pp == 1:
                row = baseline[count]
                peak = row["peak"][0] / 2**20
                print(f"| 1 | none | {count} | {row['ms']:.0f} | - | - | {peak:.1f} |")
                continue
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
                rounds = max(1, count // pp)  # interleaved 1F1B: rounds of equal size (config.train_checks)
                if (schedule == "1f1b" and count < pp) or (schedule == "interleaved_1f1b" and count % rounds):
                    continue
                with tempfile.TemporaryDirectory() as directory:
                    out = Path(directory) / "out.json"
                    run_ranks(worker, pp, settings, count, schedule, str(out))
                    row = json.loads(out.read_text())
                measured = 1 - baseline[count]["ms"] / (pp * row["ms"])
                formula = (pp - 1) / (stages_per_rank(schedule, None) * count + pp - 1)
                first, last = row["peak"][0] / 2**20, row["peak"][-1] / 2**20
                note = " (oversubscribed)" if pp > 2 else ""
                print(
                    f"| {pp} | {schedule} | {count} | {row['ms']:.0f}{note} | {measured:.2f} | {formula:.2f} | "
                    f"{first:.1f} / {last:.1f} |"
                )


if __name__ == "__main__":
    main()
