"""Loss functions against hand-computed values."""

import math

import pytest
import torch

from astrai_fabric.losses import causal_lm_loss, with_moe_aux_loss


def test_mean_cross_entropy_over_all_tokens():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])  # batch 1, 2 tokens, vocab 2
    targets = torch.tensor([[0, 0]])
    first = -math.log(math.exp(2) / (math.exp(2) + 1))
    second = -math.log(1 / (1 + math.e))
    assert causal_lm_loss(logits, targets).item() == pytest.approx((first + second) / 2)


def test_label_smoothing():
    logits = torch.tensor([[[2.0, 0.0]]])
    log_p = torch.log_softmax(logits[0, 0], -1)
    # smoothing 0.2 over 2 classes: target gets 0.9, the other 0.1
    expected = -(0.9 * log_p[0] + 0.1 * log_p[1]).item()
    assert causal_lm_loss(logits, torch.tensor([[0]]), label_smoothing=0.2).item() == pytest.approx(expected)


def test_mask_selects_the_trained_tokens():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, 0.0]]])
    targets = torch.tensor([[0, 0, 1]])
    mask = torch.tensor([[True, False, True]])
    expected = (-torch.log_softmax(logits[0, 0], -1)[0] - torch.log_softmax(logits[0, 2], -1)[1]) / 2
    assert causal_lm_loss(logits, targets, mask).item() == pytest.approx(expected.item())


def test_micro_batch_without_trained_tokens_is_zero_not_nan():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    loss = causal_lm_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0  # AstrAI: NaN (B8)
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_moe_aux_loss_is_added_with_its_coefficient():
    loss, metrics = with_moe_aux_loss(torch.tensor(2.0), torch.tensor(1.5), [], coef=0.01)
    assert loss.item() == pytest.approx(2.015)
    assert {k: round(v.item(), 6) for k, v in metrics.items()} == {
        "task_loss": 2.0,
        "moe_aux_loss": 1.5,
        "moe_aux_loss_weighted": 0.015,
    }
    dense, dense_metrics = with_moe_aux_loss(torch.tensor(2.0), None, None, coef=0.01)
    assert dense.item() == 2.0 and list(dense_metrics) == ["task_loss"]


def test_moe_diagnostics_hand_computed():
    from astrai_fabric.losses import moe_diagnostics, moe_load_metrics

    # 2 tokens, 4 experts, top-1: both go to expert 0 -> counts (2, 0, 0, 0); AstrAI divides by max(mean, 1) = 1
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    entropy = -(probs * probs.clamp_min(1e-8).log()).sum(dim=-1).mean()
    counted = moe_diagnostics([{"expert_tokens": torch.tensor([2.0, 0.0, 0.0, 0.0]), "entropy": entropy}])
    assert counted["expert_tokens"].tolist() == [[2.0, 0.0, 0.0, 0.0]]
    stats = moe_load_metrics(counted)
    assert "expert_tokens" not in stats
    assert stats["router_entropy"].item() == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert stats["dead_expert_fraction"].item() == 0.75
    assert stats["load_imbalance_max"].item() == 2.0
    assert stats["load_imbalance_mean"].item() == pytest.approx((1 + 1 + 1 + 1) / 4)
