"""muon_adamw and adamw: AstrAI's parameter split, optimizer.pt layout, and the Newton-Schulz dtype."""

import copy

import pytest
import torch
from conftest import tiny_config

from astrai_fabric.errors import CheckpointError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import MuonNS, build_optimizer, is_matrix_param, newton_schulz, resolve_ns_dtype


def test_split_matches_astrai_counts():
    model = AutoRegressiveLM(tiny_config(tie_word_embeddings=False))
    optimizer = build_optimizer(model, "muon_adamw", lr=1e-3, weight_decay=0.1)
    # AstrAI reports 14 Muon and 7 AdamW tensors for a 2-layer untied model (its ``astrai/optim/muon_adamw.py`` split).
    assert len(optimizer.muon.param_groups[0]["params"]) == 14
    assert len(optimizer.adamw.param_groups[0]["params"]) == 7
    assert optimizer.adamw.param_groups[0]["weight_decay"] == 0.0
    assert optimizer.adamw.param_groups[0]["betas"] == (0.9, 0.95)
    assert not is_matrix_param("module._orig_mod.embed_tokens.weight", torch.zeros(2, 2))


def step(model, optimizer):
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    model(ids)["logits"].float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_optimizer_state_layout_is_astrai():
    model = AutoRegressiveLM(tiny_config())
    optimizer = build_optimizer(model, "muon_adamw", lr=1e-3, weight_decay=0.1)
    step(model, optimizer)
    state = optimizer.state_dict()
    assert list(state) == ["muon", "adamw"]
    assert set(state["muon"]["state"][0]) == {"momentum_buffer"}
    assert set(state["adamw"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert "ns_dtype" not in state["muon"]["param_groups"][0]  # torch's group keys only
    other = build_optimizer(copy.deepcopy(model), "muon_adamw", lr=1e-3, weight_decay=0.1)
    other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="another optimizer"):
        other.load_state_dict({"nora": None, "nadamw": None})


def test_bfloat16_is_exactly_torch_muon():
    torch.manual_seed(0)
    ours = AutoRegressiveLM(tiny_config())
    theirs = copy.deepcopy(ours)
    optimizer = build_optimizer(ours, "muon_adamw", lr=1e-2, weight_decay=0.1, ns_dtype=torch.bfloat16)
    matrices = [p for n, p in theirs.named_parameters() if is_matrix_param(n, p)]
    reference = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    step(ours, optimizer)
    step(theirs, reference)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if is_matrix_param(name, a):
            assert torch.equal(a, b), name


def test_float32_iteration_is_closer_to_exact_arithmetic():
    grad = torch.randn(48, 24, generator=torch.Generator().manual_seed(0))
    coefficients = (3.4445, -4.7750, 2.0315)
    exact = newton_schulz(grad.double(), coefficients, 5, 1e-7, torch.float64)
    error32 = (newton_schulz(grad, coefficients, 5, 1e-7, torch.float32).double() - exact).abs().max()
    error16 = (newton_schulz(grad, coefficients, 5, 1e-7, torch.bfloat16).double() - exact).abs().max()
    assert error32 < 1e-5 < error16


def test_our_dtype_never_changes_torch_muon_elsewhere():
    param = torch.nn.Parameter(torch.randn(8, 4))
    ours = MuonNS([param], lr=0.1, ns_dtype=torch.float32)
    param.grad = torch.randn(8, 4)
    ours.step()
    # A plain torch Muon in the same process still runs torch's bf16 iteration.
    a, b = torch.nn.Parameter(torch.ones(8, 4)), torch.nn.Parameter(torch.ones(8, 4))
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    a.grad, b.grad = grad.clone(), grad.clone()
    torch.optim.Muon([a], lr=0.1).step()
    MuonNS([b], lr=0.1, ns_dtype=torch.bfloat16).step()
    assert torch.equal(a, b)


def test_auto_dtype_depends_on_the_device():
    assert resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_ns_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_ns_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_adamw_decays_matrices_only():
    optimizer = build_optimizer(AutoRegressiveLM(tiny_config()), "adamw", lr=1e-3, weight_decay=0.1)
    decay, no_decay = optimizer.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) == 14 and len(no_decay["params"]) == 6  # tied: one embedding, 5 norms
