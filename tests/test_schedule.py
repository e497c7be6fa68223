"""Total steps and learning-rate schedules against hand-computed tables (``astrai/trainer/schedule.py``)."""

import math

import pytest
import torch

from astrai_fabric.checkpoint.position import RunPosition
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


def test_max_steps_plans_the_schedule_over_the_run():
    plan = StepPlan(1000, 4, 8, 4, 3, 0.1, max_steps=20)  # 24 steps in the epochs; the run's 20
    assert (plan.epoch_steps, plan.total_steps, plan.warmup_steps, plan.last_step()) == (24, 20, 2, 20)
    # Longer than n_epoch's data: max_steps sets the length, as in transformers, over the epochs it takes (32
    # micro-batches of 8 per rank and epoch, 4 to a step: 8 steps an epoch, 13 epochs for 100).
    longer = StepPlan(1000, 4, 8, 4, 3, 0.1, max_steps=100)
    assert (longer.total_steps, longer.last_step(), longer.num_epochs, longer.warmup_steps) == (100, 100, 13, 10)


def test_warmup_steps_replace_the_ratio_up_to_the_schedule_s_length():
    """``--warmup_steps`` (``fixed_warmup_steps``) is the warmup as given, capped at the schedule's steps; with
    neither it nor a ratio, AstrAI's 0.05."""
    assert StepPlan(1000, 4, 8, 4, 3, None, fixed_warmup_steps=5).warmup_steps == 5  # 24 steps
    assert StepPlan(1000, 4, 8, 4, 3, None, max_steps=4, fixed_warmup_steps=5).warmup_steps == 4
    assert StepPlan(1000, 4, 8, 4, 3, None, fixed_warmup_steps=0).warmup_steps == 0
    assert StepPlan(10_000, 1, 1, 1, 1, None).warmup_steps == 500  # int(0.05 x 10,000)


def test_cosine_with_min_rate_0_is_transformers_cosine():
    """docs/training.md: ``--min_rate 0`` cosine is transformers' ``lr_scheduler_type cosine`` (linear warmup from 0,
    cosine decay to 0), rate for rate at every optimizer step. The reference is transformers' own scheduler on the
    same optimizer; both compute in float64, compared to 1e-12."""
    transformers_optimization = pytest.importorskip("transformers.optimization")

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
        scheduler, seen = make(optimizer), []
        for _ in range(12):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    ours = rates(lambda o: build_scheduler(o, "cosine", total_steps=12, warmup_steps=3, min_rate=0.0))
    theirs = rates(lambda o: transformers_optimization.get_cosine_schedule_with_warmup(o, 3, 12))
    assert ours == pytest.approx(theirs, abs=1e-12) and ours[0] == 0.0


def counted_last_step(plan: StepPlan, epoch: int, sample_index: int, step: int) -> int:
    """The step a run from ``(epoch, sample_index, step)`` ends at, counted as the loop counts: every micro-batch
    of the epochs left, one window per ``grad_accum_steps`` of them (a window may span two epochs)."""
    micro_batches = 0
    for e in range(epoch, plan.num_epochs):
        start = sample_index if e == epoch else 0
        micro_batches += len(range(start, plan.samples_per_rank, plan.batch_per_device))
        while micro_batches >= plan.grad_accum_steps:
            micro_batches -= plan.grad_accum_steps
            step += 1
            if plan.max_steps is not None and step >= plan.max_steps:
                return step
    return step


@pytest.mark.parametrize("num_samples, world, batch, accum, epochs", [(10, 1, 3, 1, 2), (16, 1, 1, 3, 2),
                         (1139, 1, 8, 2, 3), (50, 3, 2, 4, 5), (7, 4, 1, 1, 1)])  # fmt: skip
def test_last_step_is_what_the_loop_takes(num_samples, world, batch, accum, epochs):
    """``last_step`` in closed form against the loop's own count, fresh and from every window boundary of a resume,
    with ``max_steps`` and ``stop_after_steps`` (the progress total, ``Reporter``)."""
    plan = StepPlan(num_samples, world, batch, accum, epochs, 0.0)
    assert plan.last_step() == counted_last_step(plan, 0, 0, 0) == epochs * plan.micro_batches_per_rank // accum
    for stop_after in (None, 1, 3):
        plan = StepPlan(num_samples, world, batch, accum, epochs, 0.0, stop_after_steps=stop_after)
        for step in range(counted_last_step(plan, 0, 0, 0)):  # a checkpoint after each step of a fresh run
            epoch, micro_batch = divmod(step * accum, plan.micro_batches_per_rank)
            index = micro_batch * batch
            start = RunPosition(epoch=epoch, sample_index=index, optimizer_step=step)
            counted = counted_last_step(plan, epoch, index, step)
            expected = counted if stop_after is None else min(counted, step + stop_after)
            assert plan.last_step(start) == expected
    capped = StepPlan(num_samples, world, batch, accum, epochs, 0.0, max_steps=2)
    assert capped.last_step() == counted_last_step(capped, 0, 0, 0) == 2
    past = 3 * plan.last_step() + 1  # past n_epoch's windows: the loop runs the epochs it takes
    longer = StepPlan(num_samples, world, batch, accum, epochs, 0.0, max_steps=past)
    assert longer.last_step() == counted_last_step(longer, 0, 0, 0) == past


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
    assert sorted(state) == sorted(
        [
            "_get_lr_called_within_step",
            "_is_initial",
            "_last_lr",
            "_step_count",
            "base_lrs",
            "last_epoch",
            "lr_decay_steps",
            "min_rate",
            "total_steps",
            "warmup_steps",
        ]
    )
    other = build_scheduler(optimizer(), "cosine", total_steps=99, warmup_steps=9)
    other.load_state_dict(state)
    # The checkpoint's schedule wins, and the optimizer runs at the restored rate right away.
    assert (other.warmup_steps, other.lr_decay_steps, other.last_epoch) == (2, 8, 3)
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(cosine_factor(3, 2, 8, 0.01))
    with pytest.raises(ConfigError, match="another schedule type"):
        build_scheduler(optimizer(), "wsd", total_steps=10, warmup_steps=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("num_samples", "interval", "passes", "max_steps", "sample_index"),
    [(40, 1, 1, None, 0), (40, 3, 1, 7, 0), (40, 3, 2, 11, 0), (10, 4, 1, 9, 0), (10, 2, 3, None, 4), (26, 5, 2, 6, 8)],
)
def test_the_plan_counts_the_rollouts_online_runs_sample(num_samples, interval, passes, max_steps, sample_index):
    """``StepPlan.rollouts`` against ``train.grpo.Rollouts``' own iteration (its sampling counted, the loop's budget
    applied: each epoch's prompt micro-batches pulled until the run's last step is trained), over several epochs, a
    cut last rollout, several passes and a position resumed mid-epoch."""
    from astrai_fabric.train.grpo import Rollouts

    accum, batch = 2, 2
    plan = StepPlan(
        num_samples, 1, batch, accum, 3, None, max_steps, num_iterations=passes, rollout_micro_batches=interval * accum
    )
    start = RunPosition(sample_index=sample_index, optimizer_step=sample_index // batch // accum)
    to_train = (plan.last_step(start) - start.optimizer_step) * accum
    sampled = []
    rollouts = object.__new__(Rollouts)  # its iteration alone: the sampling itself is counted, not done
    rollouts.micro_batches, rollouts.num_iterations, rollouts.statistics = interval * accum, passes, False
    rollouts.micro_batches_left = to_train
    rollouts.rollout = lambda prompts, k: sampled.append(k) or {"prompts": prompts}
    trained, first = 0, sample_index // batch
    while trained < to_train:  # the loop's epochs
        rollouts.prompts, first = range(first, plan.micro_batches_per_rank), 0
        for _ in rollouts:
            trained += 1
            if trained == to_train:
                break
    assert plan.rollouts(start) == (sampled.count(0), len(sampled))
    assert len(sampled) <= to_train  # each sampled micro-batch is trained (at least its first pass)
