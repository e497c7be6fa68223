"""Mixture-of-experts at scale (issue 44): the routed experts one by one against together, and expert parallelism.

    .venv/bin/python bench/moe.py [--part layer|ranks|both] [--repeats 7] [--steps 4]

``layer``: one MoE layer's forward+backward on one process and one thread (hidden 256, 2,048 tokens), today's loop
over the experts against one grouped matmul per projection (``model.ffn.run_experts``), the two sides alternated,
medians of ``--repeats``, at 16 experts top-4 and 128 experts top-8.

``ranks``: a 4-layer MoE decoder (16 routed experts, top-4, hidden 256), one window of 1,024 tokens per rank,
under FSDP alone and under ``--ep_size`` 2 and 4 (gloo, one thread a rank). Per rank: the MiB of routed-expert
parameters it holds (its shards: the same count of shards either way), the MiB of them a layer holds whole while
it runs (FSDP gathers every expert of the layer; an expert rank its own), those of everything else, the all-to-all
MiB it sends in one forward and
backward (counted at ``model.expert_parallel._exchange``), and tokens/s over every rank (the median of ``--steps``
steps after one warm-up; only for 2 ranks: 4 ranks on this machine's 2 cores oversubscribe).
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


def moe_config(num_experts: int, top_k: int, hidden: int, width: int, layers: int = 1):
    from astrai_fabric.config import ModelConfig

    return ModelConfig(
        vocab_size=2048,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        ffn_type="moe",
        n_routed_experts=num_experts,
        n_shared_experts=1,
        n_activated_experts=top_k,
        moe_intermediate_size=width,
    )


def layer_part(repeats: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """The layer table; on ``device`` in ``dtype`` (``bench/gpu_check.py --moe`` runs it on a GPU)."""
    from astrai_fabric.model import AutoRegressiveLM

    if device == "cpu":
        torch.set_num_threads(1)
    where = "one thread" if device == "cpu" else torch.cuda.get_device_name()
    print(f"one MoE layer, forward+backward, 2,048 tokens, hidden 256, {str(dtype).removeprefix('torch.')}, {where}")
    print(f"{'experts':>8} {'top-k':>6} {'one by one ms':>14} {'together ms':>12} {'together / one by one':>22}")
    for num_experts, top_k, width in ((16, 4, 256), (128, 8, 128)):
        torch.manual_seed(0)
        model = AutoRegressiveLM(moe_config(num_experts, top_k, 256, width)).to(device, dtype)
        layer = model.decoder_blocks[0].mlp.train()
        tokens = torch.randn(1, 2048, 256, device=device, dtype=dtype)
        times = {False: [], True: []}
        for _ in range(repeats + 1):  # the first round warms up
            for grouped in (False, True):
                layer.grouped = grouped
                start = time.perf_counter()
                out, aux_loss, _ = layer(tokens)
                (out.float().square().mean() + aux_loss).backward()
                if device != "cpu":
                    torch.cuda.synchronize()
                times[grouped].append(time.perf_counter() - start)
        one, together = (statistics.median(times[g][1:]) * 1000 for g in (False, True))
        print(f"{num_experts:>8} {top_k:>6} {one:>14.1f} {together:>12.1f} {together / one:>22.2f}")


def ranks_worker(settings: dict, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import astrai_fabric.model.expert_parallel as expert_parallel
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = AutoRegressiveLM(moe_config(16, 4, 256, 256, layers=4))
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = parallelize(model, mesh, ep_size=settings["ep"])
    sent = [0]
    original = expert_parallel._exchange

    def counted(x, group, receive_splits, send_splits):
        rows_away = sum(send_splits) - send_splits[dist.get_rank(group)]  # rows this rank keeps are not sent
        sent[0] += rows_away * x[0].numel() * x.element_size()
        return original(x, group, receive_splits, send_splits)

    expert_parallel._exchange = counted
    gathered = []  # the routed experts' bytes one MoE layer holds whole while it runs (FSDP's gathered parameters)
    for layer in expert_parallel.moe_layers(model):
        layer.routed_experts.register_forward_pre_hook(
            lambda module, _: gathered.append(sum(p.numel() * p.element_size() for p in module.parameters()))
        )
    ids = torch.randint(0, 2048, (1, 1024), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(settings["steps"] + 1):
        sent[0] = 0
        start = time.perf_counter()
        output = model(ids)
        (output.logits.float().square().mean() + output.aux_loss).backward()
        times.append(time.perf_counter() - start)
    expert_parallel._exchange = original

    def mib(params) -> float:
        return sum(p.to_local().numel() * p.element_size() for p in params) / 2**20

    experts = [p for name, p in model.named_parameters() if ".routed_experts." in name]
    others = [p for name, p in model.named_parameters() if ".routed_experts." not in name]
    result = dict(
        experts_mib=mib(experts),
        others_mib=mib(others),
        gathered_mib=max(gathered) / 2**20,
        all_to_all_mib=sent[0] / 2**20,
        step_s=statistics.median(times[1:]),
    )
    everyone = [None] * world_size
    dist.all_gather_object(everyone, result)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def ranks_part(steps: int) -> None:
    print("4 MoE layers of 16 experts (top-4), hidden 256, 1,024 tokens per rank, float32, one thread per rank")
    columns = (
        "ranks",
        "layout",
        "experts MiB/rank",
        "whole in a layer",
        "other MiB/rank",
        "all-to-all MiB",
        "tokens/s",
    )
    widths = (5, 14, 16, 16, 14, 14, 9)
    print(" ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for world_size, ep in ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4)):
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(ranks_worker, world_size, dict(ep=ep, steps=steps), f"{tmp}/out.json")
            ranks = json.loads(Path(f"{tmp}/out.json").read_text())
        layout = "FSDP" if ep == 1 else f"ep {ep} x FSDP {world_size // ep}"
        timed = world_size == 2
        rate = f"{world_size * 1024 / max(r['step_s'] for r in ranks):.0f}" if timed else "-"
        print(
            f"{world_size:>5} {layout:>14} {max(r['experts_mib'] for r in ranks):>16.2f} "
            f"{max(r['gathered_mib'] for r in ranks):>16.2f} {max(r['others_mib'] for r in ranks):>14.2f} "
            f"{max(r['all_to_all_mib'] for r in ranks):>14.2f} {rate:>9}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("layer", "ranks", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.part in ("layer", "both"):
        layer_part(args.repeats)
    if args.part in ("ranks", "both"):
        ranks_part(args.steps)


if __name__ == "__main__":
    main()
