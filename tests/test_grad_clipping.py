"""Gradient clipping inside the real ``loop.step.train_step`` on 2 gloo ranks: DDP, FSDP2 (DTensor gradients on the
data mesh) and tensor parallelism 2 (gradients on two meshes), against ``torch.nn.utils.clip_grad_norm_``.

One spawn of 2 ranks runs the three strategies in sequence. Per strategy: the same seeded tiny model and one
micro-batch per rank (tensor-parallel ranks share one, data-parallel size = world / tp); a first backward, not
stepped, gives the unclipped gradients, gathered whole (``DTensor.full_tensor``); then ``train_step`` runs on the same
batch with an SGD whose ``step`` records the gradients it is handed, gathered the same way. Reference: torch's
``clip_grad_norm_`` applied, in this process, to the whole unclipped gradients with the same ``max_grad_norm``
(the coefficient is 0.04-0.06: clipping is active, asserted). Tolerance: float32, ``atol=1e-7`` on gradient entries of
~1e-3 after clipping and ``rel=1e-5`` on the norm (the per-mesh and per-shard reductions sum in another order).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from spawn import run_ranks
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow

MODES = {
    "ddp": dict(parallel_mode="ddp"),
    "fsdp": dict(parallel_mode="fsdp"),
    "tp": dict(parallel_mode="fsdp", tp_size=2),
}
MAX_GRAD_NORM = 0.05


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain full copy of a (possibly sharded) tensor; collective for a DTensor."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps, whole, the gradients each ``step`` is given (after ``train_step`` clipped them)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[dict[str, torch.Tensor]] = []
        self.names: dict[int, str] = {}

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        params = [p for group in self.param_groups for p in group["params"]]
        self.seen.append({self.names[id(p)]: whole(p.grad) for p in params if p.grad is not None})
        return super().step(closure)


def clip_one_step(root: Path, mode: str) -> None:
    from astrai_fabric.checkpoint.position import RunPosition
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.loop.state import TrainState
    from astrai_fabric.loop.step import StepTools, train_step
    from astrai_fabric.losses import causal_lm_loss
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.strategy import data_parallel, is_fsdp
    from astrai_fabric.train import build_run_fabric
    from astrai_fabric.train.common import loop_args as loop_args_of

    args = TrainArgs(
        param_path="bundled:tiny",
        ckpt_dir=str(root / mode),
        nprocs=2,
        batch_per_device=2,
        grad_accum_steps=1,
        max_grad_norm=MAX_GRAD_NORM,
        device_type="cpu",
        **MODES[mode],
    )
    fabric = build_run_fabric(args)
    fabric.launch()
    torch.manual_seed(0)  # the same model on every rank
    model = fabric.setup_module(AutoRegressiveLM(tiny_config(max_position_embeddings=16)))
    optimizer = RecordingSGD(model.parameters(), lr=1.0)
    optimizer.names = {id(p): n for n, p in model.named_parameters()}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    optimizer = fabric.setup_optimizers(optimizer)
    dp = data_parallel(fabric)
    assert dp.num_dp_ranks == (1 if mode == "tp" else 2)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(100 + dp.dp_rank))

    def compute_loss(model, batch):
        ids = batch["input_ids"]
        return causal_lm_loss(model(ids[:, :-1])["logits"], ids[:, 1:]), {}

    # The unclipped gradients of the same batch at the same weights: one backward, then cleared.
    fabric.backward(compute_loss(model, {"input_ids": ids})[0])
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    assert len(meshes) == {"ddp": 1, "fsdp": 1, "tp": 2}[mode] and (None in meshes) == (mode == "ddp")
    unclipped = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    optimizer.zero_grad(set_to_none=True)

    loop_args = loop_args_of(args, num_epochs=args.n_epoch, dp_rank=dp.dp_rank, fsdp=is_fsdp(fabric))
    state = TrainState(model, optimizer, scheduler, RunPosition(world_size=dp.num_dp_ranks))
    tools = StepTools.for_run(fabric, model, loop_args, dp.num_dp_ranks)
    result = train_step(
        fabric,
        state=state,
        micro_batches=iter([{"input_ids": ids}]),
        compute_loss=compute_loss,
        args=loop_args,
        tools=tools,
    )
    assert result is not None and result.stepped
    (clipped,) = optimizer.seen
    if os.environ["RANK"] == "0":
        torch.save({"unclipped": unclipped, "clipped": clipped, "grad_norm": result.grad_norm}, root / f"{mode}.pt")


def two_rank_worker(root: str) -> None:
    for mode in MODES:
        clip_one_step(Path(root), mode)


@pytest.fixture(scope="module")
def clipped_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clip")
    run_ranks(two_rank_worker, 2, str(root))
    return root


@pytest.mark.parametrize("mode", list(MODES))
def test_train_step_clips_like_torch_clip_grad_norm(clipped_runs, mode):
    saved = torch.load(clipped_runs / f"{mode}.pt", weights_only=True)
    unclipped, clipped = saved["unclipped"], saved["clipped"]
    assert unclipped.keys() == clipped.keys() and len(unclipped) > 10
    holders = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in unclipped.items()}
    for name, holder in holders.items():
        holder.grad = unclipped[name].clone()
    norm = float(torch.nn.utils.clip_grad_norm_(list(holders.values()), MAX_GRAD_NORM))  # clips each .grad
    assert MAX_GRAD_NORM / norm < 0.3  # clipping is active, and strongly
    assert saved["grad_norm"] == pytest.approx(norm, rel=1e-5)  # the logged norm is the pre-clip one
    for name, grad in clipped.items():
        torch.testing.assert_close(grad, holders[name].grad, atol=1e-7, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
