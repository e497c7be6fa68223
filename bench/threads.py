"""Step time of the tiny run against torch's CPU thread count: the CLI's default against fixed counts.

    .venv/bin/python bench/threads.py [--steps 10] [--repeats 3] [--threads 1,2] [--nprocs 1]

Each run is a fresh ``astrai-fabric seq --config recipes/tiny-seq.yaml --max_steps STEPS`` (one process, or
``--nprocs`` local DDP ranks) with ``OMP_NUM_THREADS`` unset ("default": torch's own count for one process,
Lightning's CPUs-per-rank for several) or set to each count. Step time is the median over the run's steps after the
first (from the tokens/s in its ``metric.jsonl``); wall is the whole command, start-up included. The settings are
run in turn, each repeat in a rotated order, and the table shows the medians over repeats, so a noisy (shared)
machine affects every setting alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
WINDOW = 128  # tiny-seq.yaml's windows: every sample holds this many tokens


def one_run(threads: int | None, steps: int, nprocs: int, ckpt_dir: Path) -> tuple[float, float]:
    """(wall seconds, median seconds per step after the first) of one tiny run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "seq",
        "--config",
        "recipes/tiny-seq.yaml",
        "--ckpt_dir",
        str(ckpt_dir),
        "--max_steps",
        str(steps),
        "--window_size",
        str(WINDOW),
        "--loggers",
        "[]",
        "--nprocs",
        str(nprocs),
        "--parallel_mode",
        "ddp" if nprocs > 1 else "none",
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    (last,) = ckpt_dir.glob(f"epoch_*_step_{steps}")
    entries = [json.loads(line) for line in (last / "metric.jsonl").read_text().splitlines()]
    entries = [e for e in entries if e["type"] == "step"]
    seconds = [
        (entry["consumed_samples"] - before["consumed_samples"]) * WINDOW / entry["tokens_per_sec"]
        for before, entry in zip(entries, entries[1:], strict=False)
    ]
    return wall, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="comma-separated counts, besides the default")
    parser.add_argument("--nprocs", type=int, default=1)
    options = parser.parse_args()
    settings: list[int | None] = [None] + [int(t) for t in options.threads.split(",")]
    results: dict[int | None, list[tuple[float, float]]] = {s: [] for s in settings}
    print(f"{'repeat':>6}  {'threads':>8}  {'wall s':>7}  {'step ms':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(options.repeats):
            shift = repeat % len(settings)
            for setting in settings[shift:] + settings[:shift]:
                ckpt_dir = Path(tmp) / f"r{repeat}_t{setting}"
                wall, step = one_run(setting, options.steps, options.nprocs, ckpt_dir)
                results[setting].append((wall, step))
                name = "default" if setting is None else str(setting)
                print(f"{repeat:>6}  {name:>8}  {wall:7.1f}  {step * 1000:8.1f}", flush=True)
    print(
        f"\nmedians over {options.repeats} repeat(s), {options.steps} steps, {options.nprocs} process(es), "
        f"{os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.2f} at the end"
    )
    print(f"{'threads':>8}  {'wall s':>7}  {'step ms':>8}")
    for setting, runs in results.items():
        name = "default" if setting is None else str(setting)
        wall = statistics.median(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        print(f"{name:>8}  {wall:7.1f}  {step * 1000:8.1f}")


if __name__ == "__main__":
    main()
