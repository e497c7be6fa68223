"""Seeing inside a run: ``--profile_steps`` writes a torch.profiler trace of exactly those optimizer steps, and
``--loggers wandb`` logs offline into ``ckpt_dir`` with one W&B run id kept across ``--resume``. Real runs of the
CLI (in process; W&B's in subprocesses); W&B's own offline files are read back."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from astrai_fabric.cli import main

HAS_WANDB = importlib.util.find_spec("wandb") is not None  # the [wandb] extra (in [test] and [dev])


def tiny(ckpt_dir, *extra) -> list[str]:
    return [
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--window_size",
        "16",
        "--batch_per_device",
        "2",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(ckpt_dir),
        *extra,
    ]


def test_profile_steps_trace_exactly_those_steps(tmp_path, capsys):
    assert main(tiny(tmp_path / "run", "--max_steps", "4", "--ckpt_interval", "4", "--profile_steps", "2:3")) == 0
    out = capsys.readouterr().out
    trace_dir = tmp_path / "run" / "profile" / "steps_2-3"
    assert (
        f"  profiling    steps 2 to 3: a torch.profiler trace per rank (and on CUDA a memory snapshot) in {trace_dir}"
        in out
    )
    assert f"profile: {trace_dir} (rank*.pt.trace.json)" in out
    trace = json.loads((trace_dir / "rank0.pt.trace.json").read_text())  # Chrome trace format
    steps = [event for event in trace["traceEvents"] if event.get("name", "").startswith("optimizer_step")]
    assert [event["name"] for event in steps] == ["optimizer_step 2", "optimizer_step 3"]
    assert steps[0]["ts"] + steps[0]["dur"] <= steps[1]["ts"]  # one span per step, in order
    # The steps' own work is inside their spans: the optimizer's update and the backward pass.
    inside = {e["name"] for e in trace["traceEvents"] if steps[0]["ts"] <= e.get("ts", -1) <= steps[1]["ts"]}
    assert any(name.startswith("Optimizer.step") for name in inside) and any("backward" in n.lower() for n in inside)
    # The resolved recipe quotes the range: unquoted, YAML would read 2:3 as the base-60 number 123.
    assert "profile_steps: '2:3'" in (tmp_path / "run" / "recipe.yaml").read_text()


@pytest.mark.parametrize("value", ["3:2", "0:2", "2", "a:b", ""])
def test_profile_steps_must_be_a_step_range(value, tmp_path, capsys):
    assert main(tiny(tmp_path / "run", "--profile_steps", value, "--max_steps", "1")) == 2  # 1: were it accepted
    err = capsys.readouterr().err
    assert "profile_steps must be A:B with optimizer steps 1 <= A <= B (e.g. 10:12)" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_dry_run_says_profiling_is_on(tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text('profile_steps: "5:5"\n')  # quoted, as a recipe must
    assert main(tiny(tmp_path / "run", "--config", str(tmp_path / "recipe.yaml"), "--dry_run")) == 0
    assert (
        f"  profiling    steps 5 to 5: a torch.profiler trace per rank (and on CUDA a memory snapshot) in {tmp_path}"
        in capsys.readouterr().out
    )
    assert not (tmp_path / "run").exists()


def test_profile_steps_past_the_last_step_are_warned_of_in_the_plan(tmp_path, capsys):
    def plan(*flags: str, run: str = "run") -> list[str]:
        assert main(tiny(tmp_path / run, "--max_steps", "1", *flags)) == 0
        return capsys.readouterr().out.split("\n  outputs ")[0].splitlines()

    warning = "warning: steps 900 to 905 are past this run's last step 1: nothing will be profiled"
    assert plan("--profile_steps", "900:905", "--dry_run")[-1] == warning
    assert plan("--profile_steps", "900:905")[-1] == warning  # the one renderer: the run says the same
    assert not (tmp_path / "run" / "profile").exists()
    partly = plan("--profile_steps", "1:3", "--dry_run", run="other")[-1]
    assert partly == "warning: this run's last step is 1: steps 2 to 3 will not be profiled"


def test_wandb_without_its_package_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # how an absent package imports: ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "astrai_fabric.wandb_logger", raising=False)
    assert main(tiny(tmp_path / "run", "--loggers", "wandb", "--max_steps", "1")) == 2
    err = capsys.readouterr().err
    assert "loggers wandb needs the wandb package" in err and "pip install 'astrai-fabric[wandb]'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def offline_runs(ckpt_dir) -> list[str]:
    """W&B's offline run folders (``offline-run-<time>-<id>``), oldest first."""
    return sorted(path.name for path in (ckpt_dir / "logs" / "wandb").glob("offline-run-*"))


@pytest.mark.skipif(not HAS_WANDB, reason="needs the [wandb] extra (pip install 'astrai-fabric[wandb]')")
def test_wandb_logs_offline_into_ckpt_dir_and_resume_keeps_the_run(tmp_path):
    # Real processes of the CLI: W&B's service writes a run's files by the time its process has exited, and no W&B
    # state of this test process (or of other tests in it) is involved.
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    (tmp_path / "cwd").mkdir()  # W&B's default would be ./wandb

    def train(*flags: str) -> None:
        command = [sys.executable, "-m", "astrai_fabric", *tiny(run, "--loggers", "wandb", *flags)]
        done = subprocess.run(command, cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr

    run = tmp_path / "run"
    train("--max_steps", "2", "--ckpt_interval", "2")
    (first,) = offline_runs(run)
    run_id = (run / "logs" / "wandb_run_id").read_text().strip()
    assert first.endswith(f"-{run_id}") and len(run_id) == 8
    log = (run / "logs" / "wandb" / first / f"run-{run_id}.wandb").read_bytes()
    # The resolved recipe is the run's config (W&B stores each key and its JSON value as text in its log).
    assert b"data_root_path" in log and b'"bundled:data/seq"' in log and str(run).encode() in log
    assert b"trust_code" not in log  # command-line only, as in recipe.yaml
    assert list((tmp_path / "cwd").iterdir()) == []

    train("--max_steps", "3", "--resume", "auto")
    runs = offline_runs(run)
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs)  # the same W&B run, continued
    assert (run / "logs" / "wandb_run_id").read_text().strip() == run_id
    assert list((tmp_path / "cwd").iterdir()) == []
