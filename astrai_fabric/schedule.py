"""Total-steps arithmetic and AstrAI's learning-rate schedules (AstrAI's
``astrai/trainer/schedule.py``). Pure math, checked loudly.

A schedule multiplies each parameter group's base rate by ``factor(t)``, ``t`` = optimizer steps taken so far;
the scheduler steps once per optimizer step, so optimizer step ``k`` (1-based) runs at ``factor(k - 1)``.
Warmup is shared: ``max(min_rate, t / warmup_steps)``, so the first step runs at ``min_rate``, not at 0
(AstrAI's rule). The scheduler classes keep AstrAI's attribute names and ``state_dict`` layout, so a
``scheduler.pt`` moves between the two trainers, and loading one restores its hyper-parameters (AstrAI: the
checkpoint's schedule wins over a recomputed one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from astrai_fabric.errors import ConfigError

if TYPE_CHECKING:
    from astrai_fabric.checkpoint.position import RunPosition

DEFAULT_MIN_RATE = 0.01
DEFAULT_WARMUP_RATIO = 0.05
"""``--warmup_ratio`` when neither it nor ``--warmup_steps`` is given (AstrAI's)."""


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps a run takes, derived as AstrAI derives it, and the schedule's length: AstrAI's count,
    or ``--max_steps``, which sets the run's length over as many epochs as it takes, whatever ``--n_epoch`` says
    (Hugging Face's ``max_steps`` overrides ``num_train_epochs`` so). Numbers only: the run and its dry run both
    build it from the flags with ``train.plan.step_plan``."""

    num_samples: int
    """Training samples (after the validation split)."""
    num_dp_ranks: int
    """Data-parallel ranks: the ones that consume different samples (tensor-parallel ranks share theirs)."""
    batch_per_device: int
    grad_accum_steps: int
    n_epoch: int
    warmup_ratio: float | None
    """``--warmup_ratio``: the warmup's share of the schedule's steps; None: ``DEFAULT_WARMUP_RATIO``, unless
    ``fixed_warmup_steps`` is given."""
    max_steps: int | None = None
    """``--max_steps``: the run's length in optimizer steps (it ends there, and the schedule is planned over it),
    over ``num_epochs`` epochs."""
    stop_after_steps: int | None = None
    """``--stop_after_steps``: this run stops after this many steps of its own, the schedule untouched."""
    num_iterations: int = 1
    """Times each micro-batch is trained (online grpo's ``--grpo_num_iterations``; its repeats consume no samples)."""
    fixed_warmup_steps: int | None = None
    """``--warmup_steps``: the warmup's length in optimizer steps, instead of ``warmup_ratio``'s share."""
    rollout_micro_batches: int | None = None
    """Online grpo and dpo: micro-batches of prompts sampled at once (``rollout_interval x grad_accum_steps``);
    None: the data holds what is trained."""

    @property
    def samples_per_rank(self) -> int:
        """Samples each rank sees per epoch (the sampler pads the last round by wrapping around)."""
        return math.ceil(self.num_samples / self.num_dp_ranks)

    @property
    def micro_batches_per_rank(self) -> int:
        """Micro-batches per rank per epoch; the last one may be short."""
        return math.ceil(self.samples_per_rank / self.batch_per_device)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, all ranks together."""
        return self.num_dp_ranks * self.batch_per_device * self.grad_accum_steps

    @property
    def epoch_steps(self) -> int:
        """AstrAI's ``(ceil(ceil(N / ranks) / batch) // accum) * epochs``: its schedule's length (each micro-batch
        counted ``num_iterations`` times: ``(iterations * ceil(ceil(N / ranks) / batch) // accum) * epochs``).

        Accumulation windows run across epoch boundaries, so the epochs hold up to ``n_epoch - 1`` more steps than
        this (``last_step``); they run at the schedule's floor (AstrAI's behaviour).
        """
        return (self.num_iterations * self.micro_batches_per_rank // self.grad_accum_steps) * self.n_epoch

    @property
    def num_epochs(self) -> int:
        """The epochs the run passes through: ``n_epoch``, or the first number of epochs whose accumulation windows
        reach ``max_steps`` (windows run across epoch boundaries, each epoch reshuffled as any other)."""
        if self.max_steps is None:
            return self.n_epoch
        micro_batches_per_epoch = self.num_iterations * self.micro_batches_per_rank  # each trained num_iterations times
        return max(1, math.ceil(self.max_steps * self.grad_accum_steps / micro_batches_per_epoch))

    @property
    def total_steps(self) -> int:
        """The schedule's length: ``epoch_steps``, or ``max_steps`` (a run that ends at ``max_steps`` warms up and
        decays within it; AstrAI has no ``max_steps``)."""
        return self.epoch_steps if self.max_steps is None else self.max_steps

    @property
    def warmup_steps(self) -> int:
        """``fixed_warmup_steps``, or ``int(warmup_ratio x total_steps)`` (AstrAI's), at most ``total_steps``."""
        if self.fixed_warmup_steps is not None:
            return min(self.fixed_warmup_steps, self.total_steps)
        ratio = DEFAULT_WARMUP_RATIO if self.warmup_ratio is None else self.warmup_ratio
        return min(int(ratio * self.total_steps), self.total_steps)

    def last_step(self, start: RunPosition | None = None) -> int:
        """The optimizer step a run starting at ``start`` (default: the beginning) ends at: the whole accumulation
        windows left in the epochs (a window may span two), ``max_steps`` or ``stop_after_steps`` when sooner
        (``max_tokens``, a skipped step or a stop request may end it sooner still).

        A resume continues at a window's start (a checkpoint follows an optimizer step), so the windows left are
        the micro-batches left (each trained ``num_iterations`` times) over ``grad_accum_steps``. With several
        iterations the position counts each prompt when first trained, and a resume samples anew from there: a rollout
        cut short is not finished, so every micro-batch left is trained ``num_iterations`` times.
        """
        epoch, sample_index, step = (start.epoch, start.sample_index, start.optimizer_step) if start else (0, 0, 0)
        consumed = epoch * self.micro_batches_per_rank + math.ceil(sample_index / self.batch_per_device)
        remaining = max(self.num_epochs * self.micro_batches_per_rank - consumed, 0)
        final = step + self.num_iterations * remaining // self.grad_accum_steps
        if self.max_steps is not None:
            final = min(final, max(self.max_steps, step))
        if self.stop_after_steps is not None:
            final = min(final, step + self.stop_after_steps)
        return final

    def check(self) -> None:
        if self.num_samples < 1:
            raise ConfigError("the training set is empty: no sample fits (check data_root_path and window_size)")
        if self.epoch_steps < 1:
            raise ConfigError(
                f"no optimizer step fits in the data: {self.num_samples} samples over {self.num_dp_ranks} rank(s) make "
                f"{self.micro_batches_per_rank} micro-batch(es) of {self.batch_per_device} per rank and epoch, fewer "
                f"than grad_accum_steps={self.grad_accum_steps}; lower batch_per_device or grad_accum_steps"
            )

    def rollouts(self, start: RunPosition | None = None) -> tuple[int, int]:
        """Online runs: ``(rollouts, micro-batches of prompts sampled)`` from ``start`` to ``last_step``, as
        ``train.grpo.Rollouts`` cuts them: ``rollout_micro_batches`` at a time from each epoch's start (or the
        resumed position), fewer at an epoch's end, and the last cut to the micro-batches the run still trains."""
        assert self.rollout_micro_batches is not None
        sample_index, step = (start.sample_index, start.optimizer_step) if start else (0, 0)
        left = (self.last_step(start) - step) * self.grad_accum_steps  # trained, repeats included
        in_epoch = self.micro_batches_per_rank - math.ceil(sample_index / self.batch_per_device)
        size, passes = self.rollout_micro_batches, self.num_iterations
        num_rollouts = sampled = 0
        while left > 0 and in_epoch > 0:
            whole = min(in_epoch // size, left // (size * passes))  # whole rollouts, all of them trained
            chunk = size if whole else min(size, in_epoch, left)
            count = max(whole, 1)
            num_rollouts, sampled = num_rollouts + count, sampled + count * chunk
            left, in_epoch = left - count * chunk * passes, in_epoch - count * chunk
            if in_epoch == 0:
                in_epoch = self.micro_batches_per_rank
        return num_rollouts, sampled

    def describe(self, start: RunPosition | None = None, max_tokens: int | None = None) -> list[tuple[str, str]]:
        """The plan's ``batch``, ``steps`` and ``this run`` lines, labelled (``train.plan.describe_plan``), for a run
        starting at ``start`` (default: the beginning) that may also stop at ``max_tokens``."""
        trained = f", each trained {self.num_iterations} times" if self.num_iterations > 1 else ""
        steps = (
            f"{self.num_samples} samples -> {self.samples_per_rank} per rank -> {self.micro_batches_per_rank} "
            f"micro-batches per rank per epoch{trained} -> "
        )
        if self.max_steps is None:
            steps += f"{self.epoch_steps} optimizer steps over {self.n_epoch} epoch(s)"
        else:
            steps += (
                f"max_steps {self.max_steps} optimizer steps over {self.num_epochs} epoch(s) (max_steps sets the "
                "length, as in transformers; n_epoch is not read)"
            )
        steps += f", {self.warmup_steps} of them warmup"
        first, last = (start.optimizer_step if start is not None else 0) + 1, self.last_step(start)
        run = f"steps {first} to {last}" if last >= first else f"none: step {first - 1} is this run's last"
        if self.stop_after_steps is not None and last == first - 1 + self.stop_after_steps:
            run += f" (stop_after_steps {self.stop_after_steps}; the schedule runs on to step {self.total_steps})"
        elif self.max_steps is None and last > self.total_steps:
            run += (
                f" ({last - self.total_steps} past the schedule's {self.total_steps}, at its floor: accumulation "
                "windows run across epochs)"
            )
        if max_tokens is not None:
            run += f", or fewer: the run stops at max_tokens {max_tokens:,}"
        rows = [
            (
                "batch",
                f"{self.num_dp_ranks} rank(s) x {self.batch_per_device} per device x {self.grad_accum_steps} "
                f"accumulation = {self.global_batch_size} samples per optimizer step",
            ),
            ("steps", steps),
            ("this run", run),
        ]
        if self.rollout_micro_batches is not None:
            num_rollouts, sampled = self.rollouts(start)
            rows.append(
                (
                    "rollouts",
                    f"{num_rollouts} per rank, {sampled} micro-batches of prompts sampled (up to "
                    f"{self.rollout_micro_batches} at a time; none past the run's last step)",
                )
            )
        return rows


@dataclass(frozen=True)
class ScheduleArgs:
    """The flags a run's schedule reads (``TrainArgs`` documents each; ``train.plan.schedule_args`` builds it)."""

    schedule_type: str
    min_rate: float | None
    cycle_length: int | None
    t_mult: int
    stable_steps: int | None
    decay_steps: int | None
    resume_schedule: bool
    """Whether a resume continues the checkpoint's schedule (``train.common.build_schedule``)."""

    def build(self, optimizer: Optimizer, plan: StepPlan) -> _AstraiSchedule:
        """This schedule over ``plan``'s steps (``build_scheduler``), after ``check``."""
        self.check(plan)
        return build_scheduler(
            optimizer,
            self.schedule_type,
            plan.total_steps,
            plan.warmup_steps,
            self.min_rate,
            self.cycle_length,
            self.t_mult,
            self.stable_steps,
            self.decay_steps,
        )

    def check(self, plan: StepPlan) -> None:
        """A run that ends at ``--max_steps`` must hold the phases its flags make explicit: a stable phase or first
        cycle longer than the steps after warmup would never decay (or finish), silently."""
        if plan.max_steps is None:
            return
        after_warmup = plan.total_steps - plan.warmup_steps
        lengths = {"wsd": ("stable_steps", "decay_steps"), "sgdr": ("cycle_length",)}.get(self.schedule_type, ())
        given = {name: getattr(self, name) for name in lengths if getattr(self, name) is not None}
        if sum(given.values()) > after_warmup:
            phases = " + ".join(f"{name} {value}" for name, value in given.items())
            raise ConfigError(
                f"{phases}: longer than the {after_warmup} steps after warmup of this run (max_steps "
                f"{plan.max_steps}, {plan.warmup_steps} warmup); lower it, or leave it out to fit the run"
            )


def warmup_factor(t: int, warmup_steps: int, min_rate: float) -> float:
    return max(min_rate, t / max(warmup_steps, 1))


def cosine_factor(t: int, warmup_steps: int, decay_steps: int, min_rate: float) -> float:
    """Warmup, then ``max(min_rate, 0.5 (1 + cos(pi p)))`` with ``p`` capped at 1 (a max, not an affine floor)."""
    if t < warmup_steps:
        return warmup_factor(t, warmup_steps, min_rate)
    progress = min((t - warmup_steps) / max(decay_steps, 1), 1.0)
    return max(min_rate, 0.5 * (1.0 + math.cos(math.pi * progress)))


def sgdr_factor(t: int, warmup_steps: int, cycle_length: int, min_rate: float, t_mult: int) -> float:
    """Warmup, then cosine restarts over cycles ``L, L m, L m^2, ...`` between ``min_rate`` and 1 (affine)."""
    if t < warmup_steps:
        return warmup_factor(t, warmup_steps, min_rate)
    if cycle_length < 1:  # AstrAI loops forever here (B15)
        raise ConfigError(f"sgdr needs cycle_length >= 1, got {cycle_length}")
    step, length = t - warmup_steps, cycle_length
    while step >= length:
        step -= length
        length *= t_mult
    return min_rate + (1 - min_rate) * 0.5 * (1 + math.cos(math.pi * step / length))


def wsd_factor(t: int, warmup_steps: int, stable_steps: int, decay_steps: int, min_rate: float) -> float:
    """Warmup, ``stable_steps`` at 1, then a quadratic decay ``(1 - min_rate)(1 - r)^2 + min_rate``.

    AstrAI's docstring calls the decay "sqrt"; its code, which we follow, is quadratic.
    """
    if t < warmup_steps:
        return warmup_factor(t, warmup_steps, min_rate)
    offset = t - warmup_steps
    if offset < stable_steps:
        return 1.0
    ratio = min((offset - stable_steps) / max(decay_steps, 1), 1.0)
    return (1.0 - min_rate) * (1.0 - ratio) ** 2 + min_rate


class _AstraiSchedule(LRScheduler):
    """Base rate times ``factor(last_epoch)``; ``state_dict`` adds the hyper-parameters named in ``hyper``."""

    hyper: tuple[str, ...] = ()

    def factor(self, t: int) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a saved state after checking it has this schedule's keys, each of the kind it is here (a number,
        or a list of one finite number per parameter group); keys this class does not have are ignored."""
        if not isinstance(state_dict, dict):
            raise ConfigError(f"scheduler state must be a mapping, got {type(state_dict).__name__}")
        missing = [k for k in self.hyper if k not in state_dict]
        if missing:
            raise ConfigError(f"scheduler state lacks {missing}: it was saved by another schedule type")
        state = {k: v for k, v in state_dict.items() if k in self.__dict__ and k != "optimizer"}
        wrong = [f"{k}={v!r}" for k, v in state.items() if not _same_kind(v, self.__dict__[k])]
        if wrong:
            raise ConfigError(f"scheduler state has values of the wrong kind: {', '.join(wrong)[:300]}")
        self.__dict__.update(state)
        # The groups must run at the restored rate now, whatever set them before (e.g. this scheduler's own
        # constructor, which applies factor(0)).
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def continue_at(self, step: int) -> None:
        """Go on as if ``step`` optimizer steps had been taken (a schedule rebuilt for a resumed run)."""
        self.last_epoch = step
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


class CosineScheduler(_AstraiSchedule):
    hyper = ("warmup_steps", "lr_decay_steps", "min_rate", "total_steps")

    def describe(self) -> str:
        return f"cosine: {self.warmup_steps} warmup steps, then decay over {self.lr_decay_steps} to {self.min_rate}x"

    def __init__(self, optimizer: Optimizer, warmup_steps: int, lr_decay_steps: int, min_rate: float) -> None:
        self.warmup_steps, self.lr_decay_steps, self.min_rate = warmup_steps, lr_decay_steps, min_rate
        self.total_steps = warmup_steps + lr_decay_steps
        super().__init__(optimizer)

    def factor(self, t: int) -> float:
        return cosine_factor(t, self.warmup_steps, self.lr_decay_steps, self.min_rate)


class SGDRScheduler(_AstraiSchedule):
    hyper = ("warmup_steps", "cycle_length", "min_rate", "t_mult")

    def __init__(self, optimizer: Optimizer, warmup_steps: int, cycle_length: int, min_rate: float, t_mult: int):
        if cycle_length < 1:
            raise ConfigError(
                f"sgdr needs cycle_length >= 1, got {cycle_length} (set --cycle_length, or train for more steps "
                "than the warmup)"
            )
        self.warmup_steps, self.cycle_length, self.min_rate, self.t_mult = warmup_steps, cycle_length, min_rate, t_mult
        super().__init__(optimizer)

    def describe(self) -> str:
        return (
            f"sgdr: {self.warmup_steps} warmup steps, then cosine cycles of {self.cycle_length} steps "
            f"(each x{self.t_mult}) down to {self.min_rate}x"
        )

    def factor(self, t: int) -> float:
        return sgdr_factor(t, self.warmup_steps, self.cycle_length, self.min_rate, self.t_mult)


class WSDScheduler(_AstraiSchedule):
    hyper = ("warmup_steps", "stable_steps", "decay_steps", "min_rate", "total_steps")

    def __init__(self, optimizer: Optimizer, warmup_steps: int, stable_steps: int, decay_steps: int, min_rate: float):
        self.warmup_steps, self.stable_steps, self.decay_steps = warmup_steps, stable_steps, decay_steps
        self.min_rate = min_rate
        self.total_steps = warmup_steps + stable_steps + decay_steps
        super().__init__(optimizer)

    def describe(self) -> str:
        return (
            f"wsd: {self.warmup_steps} warmup steps, {self.stable_steps} at the peak, quadratic decay over "
            f"{self.decay_steps} to {self.min_rate}x"
        )

    def factor(self, t: int) -> float:
        return wsd_factor(t, self.warmup_steps, self.stable_steps, self.decay_steps, self.min_rate)


def build_scheduler(
    optimizer: Optimizer,
    schedule_type: str,
    total_steps: int,
    warmup_steps: int,
    min_rate: float | None = None,
    cycle_length: int | None = None,
    t_mult: int = 2,
    stable_steps: int | None = None,
    decay_steps: int | None = None,
) -> _AstraiSchedule:
    """AstrAI's scheduler arguments from the total steps (as its ``scripts/tools/train.py`` derives them), except
    that an explicit 0 is honoured.

    AstrAI writes ``value or default`` and so treats ``--stable_steps 0`` or ``--min_rate 0`` as unset (B15).
    """
    min_rate = DEFAULT_MIN_RATE if min_rate is None else min_rate
    remaining = total_steps - warmup_steps
    if schedule_type == "cosine":
        return CosineScheduler(optimizer, warmup_steps, remaining, min_rate)
    if schedule_type == "sgdr":
        return SGDRScheduler(
            optimizer, warmup_steps, remaining if cycle_length is None else cycle_length, min_rate, t_mult
        )
    if schedule_type == "wsd":
        stable = max(1, int(remaining * 0.8)) if stable_steps is None else stable_steps
        decay = max(1, remaining - stable) if decay_steps is None else decay_steps
        return WSDScheduler(optimizer, warmup_steps, stable, decay, min_rate)
    raise ConfigError(f"schedule_type must be cosine, sgdr or wsd, got {schedule_type!r}")


def _same_kind(value: Any, current: Any) -> bool:
    """``value`` can stand where ``current`` is: None for None, a finite number for a number, a bool for a bool, a
    list of as many for a list."""
    if current is None or isinstance(current, bool):
        return type(value) is type(current)
    if isinstance(current, int | float):
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(current, list):
        return isinstance(value, list) and len(value) == len(current) and all(map(_same_kind, value, current))
    return type(value) is type(current)
