"""Nothing in a ckpt_dir is lost: one run at a time (a lock), no file a run did not write is overwritten (a
manifest), no checkpoint holds non-finite weights, and pruning never follows a symlink."""

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from spawn import free_port
from test_faults import cli, started

from astrai_fabric.checkpoint import complete_checkpoints, find_latest_checkpoint
from astrai_fabric.checkpoint import ownership as ckpt_dir
from astrai_fabric.cli import main

ENV = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent)}


def tiny(directory, *extra) -> list[str]:
    return [
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--window_size",
        "16",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(directory),
        *extra,
    ]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


# --- the lock ----------------------------------------------------------------------------------------------------


def test_a_second_run_into_a_held_ckpt_dir_refuses_on_every_rank_and_a_killed_runs_lock_is_taken_over(tmp_path):
    first, _ = started(cli("--parallel_mode", "none", "--ckpt_dir", str(tmp_path), "--max_steps", "500"))
    try:
        before = snapshot(tmp_path)
        assert ".astrai_fabric.lock" in before and "recipe.yaml" in before
        # The second run has two ranks (two single-rank 'nodes'): rank 0 finds the lock held, rank 1 must hear of it.
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        second = cli(
            "--parallel_mode",
            "ddp",
            "--num_nodes",
            "2",
            "--ckpt_dir",
            str(tmp_path),
            "--max_lr",
            "1e-3",
            "--max_steps",
            "1",
            "--dist_timeout",
            "60",
        )
        ranks = [
            subprocess.Popen(
                second, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, NODE_RANK=str(rank))
            )
            for rank in (0, 1)
        ]
        errors = [rank.communicate(timeout=120)[1] for rank in ranks]
        assert [rank.returncode for rank in ranks] == [2, 2], errors
        for err in errors:
            assert err.count("astrai-fabric: error:") == 1 and "Traceback" not in err  # (and Lightning's banner)
            assert f"in use by another run (host {socket.gethostname()}, pid {first.pid}, started " in err
        assert snapshot(tmp_path) == before  # the first run's recipe.yaml, manifest and lock record as they were
    finally:
        first.kill()  # SIGKILL: its lock dies with it, its record stays
        first.communicate()

    # The killed run's record is left; its lock is gone, so the next run takes it over with a warning.
    with pytest.warns(UserWarning, match=f"taking over the lock left by host .*, pid {first.pid}, .*no longer exists"):
        assert main(tiny(tmp_path, "--max_steps", "1")) == 0
    assert not (tmp_path / ".astrai_fabric.lock").exists()  # released at exit
    assert find_latest_checkpoint(tmp_path).name == "epoch_0_step_1"


def test_the_lock_is_held_for_the_run_and_the_dry_run_reports_it_without_taking_it(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    lock_path = tmp_path / "run" / ".astrai_fabric.lock"
    holder = os.open(lock_path, os.O_RDWR | os.O_CREAT)  # another open file: flock excludes it as another process
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(holder, json.dumps({"host": "node7", "pid": 4242, "started": "2025-01-01T00:00:00"}).encode())
        assert main(tiny(tmp_path / "run", "--dry_run")) == 2
        out = capsys.readouterr().out
        assert "cannot start:" in out and "in use by another run (host node7, pid 4242, started 2025-01-01" in out
        assert main(tiny(tmp_path / "run", "--max_steps", "1")) == 2
        assert "in use by another run (host node7, pid 4242" in error_line(capsys)
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".astrai_fabric.lock"]  # nothing written
    finally:
        os.close(holder)


def test_a_filesystem_that_cannot_lock_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, recwarn):
    def no_locks(fd, operation):  # what flock says on NFS/Lustre mounts without lock support
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(ckpt_dir.fcntl, "flock", no_locks)
    assert main(tiny(tmp_path, "--max_steps", "1")) == 0
    warned = [str(w.message) for w in recwarn if "cannot lock" in str(w.message)]
    assert len(warned) == 1 and "this filesystem cannot lock files (ENOLCK" in warned[0]
    assert find_latest_checkpoint(tmp_path).name == "epoch_0_step_1"


def test_a_ckpt_dir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    assert main(tiny(tmp_path / ("x" * 300), "--max_steps", "1")) == 2  # a name longer than the filesystem allows
    assert "ckpt_dir " in (line := error_line(capsys)) and "cannot be created or written" in line
    assert list(tmp_path.iterdir()) == []


# --- the manifest ------------------------------------------------------------------------------------------------


def test_files_a_run_did_not_write_are_never_overwritten(tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text("my own notes\n")
    (tmp_path / "plot.png").write_bytes(b"my own picture")
    assert main(tiny(tmp_path, "--max_steps", "1", "--loggers", "[csv]")) == 2
    line = error_line(capsys)
    assert "recipe.yaml, plot.png are not written by astrai-fabric (not listed in .astrai_fabric.json)" in line
    assert snapshot(tmp_path) == {"recipe.yaml": b"my own notes\n", "plot.png": b"my own picture"}  # no lock file
    (tmp_path / "recipe.yaml").unlink()
    (tmp_path / "logs").mkdir()  # a directory the CSV logger would write into
    assert main(tiny(tmp_path, "--max_steps", "1", "--loggers", "[csv]", "--dry_run")) == 2
    assert "plot.png, logs are not written by astrai-fabric" in capsys.readouterr().out
    (tmp_path / ".astrai_fabric.json").write_text("[1, 2]")
    assert main(tiny(tmp_path, "--max_steps", "1")) == 2
    assert "is not astrai-fabric's manifest of the files it wrote" in error_line(capsys)


def test_a_lock_record_that_is_not_ours_leaves_the_holder_unknown(tmp_path):
    for content in (b"[" * 4096, b"\xff\xfe", b"[1, 2]"):  # too deep for Python's parser, not UTF-8, not a record
        (tmp_path / "lock").write_bytes(content)
        fd = os.open(tmp_path / "lock", os.O_RDONLY)
        try:
            assert ckpt_dir._read_holder(fd) is None
        finally:
            os.close(fd)


def test_a_runs_own_files_are_rewritten_on_resume_also_for_runs_from_before_the_manifest(tmp_path):
    assert main(tiny(tmp_path, "--max_steps", "1")) == 0
    assert json.loads((tmp_path / ".astrai_fabric.json").read_text())["names"] == ["plot.png", "recipe.yaml"]
    (tmp_path / ".astrai_fabric.json").unlink()  # as an older version of astrai-fabric left it
    plot = (tmp_path / "plot.png").read_bytes()
    assert main(tiny(tmp_path, "--max_steps", "2", "--resume", "auto")) == 0
    assert "max_steps: 2" in (tmp_path / "recipe.yaml").read_text()
    assert (tmp_path / "plot.png").read_bytes() != plot
    assert json.loads((tmp_path / ".astrai_fabric.json").read_text())["names"] == ["plot.png", "recipe.yaml"]
    assert find_latest_checkpoint(tmp_path).name == "epoch_0_step_2"


# --- non-finite weights ------------------------------------------------------------------------------------------


def nan_free(root: Path) -> bool:
    weights = [load_file(c / "model.safetensors") for c in complete_checkpoints(root)]
    return all(t.isfinite().all() for w in weights for t in w.values())


def test_weights_made_non_finite_by_a_step_are_never_saved(tmp_path, capsys):
    # A huge but float32-finite rate and decay: AdamW's decay factor 1 - lr * wd overflows the weights to inf in
    # step 1 while loss and gradients are finite. Before this check, later steps were skipped and the NaN weights
    # saved as "the last good state".
    huge = [
        "--optimizer",
        "adamw",
        "--max_lr",
        "1e30",
        "--weight_decay",
        "1e30",
        "--ckpt_interval",
        "1",
        "--max_steps",
        "20",
    ]
    assert main(tiny(tmp_path / "fresh", *huge, "--max_bad_steps", "1")) == 1
    line = error_line(capsys)
    assert "the weights became non-finite (NaN or infinite) in optimizer step 1" in line
    assert f"ckpt_dir {tmp_path / 'fresh'} holds no checkpoint" in line
    assert complete_checkpoints(tmp_path / "fresh") == []

    # No save due after step 1: step 2 reads step 1's check with its own numbers (one read per step) and stops.
    sparse = [*huge[:-4], "--ckpt_interval", "50", "--max_steps", "20"]
    assert main(tiny(tmp_path / "sparse", *sparse, "--max_bad_steps", "1")) == 1
    line = error_line(capsys)
    assert "the weights became non-finite (NaN or infinite) in optimizer step 1 (loss " in line
    assert complete_checkpoints(tmp_path / "sparse") == []

    # min_rate 0: step 1 runs at lr 0 (saved, finite), step 2 at max_lr / warmup: the message names step 1's.
    assert main(tiny(tmp_path / "later", *huge, "--min_rate", "0")) == 1
    line = error_line(capsys)
    assert "became non-finite (NaN or infinite) in optimizer step 2" in line
    assert f"The newest checkpoint is {tmp_path / 'later' / 'epoch_0_step_1'}: continue from it" in line
    assert [c.name for c in complete_checkpoints(tmp_path / "later")] == ["epoch_0_step_1"]
    assert nan_free(tmp_path / "later")


# --- symlinks ----------------------------------------------------------------------------------------------------


def test_pruning_never_follows_or_dies_on_a_symlinked_checkpoint(tmp_path):
    elsewhere, run = tmp_path / "elsewhere", tmp_path / "run"
    assert main(tiny(elsewhere, "--max_steps", "1")) == 0
    target = elsewhere / "epoch_0_step_1"
    before = snapshot(target)
    run.mkdir()
    (run / "epoch_0_step_1").symlink_to(target, target_is_directory=True)  # linked in to continue from it
    (run / "epoch_0_step_9").symlink_to(tmp_path / "gone", target_is_directory=True)  # a dangling link
    assert find_latest_checkpoint(run).name == "epoch_0_step_1"  # the dangling one is no checkpoint
    assert main(tiny(run, "--max_steps", "3", "--ckpt_interval", "1", "--keep_last_k", "1", "--resume", "auto")) == 0
    assert snapshot(target) == before  # the link's target untouched
    assert (run / "epoch_0_step_1").is_symlink() and (run / "epoch_0_step_9").is_symlink()  # not ours to delete
    assert not (run / "epoch_0_step_2").exists() and (run / "epoch_0_step_3").is_dir()
    shutil.rmtree(elsewhere)
    assert find_latest_checkpoint(run).name == "epoch_0_step_3"  # dangling links everywhere: still no crash
