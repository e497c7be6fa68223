"""One prepared check for a machine with CUDA GPUs: FSDP2 in pure bf16 on a ~1B-parameter model for 50 steps, then
a checkpoint save/load round trip. Prints tokens/s, MFU and peak memory. Not part of the tests or `make bench`.

    python bench/gpu_check.py                 # every visible GPU (one FSDP rank each), 50 steps
    python bench/gpu_check.py --devices 1 --steps 20
    python bench/gpu_check.py --smoke         # the same path on CPU with the tiny model: checks the script itself
    python bench/gpu_check.py --qlora         # instead: full / LoRA / QLoRA x chunked loss, bench/qlora_memory.py
    python bench/gpu_check.py --qlora --smoke # that comparison on CPU with a tiny shape: checks it
    python bench/gpu_check.py --moe           # instead: bench/moe.py's MoE layer, experts one by one vs together

Model: hidden 2048, 20 layers, 16/8 heads, SwiGLU 5632, vocabulary 32000 (1.0B parameters), windows of 1024
tokens from the bundled corpus (its tiny tokenizer uses the first 2048 ids), 4 per GPU, muon_adamw, bf16-true,
NEFTune on (alpha 5: its noise generator lives on the GPU, ``astrai_fabric.randomness``).
MFU uses Lightning's table of peak FLOP/s for the GPU (or --peak_flops). Peak memory is torch's
``max_memory_allocated`` on rank 0: parameters, gradients and optimizer state are sharded, activations are not.

``--qlora`` runs ``bench/qlora_memory.py``'s comparison on one GPU instead: Qwen2.5-0.5B's shape, 1 x 1,024 tokens,
full fine-tuning, LoRA and QLoRA (r=16, all seven targets), each with the loss unchunked and chunked, each a fresh
process through ``astrai_fabric.train.run`` for 2 steps; peak ``max_memory_allocated`` of loading plus the steps, the
head-plus-loss peak alone, and the step times of the six sides alternating in one process (the real shape: a step
takes milliseconds here). ``--qlora_precision`` (default ``32-true``, as the CPU table in docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.train import run

BILLION = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8,
    intermediate_size=5632, max_position_embeddings=2048, tie_word_embeddings=False,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--devices", type=int, default=None, help="GPUs (FSDP ranks); default: all visible")
    parser.add_argument("--peak_flops", type=float, default=None, help="Peak FLOP/s of one GPU, for unknown GPUs")
    parser.add_argument("--out", default=None, help="Where checkpoints go; default: a temporary folder")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 steps: check the script itself")
    parser.add_argument("--qlora", action="store_true", help="Instead: full / LoRA / QLoRA x chunked loss memory")
    parser.add_argument("--qlora_precision", default="32-true", help="--qlora's precision (bf16-true, say)")
    parser.add_argument("--moe", action="store_true", help="Instead: MoE experts one by one against together")
    options = parser.parse_args()
    if not options.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible (use --smoke to check the script on CPU)")
    if options.qlora:
        # bench/ is the script's folder, first on sys.path: the comparison is qlora_memory's, run on this device.
        from qlora_memory import main as qlora_memory

        device = ["--device", "cpu", "--smoke"] if options.smoke else ["--device", "cuda"]
        qlora_memory([*device, "--precision", options.qlora_precision])
        return
    if options.moe:  # bench/moe.py's layer table on this device, in bfloat16 (float32 on CPU for --smoke)
        from moe import layer_part

        layer_part(3 if options.smoke else 20, *(("cpu", torch.float32) if options.smoke else ("cuda", torch.bfloat16)))
        return
    # The launcher re-runs this script for the other local ranks: they must find the same folder (environment).
    os.environ.setdefault("GPU_CHECK_OUT", options.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out = Path(os.environ["GPU_CHECK_OUT"])
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    if not options.smoke:
        config.update(BILLION)
    (model_dir / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, model_dir / name)

    devices = options.devices or (1 if options.smoke else torch.cuda.device_count())
    args = TrainArgs(
        train_type="seq",
        param_path=str(model_dir),
        data_root_path="bundled:data/seq",
        ckpt_dir=str(out / "run"),
        window_size=64 if options.smoke else 1024,
        batch_per_device=4,
        max_steps=3 if options.smoke else options.steps,
        n_epoch=1000,
        parallel_mode="fsdp",
        nprocs=devices,
        device_type="cpu" if options.smoke else "cuda",
        precision="32-true" if options.smoke else "bf16-true",
        num_workers=2,
        ckpt_interval=10**9,
        loggers=[],
        metrics=["loss", "lr", "grad_norm", "tokens_per_sec", "mfu"],
        peak_flops=options.peak_flops,
        neftune_alpha=5.0,
    )
    history = run(args)
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:  # the launched ranks train; rank 0 reports
        return
    peak_memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    steady = history[min(5, len(history) - 1) :]  # the first steps include compilation of kernels and warm-up
    tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in steady)
    mfu = statistics.median(r["mfu"] for r in steady) if "mfu" in steady[0] else None

    checkpoint_dir = find_latest_checkpoint(args.ckpt_dir)
    started = time.perf_counter()
    checkpoint = load_checkpoint(checkpoint_dir)
    load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    copy = save_checkpoint(
        out / "round_trip", checkpoint.state_dict, checkpoint.config, meta={"train_type": "seq"}, extra=checkpoint.extra
    )
    save_seconds = time.perf_counter() - started
    reloaded = load_checkpoint(copy)
    exact = all(torch.equal(reloaded.state_dict[k], v) for k, v in checkpoint.state_dict.items())

    num_params = sum(t.numel() for t in checkpoint.state_dict.values())
    device = "CPU (smoke)" if options.smoke else f"{devices} x {torch.cuda.get_device_name(0)}"
    print(
        f"\ngpu_check on {device}: {num_params / 1e9:.2f}B parameters, {len(history)} steps, "
        f"{args.precision}, FSDP over {devices} rank(s)\n"
    )
    rows = [
        ("tokens/s (all ranks, median after step 5)", f"{tokens_per_sec:,.0f}"),
        ("MFU", f"{mfu:.1%}" if mfu is not None else "unknown peak FLOP/s (pass --peak_flops)"),
        ("peak memory, rank 0", f"{peak_memory / 2**30:.1f} GiB"),
        ("final loss", f"{history[-1]['loss']:.4f}"),
        ("checkpoint load (all files)", f"{load_seconds:.1f} s"),
        ("checkpoint save (atomic, fsync)", f"{save_seconds:.1f} s"),
        ("round trip bit-exact", "yes" if exact else "NO"),
    ]
    for name, value in rows:
        print(f"{name:<42} {value}")
    print(f"\ncheckpoints: {out}")


if __name__ == "__main__":
    main()
