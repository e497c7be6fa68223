"""The first command a user runs, from a fresh clone: `make train` (install what training needs, then train the
bundled model), timed in its two parts, with what the install put on disk.

    .venv/bin/python bench/first_command.py [--full]

The clone is of this repository's HEAD into a temporary folder (nothing is downloaded beyond what pip fetches from
the configured index or local wheel folder). ``--full`` also times `make install` (the whole test stack, what
`make test` needs) in the same clone afterwards, for the difference. Prints a table: seconds per part, the venv's
size on disk and its number of installed distributions.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def timed(command: list[str], cwd: Path) -> float:
    """Wall seconds of ``command`` (its output kept for a failure only)."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def venv_size(venv: Path) -> tuple[int, int]:
    """(bytes on disk, installed distributions) of ``venv``."""
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    distributions = len(list(venv.glob("lib/python*/site-packages/*.dist-info")))
    return size, distributions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also time `make install` (the test stack)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        rows = [("make install-train", timed(["make", "install-train"], clone), *venv_size(clone / ".venv"))]
        rows.append(("make train (training)", timed(["make", "train"], clone), *venv_size(clone / ".venv")))
        if args.full:
            rows.append(("make install (full)", timed(["make", "install"], clone), *venv_size(clone / ".venv")))
    load = os.getloadavg()[0]
    print(f"a fresh clone of {ROOT.name}'s HEAD, {os.cpu_count()} CPU(s), load average {load:.2f} at the end")
    print(f"{'step':<24}{'wall s':>8}{'venv MB':>10}{'packages':>10}")
    for name, seconds, size_bytes, distributions in rows:
        print(f"{name:<24}{seconds:>8.1f}{size_bytes / 1e6:>10.0f}{distributions:>10}")


if __name__ == "__main__":
    main()
