"""Context parallelism on one long window: activation memory and time per rank at cp 1, 2 and 4 (issue 43).

    .venv/bin/python bench/context_parallel.py [--window 8192] [--cps 1,2,4] [--time_cps 1,2] [--steps 3]

A decoder of ``--layers`` blocks (hidden ``--hidden``, 4 query heads, 2 KV heads: repeated to one per query head
at cp 4), one window of ``--window`` tokens, the fused loss (CPU's default), with and without activation
checkpointing. cp 1 is one process without a mesh; cp > 1 is ``parallelize(cp_size=cp)`` over that many gloo ranks
(FSDP over the context group, one thread each). Per rank:

- activation MiB: the bytes of the distinct tensors autograd saves for the backward pass in one forward (counted
  with ``torch.autograd.graph.saved_tensors_hooks``, storages counted once; parameters excluded), the memory that
  grows with the window and that context parallelism divides;
- all-to-all MiB: the bytes one rank sends through attention's all-to-alls in one forward and backward (counted at
  ``model.context_parallel._all_to_all``);
- step ms: the median of ``--steps`` forward+backward passes (the slowest rank's), only for ``--time_cps``: 4 ranks
  on 2 cores oversubscribe.
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


def build(settings: dict):
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=2048,
        hidden_size=settings["hidden"],
        num_hidden_layers=settings["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=settings["hidden"] * 8 // 3,
        max_position_embeddings=settings["window"],
        tie_word_embeddings=True,
    )
    return AutoRegressiveLM(config)


def measure(model: torch.nn.Module, settings: dict, timed: bool) -> dict:
    """Activation bytes saved in one forward, all-to-all bytes of one step, and the step's median time."""
    import astrai_fabric.model.context_parallel as context_parallel

    model.gradient_checkpointing = settings["checkpointing"]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (1, settings["window"]), generator=generator)
    targets = torch.roll(ids, -1, dims=1)
    weights = torch.full(ids.shape, 1.0 / ids.numel())
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if not isinstance(base, torch.nn.Parameter):  # weights (FSDP's gathered ones too) are not activations
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    sent = [0]
    original = context_parallel._all_to_all

    def counted(x, group, scatter_dim, gather_dim):
        size = torch.distributed.get_world_size(group)
        sent[0] += x.numel() * x.element_size() * (size - 1) // size
        return original(x, group, scatter_dim, gather_dim)

    context_parallel._all_to_all = counted
    times, activation_bytes, all_to_all_bytes = [], [], []
    for _ in range(settings["steps"] if timed else 1):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(ids, nll_targets=targets, nll_chunk_size=4096, nll_weights=weights)
        out.nll_loss.backward()
        times.append(time.perf_counter() - start)
        activation_bytes.append(sum(saved.values()))
        all_to_all_bytes.append(sent[0])
        saved.clear()
        sent[0] = 0
    context_parallel._all_to_all = original
    return {
        "activation_mib": activation_bytes[0] / 2**20,
        "all_to_all_mib": all_to_all_bytes[0] / 2**20,
        "step_ms": statistics.median(times) * 1000 if timed else None,
        "loss": out.nll_loss.item(),
    }


def worker(settings: dict, timed: bool, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    result = measure(parallelize(build(settings), mesh, cp_size=cp), settings, timed)
    everyone = [None] * cp
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--time_cps", default="1,2")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cps = [int(c) for c in args.cps.split(",")]
    timed_cps = {int(c) for c in args.time_cps.split(",")}
    print(f"one window of {args.window} tokens, hidden {args.hidden}, {args.layers} layers, float32, one thread/rank")
    columns = ("cp", "checkpointing", "activation MiB/rank", "x cp 1", "all-to-all MiB", "step ms", "loss")
    widths = (3, 13, 20, 7, 15, 9, 9)
    print(" ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for checkpointing in (False, True):
        baseline = None
        for cp in cps:
            settings = dict(vars(args), checkpointing=checkpointing)
            timed = cp in timed_cps
            if cp == 1:
                ranks = [measure(build(settings), settings, timed)]
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    run_ranks(worker, cp, settings, timed, f"{tmp}/out.json")
                    ranks = json.loads(Path(f"{tmp}/out.json").read_text())
            activation = max(r["activation_mib"] for r in ranks)
            baseline = baseline or activation
            step = max(r["step_ms"] for r in ranks) if timed else None
            print(
                f"{cp:>3} {'on' if checkpointing else 'off':>13} {activation:>20.1f} {activation / baseline:>7.2f} "
                f"{max(r['all_to_all_mib'] for r in ranks):>15.1f} {f'{step:.0f}' if step else '-':>9} "
                f"{ranks[0]['loss']:>9.5f}"
            )


if __name__ == "__main__":
    main()
