"""DPO and GRPO losses against hand-computed values on small tensors, and dapo's normaliser gathered over ranks."""

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from spawn import run_ranks

from astrai_fabric.losses import dpo_loss, token_logprobs
from astrai_fabric.policy_losses import group_advantages, grpo_advantages, grpo_loss, rloo_advantages
from astrai_fabric.train.grpo import (
    ADVANTAGES,
    REWARD_STD,
    TOKENS_PER_MICRO_BATCH,
    attach_statistics,
    batch_statistics,
    rollout_sums,
)


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
    return grpo_loss(
        torch.tensor(logp), torch.tensor(old), torch.tensor(ref), torch.tensor(mask), torch.tensor(adv), eps, kl
    )


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


def fake_rollout(seed: int, num_micro_batches: int) -> list[dict[str, torch.Tensor]]:
    """One rank's share of a rollout: micro-batches of one group of 4 responses, whose lengths differ."""
    generator = torch.Generator().manual_seed(seed)
    rolled = []
    for _ in range(num_micro_batches):
        lengths = torch.randint(1, 9, (4,), generator=generator)
        mask = torch.arange(9)[None] <= lengths[:, None]  # position 0 is the prompt's: grpo_batch_loss drops it
        mask[:, 0] = False
        rolled.append({"loss_mask": mask[None], "rewards": torch.rand(1, 4, generator=generator)})
    return rolled


def test_dapo_step_is_one_token_mean_over_every_rank_and_micro_batch():
    """2 data-parallel ranks x 2 micro-batches of unequal lengths: each micro-batch's dapo loss, divided by
    grad_accum_steps (the loop) and averaged over ranks (DDP), has the gradient of one token mean over all 4."""
    ranks = [fake_rollout(seed, 2) for seed in (0, 1)]
    total = rollout_sums(ranks[0]) + rollout_sums(ranks[1])  # what the all-reduce gives every rank
    for rolled in ranks:
        attach_statistics(rolled, total)
    batches = [batch for rolled in ranks for batch in rolled]
    masks = [batch["loss_mask"].flatten(0, 1)[:, 1:] for batch in batches]
    generator = torch.Generator().manual_seed(2)
    logprobs = [-torch.rand(4, 8, generator=generator).requires_grad_() for _ in batches]
    old = [lp.detach() + 0.3 * torch.randn(4, 8, generator=generator) for lp in logprobs]  # the ratio moves
    ref = [lp.detach() - 0.1 for lp in logprobs]

    def loss(i: int, kind: str, normaliser=None):
        advantages = grpo_advantages(batches[i]["rewards"], kind).flatten()
        return grpo_loss(
            logprobs[i], old[i], ref[i], masks[i], advantages, 0.2, 0.05, kind, 0.28, tokens_per_micro_batch=normaliser
        )[0]

    accum, num_ranks = 2, 2
    step = sum(loss(i, "dapo", batches[i][TOKENS_PER_MICRO_BATCH]) / accum for i in range(4)) / num_ranks
    ours = torch.autograd.grad(step, logprobs)
    # The reference: bnpo's token mean, over the 4 micro-batches as one
    everything = grpo_loss(
        torch.cat(logprobs),
        torch.cat(old),
        torch.cat(ref),
        torch.cat(masks),
        torch.cat([grpo_advantages(b["rewards"], "bnpo").flatten() for b in batches]),
        0.2,
        0.05,
        "bnpo",
        0.28,
    )[0]
    expected = torch.autograd.grad(everything, logprobs)
    assert step.item() == pytest.approx(everything.item(), abs=1e-6)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    bnpo = sum(loss(i, "bnpo") / accum for i in range(4)) / num_ranks  # a mean of means: not the same
    assert abs(bnpo.item() - everything.item()) > 1e-3


def statistics_worker(out: str) -> None:
    """One of 2 ddp ranks: its share of a rollout (3 micro-batches, its own lengths and rewards), statistics
    gathered from both (``spawn.run_ranks``)."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rolled = fake_rollout(fabric.global_rank, 3)
    batch_statistics(fabric, rolled)
    values = [[b[TOKENS_PER_MICRO_BATCH].item(), b[REWARD_STD].item()] for b in rolled]
    rloo = [{**batch, ADVANTAGES: rloo_advantages(batch["rewards"])} for batch in fake_rollout(fabric.global_rank, 3)]
    batch_statistics(fabric, rloo)  # RLOO's advantages normalised over both ranks' rollout
    advantages = [batch[ADVANTAGES].flatten().tolist() for batch in rloo]
    (Path(out) / f"{fabric.global_rank}.json").write_text(json.dumps({"values": values, "advantages": advantages}))


def test_rollout_statistics_are_gathered_over_ranks(tmp_path):
    run_ranks(statistics_worker, 2, str(tmp_path))
    ranks = [fake_rollout(rank, 3) for rank in (0, 1)]
    tokens = sum(b["loss_mask"].sum().item() for rolled in ranks for b in rolled)
    rewards = torch.cat([b["rewards"].flatten() for rolled in ranks for b in rolled])
    # TRL's RLOO normalisation over its generation batch, all processes (RLOOTrainer, normalize_advantages)
    everything = torch.cat([rloo_advantages(b["rewards"]).flatten() for rolled in ranks for b in rolled])
    normalised = ((everything - everything.mean()) / (everything.std() + 1e-4)).view(2, 3, 4)  # nanstd: Bessel's
    for rank in (0, 1):
        found = json.loads((tmp_path / f"{rank}.json").read_text())
        for per_micro_batch, std in found["values"]:
            assert per_micro_batch == pytest.approx(tokens / 6, rel=1e-6)  # 2 ranks x 3 micro-batches
            assert std == pytest.approx(rewards.std().item(), rel=1e-6)
        torch.testing.assert_close(torch.tensor(found["advantages"]), normalised[rank], atol=1e-6, rtol=0)
