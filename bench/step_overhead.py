"""Whole-process step time of ``astrai-fabric seq`` against a hand-written PyTorch script, taking turns.

    .venv/bin/python bench/step_overhead.py [--repeats 6] [--steps 24] [--optimizer muon_adamw] [--calibrate]
    .venv/bin/python bench/step_overhead.py --vs litgpt [--repeats 12] [--calibrate]
    .venv/bin/python bench/step_overhead.py --ops | --grad_snr_cost

Both sides are fresh processes training the same ~5M-parameter model (hidden 256, 6 layers, vocabulary 2048,
context 256; built from one ``config.json`` with the same seed) on windows of the same bin shard of random tokens,
in the same order, micro-batch 4 x 256, float32, one thread, the same optimizer (the run's default ``muon_adamw``;
``--optimizer adamw`` for both), the same schedule and clipping at 1.0. Ours is the real command
(``python -m astrai_fabric seq ... --num_threads 1 --parallel_mode none``, its default loggers and metrics, which
include ``grad_snr``); the other is ``bench/step_plain.py``.

Why turns: on a shared virtual machine a process's speed drifts by +-10% over seconds (other tenants' load on the
host's caches and memory), so two whole runs one after the other differ by that much whatever they run (the A/A
runs below: a script against itself). Here both processes live at once, pinned to the same core, and take turns
(SIGSTOP/SIGCONT from this benchmark): one runs until it prints its next step line, then the other does the same
step, the order swapping every step. Each step of ours is timed within a couple of seconds of the same step of the
script, so the drift cancels; everything a process does between two of its step lines counts (the model, the
optimizer, metrics, the metric log, loggers, the progress display, synchronisations, the data path). Both sides
print the same steps (``astrai-fabric`` on a pipe: about every ``steps // 20``; the script is told the same).
Start-up is left out: each runs alone to its first step line, and ``--warmup`` logged steps are dropped.

A pair is one such run of the two; pairs alternate which side is started first and which core they share. The
table prints each pair's tokens/s by time on the core and the ratio, then min/median/max of ours / script.
Target: median >= 0.99. ``--calibrate`` puts a second copy of the script in ours' place: its ratios show what the
method itself can resolve. Step 1's loss is printed for both sides: equal losses say the two did the same work.

``--vs litgpt`` puts LitGPT 0.5.13 in the script's place: ``bench/litgpt_side.py``, run by the python of a venv
of its own (``.bench-venvs/litgpt``, made on first use by ``litgpt_python``: ``torch==2.13.0+cpu`` and
``litgpt==0.5.13``), which trains ``litgpt.GPT`` of the same shape through ``lightning.Fabric`` as
``litgpt/pretrain.py`` does (its docstring lists each choice), eager, one thread, AdamW with our ``adamw``'s
hyper-parameters, so ours runs ``--optimizer adamw`` (the default under ``--vs litgpt``). The column is then
``ours / litgpt`` tokens/s, target median >= 1.05 (ours 5% faster than LitGPT). LitGPT initialises its weights its
own way, so the step-1 losses differ (both are printed); ``--calibrate`` runs two copies of the LitGPT side.

``--ops`` instead says where a difference comes from: each side runs once under torch.profiler for steps 5-7
(ours through its own ``--profile_steps``, the script through ``--profile`` with the same settings), and the ops
whose number of calls per step differs between the two are listed with their self time: that is the work ours
adds. The op counts are exact whatever the machine's load; the milliseconds carry the profiler's own overhead.

``--grad_snr_cost`` instead times the ``grad_snr`` metric alone in one process: ``GradSNR.update`` after each of
a run of training steps of the same model and batch (AdamW), both medians and their ratio (target <= 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from astrai_fabric.config import ModelConfig
from astrai_fabric.metrics import GradSNR
from astrai_fabric.model import AutoRegressiveLM

ROOT = Path(__file__).parents[1]
PLAIN = Path(__file__).with_name("step_plain.py")
LITGPT_SIDE = Path(__file__).with_name("litgpt_side.py")
LITGPT_VENV = ROOT / ".bench-venvs" / "litgpt"
LITGPT_REQUIREMENTS = ("torch==2.13.0+cpu", "litgpt==0.5.13")
"""One pip command, so the CPU build of torch (from the local wheel directory) is what satisfies litgpt's torch
requirement and pip never fetches a CUDA build."""
CONFIG = dict(
    vocab_size=2048, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=704, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
BATCH, WINDOW, SEED, LR = 4, 256, 3407, 3e-4
TARGETS = {"script": 0.99, "litgpt": 1.05}
"""Median ours / other tokens/s to reach (issue 41): within 1% of the hand-written loop, 5% faster than LitGPT."""


def write_inputs(root: Path, steps: int) -> tuple[Path, Path]:
    """A model directory (config.json only: fresh weights) and a bin shard of exactly ``steps`` micro-batches of
    windows: one epoch, so ours plans the script's ``steps`` (and the same schedule)."""
    model_dir, data_dir = root / "model", root / "data"
    model_dir.mkdir()
    data_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    num_tokens = steps * BATCH * WINDOW + 1  # windows of WINDOW + 1 tokens at stride WINDOW
    tokens = np.random.default_rng(SEED).integers(0, CONFIG["vocab_size"], num_tokens, dtype=np.int32)
    tokens.tofile(data_dir / "sequence.bin")
    (data_dir / "meta.json").write_text(json.dumps({"sequence": {"shape": [num_tokens], "dtype": "int32"}}))
    return model_dir, data_dir


class Side:
    """One side of a pair: its process, pinned to ``core``, read line by line and run only in its turns."""

    def __init__(self, command: list[str], env: dict[str, str], core: int) -> None:
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )
        self.step = 0
        self.turns: list[tuple[int, float]] = []
        """Per turn after start-up: the optimizer steps it covered and the seconds the process ran for them."""
        self.first_loss: float | None = None

    def take_turn(self) -> int:
        """Let the process run until it prints its next ``step S/N | loss L ...`` line, then stop it; returns S."""
        start = time.perf_counter()
        os.kill(self.process.pid, signal.SIGCONT)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("step "):
                seconds = time.perf_counter() - start
                os.kill(self.process.pid, signal.SIGSTOP)
                step = int(line.split()[1].split("/")[0])
                if self.first_loss is None:
                    self.first_loss = float(line.split("loss ")[1].split()[0])
                else:
                    self.turns.append((step - self.step, seconds))
                self.step = step
                return step
        self.process.wait()
        raise RuntimeError(f"{' '.join(self.process.args)} exited {self.process.returncode} before its next step")

    def finish(self) -> None:
        """Let the process run to its end."""
        os.kill(self.process.pid, signal.SIGCONT)
        assert self.process.stdout is not None
        self.process.stdout.read()
        if self.process.wait():
            raise RuntimeError(f"{' '.join(self.process.args)} exited {self.process.returncode}")

    def seconds_per_step(self, warmup: int) -> float:
        timed = self.turns[warmup:]
        if not timed:
            raise RuntimeError(f"no logged steps after the warm-up of {warmup}")
        return sum(seconds for _, seconds in timed) / sum(steps for steps, _ in timed)


def run_pair(
    commands: dict[str, list[str]], env: dict[str, str], first: str, core: int, last_step: int
) -> dict[str, Side]:
    """Start both sides, ``first`` first, each alone up to its first step line (start-up is not timed), then let
    them take turns, one logged step each, the order swapping every step, up to ``last_step``."""
    order = sorted(commands, key=lambda name: name != first)
    sides: dict[str, Side] = {}
    try:
        for name in order:
            sides[name] = Side(commands[name], env, core)
            os.kill(sides[name].process.pid, signal.SIGSTOP)  # from here on it runs only in its turns
            sides[name].take_turn()
        while sides[first].step < last_step:
            steps = {name: sides[name].take_turn() for name in order}
            if len(set(steps.values())) != 1:
                raise RuntimeError(f"the two sides logged different steps: {steps}")
            order.reverse()
        for side in sides.values():
            side.finish()
    finally:
        for side in sides.values():
            if side.process.poll() is None:
                side.process.kill()
                side.process.wait()
    return sides


def litgpt_venv_problems(python: Path) -> list[str]:
    """What is wrong with the LitGPT venv of ``python`` (empty: it works): litgpt must import at the pinned
    version, torch must be a ``+cpu`` build, and no ``nvidia-*`` distribution may be installed (a CUDA torch's
    runtime wheels: gigabytes, and not the build this comparison means)."""
    probe = (
        "import importlib.metadata as m, json, torch, litgpt, lightning\n"
        "print(json.dumps({'torch': torch.__version__, 'litgpt': m.version('litgpt'),"
        " 'nvidia': sorted(d.metadata['Name'] for d in m.distributions()"
        " if d.metadata['Name'].lower().startswith('nvidia'))}))"
    )
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if found.returncode:
        return [f"{python} cannot import torch, litgpt and lightning: {found.stderr.strip()[-500:]}"]
    versions = json.loads(found.stdout.splitlines()[-1])
    problems = []
    if not versions["torch"].endswith("+cpu"):
        problems.append(f"torch {versions['torch']} is not a +cpu build")
    if versions["litgpt"] != LITGPT_REQUIREMENTS[1].split("==")[1]:
        problems.append(f"litgpt {versions['litgpt']}, not {LITGPT_REQUIREMENTS[1]}")
    if versions["nvidia"]:
        problems.append(f"CUDA packages installed: {', '.join(versions['nvidia'])}")
    return problems


def litgpt_python(venv: Path = LITGPT_VENV) -> Path:
    """The python of the LitGPT venv at ``venv``, made on first use (``python -m venv``, then one pip install of
    ``LITGPT_REQUIREMENTS``) and reused while it works. The LitGPT side runs there, apart from this package's
    venv, so that each side has its own framework and nothing of ours. Raises if the made venv is not right."""
    python = venv / "bin" / "python"
    if python.exists() and not litgpt_venv_problems(python):
        return python
    print(f"making the LitGPT venv at {venv} ({' '.join(LITGPT_REQUIREMENTS)})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *LITGPT_REQUIREMENTS], check=True)
    problems = litgpt_venv_problems(python)
    if problems:
        raise RuntimeError(f"the LitGPT venv at {venv} is not usable: {'; '.join(problems)}")
    return python


def grad_snr_cost(repeats: int) -> None:
    """In one process: ``GradSNR.update`` on the bench model's gradients against a whole training step (forward,
    backward, clipping, AdamW), alternating, one thread; prints the medians and their ratio (target <= 2%)."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = AutoRegressiveLM(ModelConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, WINDOW + 1))
    tracker, step_times, snr_times = GradSNR(), [], []
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])["logits"]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        middle = time.perf_counter()
        tracker.update(model)
        end = time.perf_counter()
        if repeat:  # the first allocates the EMA
            step_times.append(middle - start)
            snr_times.append(end - middle)
    step, snr = statistics.median(step_times), statistics.median(snr_times)
    print(
        f"training step {step * 1e3:.1f} ms, GradSNR.update {snr * 1e3:.2f} ms = {snr / step:.1%} of a step "
        f"(target <= 2%; medians of {repeats}, 1 thread, load {os.getloadavg()[0]:.2f})"
    )


def commands(root: Path, options: argparse.Namespace) -> dict[str, list[str]]:
    """Ours and the other side (``options.vs``: the script or LitGPT) on the inputs written under ``root``, as
    ``options`` ask; with ``--calibrate``, a second copy of the other side in ours' place."""
    model_dir, data_dir = write_inputs(root, options.steps)
    ours = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "seq",
        "--param_path",
        str(model_dir),
        "--data_root_path",
        str(data_dir),
        "--ckpt_dir",
        str(root / "ckpt"),
        "--window_size",
        str(WINDOW),
        "--batch_per_device",
        str(BATCH),
        "--max_steps",
        str(options.steps),
        "--max_lr",
        str(LR),
        "--optimizer",
        options.optimizer,
        "--num_threads",
        "1",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--random_seed",
        str(SEED),
        "--ckpt_interval",
        "1000000",
        *(["--metrics", options.metrics] if options.metrics != "default" else []),
        *options.extra.split(),
    ]
    log_every = max(1, options.steps // 20)  # astrai-fabric's cadence on a pipe (reporting.py)
    if options.vs == "litgpt":

        def litgpt(out_dir: Path) -> list[str]:
            return [
                options.litgpt_python,
                str(LITGPT_SIDE),
                str(model_dir),
                str(data_dir),
                str(out_dir),
                *("--steps", str(options.steps), "--batch", str(BATCH), "--window", str(WINDOW)),
                *("--lr", str(LR), "--seed", str(SEED), "--log_every", str(log_every)),
            ]

        return {"ours": litgpt(root / "litgpt_copy") if options.calibrate else ours, "litgpt": litgpt(root / "litgpt")}
    script = [
        sys.executable,
        str(PLAIN),
        str(model_dir),
        str(data_dir),
        "--steps",
        str(options.steps),
        "--batch",
        str(BATCH),
        "--window",
        str(WINDOW),
        "--optimizer",
        options.optimizer,
        "--lr",
        str(LR),
        "--seed",
        str(SEED),
        "--log_every",
        str(log_every),
    ]
    return {"ours": script if options.calibrate else ours, "script": script}


def turns(options: argparse.Namespace, env: dict[str, str]) -> None:
    """The pairs, then their table (see the module docstring)."""
    other = options.vs
    cores = sorted(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sides_commands = commands(Path(tmp), options)
        for repeat in range(options.repeats):
            shutil.rmtree(Path(tmp) / "ckpt", ignore_errors=True)
            first, core = ("ours", other)[repeat % 2], cores[repeat // 2 % len(cores)]
            sides = run_pair(sides_commands, env, first, core, options.steps)
            ours_s, script_s = (sides[n].seconds_per_step(options.warmup) for n in ("ours", other))
            rows.append((repeat, first, core, ours_s, script_s, sides["ours"].first_loss, sides[other].first_loss))
            print(
                f"pair {repeat}: ours {ours_s * 1e3:.0f} ms/step, {other} {script_s * 1e3:.0f} ms/step ({first} "
                f"started first, core {core}, load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    tokens = BATCH * WINDOW
    label = f"{other} copy" if options.calibrate else "ours"
    ratio = "ratio" if other == "script" else f"{label} / {other}"  # the script's table keeps its documented form
    print(
        f"\n{'pair':>4} {'first':>6} {'core':>4} {label + ' tok/s':>17} {other + ' tok/s':>13} {ratio:>6} "
        f"{'step-1 loss ' + label:>23} {other:>8}"
    )
    for repeat, first, core, ours_s, script_s, loss_a, loss_b in rows:
        print(
            f"{repeat:>4} {first:>6} {core:>4} {tokens / ours_s:>17,.0f} {tokens / script_s:>13,.0f} "
            f"{script_s / ours_s:>{max(6, len(ratio))}.3f} {loss_a:>23.4f} {loss_b:>8.4f}"
        )
    ratios = [script_s / ours_s for _, _, _, ours_s, script_s, _, _ in rows]
    median = statistics.median(ratios)
    target = TARGETS[other]
    print(
        f"{label} / {other} tokens/s: min {min(ratios):.3f}, median {median:.3f}, max {max(ratios):.3f}"
        + ("" if options.calibrate else f" (target median >= {target}: {'ok' if median >= target else 'MISSED'})")
        + ("" if other == "script" else f"; {other} / {label}: median {statistics.median(1 / r for r in ratios):.3f}")
    )
    print(
        f"optimizer {options.optimizer}, metrics {options.metrics}, batch {BATCH}x{WINDOW}, {options.steps} "
        f"steps ({options.warmup} + 1 untimed), 1 thread, turns on one core, load {os.getloadavg()[0]:.2f}"
    )


PROFILED = (5, 7)
"""The optimizer steps ``--ops`` profiles on both sides (inclusive): after warm-up, before the end."""


def op_accounting(options: argparse.Namespace, env: dict[str, str]) -> None:
    """Both sides once under torch.profiler (astrai-fabric's own ``--profile_steps``; the script's ``--profile``
    with the same settings) for ``PROFILED`` steps: the ops whose count per step differs are the work ours adds,
    and their self time what it costs. Op counts do not depend on the machine's load; the times do."""
    first, last = PROFILED
    with tempfile.TemporaryDirectory() as tmp:
        sides = commands(Path(tmp), argparse.Namespace(**{**vars(options), "steps": max(options.steps, last + 1)}))
        traces = {
            "ours": Path(tmp) / "ckpt" / "profile" / f"steps_{first}-{last}" / "rank0.pt.trace.json",
            "script": Path(tmp) / "script.pt.trace.json",
        }
        sides["ours"] += ["--profile_steps", f"{first}:{last}"]
        sides["script"] += ["--profile", f"{first}:{last}:{traces['script']}"]
        for command in sides.values():
            subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (ours_ms, ours_n), (script_ms, script_n) = (self_times(traces[name], last - first + 1) for name in traces)
    same = [name for name in ours_n | script_n if round(ours_n[name]) == round(script_n[name])]
    added = [name for name in ours_n | script_n if name not in same]
    # The ops both run equally often give the two processes' relative speed; the script's time of an op ours calls
    # more often is scaled by it, so what remains is work, not one process having run faster than the other.
    speed = sum(ours_ms[name] for name in same) / sum(script_ms[name] for name in same)
    extra = {name: ours_ms[name] - speed * script_ms[name] for name in added}
    print(
        f"self time of every op per step: ours {sum(ours_ms.values()):.1f} ms, script {sum(script_ms.values()):.1f}"
        f" ms; the ops both call equally often took ours {speed:.3f}x the script's time (steps {first}-{last} "
        f"profiled, load {os.getloadavg()[0]:.2f})\n"
    )
    print(
        f"{'op (calls per step differ)':<40} {'ours ms':>8} {'script ms':>10} {'added ms':>9} {'ours n':>7} "
        f"{'script n':>9}"
    )
    for name in sorted(added, key=lambda name: -extra[name]):
        print(
            f"{name[:40]:<40} {ours_ms[name]:>8.2f} {script_ms[name]:>10.2f} {extra[name]:>9.2f} "
            f"{ours_n[name]:>7.0f} {script_n[name]:>9.0f}"
        )
    total = sum(extra.values())
    print(
        f"ops ours adds: {total:+.1f} ms per step ({total / (speed * sum(script_ms.values())):+.1%} of a step; "
        f"'added' = ours - {speed:.3f} x script)"
    )


def self_times(trace: Path, num_steps: int) -> tuple[Counter[str], Counter[str]]:
    """Per op name in a Chrome trace: self time (its time minus its children's, ms) and calls, per step."""
    events = [
        e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"
    ]
    milliseconds, calls = Counter(), Counter()
    for thread in {e["tid"] for e in events}:
        stack: list[dict] = []
        for event in sorted((e for e in events if e["tid"] == thread), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            if stack:
                milliseconds[stack[-1]["name"]] -= event["dur"] / 1e3 / num_steps
            milliseconds[event["name"]] += event["dur"] / 1e3 / num_steps
            calls[event["name"]] += 1 / num_steps
            stack.append(event)
    return milliseconds, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6, help="pairs of runs")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3, help="logged steps after the first left out")
    parser.add_argument(
        "--optimizer",
        choices=["muon_adamw", "adamw"],
        help="ours' (and the script's); default muon_adamw, and adamw with --vs litgpt",
    )
    parser.add_argument(
        "--metrics",
        default="default",
        help="ours: 'default', or a --metrics list such as '[loss,lr,grad_norm,tokens_per_sec]' (grad_snr left out)",
    )
    parser.add_argument("--extra", default="", help="more astrai-fabric flags, space-separated")
    parser.add_argument(
        "--vs", default="script", choices=["script", "litgpt"], help="the other side: step_plain.py or LitGPT 0.5.13"
    )
    parser.add_argument("--calibrate", action="store_true", help="a second copy of the other side in ours' place")
    parser.add_argument("--ops", action="store_true", help="only profile both sides and list the ops ours adds")
    parser.add_argument("--grad_snr_cost", action="store_true", help="only time GradSNR.update against a step")
    options = parser.parse_args()
    if options.vs == "litgpt":
        if options.ops:
            parser.error("--ops profiles against the script only")
        if options.optimizer not in (None, "adamw"):
            parser.error("--vs litgpt runs AdamW on the LitGPT side, so ours runs --optimizer adamw")
        options.optimizer = "adamw"
        options.litgpt_python = str(litgpt_python())  # made (minutes) or checked before anything is timed
    options.optimizer = options.optimizer or "muon_adamw"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if options.grad_snr_cost:
        grad_snr_cost(max(options.repeats, 15))
    elif options.ops:
        op_accounting(options, env)
    else:
        turns(options, env)


if __name__ == "__main__":
    main()
