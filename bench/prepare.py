"""Peak memory and tokens/s of ``astrai-fabric prepare`` against the input size, with 1 and 2 tokenising processes.

    .venv/bin/python bench/prepare.py [--sizes_gb 0.25,0.5,1] [--procs 1,2] [--repeats 1]

Each corpus is the bundled seq corpus (the King James Bible) repeated, as ``{"text": ...}`` records, written to a
temporary directory and deleted after its runs; the pipeline is plain text with the default packing and shard size
(``simple``, 100M tokens a shard) and the bundled tiny tokenizer. Every run is a real ``prepare`` process; the sides
(process counts) alternate within each repeat and the table gives medians. Peak RSS is the largest of the main
process's and its workers' (``wait4``'s usage of the reaped child); peak PSS sums the main process and its workers
(``/proc/PID/smaps_rollup``, sampled every 0.2 s), which counts the pages a forked worker shares with the main process
once. The target: both flat in the input size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from astrai_fabric.assets import SEQ_DATA_DIR

PIPELINE = {"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 0}}


def make_corpus(path: Path, gigabytes: float) -> int:
    """``path`` filled to ``gigabytes`` with the bundled records over and over; returns the record count."""
    lines = [line for file in sorted(SEQ_DATA_DIR.glob("*.jsonl")) for line in file.read_bytes().splitlines(True)]
    block = b"".join(lines)
    target, count = int(gigabytes * 1e9), 0
    with open(path, "wb") as f:
        while f.tell() < target:
            f.write(block)
            count += len(lines)
    return count


def tree_pss_kb(pid: int) -> int:
    """PSS of ``pid`` and its children (the workers), in kB; processes that end meanwhile count 0."""
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return 0
    total = 0
    for p in pids:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        total += int(re.search(r"^Pss:\s+(\d+)", rollup, re.M).group(1))
    return total


def run_prepare(corpus: Path, pipeline: Path, output: Path, procs: int) -> dict[str, float]:
    argv = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "prepare",
        str(corpus),
        "-o",
        str(output),
        "-c",
        str(pipeline),
        "--tokenizer_path",
        "bundled:tiny",
        "--num_proc",
        str(procs),
    ]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
        peak_pss = 0
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)  # the child's own usage, its workers' included
            if pid:
                break
            peak_pss = max(peak_pss, tree_pss_kb(child.pid))
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if child.returncode != 0:
            raise SystemExit(f"prepare failed ({child.returncode}): {err.read().decode()[-2000:]}")
        tokens = int(re.search(rb"tokens: ([\d,]+)", out.read()).group(1).replace(b",", b""))
    # ru_maxrss (kB on Linux) of a reaped process: its peak, or a reaped worker's when larger.
    return {"seconds": seconds, "tokens": tokens, "rss_mb": usage.ru_maxrss / 1024, "pss_mb": peak_pss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_gb", default="0.25,0.5,1", help="Corpus sizes, comma-separated.")
    parser.add_argument("--procs", default="1,2", help="Process counts, comma-separated.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs per size and process count (median).")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes_gb.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
            scratch = Path(scratch)
            records = make_corpus(scratch / "corpus.jsonl", size)
            (scratch / "pipeline.json").write_text(json.dumps(PIPELINE))
            runs: dict[int, list[dict[str, float]]] = {n: [] for n in procs}
            for repeat in range(args.repeats):
                for n in procs if repeat % 2 == 0 else procs[::-1]:  # alternate which side goes first
                    output = scratch / f"out-{n}-{repeat}"
                    runs[n].append(run_prepare(scratch / "corpus.jsonl", scratch / "pipeline.json", output, n))
                    print(f"  {size} GB, {n} process(es): {runs[n][-1]}", file=sys.stderr, flush=True)
                    subprocess.run(["rm", "-rf", str(output)], check=True)
            for n in procs:
                med = {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]}
                rows.append((size, n, records, med))
    print(
        f"\n{'input GB':>8} {'procs':>5} {'records':>10} {'tokens':>13} {'wall s':>8} {'tokens/s':>10} "
        f"{'peak RSS MB':>11} {'peak PSS MB':>11}"
    )
    for size, n, records, med in rows:
        print(
            f"{size:>8.3g} {n:>5} {records:>10,} {med['tokens']:>13,.0f} {med['seconds']:>8.1f} "
            f"{med['tokens'] / med['seconds']:>10,.0f} {med['rss_mb']:>11.0f} {med['pss_mb']:>11.0f}"
        )
    print(f"\nmedians of {args.repeats} run(s) each; RSS: the largest process; PSS: main process and workers together")


if __name__ == "__main__":
    main()
