"""Bytes each rank holds in parameters, gradients and optimizer state: DDP against FSDP, 2 CPU ranks.

    .venv/bin/python bench/memory.py

Model: ~48M parameters (hidden 512, 16 layers, 8/4 heads, SwiGLU 1408, vocabulary 2048), float32, muon_adamw,
one optimizer step without accumulation. Counted are the tensors a rank holds after the step's backward (local
shards for FSDP's DTensors; not process RSS, which carries the libraries). Target: fsdp <= 0.6 x ddp.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from spawn import run_ranks  # noqa: E402

CONFIG = dict(
    vocab_size=2048, hidden_size=512, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1408, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip


def local_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def worker(mode: str, out: str) -> None:
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.optim import OptimArgs, build_optimizer
    from astrai_fabric.train import build_run_fabric

    args = TrainArgs(param_path="-", data_root_path="-", parallel_mode=mode, nprocs=2, device_type="cpu")
    fabric = build_run_fabric(args)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(AutoRegressiveLM(ModelConfig(**CONFIG)))
    optimizer = build_optimizer(model, OptimArgs("muon_adamw", 1e-4, 0.1, ns_dtype=torch.float32))
    optimizer = fabric.setup_optimizers(optimizer)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64))
    fabric.backward(model(ids)["logits"].float().logsumexp(-1).mean())
    optimizer.step()  # creates the optimizer state; gradients are still held
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(
        local_bytes(v)
        for part in (optimizer.muon, optimizer.adamw)
        for s in part.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    row = {"rank": fabric.global_rank, "params": params, "grads": grads, "optimizer": states}
    Path(out, f"{mode}_{fabric.global_rank}.json").write_text(json.dumps(row))
    num = sum(p.numel() for p in model.parameters())
    Path(out, "num_parameters").write_text(str(num))


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        for mode in ("ddp", "fsdp"):
            run_ranks(worker, 2, mode, out)
        rows = {
            mode: [json.loads(Path(out, f"{mode}_{r}.json").read_text()) for r in (0, 1)] for mode in ("ddp", "fsdp")
        }
        num = int(Path(out, "num_parameters").read_text())
    mib = 2**20
    print(f"\nmodel: {num / 1e6:.1f}M parameters, float32, muon_adamw, 2 CPU ranks\n")
    print(f"{'mode':<5} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optimizer MiB':>14} {'total MiB':>10}")
    totals = {}
    for mode, ranks in rows.items():
        for row in ranks:
            total = row["params"] + row["grads"] + row["optimizer"]
            totals[mode] = max(totals.get(mode, 0), total)
            print(
                f"{mode:<5} {row['rank']:>4} {row['params'] / mib:>11.1f} {row['grads'] / mib:>10.1f} "
                f"{row['optimizer'] / mib:>14.1f} {total / mib:>10.1f}"
            )
    ratio = totals["fsdp"] / totals["ddp"]
    print(f"\nfsdp / ddp (largest rank): {ratio:.2f} (target <= 0.6: {'ok' if ratio <= 0.6 else 'MISSED'})")


if __name__ == "__main__":
    main()
