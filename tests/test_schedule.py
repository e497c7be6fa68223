"""Total steps and learning-rate schedules against hand-computed tables (``astrai/trainer/schedule.py``)."""

import math

import pytest
import torch

from astrai_fabric.errors import ConfigError
from astrai_fabric.schedule import StepPlan, build_scheduler, cosine_factor, sgdr_factor, wsd_factor


@pytest.mark.parametrize(
    "num_samples, world, batch, accum, epochs, ratio, total, warmup",
    [
        (10, 1, 3, 1, 2, 0.05, 8, 0),  # ceil(10/3)=4 micro-batches -> 4 steps per epoch
        (10, 2, 3, 2, 1, 0.5, 1, 0),  # 5 per rank -> 2 micro-batches -> 1 step; int(0.5)=0
        (1000, 4, 8, 4, 3, 0.1, 24, 2),  # 250 per rank -> 32 micro-batches -> 8 steps x 3 epochs
        (7, 4, 1, 1, 1, 1.0, 2, 2),  # ceil(7/4)=2 (the sampler pads the last round)
    ],
)
def test_total_and_warmup_steps(num_samples, world, batch, accum, epochs, ratio, total, warmup):
    plan = StepPlan(num_samples, world, batch, accum, epochs, ratio)
    assert (plan.total_steps, plan.warmup_steps) == (total, warmup)


def test_plans_that_cannot_step_are_errors():
    with pytest.raises(ConfigError, match="training set is empty"):
        StepPlan(0, 1, 1, 1, 1, 0.0).check()
    with pytest.raises(ConfigError, match=r"fewer than grad_accum_steps=8"):
        StepPlan(10, 2, 1, 8, 1, 0.0).check()  # 5 micro-batches per rank, 8 needed for one step


def test_cosine_table():
    # warmup 2, decay 4, min_rate 0.1; step k of training runs at factor(k - 1)
    expected = [0.1, 0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1, 0.1]
    assert [cosine_factor(t, 2, 4, 0.1) for t in range(8)] == pytest.approx(expected)


def test_first_step_runs_at_min_rate_not_zero():
    assert cosine_factor(0, 10, 100, 0.01) == 0.01  # AstrAI's max(min_rate, t / W)


def test_sgdr_table():
    # warmup 1, first cycle 2, t_mult 2, min_rate 0: cycles cover t = 1-2, 3-6, 7-14
    expected = [0.0, 1.0, 0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 1.0]
    assert [sgdr_factor(t, 1, 2, 0.0, 2) for t in range(8)] == pytest.approx(expected)


def test_wsd_table_is_quadratic_decay():
    # warmup 1, stable 2, decay 2, min_rate 0.1
    expected = [0.1, 1.0, 1.0, 1.0, 0.9 * 0.25 + 0.1, 0.1, 0.1]
    assert [wsd_factor(t, 1, 2, 2, 0.1) for t in range(7)] == pytest.approx(expected)


def optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def rates(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_scheduler_runs_the_factor_per_optimizer_step():
    scheduler = build_scheduler(optimizer(2.0), "cosine", total_steps=6, warmup_steps=2, min_rate=0.1)
    assert rates(scheduler, 4) == pytest.approx([2.0 * cosine_factor(t, 2, 4, 0.1) for t in range(4)])


def test_defaults_follow_astrai():
    wsd = build_scheduler(optimizer(), "wsd", total_steps=20, warmup_steps=5)
    assert (wsd.stable_steps, wsd.decay_steps, wsd.min_rate) == (12, 3, 0.01)  # int(0.8 * 15), rest, 0.01
    sgdr = build_scheduler(optimizer(), "sgdr", total_steps=20, warmup_steps=5)
    assert (sgdr.cycle_length, sgdr.t_mult) == (15, 2)
    cosine = build_scheduler(optimizer(), "cosine", total_steps=20, warmup_steps=5)
    assert (cosine.lr_decay_steps, cosine.total_steps) == (15, 20)


def test_explicit_zero_is_honoured():
    # AstrAI's `value or default` would turn these zeros into the defaults (B15).
    wsd = build_scheduler(optimizer(), "wsd", total_steps=20, warmup_steps=5, stable_steps=0, min_rate=0.0)
    assert (wsd.stable_steps, wsd.min_rate) == (0, 0.0)
    assert rates(wsd, 21)[-1] == 0.0


def test_sgdr_without_cycle_is_an_error_not_a_hang():
    with pytest.raises(ConfigError, match="cycle_length >= 1, got 0"):
        build_scheduler(optimizer(), "sgdr", total_steps=5, warmup_steps=5)  # nothing left after warmup
    with pytest.raises(ConfigError, match="cycle_length >= 1, got 0"):
        sgdr_factor(3, 1, 0, 0.0, 2)


def test_state_dict_is_astrai_layout_and_restores_the_schedule():
    scheduler = build_scheduler(optimizer(), "cosine", total_steps=10, warmup_steps=2)
    rates(scheduler, 3)
    state = scheduler.state_dict()
    # The keys AstrAI's CosineScheduler saves (torch 2.13).
    assert sorted(state) == sorted([
        "_get_lr_called_within_step", "_is_initial", "_last_lr", "_step_count", "base_lrs", "last_epoch",
        "lr_decay_steps", "min_rate", "total_steps", "warmup_steps",
    ])  # fmt: skip
    other = build_scheduler(optimizer(), "cosine", total_steps=99, warmup_steps=9)
    other.load_state_dict(state)
    # The checkpoint's schedule wins, and the optimizer runs at the restored rate right away.
    assert (other.warmup_steps, other.lr_decay_steps, other.last_epoch) == (2, 8, 3)
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(cosine_factor(3, 2, 8, 0.01))
    with pytest.raises(ConfigError, match="another schedule type"):
        build_scheduler(optimizer(), "wsd", total_steps=10, warmup_steps=2).load_state_dict(state)
