"""HSDP (``--fsdp_shard_size``) on 4 real CPU processes (gloo) against one process, and its refusals.

One spawn of 4 ranks runs, in sequence: 2 replicas x 2 shards for 4 steps with a sharded checkpoint at step 2; that
checkpoint resumed as 1 replica x 4 shards; 2 replicas x 1 shard x tensor parallel 2; and the CLI's Fabric sharding
the model once more, for what each rank holds. The single-process references run in the test process, with the
same global batch: 4 data-parallel ranks x 1 sample x 2 micro-batches = 1 rank x 4 samples x 2 micro-batches (2 x 1
= 2 x 1 for the tensor-parallel run, one step), and the sampler gives both the same samples per step.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch.distributed as dist
from equality import initial_weights
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from spawn import run_ranks
from test_training_distributed import assert_trained_alike, base_args, weights

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.cli import main
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.parallel.mesh import mesh_layout
from astrai_fabric.parallel.parallelize import parallelize
from astrai_fabric.strategy import LayoutStrategy, check_applied_layout, check_layout_flags
from astrai_fabric.train import build_run_fabric, run, train

HSDP = dict(nprocs=4, batch_per_device=1, parallel_mode="fsdp", optimizer="muon_adamw", max_steps=4, ckpt_interval=2)
REFERENCE = dict(batch_per_device=4, optimizer="muon_adamw", max_steps=4, ckpt_interval=2)
# One step without accumulation: the first tensor-parallel run in a process costs most of this module's time.
HSDP_TP = dict(
    nprocs=4,
    batch_per_device=1,
    grad_accum_steps=1,
    parallel_mode="fsdp",
    optimizer="muon_adamw",
    tp_size=2,
    max_steps=1,
)


def layout_report(args) -> dict:
    """What this rank holds once the CLI's Fabric has sharded the tiny model: bytes and a checksum per parameter."""
    fabric = build_run_fabric(args)
    fabric.launch()
    check_layout_flags(fabric, args.fsdp_shard_size, None, None, None)  # the CLI's own Fabric applies the flag
    model = fabric.setup_module(AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json")))
    local = {name: p.to_local() for name, p in model.module.named_parameters()}
    mesh = next(iter(model.module.parameters())).device_mesh
    report = {
        "mesh": {"names": list(mesh.mesh_dim_names), "shape": list(mesh.shape)},
        "bytes": sum(t.numel() * t.element_size() for t in local.values()),
        "sums": {name: float(t.double().sum()) for name, t in local.items()},
    }
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def four_rank_worker(root: str) -> None:
    root = Path(root)
    rank0 = os.environ["RANK"] == "0"
    history = run(base_args(root / "hsdp", **HSDP, fsdp_shard_size=2, sharded_checkpoint=True))
    if rank0:
        (root / "hsdp.json").write_text(json.dumps(history))
    # The same checkpoint resumed with every data-parallel rank one shard (the default): DCP reshards the state.
    checkpoint = str(root / "hsdp" / "epoch_0_step_2")
    resumed = run(base_args(root / "resumed", **HSDP, sharded_checkpoint=True, resume=checkpoint))
    history = run(base_args(root / "hsdp_tp", **HSDP_TP, fsdp_shard_size=1))
    reports = layout_report(base_args(root / "unused", **HSDP, fsdp_shard_size=2))
    # A Fabric built by a program: a LayoutStrategy with the same shard size passes, any other size is refused.
    user = Fabric(accelerator="cpu", devices=4, strategy=LayoutStrategy(mesh_layout(4, fsdp_shard_size=2)))
    user.launch()
    check_layout_flags(user, 2, None, None, None)
    with pytest.raises(ConfigError, match="fsdp_shard_size 4: the Fabric given to train"):
        check_layout_flags(user, 4, None, None, None)
    # A plain ModelParallelStrategy running our parallelize laid out otherwise than it says (HSDP where the
    # strategy says plain FSDP) is refused once the model is set up, before a step reads a sample.
    plain = ModelParallelStrategy(partial(parallelize, fsdp_shard_size=2), data_parallel_size=4, tensor_parallel_size=1)
    user = Fabric(accelerator="cpu", devices=4, strategy=plain)
    user.launch()
    module = user.setup_module(AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json")))
    with pytest.raises(ConfigError, match="lays the model out as 2 replica.s. x 2 shard.s., but its Model"):
        check_applied_layout(user, module.module)
    if rank0:
        (root / "resumed.json").write_text(json.dumps(resumed))
        (root / "hsdp_tp.json").write_text(json.dumps(history))
        (root / "layout.json").write_text(json.dumps(reports))


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hsdp")
    run_ranks(four_rank_worker, 4, str(root))
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    """The single process's run directory, history and the weights it started from."""
    ckpt_dir = tmp_path_factory.mktemp("one_process")
    args = base_args(ckpt_dir, **REFERENCE)
    return ckpt_dir, run(args), initial_weights(args)


@pytest.mark.slow
def test_two_replicas_of_two_shards_match_one_process(four_rank_runs, reference):
    ckpt_dir, expected, initial = reference
    history = json.loads((four_rank_runs / "hsdp.json").read_text())
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0.5 for r in expected)  # clipping is active at every step
    for ours, ref in zip(history, expected, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-5)  # float32 norms, as in 2-rank FSDP
    for step in (2, 4):
        assert_trained_alike(four_rank_runs / "hsdp", ckpt_dir, step, initial)


@pytest.mark.slow
def test_a_sharded_hsdp_checkpoint_resumes_on_another_layout(four_rank_runs):
    sharded = four_rank_runs / "hsdp" / "epoch_0_step_2"
    assert (sharded / "state" / ".metadata").is_file() and not (sharded / "optimizer.pt").exists()
    resumed = json.loads((four_rank_runs / "resumed.json").read_text())
    assert [r["step"] for r in resumed] == [3, 4]
    # Same samples and state; only the order of floating-point reductions differs (1 x 4 against 2 x 2).
    hsdp = four_rank_runs / "hsdp"
    assert_trained_alike(four_rank_runs / "resumed", hsdp, 4, weights(hsdp, 2))


@pytest.mark.slow
def test_hsdp_with_tensor_parallelism_matches_one_process(four_rank_runs, tmp_path):
    one = base_args(tmp_path, optimizer="muon_adamw", grad_accum_steps=1, max_steps=1)  # 2 ranks x 1 = 2
    expected = run(one)
    history = json.loads((four_rank_runs / "hsdp_tp.json").read_text())
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in expected], abs=1e-5)
    assert_trained_alike(four_rank_runs / "hsdp_tp", tmp_path, 1, initial_weights(one))


@pytest.mark.slow
def test_each_rank_holds_its_shard_and_replicas_hold_the_same(four_rank_runs):
    reports = json.loads((four_rank_runs / "layout.json").read_text())
    assert reports[0]["mesh"] == {"names": ["replicate", "shard"], "shape": [2, 2]}
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied embedding counted once
    # FSDP2 splits dim 0 as torch.chunk does and pads only its communication buffers; the tiny model's dims 0 are
    # even, so each of 2 shards holds exactly half.
    assert all(p.size(0) % 2 == 0 for p in model.parameters())
    assert [r["bytes"] for r in reports] == [total // 2] * 4
    # Ranks 0, 1 are replica 0's shards 0, 1; ranks 2, 3 replica 1's. Replicas hold the same shard, to the bit.
    assert reports[0]["sums"] == reports[2]["sums"] and reports[1]["sums"] == reports[3]["sums"]
    assert reports[0]["sums"] != reports[1]["sums"]


def test_a_program_s_fabric_that_shards_otherwise_refuses_the_flag(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ConfigError, match=r"fsdp_shard_size 2: the Fabric given to train\(\) decides the sharding"):
        train(fabric, base_args(tmp_path, fsdp_shard_size=2, parallel_mode="fsdp"))
    assert not any(tmp_path.iterdir())


def test_the_plan_prints_the_layout(capsys, tmp_path):
    argv = [
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--window_size",
        "32",
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--num_workers",
        "0",
        "--nprocs",
        "8",
        "--dry_run",
    ]
    assert main([*argv, "--fsdp_shard_size", "2", "--tp_size", "2"]) == 0
    assert "parallel_mode fsdp (2 replica(s) x 2 shard(s) x 2 tensor-parallel)" in capsys.readouterr().out
    assert main(argv) == 0
    assert "parallel_mode fsdp (1 replica(s) x 8 shard(s))" in capsys.readouterr().out
    assert main([*argv, "--fsdp_shard_size", "3"]) == 2
    assert "fsdp_shard_size 3 must divide the data-parallel size 8" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()
