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


def moe_config(**overrides):
    values = dict(
        ffn_type="moe", hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
        n_activated_experts=2,
    )  # fmt: skip
    return tiny_config(**values | overrides)


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
    run_experts(layer.routed_experts, torch.randn(12, 32), counts, grouped=True).sum().backward()  # expanded ones
    assert layer.routed_experts[0].up.weight.grad.abs().sum() > 0 and layer.routed_experts[1].up.weight.grad.eq(0).all()


def test_where_the_grouped_kernel_does_not_fit_the_experts_run_one_by_one():
    layer = moe_layer()
    experts = layer.routed_experts
    assert grouped_experts_fit(experts, torch.float32) and not grouped_experts_fit(experts, torch.bfloat16)
    assert grouped_experts_fit(moe_layer().to(torch.bfloat16).routed_experts, torch.bfloat16)
    assert not grouped_experts_fit(moe_layer().double().routed_experts, torch.float64)  # the kernel's dtypes
    odd = moe_layer(moe_intermediate_size=6).routed_experts
    assert not grouped_experts_fit(odd, torch.float32)  # 6 floats: a row stride of 24 bytes, not a multiple of 16
    model = AutoRegressiveLM(moe_config())
    inject(model, LoRASpec(r=2, alpha=4, targets=("up", "gate", "down")), seed=0)
    assert not grouped_experts_fit(model.decoder_blocks[0].mlp.routed_experts, torch.float32)
    counts = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="one grouped matmul"):
        run_experts(odd, torch.randn(2, 32), counts, grouped=True)
    assert run_experts(odd, torch.randn(2, 32), counts).shape == (2, 32)  # None: one by one
