"""What a user sees: plain progress lines off a terminal, metric.jsonl in AstrAI's shape, CSV logs, the plot,
and the dry-run plan."""

import importlib.util
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai_fabric.cli import main
from astrai_fabric.metrics import GradSNR
from astrai_fabric.norms import by_device_mesh, global_norm

ROOT = Path(__file__).parents[1]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the [tensorboard] extra (in [dev])
ENV = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent)}
PLAIN_LINE = re.compile(
    r"^plan for `astrai-fabric (seq|sft|dpo|grpo)`$"
    r"|^  (recipes?|processes|model|tokenizer|window|data|packing|batch|steps|this run|schedule|loader|cpu threads"
    r"|training|preference|outputs|memory)"
    r" +\S.+"
    r"|^ {15}\S.+"  # a part's later lines
    r"|^  parameters   [\d,]+ parameters(, [\d,]+ trainable \(\S+\))?; optimizer \w+: .+; state .+"
    r"|^step \d+/\d+ \| epoch \d+ \| loss [\d.]+ \| lr \S+ \| grad_norm [\d.]+ \| [\d,]+ tokens/s"
    r"( \| \w+ [-\d.]+)* \| eta \S+$"
    r"|^checkpoint: .+|^done after step \d+; latest checkpoint: .+|^plot: .+\.png$"
    r"|^memory: [\d.]+ \w+ per rank at its peak, measured \(.+\); planned [\d.]+ \w+$"
)


def short_run_argv(ckpt_dir: Path) -> list[str]:
    return [
        "sft",
        "--config",
        str(ROOT / "recipes" / "tiny-sft.yaml"),
        "--ckpt_dir",
        str(ckpt_dir),
        "--max_steps",
        "6",
        "--ckpt_interval",
        "4",
        "--val_split",
        "0.05",
        "--val_step",
        "3",
        "--n_epoch",
        "1",
        "--neftune_alpha",
        "1",
        "--gradient_checkpointing",
    ]


def plan_lines(out: str) -> list[str]:
    """The plan's lines, without its title: those from ``plan for`` up to the first one not indented."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("plan for `astrai-fabric "))
    return list(itertools.takewhile(lambda line: line.startswith("  "), lines[start + 1 :]))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run")
    command = [sys.executable, "-m", "astrai_fabric", *short_run_argv(out)]
    if HAS_TENSORBOARD:
        command += ["--loggers", "csv", "--loggers", "tensorboard"]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV)  # stdout is a pipe, not a terminal
    assert result.returncode == 0, result.stderr[-2000:]
    return out, result.stdout


def test_log_is_plain_lines_when_stdout_is_not_a_terminal(short_run):
    _, stdout = short_run
    assert "\r" not in stdout and "\x1b" not in stdout  # no progress-bar redraws, no colour codes
    lines = stdout.splitlines()
    assert [line for line in lines if not PLAIN_LINE.match(line)] == []
    assert sum(line.startswith("step ") for line in lines) >= 3 and "val_loss" in stdout


def test_the_run_prints_the_plan_its_dry_run_prints(short_run, monkeypatch, capsys):
    """One renderer (``train.plan.describe_plan``): the dry run of the same flags shows the same lines (in process,
    with the run's one CPU thread; it also lists the checkpoints the run left, beneath the plan)."""
    out, stdout = short_run
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main([*short_run_argv(out), "--dry_run"]) == 2
    dry = capsys.readouterr().out
    assert "would overwrite" in dry.partition("cannot start:")[2]
    run_plan = plan_lines(stdout)
    assert [line.split()[0] for line in run_plan if not line.startswith(" " * 15)] == [
        "recipe",
        "processes",
        "model",
        "parameters",
        "memory",
        "tokenizer",
        "data",
        "packing",
        "batch",
        "steps",
        "this",
        "schedule",
        "loader",
        "cpu",
        "training",
        "outputs",
    ]
    fused = "loss fused with the head, 4096 positions at a time (the default for a mean over tokens on CPU, where it"
    assert f"  training     NEFTune (alpha 1), {fused} was never the slower), gradient checkpointing" in run_plan
    assert plan_lines(dry) == run_plan


def test_metric_jsonl_has_astrai_entry_shapes(short_run):
    out, _ = short_run
    entries = [json.loads(line) for line in (out / "epoch_0_step_6" / "metric.jsonl").read_text().splitlines()]
    for entry in entries:
        # AstrAI's schema (``astrai/trainer/train_callback.py``): these keys first, in this order, then the metrics.
        assert list(entry)[:5] == ["type", "timestamp", "epoch", "step", "consumed_samples"]
        assert entry["type"] in ("step", "validation", "epoch", "parameters", "memory")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", entry["timestamp"])
        assert all(isinstance(v, int | float) for k, v in entry.items() if k not in ("type", "timestamp"))
    (counts,) = [e for e in entries if e["type"] == "parameters"]  # recorded once, at the start
    assert counts["trainable_parameters"] == counts["total_parameters"] > 0 and counts["optimizer_state_bytes"] > 0
    steps = [e for e in entries if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]  # the whole history in the last checkpoint
    assert {"task_loss", "loss", "lr", "grad_norm", "grad_snr", "tokens_per_sec"} <= set(steps[0])
    assert [e["step"] for e in entries if e["type"] == "validation"] == [1, 3, 6]
    assert steps[-1]["consumed_samples"] == 6 * 16
    earlier = (out / "epoch_0_step_4" / "metric.jsonl").read_text().splitlines()
    assert len(earlier) < len(entries)


def test_csv_logger_gets_every_step(short_run):
    out, _ = short_run
    (csv,) = out.glob("logs/version_*/metrics.csv")
    header, *rows = csv.read_text().splitlines()
    assert {"loss", "lr", "grad_norm", "tokens_per_sec", "samples_per_sec", "val_loss"} <= set(header.split(","))
    assert len(rows) == 6


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the [tensorboard] extra")
def test_tensorboard_writes_into_the_csv_loggers_folder(short_run):
    out, _ = short_run
    (version,) = out.glob("logs/version_*")  # one folder for the run, not one per logger
    assert (version / "metrics.csv").is_file() and list(version.glob("events.out.tfevents.*"))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_every_run_ends_with_its_plot(short_run, tmp_path, capsys):
    out, stdout = short_run
    assert f"plot: {out / 'plot.png'}" in stdout
    width, height = png_size(out / "plot.png")
    assert width > 1000 and height > 300
    # Several runs overlaid, from the command line.
    assert main(["plot", str(out), str(out / "epoch_0_step_4" / "metric.jsonl"), "-o", str(tmp_path / "two.png")]) == 0
    assert png_size(tmp_path / "two.png") == (width, height)
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "not found" in capsys.readouterr().err


def test_the_step_axis_ticks_only_whole_steps(tmp_path):
    """Two steps: matplotlib's own ticks would be 1.0, 1.2, ..., 2.0 (steps that do not exist)."""
    from astrai_fabric.plot import draw_runs

    history = tmp_path / "metric.jsonl"
    entries = [{"type": "step", "step": s, "loss": 3.0 - s, "lr": 1e-3, "tokens_per_sec": 100.0} for s in (1, 2)]
    history.write_text("".join(json.dumps(e) + "\n" for e in entries))
    figure = draw_runs([history])
    for axis in figure.axes[:3]:
        low, high = axis.get_xlim()
        ticks = [t for t in axis.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), (axis.get_title(), ticks)
    figure.clear()


@pytest.mark.parametrize("recipe", sorted(ROOT.glob("recipes/tiny-*.yaml")), ids=lambda p: p.name)
def test_dry_run_of_each_tiny_recipe_writes_nothing(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipes write under ./checkpoints
    train_type = re.search(r"astrai-fabric (\w+)", recipe.read_text())[1]
    assert main([train_type, "--config", str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for heading in ("processes", "model", "tokenizer", "data", "batch", "steps", "schedule", "outputs"):
        assert re.search(rf"^  {heading}", out, re.M), heading
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe", ["pretrain-8gpu.yaml", "sft-8gpu.yaml"])
def test_dry_run_says_what_is_missing(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    train_type = "seq" if recipe.startswith("pretrain") else "sft"
    assert main([train_type, "--config", str(ROOT / "recipes" / recipe), "--dry_run"]) == 2
    out = capsys.readouterr().out
    assert "cannot start:" in out and "param_path" in out and "not found" in out
    assert list(tmp_path.iterdir()) == []


def test_default_workers_fit_the_cpus_and_a_budget_shows_its_last_step(tmp_path, monkeypatch, capsys, recwarn):
    recipe = tmp_path / "tiny-seq.yaml"  # the recipe without its num_workers: 0, so the default decides
    lines = (ROOT / "recipes" / "tiny-seq.yaml").read_text().splitlines()
    recipe.write_text("\n".join(line for line in lines if not line.startswith("num_workers")))
    base = ["seq", "--config", str(recipe), "--window_size", "32", "--loggers", "[]"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # 2 CPUs, shared by 2 local ranks
    assert (
        main([*base, "--nprocs", "2", "--parallel_mode", "ddp", "--ckpt_dir", str(tmp_path / "plan"), "--dry_run"]) == 0
    )
    assert "loader       1 worker process(es) per rank (num_workers default: at most 4, 2 CPU(s) for 2 local" in (
        capsys.readouterr().out
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # 1 CPU: torch warns about more workers than that
    assert main([*base, "--ckpt_dir", str(tmp_path / "run"), "--max_tokens", "1500"]) == 0  # 512 a step: 3 steps
    out = capsys.readouterr().out
    assert "loader       1 worker process(es) per rank (num_workers default: at most 4, 1 CPU(s) for 1 local" in out
    assert [str(w.message) for w in recwarn if "worker processes" in str(w.message)] == []
    # 855 steps are logged every 42; the step --max_steps ends on is shown too.
    assert re.findall(r"^step (\d+)/855 ", out, re.M) == ["1", "3"]


class FakeFabric:
    global_rank, world_size, loggers = 0, 1, []

    def log_dict(self, metrics, step):
        pass


def test_progress_shows_each_step_with_its_own_numbers_and_a_compiled_first_step_as_such(monkeypatch, capsys):
    from functools import partial
    from types import SimpleNamespace

    from astrai_fabric import reporting
    from astrai_fabric.metrics import MetricLog
    from astrai_fabric.schedule import StepPlan

    now = [0.0]
    monkeypatch.setattr(reporting, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    plan = StepPlan(160, 1, 1, 1, 1, 0.0)  # 160 steps, logged every 8

    def train(reporter, steps):
        for step in range(1, steps + 1):
            now[0] += 40.0 if step == 1 else 0.5  # the first step compiles
            record = {"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0}
            reporter.throughput(record, tokens=64, samples=1)
            reporter.step(record, [], 0, step)
            reporter.restart_clock()
        reporter.close()

    train(reporting.Reporter(FakeFabric(), plan, MetricLog([]), first_step=1, compiled=True), 8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| first step 40.0 s, compilation included | eta ?")
    assert lines[1].startswith("step 8/160") and lines[1].endswith("| 128 tokens/s | eta 1m16s")  # 152 x 0.5 s

    # On a terminal: a bar whose counter and postfix always name the same step.
    monkeypatch.setattr(reporting, "sys", SimpleNamespace(stdout=SimpleNamespace(isatty=lambda: True)))
    monkeypatch.setattr(reporting, "tqdm", partial(reporting.tqdm, mininterval=0, file=sys.stderr))
    train(reporting.Reporter(FakeFabric(), plan, MetricLog([]), first_step=1), 5)
    frames = [f for f in capsys.readouterr().err.split("\r") if "step " in f]
    assert len(frames) >= 5
    for frame in frames:
        assert re.search(r"\| (\d+)/160 ", frame)[1] == re.search(r"step (\d+)/160", frame)[1], frame


def test_grad_snr_is_astrai_formula_in_float64():
    """GradSNR against AstrAI's formula (``astrai/trainer/metric_util.py``: EMAs ``m``, ``v`` of ``g`` and ``g^2``,
    ``10 log10(sum m^2 / sum max(v - m^2, 0))``), written out here elementwise in float64 as the reference, over
    gradients that change a little each step (SNR 20-40 dB, where a float32 ``v - m^2`` cancels most digits).
    Float32 gradients, tolerance 1e-6 relative."""
    beta, eps = 0.999, 1e-8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    base = [torch.randn_like(p) for p in model.parameters()]
    tracker, first, second = GradSNR(beta, eps), None, None
    for step in range(8):
        for p, b in zip(model.parameters(), base, strict=True):
            p.grad = b + 0.05 * (step + 1) * torch.randn_like(b)
        grads = [p.grad.double() for p in model.parameters()]
        if first is None:
            first, second = [g.clone() for g in grads], [g * g for g in grads]
        else:
            first = [beta * m + (1 - beta) * g for m, g in zip(first, grads, strict=True)]
            second = [beta * v + (1 - beta) * g * g for v, g in zip(second, grads, strict=True)]
        signal = sum(float((m * m).sum()) for m in first)
        noise = sum(float((v - m * m).clamp(min=0).sum()) for m, v in zip(first, second, strict=True))
        expected = 10 * math.log10(max(signal / (noise + eps), eps))
        assert tracker.update(model) == pytest.approx(expected, rel=1e-6), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_snr_gives_the_gradient_norm_global_norm_gives(dtype, monkeypatch):
    """The step takes its gradient norm from GradSNR's pass over the gradients (loop/step.py): equal to
    ``global_norm``'s (torch's ``get_total_norm`` per mesh), bit for bit, in blocks smaller than a tensor and over
    several, and for bf16 gradients (norms of the gradients as they are, not of GradSNR's float32 copies)."""
    monkeypatch.setattr("astrai_fabric.metrics.BLOCK_NUMEL", 300)  # several blocks, and tensors larger than one
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8), torch.nn.Linear(8, 4)).to(dtype)
    tracker = GradSNR()
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 3
        tracker.update_on_device(model)
        expected = global_norm(by_device_mesh(p.grad for p in model.parameters()))
        assert torch.equal(tracker.grad_norm, expected)


def test_grad_snr_starts_again_when_the_parameters_with_gradients_change():
    """A parameter that gets no gradient in some step (a user's model; ours give every parameter one) would shift
    every later EMA onto the wrong parameter: the tracker starts again, with a warning, and from there matches a
    tracker that began at that step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    tracker, fresh = GradSNR(), GradSNR()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    tracker.update(model)
    model[0].weight.grad = None  # this step did not use it
    with pytest.warns(UserWarning, match="grad_snr: the parameters that have gradients changed"):
        restarted = tracker.update(model)
    assert restarted == fresh.update(model)
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad + 0.1 * torch.randn_like(p)
    assert tracker.update(model) == pytest.approx(fresh.update(model), rel=1e-12)


def few_records(tmp_path: Path, train_type: str, count: int) -> Path:
    """The first ``count`` records of the bundled data of ``train_type``, in a file of their own."""
    folder = {"seq": "seq", "sft": "sft", "dpo": "dpo", "grpo": "grpo"}[train_type]
    (source,) = (ROOT / "astrai_fabric" / "assets" / "data" / folder).glob("*.jsonl")
    path = tmp_path / f"{train_type}.jsonl"
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))
    return path


def progress_totals(out: str) -> tuple[int, int, list[tuple[int, int]]]:
    """The plan's ``this run`` first and last step, and every progress line's ``(step, total)``."""
    first, last = map(int, re.search(r"^  this run +steps (\d+) to (\d+)", out, re.M).groups())
    return first, last, [tuple(map(int, m)) for m in re.findall(r"^step (\d+)/(\d+) ", out, re.M)]


@pytest.mark.parametrize("train_type", ["seq", "sft", "dpo", "grpo"])
def test_the_progress_total_is_the_step_the_run_ends_at(train_type, tmp_path, capsys):
    """Accumulation windows run across epochs, so 2 epochs of 8 micro-batches in windows of 3 take 5 steps, one
    more than AstrAI's count (2 x 8 // 3 = 4, the schedule's length): the plan, every progress line's total and the
    last line's step say 5. (Regression: the total was the schedule's length, and the last line read 5/4.)"""
    argv = [
        train_type,
        "--config",
        str(ROOT / "recipes" / f"tiny-{train_type}.yaml"),
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--batch_per_device",
        "1",
        "--grad_accum_steps",
        "3",
        "--n_epoch",
        "2",
        "--loggers",
        "[]",
        "--val_split",
        "null",
    ]
    records = {"seq": 1, "sft": 32}.get(train_type, 8)  # 8 samples: seq's windows, sft's packed rows, pairs, groups
    argv += ["--data_root_path", str(few_records(tmp_path, train_type, records))]
    if train_type == "seq":
        argv += ["--max_tokens", str(10**9)]  # a token budget not reached: the total is the data's
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-> 8 micro-batches per rank per epoch -> 4 optimizer steps over 2 epoch(s)" in out  # the case meant
    first, last, lines = progress_totals(out)
    assert (first, last) == (1, 5) and lines[-1] == (5, 5) and {total for _, total in lines} == {5}
    assert "done after step 5;" in out


def test_the_progress_total_holds_across_stops_and_resumes(tmp_path, capsys):
    """A run split by ``--stop_after_steps 2`` shows steps 1-2 of 2, then (resumed) 3-4 of 4, then 5 of 5;
    ``--max_steps 3`` ends at 3 of 3, the schedule planned over 3 steps."""
    data = few_records(tmp_path, "sft", 32)
    base = [
        "sft",
        "--config",
        str(ROOT / "recipes" / "tiny-sft.yaml"),
        "--data_root_path",
        str(data),
        "--batch_per_device",
        "1",
        "--grad_accum_steps",
        "3",
        "--n_epoch",
        "2",
        "--loggers",
        "[]",
    ]
    pieces = [
        (["--stop_after_steps", "2"], 1, 2),
        (["--resume", "auto", "--stop_after_steps", "2"], 3, 4),
        (["--resume", "auto"], 5, 5),
    ]
    for flags, first, last in pieces:
        assert main([*base, "--ckpt_dir", str(tmp_path / "split"), *flags]) == 0
        shown_first, shown_last, lines = progress_totals(capsys.readouterr().out)
        assert (shown_first, shown_last) == (first, last) and lines[0][0] == first and lines[-1] == (last, last)
    assert main([*base, "--ckpt_dir", str(tmp_path / "short"), "--max_steps", "3"]) == 0
    out = capsys.readouterr().out
    assert progress_totals(out)[1:] == (3, [(1, 3), (2, 3), (3, 3)])
    assert "max_steps 3 optimizer steps over 2 epoch(s)" in out and "decay over 3 to" in out  # 3 a step of 8


def test_the_csv_log_is_written_every_flush_seconds_at_checkpoints_and_at_the_end(tmp_path, monkeypatch):
    """The loggers' rows reach the disk by time (reporting.FLUSH_SECONDS), with every checkpoint and at the end: not
    every step (a write per step), nor Lightning's every 100 steps (hours of a slow run lost to a crash)."""
    import csv
    from types import SimpleNamespace

    from lightning.fabric import Fabric
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from astrai_fabric import reporting
    from astrai_fabric.loggers import build_loggers
    from astrai_fabric.metrics import MetricLog
    from astrai_fabric.schedule import StepPlan

    now = [0.0]
    monkeypatch.setattr(reporting, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    # Rank 0, as a fresh process is: an earlier test in this process may have set another (Lightning's
    # environments set the process-wide rank its loggers log on).
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=build_loggers(["csv"], str(tmp_path), {}))
    reporter = reporting.Reporter(fabric, StepPlan(400, 1, 1, 1, 1, 0.0), MetricLog([]), first_step=1)

    def rows() -> list[str]:
        files = list(tmp_path.glob("logs/version_*/metrics.csv"))
        return [row["step"] for row in csv.DictReader(files[0].open())] if files else []

    def steps(first: int, last: int, seconds_each: float) -> None:
        for step in range(first, last + 1):
            now[0] += seconds_each
            record = {"step": step, "epoch": 0, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0}
            reporter.throughput(record, tokens=64, samples=1)
            reporter.step(record, [], 0, step)

    steps(1, 150, 0.1)  # 15 s: past Lightning's 100 steps, short of FLUSH_SECONDS
    assert rows() == []
    steps(151, 160, 2.0)  # 35 s in: written at step 158, the first past 30 s
    assert rows()[-1] == "158" and len(rows()) == 158
    steps(161, 163, 0.1)
    reporter.checkpoint_saved(tmp_path / "step_163")
    assert rows()[-1] == "163"
    steps(164, 165, 0.1)
    reporter.close()
    assert rows() == [str(step) for step in range(1, 166)]
