"""What a run shows and records each optimizer step: the progress display, the Fabric's loggers, AstrAI's
``metric.jsonl`` and the records ``fit`` returns. ``fit`` calls it explicitly; it decides nothing about training.

On a terminal rank 0 shows one progress bar over the run's steps (epoch, step, loss, lr, grad_norm, tokens/s, and
the bar's ETA); otherwise (a log file, CI) it prints plain lines at about 20 per run, each with its ETA. The total
shown is the step the run ends at (``StepPlan.last_step``), so the last line reaches it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from lightning.fabric import Fabric
from tqdm import tqdm

from astrai_fabric.metrics import MetricLog
from astrai_fabric.schedule import StepPlan

FLUSH_SECONDS = 30.0
"""The loggers' buffers (the CSV file's rows) are written at least this often, at every checkpoint and at the end
of a run: a crash loses at most this much of the log, and a step pays for a write only now and then."""

SHOWN_METRICS = ("reward", "reward_accuracy", "reward_margin", "kl_loss", "val_loss")
"""Train-type metrics worth a place on the log line when a loss function reports them."""


class Reporter:
    def __init__(
        self,
        fabric: Fabric,
        plan: StepPlan,
        metric_log: MetricLog,
        first_step: int,
        last_step: int | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        compiled: bool = False,
    ) -> None:
        self.fabric, self.plan, self.metric_log = fabric, plan, metric_log
        self.first_step = first_step
        self.last_step = plan.last_step() if last_step is None else last_step
        """The step the run ends at (``StepPlan.last_step``): the progress total, which the last line reaches."""
        self.compiled = compiled
        """The first step then includes compilation: its time is shown as such, and no ETA is made from it."""
        self.first_step_end: float | None = None
        self.window_seconds = 0.0
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.is_main = fabric.global_rank == 0
        self.interactive = self.is_main and sys.stdout.isatty()
        self.log_every = max(1, (self.last_step - first_step + 1) // 20)
        self.history: list[dict[str, Any]] = []
        self.bar: tqdm | None = None
        self.bar_epoch = -1
        self.started = self.window_start = self.flushed = time.perf_counter()

    def throughput(self, record: dict[str, Any], tokens: int, samples: int) -> None:
        """Add tokens/s, samples/s (and MFU) of the window just trained to ``record``; call right after the
        optimizer step, so validation and checkpoints do not count. ``tokens``/``samples``: all ranks together."""
        seconds = max(time.perf_counter() - self.window_start, 1e-9)
        self.window_seconds = seconds
        record["tokens_per_sec"] = tokens / seconds
        record["samples_per_sec"] = samples / seconds
        if self.flops_per_token and self.peak_flops:
            devices = self.fabric.world_size
            record["mfu"] = record["tokens_per_sec"] * self.flops_per_token / (self.peak_flops * devices)

    def restart_clock(self) -> None:
        """The next window's time starts now."""
        self.window_start = time.perf_counter()

    def step(
        self, record: dict[str, Any], loss_metrics: list[str], epoch: int, consumed_samples: int, last: bool = False
    ) -> None:
        """Log a finished step's record everywhere: the display, the Fabric's loggers, the metric log. ``last``: the
        run ends after it (a budget or a stop), so the plain log shows it."""
        if record["step"] == self.first_step:
            self.first_step_end = time.perf_counter()
        self.history.append(record)
        self.fabric.log_dict({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if "val_loss" in record:
            self.metric_log.add("validation", epoch, record["step"], consumed_samples, val_loss=record["val_loss"])
        self.metric_log.add_step(record, loss_metrics, epoch, consumed_samples)
        self._show(record, epoch, last)
        if time.perf_counter() - self.flushed >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write what the loggers buffer (the CSV logger's rows) now."""
        for logger in self.fabric.loggers:
            logger.save()
        self.flushed = time.perf_counter()

    def epoch_end(self, epoch: int, step: int, consumed_samples: int) -> None:
        self.metric_log.add("epoch", epoch, step, consumed_samples)

    def checkpoint_saved(self, path: Path) -> None:
        """Say where a checkpoint went, and write the loggers' buffers with it: the log reaches the same step."""
        self.flush()
        self.message(f"checkpoint: {path}")

    def message(self, text: str) -> None:
        """A line for the user (a checkpoint was written, ...) that does not break the progress bar."""
        if self.bar is not None:
            self.bar.write(text)
        elif self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.flush()  # closing the loggers is their owner's call

    def _show(self, record: dict[str, Any], epoch: int, last: bool) -> None:
        step, total = record["step"], self.last_step
        compiling = self.window_seconds if self.compiled and step == self.first_step else None
        fields = _fields(record, compiling)
        if self.interactive:
            if self.bar is None:  # one bar over this run's steps: its ETA is the run's
                self.bar = tqdm(total=max(1, total - self.first_step + 1), dynamic_ncols=True)
            if epoch != self.bar_epoch:
                self.bar.set_description(f"Epoch {epoch + 1}/{self.plan.num_epochs}", refresh=False)
                self.bar_epoch = epoch
            self.bar.set_postfix_str(f"step {step}/{total} | {fields}", refresh=False)
            self.bar.update(1)  # redraws with the postfix of this step
        elif self.is_main and (
            step == self.first_step or step >= total or step % self.log_every == 0 or "val_loss" in record or last
        ):
            print(f"step {step}/{total} | epoch {epoch} | {fields} | eta {self._eta(step)}", flush=True)

    def _eta(self, step: int) -> str:
        """Time left at the pace of the steps after the first (which includes start-up work: workers, allocation,
        compilation); from the first step itself only when it was not compiled."""
        now = time.perf_counter()
        if step > self.first_step and self.first_step_end is not None:
            per_step = (now - self.first_step_end) / (step - self.first_step)
        elif self.compiled:
            return "?"
        else:
            per_step = now - self.started
        remaining = max(self.last_step - step, 0) * per_step
        minutes, seconds = divmod(int(remaining), 60)
        return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def _fields(record: dict[str, Any], compiling: float | None = None) -> str:
    """The log line's metrics; ``compiling``: the seconds of a step that went mostly into compilation, shown in place
    of its throughput."""
    speed = (
        f"{record['tokens_per_sec']:,.0f} tokens/s"
        if compiling is None
        else f"first step {compiling:.1f} s, compilation included"
    )
    line = f"loss {record['loss']:.4f} | lr {record['lr']:.3e} | grad_norm {record['grad_norm']:.4f} | {speed}"
    if "mfu" in record and compiling is None:
        line += f" | mfu {record['mfu']:.1%}"
    return line + "".join(f" | {name} {record[name]:.4f}" for name in SHOWN_METRICS if name in record)
