"""How long the planner takes, and how much memory, on the largest layouts it accepts (issue 59: bounded planning).

    .venv/bin/python bench/planner.py [--repeats 3]

Each row is one ``--dry_run`` through the command line's own entry point, in this process after a warm-up run (so
Lightning's import is not timed): the plan of a model config (no weights, nothing read but its config.json and the
bundled corpus) over a cluster. Wall time is the median of the repeats; memory is the peak of Python's allocations
during one more run (tracemalloc, which slows a run 2-3x: not timed; the model is built on the meta device, so no
tensor storage is allocated). The targets: DeepSeek-V3's plan at 1,024 nodes within 2 s here; the largest plan the
caps admit (``config.train_checks``: 100,000 ranks; ``config.model``: 4,096 layers, 65,536 expert MLPs) within 15 s
and 1 GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from astrai_fabric.cli import main

LLAMA_70B = dict(
    model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip
DEEPSEEK_V3_671B = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=8, topk_group=4, first_k_dense_replace=3,
    norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    torch_dtype="bfloat16", scoring_func="sigmoid", topk_method="noaux_tc",
)  # fmt: skip
DEEP_MOE = dict(
    model_type="qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
    num_experts_per_tok=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
CASES = [
    ("Llama 70B shape, FSDP over 1,024 nodes x 8", LLAMA_70B, ["--nprocs", "8", "--num_nodes", "1024"]),
    ("Llama 70B shape, tensor 8 x FSDP 12,500 (the cap)", LLAMA_70B,
     ["--nprocs", "8", "--num_nodes", "12500", "--tp_size", "8"]),
    ("DeepSeek-V3 671B shape, FSDP over 1,024 nodes x 8", DEEPSEEK_V3_671B, ["--nprocs", "8", "--num_nodes", "1024"]),
    ("DeepSeek-V3 671B shape, expert 8 x 1,024 nodes", DEEPSEEK_V3_671B,
     ["--nprocs", "8", "--num_nodes", "1024", "--ep_size", "8"]),
    ("4,096 layers x 16 experts, 8 ranks", DEEP_MOE, ["--nprocs", "8"]),
    ("4,096 layers x 16 experts, DDP over 100,000 ranks", DEEP_MOE,
     ["--nprocs", "8", "--num_nodes", "12500", "--parallel_mode", "ddp"]),
]  # fmt: skip


def dry_run(model: Path, flags: list[str], out: Path, traced: bool = False) -> float:
    """Seconds of one dry run of ``model`` with ``flags``, or with ``traced`` the peak MiB of its Python allocations
    (tracemalloc slows it 2-3x: timed apart)."""
    common = ["--tokenizer_path", "bundled:tiny", "--data_root_path", "bundled:data/sft", "--device_type", "cuda"]
    argv = ["sft", "--param_path", str(model), *common, "--device_memory", "h100", "--window_size", "4096"]
    argv += ["--ckpt_dir", str(out), "--dry_run", *flags]
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20 if traced else 0.0
    tracemalloc.stop()
    if "plan for" not in out.getvalue():  # a plan that does not fit exits 2 after it: a verdict, not a failure
        raise SystemExit(f"{' '.join(flags)}: exit {code}, no plan: {err.getvalue()[-500:]}")
    return peak if traced else seconds


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name, config in (("llama", LLAMA_70B), ("deepseek", DEEPSEEK_V3_671B), ("deep_moe", DEEP_MOE)):
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps(config))
        dry_run(root / "llama", [], root / "warm")  # Lightning's import and the parser, once
        print(f"{'plan':52s} {'median s':>9s} {'peak MiB':>9s}")
        for title, config, flags in CASES:
            model = root / {id(LLAMA_70B): "llama", id(DEEPSEEK_V3_671B): "deepseek"}.get(id(config), "deep_moe")
            seconds = statistics.median(dry_run(model, flags, root / "out") for _ in range(repeats))
            peak = dry_run(model, flags, root / "out", traced=True)
            print(f"{title:52s} {seconds:9.2f} {peak:9.1f}", flush=True)


if __name__ == "__main__":
    main_bench()
