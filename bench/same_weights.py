"""The weights each train type and each parallel layout trains, as hashes: run before a change that must not change
behaviour (issue 62's layout refactor) and after it, and compare (a one-off check, not a suite test).

    .venv/bin/python bench/same_weights.py --out before.json        # then, after the change:
    .venv/bin/python bench/same_weights.py --out after.json --against before.json

Each row is a tiny recipe run by the CLI in its own process (2 ranks where the layout has them, through the CLI's
own launcher), 2 optimizer steps, and the SHA-256 of the checkpoint's ``model.safetensors``. Hashes hold on one
machine (another CPU's kernels may round otherwise); ``--against`` prints the rows that differ and exits 1 if any.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
COMMON = ["--max_steps", "2", "--batch_per_device", "2", "--grad_accum_steps", "2", "--num_workers", "0"]
RUNS = {  # name: (train type, recipe, extra flags)
    "seq": ("seq", "tiny-seq.yaml", []),
    "sft": ("sft", "tiny-sft.yaml", []),
    "dpo": ("dpo", "tiny-dpo.yaml", []),
    "kto": ("kto", "tiny-kto.yaml", []),
    "grpo": ("grpo", "tiny-grpo.yaml", []),
    "grpo_online": ("grpo", "tiny-grpo-online.yaml", ["--rollout_max_tokens", "6"]),
    "reward_model": ("reward_model", "tiny-reward-model.yaml", []),
    "ddp2_sft": ("sft", "tiny-sft.yaml", ["--nprocs", "2", "--parallel_mode", "ddp"]),
    "fsdp2_sft": ("sft", "tiny-sft.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp"]),
    "fsdp2_dpo": ("dpo", "tiny-dpo.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp"]),
    "tp2_seq": ("seq", "tiny-seq.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp", "--tp_size", "2"]),
    "cp2_sft": ("sft", "tiny-sft.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp", "--cp_size", "2"]),
    "pp2_seq": ("seq", "tiny-seq.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp", "--pp_size", "2"]),
    "ep2_seq_moe": ("seq", "tiny-seq.yaml", ["--nprocs", "2", "--parallel_mode", "fsdp", "--ep_size", "2", "MOE"]),
}
MOE = {"ffn_type": "moe", "n_routed_experts": 4, "n_activated_experts": 2, "n_shared_experts": 1,
       "moe_intermediate_size": 64}  # fmt: skip
"""The MoE model of the expert-parallel row: the bundled tiny model's config with MoE layers (AstrAI's init)."""


def moe_model(scratch: Path) -> Path:
    model = scratch / "tiny-moe"
    shutil.copytree(ROOT / "astrai_fabric" / "assets" / "tiny", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **MOE}, indent=2))
    return model


def run(name: str, scratch: Path) -> str:
    train_type, recipe, flags = RUNS[name]
    if "MOE" in flags:
        flags = [flag for flag in flags if flag != "MOE"] + ["--param_path", str(moe_model(scratch))]
    out = scratch / name
    argv = [train_type, "--config", str(ROOT / "recipes" / recipe), "--ckpt_dir", str(out), *COMMON, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "astrai_fabric", *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    (weights,) = out.glob("epoch_*_step_2/model.safetensors")
    return hashlib.sha256(weights.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where the hashes go (JSON)")
    parser.add_argument("--against", help="an earlier --out to compare with")
    parser.add_argument("--runs", default=",".join(RUNS))
    options = parser.parse_args()
    hashes = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in options.runs.split(","):
            started = time.perf_counter()
            hashes[name] = run(name, Path(scratch))
            print(f"| {name} | {hashes[name][:16]} | {time.perf_counter() - started:.1f} s |", flush=True)
    Path(options.out).write_text(json.dumps(hashes, indent=2) + "\n")
    if options.against:
        before = json.loads(Path(options.against).read_text())
        differ = [name for name in hashes if before.get(name) != hashes[name]]
        print("the same weights for every run" if not differ else f"differ: {', '.join(differ)}")
        raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
