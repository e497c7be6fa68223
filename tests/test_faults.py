"""Faults a long run must survive, made real: signals to a running CLI (one rank or one of two), non-finite steps,
a rank killed mid-run, and kill -9 while a checkpoint is being written."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from safetensors.torch import load_file
from spawn import free_port

from astrai_fabric.assets import resolve
from astrai_fabric.checkpoint import find_latest_checkpoint, load_checkpoint
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import TrainingError
from astrai_fabric.preemption import StopRequest
from astrai_fabric.train import lm
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.start import resolve_start

BIN = Path(sys.executable).parent
ENV = {"OMP_NUM_THREADS": "1", "PATH": str(BIN)}
# 145,881 tokens in windows of 32: 4,558 samples, 569 steps of 8 per epoch: far more than any test runs.
SEQ = ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "32",
       "--batch_per_device", "4", "--grad_accum_steps", "2", "--num_workers", "0", "--ckpt_interval", "1000",
       "--loggers", "[]"]  # fmt: skip


def cli(*flags: str) -> list[str]:
    return [sys.executable, "-m", "astrai_fabric", *SEQ, *flags]


def started(command: list[str], env: dict | None = None) -> tuple[subprocess.Popen, list[str]]:
    """A CLI run, returned once it has finished its first optimizer step (its stdout lines so far)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1/"):
            return proc, lines
    raise AssertionError(f"the run ended before its first step: {proc.wait()} {proc.stderr.read()[-2000:]}")


def finish(proc: subprocess.Popen, head: list[str], timeout: float = 120) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    return "".join(head) + out, err


def step_losses(checkpoint: Path) -> list[tuple[int, float]]:
    entries = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    return [(e["step"], e["loss"]) for e in entries if e["type"] == "step"]


# --- preemption --------------------------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_and_resume_auto_continues_exactly(tmp_path):
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    proc, head = started(cli("--parallel_mode", "none", "--ckpt_dir", str(interrupted), "--stop_after_steps", "500"))
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = finish(proc, head)
    assert proc.returncode == 0, stderr[-2000:]
    stopped_at = int(stdout.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 1 <= stopped_at < 500
    assert f"--config {interrupted / 'recipe.yaml'} --resume auto" in stdout  # says how to continue
    assert find_latest_checkpoint(interrupted).name == f"epoch_0_step_{stopped_at}"

    total = str(stopped_at + 3)
    resumed = subprocess.run(
        cli("--parallel_mode", "none", "--ckpt_dir", str(interrupted), "--stop_after_steps", "3", "--resume", "auto"),
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"  resume       from {interrupted / f'epoch_0_step_{stopped_at}'}" in resumed.stdout
    reference = subprocess.run(
        cli("--parallel_mode", "none", "--ckpt_dir", str(uninterrupted), "--stop_after_steps", total),
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert reference.returncode == 0, reference.stderr[-2000:]
    ours, theirs = find_latest_checkpoint(interrupted), find_latest_checkpoint(uninterrupted)
    assert ours.name == theirs.name == f"epoch_0_step_{total}"
    assert step_losses(ours) == step_losses(theirs)  # the metric log continues across the resume, bit for bit
    assert len(step_losses(ours)) == int(total)
    expected = load_file(theirs / "model.safetensors")
    assert all(torch.equal(tensor, expected[key]) for key, tensor in load_file(ours / "model.safetensors").items())


def two_ranks(ckpt_dir: Path, *flags: str) -> list[tuple[subprocess.Popen, list[str]]]:
    """Two single-rank 'nodes' joined by environment variables (no launcher process watching them)."""
    env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = cli(
        "--parallel_mode",
        "ddp",
        "--num_nodes",
        "2",
        "--ckpt_dir",
        str(ckpt_dir),
        "--stop_after_steps",
        "500",
        "--dist_timeout",
        "60",
        *flags,
    )
    rank1 = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, NODE_RANK="1")
    )
    return [started(command, dict(env, NODE_RANK="0")), (rank1, [])]


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    (rank0, head0), (rank1, head1) = two_ranks(tmp_path)
    rank1.send_signal(signal.SIGINT)  # Ctrl-C reaching one rank only
    (stdout, stderr0), (_, stderr1) = finish(rank0, head0), finish(rank1, head1)
    assert (rank0.returncode, rank1.returncode) == (0, 0), stderr0[-1000:] + stderr1[-1000:]
    assert "stopped by a signal to another rank after step" in stdout
    stopped_at = int(stdout.split("after step ")[1].split(";")[0])
    checkpoint = load_checkpoint(find_latest_checkpoint(tmp_path))
    assert checkpoint.path.name == f"epoch_0_step_{stopped_at}"
    assert checkpoint.meta["resume_position"]["world_size"] == 2 and "optimizer" in checkpoint.extra


def test_a_killed_rank_makes_the_other_exit_with_an_error(tmp_path):
    (rank0, head0), (rank1, _) = two_ranks(tmp_path)
    rank1.kill()  # SIGKILL: no chance to say goodbye
    _, stderr = finish(rank0, head0, timeout=90)  # --dist_timeout 60 bounds the wait
    assert rank0.returncode == 1
    assert "astrai-fabric: error: rank 0 lost the other ranks" in stderr and "Traceback" not in stderr
    rank1.wait()


def child_ranks(pid: int) -> list[int]:
    """The processes ``pid`` started (its ranks), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def moe_model(root: Path) -> str:
    """The tiny model's config made MoE (8 experts, top-2), for expert parallelism."""
    config = json.loads((Path(resolve("bundled:tiny")) / "config.json").read_text())
    root.mkdir(parents=True, exist_ok=True)
    moe = dict(ffn_type="moe", n_routed_experts=8, n_shared_experts=1, n_activated_experts=2)
    (root / "config.json").write_text(json.dumps(config | moe))
    return str(root)


@pytest.mark.parametrize(
    "layout, fault",
    [
        (["--cp_size", "2"], signal.SIGKILL),
        (["--ep_size", "2"], signal.SIGKILL),
        (["--pp_size", "2", "--pp_schedule", "interleaved_1f1b"], signal.SIGSTOP),
    ],
    ids=["cp-killed", "ep-killed", "pp-stopped"],
)
def test_a_lost_child_rank_ends_the_run_with_exit_1_and_one_line(tmp_path, layout, fault):
    """``--nprocs 2`` under each model-parallel layout, the launcher's child rank killed (or stopped) after step 1:
    the launcher says it lost the other ranks, in one line, exits 1 (not Lightning's watcher's silent 137), and no
    process of the run is left, the stopped one included (``launch.LocalRanks``). Under the pipeline, torch's report
    of the failed schedule goes to the crash log, not stderr."""
    model = (
        ["--param_path", moe_model(tmp_path / "moe"), "--tokenizer_path", "bundled:tiny"]
        if "--ep_size" in layout
        else []
    )
    command = cli(*layout, *model, "--parallel_mode", "fsdp", "--nprocs", "2", "--ckpt_dir", str(tmp_path / "run"))
    command += ["--dist_timeout", "5" if fault == signal.SIGSTOP else "60"]
    proc, head = started(command, dict(ENV, MASTER_PORT=str(free_port())))
    (child,) = child_ranks(proc.pid)
    os.kill(child, fault)
    try:
        _, stderr = finish(proc, head, timeout=60)
    finally:
        os.kill(child, signal.SIGKILL) if alive(child) else None
    assert proc.returncode == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("astrai-fabric: error:")]
    assert len(lines) == 1 and "rank 0 lost the other ranks" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr
    assert not alive(child)  # killed by the launcher as it ended, stopped or not
    if "--pp_size" in layout:  # torch's schedule, printed as a table when a step fails: in the crash log alone
        assert "schedules.py" not in stderr and "Step 00" not in stderr, stderr[-3000:]
        assert "returned a view tensor" not in stderr  # FSDP's warning of the last stage's losses, gone
        (log,) = (tmp_path / "run").glob("crash-*.log")
        assert "torch's pipeline schedule reported" in log.read_text() and "Step 00" in log.read_text()


def test_the_watcher_reports_a_lost_rank_the_launcher_does_not_notice(tmp_path):
    """A launching process busy elsewhere (no collective to fail): the watcher gives it ``NOTICE_S`` to notice the
    rank that died, then says so in the launcher's words and exits 1, killing the ranks left."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("astrai-fabric: error:")]
    assert lines == ["astrai-fabric: error: lost: local rank 1 (pid " + lines[0].split("(pid ")[1]], result.stderr
    assert "was killed by SIGKILL" in lines[0]
    survivor = int(result.stdout.split("survivor ")[1])
    assert not alive(survivor)


WATCHED = """
import os, signal, subprocess, sys, time
from astrai_fabric import launch
launch.NOTICE_S = 0.5
dying = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(1); os.kill(os.getpid(), 9)"])
survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("survivor", survivor.pid, flush=True)
launch.LocalRanks([dying, survivor], lambda what: f"lost: {what}", {})
time.sleep(60)  # busy elsewhere: never notices
"""


# --- non-finite steps --------------------------------------------------------------------------------------------


def poisoned_run(tmp_path: Path, bad_micro_batches, **overrides) -> list[dict]:
    """seq on the tiny model, the loss made NaN on the given micro-batches (counted from 0)."""
    args = TrainArgs(
        train_type="seq",
        param_path="bundled:tiny",
        data_root_path="bundled:data/seq",
        window_size=16,
        batch_per_device=2,
        grad_accum_steps=2,
        parallel_mode="none",
        num_workers=0,
        optimizer="adamw",
        ckpt_dir=str(tmp_path),
        ckpt_interval=1000,
        loggers=[],
        **overrides,
    )
    fabric = Fabric(accelerator="cpu", devices=1)
    calls = itertools.count()

    def loss_fn(model, batch):
        loss, metrics = lm.lm_loss(model, batch, label_smoothing=0.0, moe_aux_loss_coef=0.0)
        return (loss * float("nan"), metrics) if next(calls) in bad_micro_batches else (loss, metrics)

    start = resolve_start(fabric, args)
    dataset, summary = lm.build_dataset(args, start)
    return train_on(fabric, args, start, TrainTask(dataset, summary, loss_fn))


def test_a_non_finite_step_is_skipped_and_counted(tmp_path):
    clean = poisoned_run(tmp_path / "clean", bad_micro_batches=(), max_steps=4)
    history = poisoned_run(tmp_path / "poisoned", bad_micro_batches={2, 3}, max_steps=4)  # the 2nd window
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert [r["lr"] for r in history] == [r["lr"] for r in clean]  # the schedule did not advance on the bad window
    checkpoint = load_checkpoint(tmp_path / "poisoned" / "epoch_0_step_4")
    assert checkpoint.meta["resume_position"]["skipped_steps"] == 1
    assert checkpoint.consumed_samples == 5 * 2 * 2  # the skipped window's samples count as consumed
    assert checkpoint.extra["scheduler"]["last_epoch"] == 4
    assert history[0]["loss"] == clean[0]["loss"] and history[1]["loss"] != clean[1]["loss"]  # later data


def test_too_many_bad_steps_in_a_row_stop_with_the_last_good_state_saved(tmp_path):
    with pytest.raises(TrainingError, match=r"3 optimizer steps in a row had a non-finite loss .* after step 1"):
        poisoned_run(tmp_path, bad_micro_batches=range(2, 100), max_bad_steps=2, max_steps=50)
    checkpoint = load_checkpoint(find_latest_checkpoint(tmp_path))
    assert checkpoint.path.name == "epoch_0_step_1"
    assert checkpoint.meta["resume_position"]["skipped_steps"] == 3
    assert all(torch.isfinite(t).all() for t in checkpoint.state_dict.values())


# --- kill -9 while a checkpoint is written ------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["meta", "weights", "extra", "rename"])
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, point):
    env = dict(ENV, ASTRAI_FABRIC_CRASH_AT=f"{point}@2")  # the second save dies at this point
    run = subprocess.run(
        cli("--parallel_mode", "none", "--ckpt_dir", str(tmp_path), "--max_steps", "6", "--ckpt_interval", "2"),
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    newest = find_latest_checkpoint(tmp_path)
    assert newest.name == "epoch_0_step_2"
    load_checkpoint(newest)  # every file, the .pt extras included
    assert len(list(tmp_path.glob(".epoch_0_step_4.tmp-*"))) == 1  # the partial one stays hidden
    if point == "weights":  # and the next run clears it and continues from the newest complete one
        resumed = subprocess.run(
            cli(
                "--parallel_mode",
                "none",
                "--ckpt_dir",
                str(tmp_path),
                "--max_steps",
                "6",
                "--ckpt_interval",
                "2",
                "--resume",
                "auto",
            ),
            capture_output=True,
            text=True,
            env=ENV,
        )
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "removed 1 partial checkpoint(s)" in resumed.stdout and "  resume       from " in resumed.stdout
        assert find_latest_checkpoint(tmp_path).name == "epoch_0_step_6"
        assert not list(tmp_path.glob(".epoch_*"))


def test_stop_request_records_the_first_signal_and_a_second_ctrl_c_stops_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered to this (main) thread's handler
        assert (stop.requested, stop.signal_name) == (True, "SIGTERM")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handlers are back


# --- any exception ends every process: no hang, workers reaped ---------------------------------------------------

FAILING_RUN = """
import sys
from astrai_fabric.cli import main
from astrai_fabric.data.datasets import WindowDataset

read = WindowDataset.__getitem__
calls = [0]

def fail_mid_epoch(self, index):  # runs in the loader's worker processes (forked, so they have it too)
    calls[0] += 1
    if calls[0] > 12:
        raise RuntimeError("injected failure mid-epoch")
    return read(self, index)

WindowDataset.__getitem__ = fail_mid_epoch
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "two-ddp-ranks"])
def test_an_exception_mid_epoch_ends_every_process_with_workers_reaped(tmp_path, ranks):
    script = tmp_path / "failing.py"
    script.write_text(FAILING_RUN)
    flags = [
        *SEQ,
        "--num_workers",
        "2",
        "--persistent_workers",
        "true",
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--nprocs",
        str(ranks),
        "--parallel_mode",
        "ddp" if ranks > 1 else "none",
    ]
    env = {**ENV, "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        [sys.executable, str(script), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=60)  # a hang fails here (the bug this guards against never exited)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "astrai-fabric: error: internal error, a bug: RuntimeError" in stderr or "lost the other ranks" in stderr
    logs = list((tmp_path / "run").glob("crash-*.log"))
    assert logs and "injected failure mid-epoch" in logs[0].read_text()
    for _ in range(100):  # every process of the run (ranks, loader workers) is gone within 10 s
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("processes of the failed run are still alive")


def test_running_out_of_memory_mid_run_is_one_line_not_a_bug(tmp_path):
    """A model that builds but whose step does not fit (here: the address space capped at 1.6 GB, a 67M-parameter
    model whose gradients and optimizer state pass it) ends with one line saying so and what to change, exit 1: not
    "internal error, a bug" (what the fuzz tier met when two such runs shared the machine)."""
    import resource

    from astrai_fabric.assets import TINY_MODEL_DIR

    model = tmp_path / "m"
    model.mkdir()
    for file in Path(TINY_MODEL_DIR).iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 8192}))  # 67M parameters, 0.27 GB
    cap = 1_600_000_000

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    command = [*cli("--param_path", str(model), "--window_size", "16", "--max_steps", "1"), "--ckpt_dir"]
    done = subprocess.run(
        [*command, str(tmp_path / "out")], env=ENV, capture_output=True, text=True, timeout=300, preexec_fn=capped
    )
    assert done.returncode == 1, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("astrai-fabric: error:")]
    assert line.startswith("astrai-fabric: error: out of memory: the run needs more than this machine has"), line
    assert "internal error" not in done.stderr
