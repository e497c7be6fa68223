"""Shared fixtures. Tests never touch the network; multi-process tests set OMP_NUM_THREADS=1 themselves."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from astrai_fabric.config import ModelConfig  # noqa: E402
from astrai_fabric.model import AutoRegressiveLM  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    """A small dense GQA config for fast unit tests."""
    values = dict(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    values.update(overrides)
    return ModelConfig(**values)


@pytest.fixture
def tiny_model() -> AutoRegressiveLM:
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config())


def assert_resume_is_bit_exact(argv: list[str], root: Path, weights: str = "adapter_model.safetensors") -> None:
    """Run the CLI's ``argv`` (4 steps, a checkpoint every 2) into ``root/full``, then again into ``root/resumed`` from
    its step 2: the two step-4 ``weights`` files hold identical tensors, which step 2's do not."""
    from astrai_fabric.cli import main

    assert main([*argv, "--ckpt_dir", str(root / "full")]) == 0
    resume = root / "full" / "epoch_0_step_2"
    assert main([*argv, "--ckpt_dir", str(root / "resumed"), "--resume", str(resume)]) == 0
    full, resumed = (load_file(root / run / "epoch_0_step_4" / weights) for run in ("full", "resumed"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert not all(torch.equal(full[k], load_file(resume / weights)[k]) for k in full)  # training moved them
