"""Mistakes a user can make, each through the real CLI: one message naming what is wrong (listed in
docs/troubleshooting.md), exit code 2, no traceback, and nothing written or overwritten."""

import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.cli import main
from astrai_fabric.data.prepare import PipelineConfig, prepare
from astrai_fabric.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """One finished 1-step run (``run/epoch_0_step_1``), bin shards, and an empty directory."""
    root = tmp_path_factory.mktemp("mistakes")
    assert main(tiny(root / "run", "--max_steps", "1")) == 0
    (root / "empty").mkdir()
    (root / "texts.jsonl").write_text('{"text": "In the beginning God created the heaven and the earth."}\n')
    text = PipelineConfig.from_dict({"input": {"sections": [{"field": "text", "action": "train"}]}}, "text")
    prepare([root / "texts.jsonl"], root / "shards", text, Tokenizer.from_dir(TINY_MODEL_DIR))
    shutil.copytree(root / "run" / "epoch_0_step_1", root / "no_optimizer")
    (root / "no_optimizer" / "optimizer.pt").unlink()
    (root / "broken.yaml").write_text("max_lr: [1e-3\n")
    (root / "typo.yaml").write_text("param_path: bundled:tiny\nmax_lrr: 1.0e-3\n")
    (root / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    (root / "no_tokenizer").mkdir()  # AstrAI's save_pretrained output: config.json, no tokenizer
    (root / "no_tokenizer" / "config.json").write_text(json.dumps(config))
    (root / "small_vocab").mkdir()
    (root / "small_vocab" / "config.json").write_text(json.dumps(config | {"vocab_size": 1000}))
    shutil.copytree(root / "run" / "epoch_0_step_1", root / "other_shape")  # weights of one model, config of another
    (root / "other_shape" / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    shutil.copytree(root / "run" / "epoch_0_step_1", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(root / "run" / "epoch_0_step_1", root / "pickled")
    torch.save({"last_epoch": 1, "hook": os.system}, root / "pickled" / "scheduler.pt")  # a callable inside
    return root


def tiny(ckpt_dir, *extra) -> list[str]:
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
        "--ckpt_dir",
        str(ckpt_dir),
        *extra,
    ]


def snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

CASES = [
    # (argv with {w} for the workspace, message)
    (["seq", "--config", "{w}/broken.yaml"], "broken.yaml: not valid YAML at line 2, column 1"),
    (["seq", "--config", "{w}/typo.yaml"], "unknown key(s) max_lrr (did you mean max_lr?)"),
    (tiny("{w}/new", "--n_epoch", "two"), 'Parser key "n_epoch": Expected a <class \'int\'>. Got value: two'),
    (tiny("{w}/new", "--batch_per_device", "0"), "batch_per_device must be positive, got 0"),
    (tiny("{w}/new", "--max_lr", "-1"), "max_lr must be >= 0, got -1.0"),
    (tiny("{w}/new", "--param_path", "{w}/absent"), "absent: not found (expected a model"),
    (tiny("{w}/new", "--data_root_path", "{w}/latin1.jsonl"), "latin1.jsonl:1: not UTF-8 text"),
    (tiny("{w}/new", "--param_path", "{w}/small_vocab", "--tokenizer_path", "bundled:tiny"),
     "has 2,048 ids, but the model's vocab_size is 1,000"),
    (tiny("{w}/new", "--param_path", "{w}/other_shape"), "does not match the model built from its config.json"),
    (tiny("{w}/new", "--param_path", "{w}/truncated"), "model.safetensors: not a readable safetensors file"),
    (tiny("{w}/new", "--param_path", "{w}/pickled", "--resume", "true"), "scheduler.pt: refused to load"),
    (["frobnicate"], "unknown command 'frobnicate'; choose one of"),
    (tiny("{w}/new", "--metrics", "foo"), "invalid training arguments: metrics ['foo'] are unknown; choose from"),
    (tiny("{w}/new", "--tp_size", "2", "--parallel_mode", "ddp"), "tp_size 2 needs parallel_mode fsdp"),
    (tiny("{w}/new", "--grad_accum_steps", "100000"), "no optimizer step fits in the data"),
    (tiny("{w}/new", "--data_root_path", "{w}/empty"), "no bin shards (meta.json + *.bin) or .jsonl files found"),
    (tiny("{w}/new", "--tokenizer_path", "{w}/empty"),
     "a tokenizer directory holds tokenizer.json and tokenizer_config.json"),
    (["sft", *tiny("{w}/new")[1:]], "an sft record needs a non-empty list 'messages'"),
    (["sft", *tiny("{w}/new", "--param_path", "{w}/no_tokenizer", "--data_root_path", "bundled:data/sft")[1:]],
     "sft on JSONL data needs a tokenizer: {w}/no_tokenizer/tokenizer.json: file not found"),
    (["dpo", *tiny("{w}/new", "--param_path", "{w}/no_tokenizer", "--data_root_path", "bundled:data/dpo")[1:]],
     "dpo needs a tokenizer: {w}/no_tokenizer/tokenizer.json: file not found"),
    (["dpo", *tiny("{w}/new", "--data_root_path", "{w}/shards")[1:]],
     "dpo reads records (JSONL, parquet, ...), not bin shards"),
    (tiny("{w}/run", "--max_steps", "1"), "already holds epoch_0_step_1, past this run's start (step 0)"),
    (tiny("{w}/run", "--dry_run"), "holds 1 checkpoint(s) this fresh run would overwrite"),
    # a run that ends at --max_steps must hold the schedule's explicit phases, in the run and its dry run alike
    (tiny("{w}/new", "--schedule_type", "wsd", "--stable_steps", "8", "--decay_steps", "4", "--max_steps", "10"),
     "stable_steps 8 + decay_steps 4: longer than the 10 steps after warmup of this run (max_steps 10, 0 warmup)"),
    (tiny("{w}/new", "--schedule_type", "sgdr", "--cycle_length", "11", "--max_steps", "10", "--dry_run"),
     "cycle_length 11: longer than the 10 steps after warmup"),
    (["sft", *tiny("{w}/new", "--resume", "{w}/run/epoch_0_step_1")[1:]], "was written by a seq run, this is sft"),
    (tiny("{w}/new", "--resume", "{w}/no_optimizer"), "has no optimizer.pt (add --resume_optimizer false"),
    (tiny("{w}/new", "--resume", "{w}/run/epoch_0_step_1", "--optimizer", "adamw"),
     "the checkpoint was trained with another --optimizer"),
    pytest.param(tiny("{w}/new", "--device_type", "cuda"), "no CUDA device is available here", marks=NO_CUDA),
    pytest.param(tiny("{w}/new", "--parallel_mode", "fsdp", "--nprocs", "2", "--fsdp_cpu_offload"),
                 "fsdp_cpu_offload moves state from an accelerator to CPU memory", marks=NO_CUDA),
    (tiny("{w}/new", "--parallel_mode", "fsdp", "--nprocs", "3", "--tp_size", "2"), "must divide the world size 3"),
    (tiny("{w}/new", "--fsdp_shard_size", "2", "--parallel_mode", "ddp", "--max_steps", "1"),
     "fsdp_shard_size needs parallel_mode fsdp"),
    (tiny("{w}/new", "--fsdp_shard_size", "0", "--parallel_mode", "fsdp"), "fsdp_shard_size must be positive, got 0"),
    (tiny("{w}/new", "--parallel_mode", "fsdp", "--nprocs", "4", "--fsdp_shard_size", "3"),
     "fsdp_shard_size 3 must divide the data-parallel size 4 (world size 4)"),
    # bundled: names are read wherever a model is; the tiny model has no weights, which is said in one line
    (["export", "bundled:tiny"], "assets/tiny: has no weights (no model.safetensors or model.safetensors.index.json"),
    (["export", "bundled:tiny", "--format", "hf", "--out", "{w}/new"], "assets/tiny: has no weights"),
    (["generate", "--param_path", "bundled:tiny", "--prompt", "x"], "assets/tiny: has no weights"),
    (["plot", "{w}/empty"], "no metric.jsonl found"),
    (["prepare", "{w}/texts.jsonl", "-o", "{w}/new", "-c", "{w}/text.json"], "prepare needs --tokenizer_path"),
    (["prepare", "{w}/texts.jsonl", "-o", "{w}/new", "-c", "{w}/long.json", "--tokenizer_path", "bundled:tiny"],
     "no record was kept"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_mistake_gets_one_clear_message(workspace, capsys, argv, message):
    (workspace / "text.json").write_text('{"input": {"sections": [{"field": "text", "action": "train"}]}}')
    (workspace / "long.json").write_text(
        '{"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 1000}}'
    )
    before = snapshot(workspace)
    code = main([arg.replace("{w}", str(workspace)) for arg in argv])
    captured = capsys.readouterr()
    assert code == 2, captured.out[-2000:]
    assert message.replace("{w}", str(workspace)) in captured.err + captured.out, captured.err
    assert "Traceback" not in captured.err
    assert snapshot(workspace) == before  # nothing written, nothing overwritten


def limit_file_size() -> None:
    """In the child: files may not grow past 1 MiB (a full disk, made real), and hitting it raises an OSError."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_full_disk_during_a_save_keeps_the_earlier_checkpoint(workspace, tmp_path):
    shutil.copytree(workspace / "run", tmp_path / "run")
    command = [sys.executable, "-m", "astrai_fabric", *tiny(tmp_path / "run", "--resume", "auto", "--max_steps", "3")]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=limit_file_size)
    assert result.returncode == 2
    assert "epoch_0_step_3: could not write the checkpoint (" in result.stderr and "File too large" in result.stderr
    assert "while writing " in result.stderr and "nothing of it was kept" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "run").glob("*epoch_*")) == ["epoch_0_step_1"]  # no partial save
    assert snapshot(tmp_path / "run" / "epoch_0_step_1") == snapshot(workspace / "run" / "epoch_0_step_1")


def can_mount_in_a_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "layout, written",
    [
        ([], "model.safetensors"),
        ([], "optimizer.pt"),
        (["--parallel_mode", "fsdp", "--sharded_checkpoint", "true"], "state"),
    ],
    ids=["weights", "optimizer", "sharded"],
)
def test_a_full_disk_names_its_device_and_the_file(workspace, tmp_path, layout, written):
    """A real full disk: a tmpfs 1 MiB larger than the finished run (and the weights, for the optimizer's case),
    mounted in a user namespace of its own, and the run resumed to step 2 on it. The save of step 2 fails for space
    in the file named (safetensors' weights, ``torch.save``'s optimizer.pt and torch's sharded state, whose writers
    hide the errno), and says so in one line naming the device and the file; step 1 is untouched and no staging
    directory is left. The mount lives as long as the namespace: the shell lists it before it ends."""
    if not can_mount_in_a_namespace():
        pytest.skip("no user namespaces here (unshare -rm): a small file system cannot be mounted")
    source, disk = workspace / "run", tmp_path / "disk"
    disk.mkdir()
    size = sum(f.stat().st_size for f in source.rglob("*") if f.is_file()) + 2**20
    if written == "optimizer.pt":
        size += (source / "epoch_0_step_1" / "model.safetensors").stat().st_size
    command = [sys.executable, "-m", "astrai_fabric", *tiny(disk / "run", "--resume", "auto", "--max_steps", "2")]
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {disk} && cp -a {source} {disk}/run || exit 99; "
        f'{shlex.join(command + layout)}; echo "exit $?"; cd {disk}/run && find . | sort && sha256sum epoch_0_step_1/*'
    )
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ["PATH"]}
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env)
    target = f"{disk}/run/epoch_0_step_2"
    assert (
        f"astrai-fabric: error: {target}: no space left on tmpfs (mounted at {disk}) while writing {target}/{written}; "
        "nothing of it was kept and earlier checkpoints are intact" in result.stderr
    ), result.stderr[-3000:]
    assert "exit 2" in result.stdout and "Traceback" not in result.stderr
    assert "epoch_0_step_2" not in result.stdout  # neither the checkpoint nor its staging
    for file in (source / "epoch_0_step_1").iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        assert f"{digest}  epoch_0_step_1/{file.name}" in result.stdout, file.name


@pytest.mark.slow
def test_a_refusal_every_rank_raises_is_printed_once(workspace):
    # Rank 0 finds the later checkpoint and tells rank 1: both exit 2, one message (not one per rank).
    command = [
        sys.executable,
        "-m",
        "astrai_fabric",
        *tiny(workspace / "run", "--max_steps", "1", "--parallel_mode", "ddp", "--nprocs", "2"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("astrai-fabric: error:") == 1, result.stderr[-2000:]
    assert "already holds epoch_0_step_1, past this run's start (step 0)" in result.stderr
