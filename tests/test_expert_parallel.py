"""Mixture-of-experts at scale: the routed experts computed together (one grouped matmul per projection, no host
read), and expert parallelism. The references are the experts run one by one in the same process
(``run_experts(grouped=False)``, the path every MoE test before this file checks against AstrAI and transformers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from torch.overrides import TorchFunctionMode

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import ConfigError
from astrai_fabric.lora import LoRASpec, inject
from astrai_fabric.model.ffn import DeepSeekMoE, grouped_experts_fit, run_experts
from astrai_fabric.model.transformer import AutoRegressiveLM
from astrai_fabric.parallel.expert import check_expert_parallel
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout

HOST_READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "nonzero"}
"""Tensor functions whose result the host must wait for."""


MOE = dict(ffn_type="moe", hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
           n_activated_experts=2)  # fmt: skip
"""A tiny MoE: 8 experts, top-2, widths the grouped kernel takes (rows of 16 and 32 floats)."""


def moe_config(**overrides):
    return tiny_config(**MOE | overrides)


def moe_layer(**overrides) -> DeepSeekMoE:
    torch.manual_seed(0)
    return AutoRegressiveLM(moe_config(**overrides)).decoder_blocks[0].mlp


def forward_backward(layer: DeepSeekMoE, tokens: torch.Tensor, grouped: bool | None) -> tuple[torch.Tensor, ...]:
    layer.grouped = grouped
    layer.zero_grad()
    inputs = tokens.clone().requires_grad_()
    out, aux_loss, _ = layer(inputs)
    (out.square().sum() + aux_loss).backward()
    return out.detach(), inputs.grad, *[p.grad.clone() for p in layer.parameters()]


ROUTINGS = {
    "softmax": {},
    "sigmoid-groups-bias": dict(scoring_func="sigmoid", score_correction_bias=True, n_group=4, topk_group=2,
                                routed_scaling_factor=2.5),
}  # fmt: skip


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_experts_computed_together_equal_one_by_one(routing):
    layer = moe_layer(**ROUTINGS[routing]).train()
    tokens = torch.randn(3, 7, 32)
    together, one_by_one = forward_backward(layer, tokens, True), forward_backward(layer, tokens, False)
    for a, b in zip(together, one_by_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_experts_computed_together_read_nothing_back_to_the_host():
    class HostReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen += [func.__name__] if getattr(func, "__name__", "") in HOST_READS else []
            return func(*args, **(kwargs or {}))

    layer, tokens = moe_layer().train(), torch.randn(2, 5, 32)
    for grouped, expected in ((True, []), (False, ["tolist"])):
        layer.grouped = grouped
        with HostReads() as reads:
            layer(tokens)
        assert reads.seen == expected, grouped


def test_an_expanded_gradient_reaches_the_grouped_kernel_made_contiguous():
    layer = moe_layer()
    layer.grouped = True
    counts = torch.tensor([3, 0, 2, 1, 0, 0, 4, 2])
    layer.routed_experts(torch.randn(12, 32), counts, grouped=True).sum().backward()  # expanded ones
    assert (
        layer.routed_experts["0"].up.weight.grad.abs().sum() > 0
        and layer.routed_experts["1"].up.weight.grad.eq(0).all()
    )


def test_where_the_grouped_kernel_does_not_fit_the_experts_run_one_by_one():
    layer = moe_layer()
    experts = list(layer.routed_experts.values())
    assert grouped_experts_fit(experts, torch.float32) and not grouped_experts_fit(experts, torch.bfloat16)
    assert grouped_experts_fit(list(moe_layer().to(torch.bfloat16).routed_experts.values()), torch.bfloat16)
    assert not grouped_experts_fit(
        list(moe_layer().double().routed_experts.values()), torch.float64
    )  # the kernel's dtypes
    odd = list(moe_layer(moe_intermediate_size=6).routed_experts.values())
    assert not grouped_experts_fit(odd, torch.float32)  # 6 floats: a row stride of 24 bytes, not a multiple of 16
    model = AutoRegressiveLM(moe_config())
    inject(model, LoRASpec(r=2, alpha=4, targets=("up", "gate", "down")), seed=0)
    assert not grouped_experts_fit(list(model.decoder_blocks[0].mlp.routed_experts.values()), torch.float32)
    counts = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="one grouped matmul"):
        run_experts(odd, torch.randn(2, 32), counts, grouped=True)
    assert run_experts(odd, torch.randn(2, 32), counts).shape == (2, 32)  # None: one by one


def test_the_logged_expert_load_is_the_whole_windows():
    """The load metrics come from the experts' token counts summed over a step's micro-batches (and, by the same
    all-reduce, its ranks): the model's load over the step, not an average of each micro-batch's (AstrAI logs one
    micro-batch's). Here each micro-batch of 3 tokens (top-2 of 8 experts) leaves most experts idle, the window less."""
    from lightning.fabric import Fabric

    from astrai_fabric.checkpoint.position import RunPosition
    from astrai_fabric.loop.state import TrainState
    from astrai_fabric.loop.step import StepTools, train_step
    from astrai_fabric.losses import moe_load_metrics
    from astrai_fabric.train.common import loop_args
    from astrai_fabric.train.lm import lm_loss

    torch.manual_seed(0)
    model = AutoRegressiveLM(moe_config()).train()
    ids = torch.randint(0, 32, (2, 1, 4), generator=torch.Generator().manual_seed(3))
    batches = [{"input_ids": i[:, :-1], "target_ids": i[:, 1:]} for i in ids]
    counts = [lm_loss(model, batch, 0.0, 0.01)[1]["expert_tokens"] for batch in batches]  # at the step's weights
    window = moe_load_metrics({"expert_tokens": sum(counts) / 2})
    each = [moe_load_metrics({"expert_tokens": c}) for c in counts]
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    train_args = TrainArgs(param_path="bundled:tiny", ckpt_dir=".", batch_per_device=1, grad_accum_steps=2)
    args = loop_args(train_args, num_epochs=train_args.n_epoch, dp_rank=0, fsdp=False)
    result = train_step(
        fabric,
        state=TrainState(model, optimizer, scheduler, RunPosition(world_size=1)),
        micro_batches=iter(batches),
        compute_loss=lambda m, b: lm_loss(m, b, 0.0, 0.01),
        args=args,
        tools=StepTools.for_run(fabric, model, args, num_dp_ranks=1),
    )
    assert "expert_tokens" not in result.metrics
    for name in ("dead_expert_fraction", "load_imbalance_mean", "load_imbalance_max"):
        assert result.metrics[name] == pytest.approx(window[name].item(), abs=1e-6), name
    averaged = (each[0]["dead_expert_fraction"] + each[1]["dead_expert_fraction"]).item() / 2
    assert result.metrics["dead_expert_fraction"] < averaged  # what averaging each micro-batch's would log


# --- expert parallelism: the model on 2 ranks against one process -------------------------------------------------

FAMILIES = {
    "mixtral": dict(n_shared_experts=0),
    "qwen2_moe": dict(shared_expert_gate=True, norm_topk_prob=False),
    "qwen3_moe": dict(n_shared_experts=0, num_hidden_layers=3, mlp_only_layers=[1]),
    "deepseek_v3": dict(ROUTINGS["sigmoid-groups-bias"], n_shared_experts=2),
}
"""Tiny stand-ins for each MoE family's routing (``checkpoint/hf/families``): 8 experts, top-2."""


def family_model(name: str) -> AutoRegressiveLM:
    torch.manual_seed(5)
    return AutoRegressiveLM(moe_config(**FAMILIES[name])).train()


def halves() -> list[torch.Tensor]:
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(2))
    return [ids[:2], ids[2:]]


def half_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A loss that reaches every parameter: the logits' mean square, plus the balance loss (each rank's own)."""
    out = model(ids)
    return out.logits.float().square().mean() + 0.1 * out.aux_loss


def whole_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, made whole over FSDP's shards (each rank's own experts only)."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


def expert_parallel_worker(out: str) -> None:
    """Each family under ``parallelize(ep_size=2)`` on 2 ranks, each rank one half of the batch; rank 0 saves the
    losses and the gradients, each expert's from the rank that holds it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {}
    for name in [*FAMILIES, "grouped"]:
        model = parallelize(family_model("mixtral" if name == "grouped" else name), mesh, ep_size=2)
        for layer in model.modules():
            if hasattr(layer, "routed_experts"):
                assert sorted(layer.routed_experts) == [
                    str(j) for j in range(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
                ]
                layer.grouped = name == "grouped"
        loss = half_loss(model, halves()[dist.get_rank()])
        loss.backward()
        losses, grads = [None, None], [None, None]
        dist.all_gather_object(losses, loss.item())
        dist.all_gather_object(grads, whole_gradients(model))
        results[name] = {"losses": losses, "grads": grads[0] | grads[1]}
    with pytest.raises(ConfigError, match="where each expert is on one rank: torch .* would divide its gradient twice"):
        parallelize(family_model("mixtral"), mesh, ep_size=2, reduce_dtype="float16")
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def test_two_expert_ranks_equal_one_process(tmp_path):
    from spawn import run_ranks

    run_ranks(expert_parallel_worker, 2, str(tmp_path / "ep.pt"))
    results = torch.load(tmp_path / "ep.pt", weights_only=False)
    for name, ours in results.items():
        model = family_model("mixtral" if name == "grouped" else name)
        losses = [half_loss(model, ids) for ids in halves()]
        (sum(losses) / 2).backward()  # FSDP's average over the two ranks
        torch.testing.assert_close(ours["losses"], [loss.item() for loss in losses], rtol=1e-6, atol=0, msg=name)
        reference = whole_gradients(model)
        assert sorted(ours["grads"]) == sorted(reference), name
        for param, grad in reference.items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                ours["grads"][param], grad, rtol=0, atol=1e-5 * scale + 1e-8, msg=f"{name} {param}"
            )


FOUR_RANK_LAYOUTS = {
    "ep4": dict(ep_size=4),
    "ep2_fsdp2": dict(ep_size=2),
    "hsdp2_ep2": dict(ep_size=2, fsdp_shard_size=2),
}
"""On 4 ranks: one expert rank per data rank (each expert on one rank, its gradient divided where the reduction is
skipped), expert groups of 2 with each expert sharded over 2 ranks, and HSDP's 2 replicas of 2 shards, each an
expert group (the experts replicated over the replicas)."""


def quarters() -> list[torch.Tensor]:
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(2))
    return list(ids.split(1))


def four_rank_expert_worker(out: str) -> None:
    """Run inside tests/test_training_distributed.py's 4-rank spawn (its process group): Mixtral's routing under
    each of ``FOUR_RANK_LAYOUTS``, each rank a quarter of the batch; rank 0 saves as ``expert_parallel_worker``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {}
    for name, layout in FOUR_RANK_LAYOUTS.items():
        model = parallelize(family_model("mixtral"), mesh, **layout)
        half_loss(model, quarters()[dist.get_rank()]).backward()
        grads = [None] * 4
        dist.all_gather_object(grads, whole_gradients(model))
        results[name] = {key: value for part in grads for key, value in part.items()}
    if dist.get_rank() == 0:
        torch.save(results, out)


def check_four_ranks_against_one_process(out: str) -> None:
    model = family_model("mixtral")
    (sum(half_loss(model, ids) for ids in quarters()) / 4).backward()
    reference = whole_gradients(model)
    for name, grads in torch.load(out, weights_only=False).items():
        assert sorted(grads) == sorted(reference), name
        for param, grad in reference.items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(grads[param], grad, rtol=0, atol=1e-5 * scale + 1e-8, msg=f"{name} {param}")


# --- layouts, flags and the command line ----------------------------------------------------------------------------


def test_expert_ranks_are_carved_from_the_data_shards():
    layout = mesh_layout(8, fsdp_shard_size=4, ep_size=2)
    assert layout == MeshLayout(replicas=2, shards=4, ep=2) and layout.num_expert_shards == 2
    assert layout.describe() == "2 replica(s) x 4 shard(s); experts over 2 expert-parallel x 2 FSDP shard(s)"
    assert (layout.num_dp_ranks, layout.world_size) == (8, 8)  # expert ranks read different samples


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(world_size=8, fsdp_shard_size=2, ep_size=4), "ep_size 4 must divide the FSDP shards (2: fsdp_shard_size"),
        (
            dict(world_size=4, tp_size=2, ep_size=2),
            "ep_size 2 with tp_size 2: expert parallelism takes its ranks from the data shards alone",
        ),
        (dict(world_size=4, cp_size=2, ep_size=2), "ep_size 2 with cp_size 2"),
    ],
)
def test_expert_layouts_that_do_not_fit_are_named(sizes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        mesh_layout(**sizes)


def test_models_expert_parallelism_cannot_deal_out_are_refused_in_one_line():
    check_expert_parallel(moe_config(), 4)
    with pytest.raises(ConfigError, match="ep_size 2 deals out MoE experts, but the model is dense"):
        check_expert_parallel(tiny_config(), 2)
    with pytest.raises(ConfigError, match="but every layer is in mlp_only_layers"):
        check_expert_parallel(moe_config(mlp_only_layers=[0, 1]), 2)
    with pytest.raises(ConfigError, match=re.escape("ep_size 3 must divide n_routed_experts (8)")):
        check_expert_parallel(moe_config(), 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(parallel_mode="ddp"), "ep_size 2 needs parallel_mode fsdp"),
        (dict(ep_size=0), "ep_size must be"),
    ],
)
def test_flags_expert_parallelism_cannot_take_are_refused(flags, message):
    values = dict(train_type="seq", parallel_mode="fsdp", ep_size=2) | flags
    with pytest.raises(ConfigError, match=message):
        TrainArgs(**values).validate()


def moe_directory(root: Path, **fields) -> str:
    """The bundled tiny model's config made MoE (8 experts, top-2; no weights: AstrAI's init), for the CLI."""
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    values = dict(ffn_type="moe", n_routed_experts=8, n_shared_experts=1, n_activated_experts=2)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config | values | fields))
    return str(root)


def test_the_dry_run_prints_how_the_experts_are_dealt_out(tmp_path, capsys):
    from astrai_fabric.cli import main

    argv = ["seq", "--param_path", moe_directory(tmp_path / "moe"), "--tokenizer_path", "bundled:tiny"]
    argv += ["--data_root_path", "bundled:data/seq", "--window_size", "32", "--ckpt_dir", str(tmp_path / "out")]
    flags = ["--nprocs", "8", "--parallel_mode", "fsdp", "--ep_size", "4", "--fsdp_shard_size", "4"]
    assert main([*argv, *flags, "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "(2 replica(s) x 4 shard(s); experts over 4 expert-parallel x 1 FSDP shard(s))" in out
    assert "experts      expert parallel over 4 ranks: each holds 2 of the 8 routed experts" in out
    assert "8 rank(s) x 1 per device" in out
    for more, message in (
        (["--nprocs", "8", "--ep_size", "3"], "ep_size 3 must divide the FSDP shards (8"),
        (["--nprocs", "2", "--ep_size", "2", "--param_path", "bundled:tiny"], "but the model is dense"),
    ):
        assert main([*argv, "--parallel_mode", "fsdp", *more, "--dry_run"]) == 2
        assert message in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
