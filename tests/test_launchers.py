"""Every way of starting ranks gives the same run: the CLI's own launch, `fabric run` on two (simulated) nodes,
torchrun, and SLURM (detected from its variables)."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from safetensors.torch import load_file
from spawn import free_port

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.strategy import build_fabric, resolve_accelerator, resolve_topology
from astrai_fabric.train import fabric_args

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
# 593 sft windows over 2 ranks x 8 x 2 = 18 scheduled steps: every step is logged.
TRAIN = ["sft", "--config", str(ROOT / "recipes" / "tiny-sft.yaml"), "--parallel_mode", "fsdp", "--max_steps", "3",
         "--n_epoch", "1"]  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1", "PATH": str(BIN)}


def losses(stdout: str) -> list[str]:
    return re.findall(r"^step (\d+)/\d+ \| epoch \d+ \| loss (\S+)", stdout, re.M)


def final_weights(ckpt_dir: Path) -> dict:
    return load_file(ckpt_dir / "epoch_0_step_3" / "model.safetensors")


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> tuple[list, dict]:
    out = tmp_path_factory.mktemp("single_node")
    result = subprocess.run(
        [sys.executable, "-m", "astrai_fabric", *TRAIN, "--nprocs", "2", "--ckpt_dir", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(result.stdout), final_weights(out)


def assert_same_run(stdout: str, ckpt_dir: Path, reference: tuple[list, dict]) -> None:
    assert losses(stdout) == reference[0] and len(reference[0]) == 3
    weights = final_weights(ckpt_dir)
    assert all((weights[k] == v).all() for k, v in reference[1].items())  # bit for bit: same ranks, same math


@pytest.mark.slow
def test_fabric_run_on_two_simulated_nodes(tmp_path, single_node):
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                str(BIN / "fabric"),
                "run",
                "--accelerator",
                "cpu",
                "--devices",
                "1",
                "--num-nodes",
                "2",
                "--node-rank",
                str(rank),
                "--main-address",
                "127.0.0.1",
                "--main-port",
                port,
                str(BIN / "astrai-fabric"),
                *TRAIN,
                "--ckpt_dir",
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for rank in (1, 0)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[1][1][-2000:]
    assert "  batch        2 rank(s)" in outputs[1][0]
    assert_same_run(outputs[1][0], tmp_path, single_node)


@pytest.mark.slow
def test_torchrun(tmp_path, single_node):
    command = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "astrai_fabric",
        *TRAIN,
        "--ckpt_dir",
        str(tmp_path),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_run(result.stdout, tmp_path, single_node)


SLURM = {
    "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "77", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODELIST": "node[1-2]",
}  # fmt: skip


def test_slurm_is_detected_from_its_variables(monkeypatch):
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    # Building the Fabric makes this process SLURM's rank 3 for Lightning's rank-zero filter: put it back after
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    args = TrainArgs(param_path="m", data_root_path="d", parallel_mode="fsdp", nprocs=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topology = resolve_topology(args.nprocs, args.num_nodes)
    assert (topology.devices, topology.num_nodes, topology.launched_externally) == (2, 2, True)
    assert any("--nprocs 8 is ignored" in str(w.message) for w in caught)  # the launcher decides
    environment = build_fabric(fabric_args(args), topology).strategy.cluster_environment
    assert type(environment).__name__ == "SLURMEnvironment"
    assert (environment.global_rank(), environment.local_rank(), environment.node_rank()) == (3, 1, 1)
    assert (environment.world_size(), environment.main_address) == (4, "node1")


def test_fabric_run_environment_decides_devices_and_accelerator(monkeypatch):
    monkeypatch.setenv("LT_CLI_USED", "1")
    monkeypatch.setenv("LT_DEVICES", "4")
    monkeypatch.setenv("LT_NUM_NODES", "2")
    monkeypatch.setenv("LT_ACCELERATOR", "cpu")
    args = TrainArgs(param_path="m", data_root_path="d", nprocs=4, num_nodes=2)
    topology = resolve_topology(args.nprocs, args.num_nodes)
    assert (topology.devices, topology.num_nodes, topology.world_size) == (4, 2, 8)
    assert resolve_accelerator(args.device_type) == "cpu"  # `fabric run --accelerator cpu`, even where CUDA exists


def test_under_a_launcher_only_a_conflicting_flag_warns(monkeypatch, tmp_path, capsys, recwarn):
    from astrai_fabric.cli import main

    monkeypatch.chdir(tmp_path)  # the recipe writes under ./checkpoints (a dry run writes nothing)
    for key, value in {"TORCHELASTIC_RUN_ID": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)  # torchrun, 2 ranks on each of 2 nodes
    dry_run = ["seq", "--config", str(ROOT / "recipes" / "tiny-seq.yaml"), "--parallel_mode", "ddp", "--dry_run"]
    for flags in ([], ["--nprocs", "2"], ["--nprocs", "4", "--num_nodes", "2"]):  # none, per node, world size
        assert main([*dry_run, *flags]) == 0
        assert "processes    4 (2 per node x 2 node(s))" in capsys.readouterr().out
        assert [str(w.message) for w in recwarn if "ignored" in str(w.message)] == [], flags
    with pytest.warns(UserWarning, match=r"2 rank\(s\) per node on 2 node\(s\); --nprocs 8 and --num_nodes 3 are"):
        assert main([*dry_run, "--nprocs", "8", "--num_nodes", "3"]) == 0
