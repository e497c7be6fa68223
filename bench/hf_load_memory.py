"""Peak memory while loading a ~1B-parameter model, against the model's size at the training precision.

    .venv/bin/python bench/hf_load_memory.py [--repeats 3] [--keep DIR] [--small]

Writes, with random weights, a Hugging Face llama directory in Llama-3.2-1B's shape (1.24B parameters, tied
embeddings, vocabulary 128256; bf16 on disk, sharded at 1 GiB with ``model.safetensors.index.json``) and the same
model in AstrAI's layout (one ``model.safetensors``), both in a temporary directory (``$TMPDIR``, about 5 GB,
deleted afterwards; ``--keep DIR`` writes them there, reuses them on the next run, and leaves them). No
transformers needed: the shards are written with safetensors and a hand-written ``config.json``.

Each measurement is a fresh process: import torch and astrai_fabric, reset the peak RSS (``VmHWM``, via
``/proc/self/clear_refs``: a forked child starts with its parent's peak, and ``ru_maxrss`` keeps it), read the RSS
(the interpreter's baseline), run the load, read ``VmHWM`` (the peak). "new" is ``load_model(DIR, dtype)`` (meta device,
tensors read chunk by chunk from memory maps straight into their place, cast per tensor); "old" is what the
previous release did to start training from a directory: a randomly initialised model at the training dtype,
every shard read with ``safetensors.torch.load_file`` and copied in. Sides alternate; the table shows medians.
RSS counts the file pages a process has mapped and touched, so a loader that keeps files mapped pays for them
here. Target: new peak <= 1.3 x the model's size at the training precision, on one process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HF_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    hidden_act="silu", torch_dtype="bfloat16",
)  # fmt: skip
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)  # fmt: skip
SHARD_BYTES = 1 << 30

CHILD = r"""
import json, sys, time
import torch
from astrai_fabric.checkpoint import hf, load_model, load_model_weights, read_model_config
from astrai_fabric.model import AutoRegressiveLM

def status(field):
    return int([l for l in open("/proc/self/status") if l.startswith(field)][0].split()[1]) * 1024

directory, side, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM starts at the parent's peak (fork copies it, exec keeps it): reset it to now
baseline = status("VmRSS")
start = time.perf_counter()
if side == "new":
    model = load_model(directory, dtype=dtype)
else:  # the previous release's start from weights (train/models.py initial_model + checkpoint.files.read_weights)
    from pathlib import Path
    from safetensors.torch import load_file
    config = read_model_config(directory)
    index = Path(directory, "model.safetensors.index.json")
    shards = ["model.safetensors"]
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state = {}
    for shard in shards:
        state.update(load_file(str(Path(directory, shard))))
    if index.exists():
        state = hf.state_dict_from_hf(state, config)
    model = AutoRegressiveLM(config)  # float32, as built there; Fabric cast it to the precision after loading
    load_model_weights(model, state, source=directory)
    del state
    model = model.to(dtype)
seconds = time.perf_counter() - start
peak = status("VmHWM")
assert all(p.dtype == dtype for p in model.parameters())
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps(dict(baseline=baseline, peak=peak, size=size, seconds=seconds,
                      params=sum(p.numel() for p in model.parameters()))))
"""


def write_model(root: Path, config: dict, layout: str) -> Path:
    """A random bf16 llama: Hugging Face's sharded layout, or AstrAI's single file (our names and config)."""
    from astrai_fabric.checkpoint import hf

    directory = root / layout
    directory.mkdir()
    generator = torch.Generator().manual_seed(0)
    hidden, inter, heads, kv = (
        config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shards, shard, shard_bytes = [], {}, 0
    for key, shape in shapes.items():
        name = key if layout == "hf" else hf.hf_key_to_ours(key)
        shard[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard_bytes += shard[name].numel() * 2
        if layout == "hf" and shard_bytes >= SHARD_BYTES:
            shards.append(shard)
            shard, shard_bytes = {}, 0
    shards.append(shard)
    if layout == "hf":
        weight_map = {}
        for n, tensors in enumerate(shards, 1):
            file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, file)
        index = {
            "metadata": {"total_size": sum(t.numel() * 2 for s in shards for t in s.values())},
            "weight_map": weight_map,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    else:
        save_file(shards[0], str(directory / "model.safetensors"))
        astrai = hf.model_config_from_hf(config).to_dict()
        (directory / "config.json").write_text(json.dumps(astrai, indent=2))
    shards.clear()
    return directory


def measure(directory: Path, side: str, dtype: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), side, dtype], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{side} {dtype} {directory.name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="write the models here and leave them")
    parser.add_argument("--small", action="store_true", help="a 10M-parameter model: checks the script quickly")
    parser.add_argument("--no-old", action="store_true", help="measure the new loader only")
    args = parser.parse_args()
    config = {**HF_CONFIG, **(SMALL if args.small else {})}
    root = args.keep or Path(tempfile.mkdtemp(prefix="hf_load_memory-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        dirs = {
            layout: (root / layout if (root / layout).exists() else write_model(root, config, layout))
            for layout in ("hf", "astrai")
        }
        cases = [("hf", "new"), ("hf", "old"), ("astrai", "new")]
        if args.no_old:
            cases.remove(("hf", "old"))
        results: dict[tuple[str, str, str], list[dict]] = {}
        for repeat in range(args.repeats):
            order = cases if repeat % 2 == 0 else cases[::-1]  # alternate the sides
            for dtype in ("float32", "bfloat16"):
                for layout, side in order:
                    results.setdefault((layout, side, dtype), []).append(measure(dirs[layout], side, dtype))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    gib = 2**30
    first = next(iter(results.values()))[0]
    print(
        f"\nmodel: {first['params'] / 1e9:.2f}B parameters, bf16 on disk; medians of {args.repeats} fresh "
        f"processes, {os.environ.get('OMP_NUM_THREADS', '2')} thread(s)\n"
    )
    print(
        f"{'layout':<7} {'loader':<6} {'dtype':<9} {'model GiB':>9} {'peak GiB':>9} {'peak/model':>10} "
        f"{'(peak-base)/model':>17} {'load s':>7}"
    )
    verdicts = []
    for (layout, side, dtype), runs in results.items():
        size = runs[0]["size"]
        peak = statistics.median(r["peak"] for r in runs)
        above = statistics.median(r["peak"] - r["baseline"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        print(
            f"{layout:<7} {side:<6} {dtype:<9} {size / gib:>9.2f} {peak / gib:>9.2f} {peak / size:>10.2f} "
            f"{above / size:>17.2f} {seconds:>7.1f}"
        )
        if side == "new":
            verdicts.append(peak / size <= 1.3)
    base = statistics.median(r["baseline"] for runs in results.values() for r in runs)
    print(f"\nbaseline (torch and astrai_fabric imported, before loading): {base / gib:.2f} GiB")
    print(f"target: new peak <= 1.3 x model: {'ok' if all(verdicts) else 'MISSED'}")


if __name__ == "__main__":
    main()
