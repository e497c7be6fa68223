"""``astrai-fabric plot``: loss (train and validation), learning rate and throughput against step, for one run
or several overlaid. The only matplotlib importer.

A run is a ``--ckpt_dir`` (every ``metric.jsonl`` under it is merged, so resumed runs plot whole), a checkpoint
directory, or a ``metric.jsonl`` file. Where its checkpoints hold evaluations (``astrai-fabric evaluate``, their
``eval/*.json``), each metric is drawn against the checkpoint's step too: the held-out loss on the loss panel, every
other metric (perplexity, each task's) on a panel of its own below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from astrai_fabric.errors import UserError
from astrai_fabric.evaluate.results import CHECKPOINT_NAME, checkpoint_results
from astrai_fabric.metric_entries import metric_entry_problem, metric_lines

PLOT_FILE = "plot.png"
METRIC_FILE = "metric.jsonl"
"""``metrics.METRIC_FILE``, spelled here (tests/test_startup.py checks they agree): ``astrai_fabric.metrics``
imports torch.distributed.tensor (~0.7 s measured), which ``astrai-fabric plot`` has no use for."""


EVAL_SKIPPED = ("tokens", "units")
"""Evaluation numbers that are counts, not measures: not drawn."""


def read_entries(run: Path) -> list[dict[str, Any]]:
    """The run's metric entries, merged over all its ``metric.jsonl`` files, one per (type, step), by step."""
    files = sorted(run.rglob(METRIC_FILE)) if run.is_dir() else [run] if run.is_symlink() or run.exists() else []
    if not files:
        if read_evaluations(run):
            return []
        raise UserError(f"{run}: no {METRIC_FILE} found (give a run's ckpt_dir, a checkpoint, or a metric.jsonl)")
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for file in files:
        for number, line in metric_lines(file, within=None if file == run else run):
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError) as err:  # ValueError: JSON, digits
                raise UserError(f"{file}:{number}: not a metric entry ({err})") from None
            if problem := metric_entry_problem(entry):
                raise UserError(f"{file}:{number}: not a metric entry ({problem})")
            merged[(entry["type"], entry["step"])] = entry
    return sorted(merged.values(), key=lambda e: e["step"])


def read_evaluations(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Each evaluation metric of the run's checkpoints (``run`` itself, or the ``epoch_E_step_S`` in it) as
    ``(step, value)`` points by step, named ``metric`` (perplexity) or ``task/metric``, with the data it was measured
    on where a run was evaluated on several."""
    if not run.is_dir():
        return {}
    checkpoints = [run] if CHECKPOINT_NAME.match(run.name) else sorted(run.glob("epoch_*_step_*"))
    series: dict[str, list[tuple[int, float]]] = {}
    data_paths = set()
    results = []
    for checkpoint in checkpoints:
        match = CHECKPOINT_NAME.match(checkpoint.name)
        if not match or not checkpoint.is_dir():
            continue
        for result in checkpoint_results(checkpoint, "left out of the plot"):
            results.append((int(match[2]), result))
            if result.get("kind") == "perplexity":
                data_paths.add(str(result.get("settings", {}).get("data_root_path")))
    for step, result in results:
        where = (
            f" ({result['settings'].get('data_root_path')})"
            if len(data_paths) > 1 and result.get("kind") == ("perplexity")
            else ""
        )
        for name, value in result["metrics"].items():
            drawn = _is_number(value)
            if (
                drawn
                and name not in EVAL_SKIPPED
                and not name.endswith(("_stderr", "_ci95"))
                and "_stderr[" not in name
            ):
                series.setdefault(f"{name}{where}", []).append((step, value))
    return {name: sorted(points) for name, points in series.items()}


def check_output(output: Path) -> None:
    """``output`` is a new or replaceable image file of a format matplotlib writes, in an existing directory."""
    from matplotlib.backend_bases import FigureCanvasBase  # matplotlib (~3 s): only when a plot is asked for

    formats = FigureCanvasBase.get_supported_filetypes()
    if output.suffix.lower().lstrip(".") not in formats:
        raise UserError(f"-o {output}: not an image file name; end it in one of {', '.join('.' + f for f in formats)}")
    if not output.parent.is_dir():
        raise UserError(f"-o {output}: the directory {output.parent} does not exist")
    if output.is_dir():
        raise UserError(f"-o {output}: is a directory; name the image file")


def plot_runs(runs: list[Path], output: Path) -> Path:
    """Write a PNG with one panel each for loss, learning rate and tokens/s; return its path."""
    import matplotlib.pyplot as plt

    figure = draw_runs(runs)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def draw_runs(runs: list[Path]) -> Any:
    """The figure ``plot_runs`` writes: a panel each for loss, learning rate, tokens/s and every evaluation."""
    import matplotlib  # ~3 s, only when a plot is written; the backend is chosen before pyplot loads

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    evaluations = {run: read_evaluations(run) for run in runs}
    eval_names = sorted({name for series in evaluations.values() for name in series if not _is_eval_loss(name)})
    rows = 1 + -(-len(eval_names) // 3)
    figure, axes = plt.subplots(rows, 3, figsize=(16, 4.5 * rows), squeeze=False)
    loss_ax, lr_ax, speed_ax = axes[0]
    eval_axes = dict(zip(eval_names, axes.flat[3:], strict=False))
    for run in runs:
        entries = read_entries(run)
        name = run.name if run.name != METRIC_FILE else run.parent.name
        steps = [e for e in entries if e["type"] == "step"]
        line = _series(loss_ax, steps, "loss", f"{name} train")
        color = line.get_color() if line else None
        _series(
            loss_ax,
            [e for e in entries if e["type"] == "validation"],
            "val_loss",
            f"{name} validation",
            color=color,
            linestyle="--",
            marker="o",
        )
        _series(lr_ax, steps, "lr", name)
        _series(speed_ax, steps, "tokens_per_sec", name)
        for metric, points in evaluations[run].items():
            entries_of = [{"step": step, "value": value} for step, value in points]
            if _is_eval_loss(metric):
                _series(
                    loss_ax, entries_of, "value", f"{name} held-out {metric}", color=color, linestyle=":", marker="s"
                )
            else:
                _series(eval_axes[metric], entries_of, "value", name, marker="o")
    for axis in axes.flat[3 + len(eval_names) :]:
        axis.set_visible(False)
    titles = [
        (loss_ax, "loss"),
        (lr_ax, "learning rate"),
        (speed_ax, "tokens/s"),
        *((a, n) for n, a in eval_axes.items()),
    ]
    for axis, title in titles:
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.5
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
        else:
            axis.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=axis.transAxes)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    figure.tight_layout()
    return figure


PLOTTABLE = 1e300
"""The largest magnitude drawn: an axis spanning more (a finite 1e308) overflows matplotlib's tick arithmetic."""


def _series(axis: Any, entries: list[dict[str, Any]], key: str, label: str, **style: Any) -> Any:
    """``key`` against the step; values that are not finite numbers within ``PLOTTABLE`` are left out, and the
    legend says how many."""
    values = [(e["step"], e[key]) for e in entries if isinstance(e.get(key), int | float)]
    points = [(step, value) for step, value in values if _plottable(value)]
    if len(points) < len(values):
        label += f" ({len(values) - len(points)} off the scale, left out)"
    if not points:
        return None
    (line,) = axis.plot(*zip(*points, strict=True), label=label, **{k: v for k, v in style.items() if v is not None})
    return line


def _is_eval_loss(name: str) -> bool:
    """Perplexity's mean loss, drawn with the training loss it is comparable to."""
    return name == "loss" or name.startswith("loss (")


def _is_number(value: object) -> bool:
    """An int or a float; a bool (``true`` in a line) is no measure."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _plottable(value: float) -> bool:
    """Finite and within ``PLOTTABLE`` (NaN compares false; an integer past float's range raises)."""
    try:
        return abs(float(value)) <= PLOTTABLE
    except OverflowError:
        return False
