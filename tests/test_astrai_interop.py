"""Checkpoints cross between AstrAI and astrai_fabric in both directions, checked with AstrAI's own code.

Runs where AstrAI is available (tests/astrai_oracle.py says how it is found; `.ci/run` builds it on every CI run
from the snapshot in ../shared/astrai), skips with the reason elsewhere.

Each direction runs AstrAI in a real subprocess with its own interpreter, on real files.
"""

import json
import subprocess

import pytest
import torch
from astrai_oracle import ASTRAI_PYTHON, ASTRAI_SRC, astrai_env, needs_astrai, run_astrai
from conftest import tiny_config

from astrai_fabric.checkpoint import load_checkpoint, load_model, save_checkpoint
from astrai_fabric.model import AutoRegressiveLM

pytestmark = needs_astrai


@pytest.mark.parametrize("tied", [True, False])
def test_our_checkpoint_loads_in_astrai(tmp_path, tied):
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(tie_word_embeddings=tied))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 32, (2, 5)))["logits"].sum().backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / "epoch_0_step_1",
        model.state_dict(),
        model.config.to_dict(),
        epoch=0,
        consumed_samples=2,
        meta={"strategy": "seq"},
        extra={"optimizer": optimizer.state_dict()},
    )
    ids = torch.randint(0, 32, (2, 5))
    expected = model(ids)["logits"].detach()
    torch.save(ids, tmp_path / "ids.pt")
    out = run_astrai(f"""
        import torch
        from astrai.model.automodel import AutoModel
        from astrai.serialization import Checkpoint
        ckpt = Checkpoint.load("{path}")
        assert (ckpt.epoch, ckpt.consumed_samples) == (0, 2), (ckpt.epoch, ckpt.consumed_samples)
        assert sorted(ckpt.extra) == ["optimizer"]
        model = AutoModel.from_pretrained("{path}")  # strict load
        logits = model(torch.load("{tmp_path / "ids.pt"}"))["logits"]
        torch.save(logits.detach(), "{tmp_path / "astrai_logits.pt"}")
        print(type(model).__name__, model.lm_head.weight is model.embed_tokens.weight)
    """)
    assert out.strip() == f"AutoRegressiveLM {tied}"
    torch.testing.assert_close(torch.load(tmp_path / "astrai_logits.pt"), expected, atol=1e-5, rtol=0)


def test_astrai_checkpoint_loads_here(tmp_path):
    config = tiny_config().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    out_dir = tmp_path / "astrai_ckpt"
    run_astrai(f"""
        import json, torch
        from astrai.config.model_config import AutoRegressiveLMConfig
        from astrai.model.transformer import AutoRegressiveLM
        from astrai.serialization import Checkpoint
        torch.manual_seed(0)
        config = AutoRegressiveLMConfig.from_file("{tmp_path / "config.json"}")
        model = AutoRegressiveLM(config).to(torch.bfloat16)  # AstrAI's CLI trains and saves in bf16
        opt = torch.optim.AdamW(model.parameters())
        Checkpoint(state_dict=model.state_dict(), epoch=1, consumed_samples=8, config=config.to_dict(),
                   meta={{"strategy": "sft"}}, extra={{"optimizer": opt.state_dict()}}).save("{out_dir}")
    """)
    ckpt = load_checkpoint(out_dir)  # weights_only .pt loading accepts AstrAI's optimizer.pt
    assert (ckpt.epoch, ckpt.consumed_samples, ckpt.format_version) == (1, 8, None)
    model = load_model(out_dir)
    torch.manual_seed(0)
    reference = AutoRegressiveLM(tiny_config()).to(torch.bfloat16)  # same seed, same init as AstrAI
    for key, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key


def astrai_train(workdir, *flags) -> subprocess.CompletedProcess:
    """AstrAI's own trainer (scripts/tools/train.py) on CPU, in a subprocess."""
    command = [
        ASTRAI_PYTHON, f"{ASTRAI_SRC}/scripts/tools/train.py", "--train_type", "sft", "--data_root_path", "data",
        "--window_size", "64", "--batch_per_device", "2", "--grad_accum_steps", "2", "--max_lr", "1e-3",
        "--parallel_mode", "none", "--nprocs", "1", "--device_type", "cpu", "--backend", "gloo", "--num_workers", "0",
        "--ckpt_interval", "3", "--no-pin_memory", "--no-persistent_workers", *flags,
    ]  # fmt: skip
    return subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=astrai_env())


def test_training_checkpoints_resume_across_trainers(tmp_path, monkeypatch):
    """AstrAI trains 12 steps; we resume its checkpoint (AstrAI's command line, unchanged but for the tokenizer,
    which AstrAI's checkpoints lack, B22) and train to 24; AstrAI resumes our step-15 checkpoint in turn."""
    from astrai_fabric.assets import SFT_DATA_DIR, TINY_MODEL_DIR
    from astrai_fabric.cli import main

    (tmp_path / "data").mkdir()
    lines = (SFT_DATA_DIR / "tasks.jsonl").read_text().splitlines()[:200]
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    first = astrai_train(tmp_path, "--param_path", str(TINY_MODEL_DIR), "--ckpt_dir", "astrai")
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "astrai" / "epoch_0_step_12" / "optimizer.pt").is_file()

    monkeypatch.chdir(tmp_path)
    argv = [
        "--train_type", "sft", "--data_root_path", "data", "--param_path", "astrai/epoch_0_step_12", "--resume",
        "--tokenizer_path", str(TINY_MODEL_DIR), "--window_size", "64", "--batch_per_device", "2",
        "--grad_accum_steps", "2", "--max_lr", "1e-3", "--parallel_mode", "none", "--nprocs", "1", "--device_type",
        "cpu", "--backend", "gloo", "--num_workers", "0", "--ckpt_dir", "ours", "--ckpt_interval", "3",
        "--no-pin_memory", "--no-persistent_workers",
    ]  # fmt: skip
    assert main(argv) == 0
    ours = sorted(p.name for p in (tmp_path / "ours").glob("epoch_*"))
    assert ours == ["epoch_0_step_15", "epoch_0_step_18", "epoch_0_step_21", "epoch_0_step_24"]  # resumed at 12

    second = astrai_train(tmp_path, "--param_path", "ours/epoch_0_step_15", "--resume", "--ckpt_dir", "astrai2")
    assert second.returncode == 0, second.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "astrai2").glob("epoch_*"))[0] == "epoch_0_step_18"


def test_prepared_shards_load_in_astrai(tmp_path):
    """`astrai-fabric prepare` output read by AstrAI's own DatasetFactory/MmapStore: one shard yields exactly our
    training windows; several shards yield the same streams, concatenated in AstrAI's (filesystem) order."""
    import numpy as np

    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.data import load_window_dataset
    from astrai_fabric.data.prepare import PipelineConfig, prepare
    from astrai_fabric.tokenizer import Tokenizer

    records = [{"prompt": f"Question {i}?", "answer": f"Answer {i}." * (1 + i % 3)} for i in range(12)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sections = [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]
    for name, max_tokens in [("one", 10_000), ("many", 40)]:
        config = {"input": {"sections": sections}, "preprocessing": {"min_chars": 0},
                  "output": {"max_tokens_per_shard": max_tokens}}  # fmt: skip
        prepare([tmp_path / "in.jsonl"], tmp_path / name, PipelineConfig.from_dict(config, "cfg"),
                Tokenizer.from_dir(TINY_MODEL_DIR))  # fmt: skip
    assert len(list((tmp_path / "many").glob("*/shard_*"))) == 3
    run_astrai(f"""
        import glob, torch
        from astrai.dataset.dataset import DatasetFactory
        one = DatasetFactory.load("sft", "{tmp_path / "one"}", window_size=16, storage_type="bin")
        many = DatasetFactory.load("sft", "{tmp_path / "many"}", window_size=16, storage_type="bin").store
        order = [p.split("/")[-2] for p in glob.glob("{tmp_path / "many"}/**/meta.json", recursive=True)]
        streams = {{key: many.fetch(0, many.token_count, key) for key in many.keys}}
        torch.save([[one[i] for i in range(len(one))], order, streams], "{tmp_path / "astrai.pt"}")
    """)
    windows, order, streams = torch.load(tmp_path / "astrai.pt")
    ours = load_window_dataset("sft", tmp_path / "one", window_size=16, stride=None, tokenizer=None)
    assert len(windows) == len(ours) > 3
    for index, sample in enumerate(windows):
        for key, value in sample.items():
            assert ours[index][key].tolist() == value.tolist(), (index, key)
    assert sorted(streams) == ["loss_mask", "position_ids", "sequence"]
    for key, stream in streams.items():
        dtype = json.loads((tmp_path / "many" / "__default__" / "shard_0000" / "meta.json").read_text())[key]["dtype"]
        shards = [np.fromfile(tmp_path / "many" / "__default__" / shard / f"{key}.bin", dtype=dtype) for shard in order]
        assert stream.tolist() == np.concatenate(shards).tolist(), key
