"""Mistakes a user can make, each through the real CLI: one message naming what is wrong (listed in
docs/troubleshooting.md), exit code 2, no traceback, and nothing written or overwritten."""

import shutil

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
    return root


def tiny(ckpt_dir, *extra) -> list[str]:
    return ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "16",
            "--parallel_mode", "none", "--num_workers", "0", "--ckpt_dir", str(ckpt_dir), *extra]  # fmt: skip


def snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")

CASES = [
    # (argv with {w} for the workspace, message)
    (["frobnicate"], "unknown command 'frobnicate'; choose one of"),
    (tiny("{w}/new", "--metrics", "foo"), "invalid training arguments: metrics ['foo'] are unknown; choose from"),
    (tiny("{w}/new", "--tp_size", "2", "--parallel_mode", "ddp"), "tp_size 2 needs parallel_mode fsdp"),
    (tiny("{w}/new", "--grad_accum_steps", "100000"), "no optimizer step fits in the data"),
    (tiny("{w}/new", "--data_root_path", "{w}/empty"), "no bin shards (meta.json + *.bin) or .jsonl files found"),
    (tiny("{w}/new", "--tokenizer_path", "{w}/empty"),
     "a tokenizer directory holds tokenizer.json and tokenizer_config.json"),
    (["sft", *tiny("{w}/new")[1:]], "an sft record needs a non-empty list 'messages'"),
    (["dpo", *tiny("{w}/new", "--data_root_path", "{w}/shards")[1:]], "dpo reads JSONL records, not bin shards"),
    (tiny("{w}/run", "--max_steps", "1"), "already holds epoch_0_step_1, past this run's start (step 0)"),
    (tiny("{w}/run", "--dry_run"), "holds 1 checkpoint(s) this fresh run would overwrite"),
    (["sft", *tiny("{w}/new", "--resume", "{w}/run/epoch_0_step_1")[1:]], "was written by a seq run, this is sft"),
    (tiny("{w}/new", "--resume", "{w}/no_optimizer"), "has no optimizer.pt (add --resume_optimizer false"),
    (tiny("{w}/new", "--resume", "{w}/run/epoch_0_step_1", "--optimizer", "adamw"),
     "the checkpoint was trained with another --optimizer"),
    pytest.param(tiny("{w}/new", "--device_type", "cuda"), "no CUDA device is available here", marks=NO_CUDA),
    pytest.param(tiny("{w}/new", "--parallel_mode", "fsdp", "--nprocs", "2", "--fsdp_cpu_offload"),
                 "fsdp_cpu_offload moves state from an accelerator to CPU memory", marks=NO_CUDA),
    (tiny("{w}/new", "--parallel_mode", "fsdp", "--nprocs", "3", "--tp_size", "2"), "must divide the world size 3"),
    (["export", "{w}/run/epoch_0_step_1"], "not a sharded checkpoint (it is complete already)"),
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
    assert message in captured.err + captured.out, captured.err
    assert "Traceback" not in captured.err
    assert snapshot(workspace) == before  # nothing written, nothing overwritten
