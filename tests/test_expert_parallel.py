"""Mixture-of-experts at scale: the routed experts computed together (one grouped matmul per projection, no host
read), and expert parallelism. The references are the experts run one by one in the same process
(``run_experts(grouped=False)``, the path every MoE test before this file checks against AstrAI and transformers)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from torch.overrides import TorchFunctionMode

from astrai_fabric.lora import LoRASpec, inject
from astrai_fabric.model.ffn import DeepSeekMoE, grouped_experts_fit, run_experts
from astrai_fabric.model.transformer import AutoRegressiveLM

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

    from astrai_fabric.parallelize import parallelize

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
