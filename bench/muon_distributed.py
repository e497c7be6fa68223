"""Muon's Newton-Schulz work per rank, before and after issue 42 (each matrix orthogonalised once, by its owner).

    .venv/bin/python bench/muon_distributed.py [--ranks 1,2,4] [--time_ranks 1,2] [--steps 5] [--hidden 256]

For 1, 2 and 4 ranks (gloo, CPU, one thread each) and each layout, DDP (plain replicated tensors) and FSDP (every
matrix a ``Shard(0)`` DTensor on a 1-D mesh, FSDP2's layout), ``MuonNS`` steps the weight matrices of an
``AutoRegressiveLM`` (``--hidden``, ``--layers``, SwiGLU ``--intermediate``; no forward pass: the gradients are
fixed, so the optimizer step is all there is). Sides: ``before`` forces the old path (every rank gathers and
orthogonalises every matrix: the bench makes ``matrix_layout`` refuse every matrix), ``after`` is this tree's
(FSDP spread always; DDP with ``spread_replicated=True``, which ``MuonNS`` leaves off by default).

Per rank it counts the matrix FLOPs spent inside ``newton_schulz`` (a counting wrapper installed by this script;
FLOPs from the shapes passed in: ``muon_owners.newton_schulz_flops``), the largest rank's count against one
process's, and the peak bytes of whole matrices a rank holds at once for the iteration (before: the largest one,
gathered one at a time; after, FSDP: the ones it owns in one round, assembled together, ``--round_mib`` capping a
round; DDP holds every matrix whole anyway).
The optimizer step's median wall time (the slowest rank's) is measured only for ``--time_ranks``: 4 ranks on 2
cores oversubscribe, so there the iteration is replaced by a stub that only counts (its numbers are FLOPs only).
Targets (issue 42): per-rank work <= 0.55x of one process's at 2 ranks, <= 0.3x at 4.

    .venv/bin/python bench/muon_distributed.py --stack [--repeats 15]

instead times what an owner does with many small matrices of one shape (MoE experts): ``newton_schulz`` on each
against ``newton_schulz`` on all of them stacked, by turns, medians, for a few expert counts and shapes, and
says how far the stacked result is from the one-by-one one (float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from spawn import run_ranks  # noqa: E402

MODES = ("ddp", "fsdp")
SIDES = ("before", "after")


def model_matrices(hidden: int, layers: int, intermediate: int) -> list[torch.Tensor]:
    """The matrices ``muon_adamw`` gives Muon for this model size (q/k/v/o, gate/up/down per layer)."""
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.optim import is_matrix_param

    heads = max(1, hidden // 64)
    config = ModelConfig(
        vocab_size=256,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=intermediate,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = AutoRegressiveLM(config)
    return [p.detach().clone() for n, p in model.named_parameters() if is_matrix_param(n, p)]


def measure(mode: str, side: str, settings: dict, timed: bool) -> dict:
    """One layout and side on this rank: NS FLOPs, whole-matrix bytes held at once, step times (s)."""
    import torch.distributed as dist

    import astrai_fabric.optim.muon as muon
    from astrai_fabric.optim import MuonNS
    from astrai_fabric.optim.muon_owners import newton_schulz_flops

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    mesh = None
    if distributed and mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    matrices = model_matrices(settings["hidden"], settings["layers"], settings["intermediate"])

    def place(tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(tensor, mesh, [Shard(0)]) if mesh is not None else tensor

    params = [torch.nn.Parameter(place(m)) for m in matrices]
    optimizer = MuonNS(params, lr=1e-3, ns_dtype=torch.float32, spread_replicated=side == "after")
    if settings["round_mib"] is not None:
        optimizer.owner_round_bytes = int(settings["round_mib"] * 2**20)
    flops, plain_ns, plain_layout = [0], muon.newton_schulz, muon.matrix_layout

    def counted(matrix, coefficients, steps, eps, dtype):
        count = len(matrix) if matrix.dim() == 3 else 1  # a stack of matrices, or one
        flops[0] += count * newton_schulz_flops(matrix.shape[-2], matrix.shape[-1], steps)
        return plain_ns(matrix, coefficients, steps, eps, dtype) if timed else matrix.to(dtype)

    muon.newton_schulz = counted
    if side == "before":
        muon.matrix_layout = lambda param, world_size: "forced off by the bench"
    times = []
    try:
        generator = torch.Generator().manual_seed(1)
        for param in params:
            param.grad = place(torch.randn(param.shape, generator=generator))
        for step in range(settings["steps"] + 1):
            flops[0] = 0 if step == 1 else flops[0]
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            if distributed:
                dist.barrier()
            if step >= 1:  # the first builds momentum buffers and the owner table
                times.append(time.perf_counter() - start)
        plan = optimizer.owner_plan()
    finally:
        muon.newton_schulz, muon.matrix_layout = plain_ns, plain_layout
    sizes = [m.numel() * m.element_size() for m in matrices]
    if plan is not None and plan.spreads_any and mode == "fsdp":
        rounds = plan.rounds(range(len(sizes)), optimizer.owner_round_bytes)
        held = max(sum(sizes[m] for m in batch if plan.owners[m] == plan.rank) for batch in rounds)
    elif mode == "fsdp" and distributed:
        held = max(sizes)
    else:
        held = sum(sizes)  # plain tensors: every matrix is whole on this rank already
    return {
        "flops_per_step": flops[0] / settings["steps"],
        "held_bytes": held,
        "step_s": statistics.median(times) if timed else None,
        "describe": optimizer.describe_layout(),
        "matrices": len(matrices),
    }


def worker(world: int, settings: dict, timed: bool, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {f"{mode}/{side}": measure(mode, side, settings, timed) for mode in MODES for side in SIDES}
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


STACK_CASES = [(8, 64, 128), (64, 64, 128), (32, 128, 256), (32, 128, 512), (64, 256, 512), (16, 768, 2048)]
"""(matrices, rows, columns): small ones and MoE experts' sizes (Qwen3-30B-A3B: 128 experts of 768 x 2048)."""


def stack_table(repeats: int) -> None:
    """``newton_schulz`` one by one against stacked (one thread, float32, 5 steps)."""
    from astrai_fabric.optim.muon import newton_schulz

    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    print(
        f"{'matrices':>8} {'shape':>11} {'one by one ms':>14} {'stacked ms':>11} {'speed-up':>9} {'max rel diff':>13}"
    )
    for count, rows, cols in STACK_CASES:
        matrices = torch.randn(count, rows, cols, generator=torch.Generator().manual_seed(count))
        sides = {
            "one": lambda m=matrices: torch.stack([newton_schulz(x, *args) for x in m]),
            "stacked": lambda m=matrices: newton_schulz(m, *args),
        }
        times = {side: [] for side in sides}
        for repeat in range(repeats + 1):
            for side in sides if repeat % 2 else reversed(list(sides)):  # alternate which side goes first
                start = time.perf_counter()
                sides[side]()
                if repeat:  # the first round warms up
                    times[side].append(time.perf_counter() - start)
        one, stacked = (statistics.median(times[side]) * 1e3 for side in sides)
        diff = ((sides["stacked"]() - sides["one"]()).abs().max() / sides["one"]().abs().max()).item()
        print(f"{count:>8} {f'{rows}x{cols}':>11} {one:>14.2f} {stacked:>11.2f} {one / stacked:>8.2f}x {diff:>13.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4", help="world sizes to count FLOPs for")
    parser.add_argument("--time_ranks", default="1,2", help="world sizes also timed (the rest count only)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps measured after one of warm-up")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--round_mib", type=float, help="MuonNS.owner_round_bytes in MiB (default: the library's)")
    parser.add_argument("--stack", action="store_true", help="time stacked Newton-Schulz on many small matrices")
    parser.add_argument("--repeats", type=int, default=15, help="--stack: timed rounds per case")
    args = parser.parse_args()
    if args.stack:
        torch.set_num_threads(1)
        stack_table(args.repeats)
        return
    settings = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, steps=args.steps)
    settings["round_mib"] = args.round_mib
    timed_worlds = {int(w) for w in args.time_ranks.split(",") if w}
    torch.set_num_threads(1)
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        timed = world in timed_worlds
        if world == 1:
            one = {f"{mode}/{side}": measure(mode, side, settings, timed) for mode in MODES for side in SIDES}
            per_rank = [one]
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "out.json")
                run_ranks(worker, world, world, settings, timed, out)
                per_rank = json.loads(Path(out).read_text())
        for key in per_rank[0]:
            values = [rank[key] for rank in per_rank]
            rows.append((world, key, values))
    single = {key: values[0]["flops_per_step"] for world, key, values in rows if world == 1}
    matrices = rows[0][2][0]["matrices"]
    print(f"{matrices} matrices (hidden {args.hidden}, {args.layers} layers, SwiGLU {args.intermediate}), float32")
    print(f"Newton-Schulz: {single.get('fsdp/after', 0) / 1e9:.2f} GFLOP per step in one process\n")
    header = f"{'ranks':>5} {'layout':<12} {'NS GFLOP/rank (max)':>20} {'x one process':>14} {'whole MiB held':>15}"
    print(f"{header} {'step ms':>9}  path")
    for world, key, values in rows:
        largest = max(v["flops_per_step"] for v in values)
        ratio = largest / single[key] if single.get(key) else float("nan")
        held = max(v["held_bytes"] for v in values) / 2**20
        times = [v["step_s"] for v in values if v["step_s"] is not None]
        step_ms = f"{1e3 * max(times):9.1f}" if times else f"{'-':>9}"
        path = values[0]["describe"]
        print(f"{world:>5} {key:<12} {largest / 1e9:>20.3f} {ratio:>14.2f} {held:>15.2f} {step_ms}  {path}")


if __name__ == "__main__":
    main()
