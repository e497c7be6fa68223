"""Start-up: each command's CPU time, and the time from the command to the first optimizer step against a plain
script, single process.

    .venv/bin/python bench/startup.py [--repeats 3] [--only commands|first_step]

**Commands.** Each non-training command (``--help``, each command's ``--help``, ``generate``, ``chat``, ``export``,
``prepare``, ``plot``), ``sft --help`` and a training command refused for a mistaken flag (``sft --learning_rat``,
exit 2: what a typo costs before it is said) runs in a fresh process with ``OMP_NUM_THREADS=1`` on a tiny checkpoint
trained here first (2 steps of ``recipes/tiny-seq.yaml`` in a temporary directory); the figure is the child's CPU
time, user + system (``os.wait4``), which a busy machine inflates less than wall time. What it measures is mostly
imports: the work itself (8 sampled tokens, a 1M-parameter export, 16 JSONL records) takes a few milliseconds. The
commands alternate within each repeat; the table shows every run and medians. A command this version does not have
is left out.

**First step.** Both start a fresh Python process, read the bundled seq corpus (JSONL), tokenise it, cut windows
of 128 tokens, build the bundled tiny model and take one AdamW step on 8 windows; the clock stops when the step's
line reaches stdout. The plain script is what one would write without a framework: torch, tokenizers and this
package's model class, no Lightning. The difference is what the CLI costs before training starts (importing
Lightning, parsing and validating the recipe, the Fabric, printing the plan). Runs alternate; the table shows
every run and medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
PLAIN = """
import json, torch
from tokenizers import Tokenizer
from astrai_fabric.assets import SEQ_DATA_DIR, TINY_MODEL_DIR
from astrai_fabric.config import ModelConfig
from astrai_fabric.model import AutoRegressiveLM
tokenizer = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
eos = tokenizer.token_to_id("<|end_of_sentence|>")
ids = []
for line in open(SEQ_DATA_DIR / "kjv.jsonl", encoding="utf-8"):
    ids += tokenizer.encode(json.loads(line)["text"]).ids + [eos]
tokens = torch.tensor(ids)
windows = tokens[: (len(tokens) - 1) // 128 * 128 + 1]
x = windows[:-1].view(-1, 128)[:8]
y = windows[1:].view(-1, 128)[:8]
torch.manual_seed(3407)
model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
logits = model(x)["logits"]
loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
loss.backward()
optimizer.step()
print(f"step 1/1 | loss {loss.item():.4f}", flush=True)
"""


def seconds_to_first_step(command: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("step 1/"):
            elapsed = time.perf_counter() - start
            proc.wait()
            return elapsed
    raise RuntimeError(f"{command[:3]} ended without a first step (exit {proc.wait()})")


def cpu_seconds(argv: list[str], stdin: str = "") -> tuple[float, int, str]:
    """The child's user + system CPU seconds (its own children included), its exit status and its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT, env=env
        )
        proc.stdin.write(stdin)
        proc.stdin.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return usage.ru_utime + usage.ru_stime, proc.returncode, err.read()


REFUSED = {"sft, flag mistaken": 2}
"""The rows whose command is refused (its exit status): a mistake's cost is the time to say it."""


def command_rows(out: Path) -> dict[str, tuple[list[str], str]]:
    """Each measured command: its arguments (``{i}``: the run's number, for fresh outputs) and its stdin. Each exits
    0 but those in ``REFUSED``."""
    ckpt_dir = out / "run"
    train = [
        str(Path(sys.executable).parent / "astrai-fabric"),
        "seq",
        "--config",
        "recipes/tiny-seq.yaml",
        "--n_epoch",
        "1",
        "--max_steps",
        "2",
        "--ckpt_dir",
        str(ckpt_dir),
        "--loggers",
        "[]",
    ]
    subprocess.run(train, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (ckpt,) = ckpt_dir.glob("epoch_*_step_*")
    records = (ROOT / "astrai_fabric/assets/data/sft/tasks.jsonl").read_text(encoding="utf-8").splitlines()[:16]
    (out / "chats.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    pipeline = {
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "mask": {"assistant": "train"},
    }
    (out / "chat.json").write_text(json.dumps(pipeline), encoding="utf-8")
    sample = ["--max_new_tokens", "8", "--temperature", "0"]
    rows: dict[str, tuple[list[str], str]] = {"--help": (["--help"], "")}
    for command in ("generate", "chat", "export", "prepare", "plot", "sft"):
        rows[f"{command} --help"] = ([command, "--help"], "")
    rows["sft, flag mistaken"] = (["sft", "--config", "recipes/tiny-sft.yaml", "--learning_rat", "1e-3"], "")
    rows["generate"] = (["generate", "--param_path", str(ckpt), "--chat", "false", "--prompt", "In the", *sample], "")
    rows["chat"] = (["chat", str(ckpt), *sample], "In the beginning\n/exit\n")
    rows["export --format hf"] = (["export", str(ckpt), "--format", "hf", "--out", f"{out}/hf_{{i}}"], "")
    rows["prepare"] = (
        [
            "prepare",
            f"{out}/chats.jsonl",
            "-o",
            f"{out}/prepared_{{i}}",
            "-c",
            f"{out}/chat.json",
            "--tokenizer_path",
            str(ckpt),
        ],
        "",
    )
    rows["plot"] = (["plot", str(ckpt_dir), "-o", f"{out}/plot_{{i}}.png"], "")
    return rows


def command_table(repeats: int) -> None:
    """Each command's CPU seconds, the commands in turn (rotated each repeat), medians."""
    cli = [sys.executable, "-m", "astrai_fabric"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = command_rows(Path(tmp))
        cpu: dict[str, list[float]] = {name: [] for name in rows}
        left_out: dict[str, str] = {}
        counter = itertools.count()
        for repeat in range(repeats):
            names = list(rows)
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                if name in left_out:
                    continue
                argv, stdin = rows[name]
                i = next(counter)
                seconds, code, err = cpu_seconds(cli + [a.replace("{i}", str(i)) for a in argv], stdin)
                if code != REFUSED.get(name, 0):
                    left_out[name] = (err.strip().splitlines() or [f"exit {code}"])[-1][:100]
                    continue
                cpu[name].append(seconds)
    print(f"\nCPU seconds (user + system) of each command's process, OMP_NUM_THREADS=1, {repeats} runs\n")
    print(f"{'command':<20} {'runs':<24} {'median s':>9}")
    for name, values in cpu.items():
        if name not in left_out:
            print(f"{name:<20} {' '.join(f'{v:5.2f}' for v in values):<24} {statistics.median(values):>9.2f}")
    for name, why in left_out.items():
        print(f"{name:<20} left out: {why}")


def first_step_table(repeats: int) -> None:
    times: dict[str, list[float]] = {"astrai-fabric": [], "plain script": []}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(repeats):
            ours = [
                str(Path(sys.executable).parent / "astrai-fabric"),
                "seq",
                "--config",
                "recipes/tiny-seq.yaml",
                "--max_steps",
                "1",
                "--grad_accum_steps",
                "1",
                "--ckpt_dir",
                f"{out}/{repeat}",
                "--loggers",
                "[]",
            ]
            times["astrai-fabric"].append(seconds_to_first_step(ours))
            times["plain script"].append(seconds_to_first_step([sys.executable, "-c", PLAIN]))
    print(f"\nseconds from the command to the first optimizer step (tiny model, 8 windows of 128), {repeats} runs\n")
    print(f"{'command':<14} {'runs':<24} {'median s':>9}")
    for name, values in times.items():
        print(f"{name:<14} {' '.join(f'{v:5.2f}' for v in values):<24} {statistics.median(values):>9.2f}")
    ratio = statistics.median(times["astrai-fabric"]) / statistics.median(times["plain script"])
    extra = statistics.median(times["astrai-fabric"]) - statistics.median(times["plain script"])
    print(f"\nastrai-fabric / plain: {ratio:.2f}x ({extra:+.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["commands", "first_step"], help="One of the two tables.")
    args = parser.parse_args()
    if args.only != "first_step":
        command_table(args.repeats)
    if args.only != "commands":
        first_step_table(args.repeats)


if __name__ == "__main__":
    main()
