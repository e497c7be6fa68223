"""Shared fixtures. Tests never touch the network; multi-process tests set OMP_NUM_THREADS=1 themselves."""

import os

import pytest
import torch

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
