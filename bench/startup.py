"""Time from the command to the first optimizer step: ``astrai-fabric`` against a plain script, single process.

    .venv/bin/python bench/startup.py [--repeats 3]

Both start a fresh Python process, read the bundled seq corpus (JSONL), tokenise it, cut windows of 128 tokens,
build the bundled tiny model and take one AdamW step on 8 windows; the clock stops when the step's line reaches
stdout. The plain script is what one would write without a framework: torch, tokenizers and this package's model
class, no Lightning. The difference is what the CLI costs before training starts (importing Lightning, parsing
and validating the recipe, the Fabric, printing the plan). Runs alternate; the table shows every run and medians.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    times: dict[str, list[float]] = {"astrai-fabric": [], "plain script": []}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(repeats):
            ours = [str(Path(sys.executable).parent / "astrai-fabric"), "seq", "--config", "recipes/tiny-seq.yaml",
                    "--max_steps", "1", "--grad_accum_steps", "1", "--ckpt_dir", f"{out}/{repeat}",
                    "--loggers", "[]"]  # fmt: skip
            times["astrai-fabric"].append(seconds_to_first_step(ours))
            times["plain script"].append(seconds_to_first_step([sys.executable, "-c", PLAIN]))
    print(f"\nseconds from the command to the first optimizer step (tiny model, 8 windows of 128), {repeats} runs\n")
    print(f"{'command':<14} {'runs':<24} {'median s':>9}")
    for name, values in times.items():
        print(f"{name:<14} {' '.join(f'{v:5.2f}' for v in values):<24} {statistics.median(values):>9.2f}")
    ratio = statistics.median(times["astrai-fabric"]) / statistics.median(times["plain script"])
    extra = statistics.median(times["astrai-fabric"]) - statistics.median(times["plain script"])
    print(f"\nastrai-fabric / plain: {ratio:.2f}x ({extra:+.2f} s)")


if __name__ == "__main__":
    main()
