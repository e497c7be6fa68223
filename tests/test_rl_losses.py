"""DPO and GRPO losses against hand-computed values on small tensors."""

import math

import pytest
import torch

from astrai_fabric.losses import dpo_loss, group_advantages, grpo_loss, token_logprobs


def test_dpo_with_policy_equal_to_reference_is_log_2():
    logps = torch.tensor([-5.0, -7.5])
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    assert metrics["reward_margin"].item() == 0 and metrics["reward_accuracy"].item() == 0


def test_dpo_hand_computed():
    # pair 0: policy prefers chosen by 2 nats more than the reference does; pair 1: by -1
    policy_c, policy_r = torch.tensor([-4.0, -6.0]), torch.tensor([-8.0, -5.0])
    ref_c, ref_r = torch.tensor([-5.0, -6.0]), torch.tensor([-7.0, -6.0])
    loss, metrics = dpo_loss(policy_c, policy_r, ref_c, ref_r, beta=0.5)
    margins = [0.5 * ((-4 + 8) - (-5 + 7)), 0.5 * ((-6 + 5) - (-6 + 6))]  # 1.0, -0.5
    expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / 2
    assert loss.item() == pytest.approx(expected)
    assert metrics["reward_accuracy"].item() == 0.5
    assert metrics["chosen_reward"].item() == pytest.approx((0.5 * 1 + 0.5 * 0) / 2)
    assert metrics["rejected_reward"].item() == pytest.approx((0.5 * -1 + 0.5 * 1) / 2)


def test_group_advantages():
    adv = group_advantages(torch.tensor([[1.0, 3.0], [2.0, 2.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]), atol=1e-6, rtol=0)  # equal rewards: 0


def grpo(logp, old, ref, mask, adv, eps=0.2, kl=0.0):
    return grpo_loss(torch.tensor(logp), torch.tensor(old), torch.tensor(ref), torch.tensor(mask),
                     torch.tensor(adv), eps, kl)  # fmt: skip


def test_grpo_clipping_on_both_sides():
    # token ratios e^0.5 = 1.65 (above 1 + eps) and e^-0.5 = 0.61 (below 1 - eps)
    logp, old = [[0.5, -0.5]], [[0.0, 0.0]]
    up, down = math.exp(0.5), math.exp(-0.5)
    positive, _ = grpo(logp, old, logp, [[1, 1]], [2.0])  # A > 0: min(r A, clip(r) A) caps the large ratio at 1.2
    assert positive.item() == pytest.approx(-(1.2 * 2 + down * 2) / 2)
    negative, metrics = grpo(logp, old, logp, [[1, 1]], [-2.0])  # A < 0: the small ratio is floored at 0.8
    assert negative.item() == pytest.approx(-(up * -2 + 0.8 * -2) / 2)
    assert metrics["clip_fraction"].item() == 1.0


def test_grpo_kl_is_astrai_estimator_and_masks_count():
    logp, ref = [[-1.0, -2.0, -3.0]], [[-1.5, -2.0, 0.0]]
    loss, metrics = grpo(logp, logp, ref, [[1, 1, 0]], [0.0], kl=0.1)  # A = 0: only the KL term
    r = math.exp(-0.5)
    expected = 0.1 * ((r - math.log(r + 1e-8) - 1) + 0.0) / 2  # the masked third token does not count
    assert metrics["policy_loss"].item() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_grpo_all_masked_rows_give_zero():
    loss, _ = grpo([[0.3, 0.1]], [[0.0, 0.0]], [[1.0, 1.0]], [[0, 0]], [1.0], kl=0.1)
    assert loss.item() == 0.0


def test_token_logprobs():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
