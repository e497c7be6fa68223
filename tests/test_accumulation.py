"""Gradient accumulation: AstrAI's counter, and equality with one big batch (and when sft has it)."""

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file

from astrai_fabric.accumulation import GradientState
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.losses import causal_lm_loss
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.train import run


def test_sync_every_nth_micro_batch_across_epochs():
    state = GradientState(3)
    assert [state.advance() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert GradientState(0).advance() is True  # max(steps, 1), as AstrAI


def seq_args(tmp_path, **overrides) -> TrainArgs:
    values = dict(
        param_path="bundled:tiny", data_root_path="bundled:data/seq", train_type="seq", ckpt_dir=str(tmp_path),
        window_size=16, max_steps=2, max_lr=1e-3, warmup_ratio=0.0, num_workers=0, parallel_mode="none",
        optimizer="adamw", random_seed=5, ckpt_interval=1000,
    )  # fmt: skip
    values.update(overrides)
    return TrainArgs(**values)


def test_seq_accumulating_4_of_2_equals_one_batch_of_8(tmp_path):
    # A small rate: AdamW's first steps move each weight by ~lr * sign(grad), so a weight whose gradient is ~0
    # turns float32 rounding noise into an lr-sized difference; at 1e-4 that stays below the 1e-6 asked for.
    small = run(seq_args(tmp_path / "small", batch_per_device=2, grad_accum_steps=4, max_lr=1e-4))
    big = run(seq_args(tmp_path / "big", batch_per_device=8, grad_accum_steps=1, max_lr=1e-4))
    for a, b in zip(small, big, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-5)  # float32 CPU norm noise
    small_w = load_file(tmp_path / "small" / "epoch_0_step_2" / "model.safetensors")
    big_w = load_file(tmp_path / "big" / "epoch_0_step_2" / "model.safetensors")
    for key in big_w:
        torch.testing.assert_close(small_w[key], big_w[key], atol=1e-6, rtol=0)


def sft_gradients(masks: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """Gradient of the embedding after accumulating ``micro_batches`` equal slices of a batch of 4."""
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config())
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    for chunk_ids, chunk_masks in zip(ids.chunk(micro_batches), masks.chunk(micro_batches), strict=True):
        loss = causal_lm_loss(model(chunk_ids[:, :-1])["logits"], chunk_ids[:, 1:], chunk_masks)
        (loss / micro_batches).backward()
    return model.embed_tokens.weight.grad


def test_sft_equals_one_batch_only_when_micro_batches_train_equal_token_counts():
    # sft's loss is the mean over each micro-batch's trained tokens, divided by grad_accum_steps (AstrAI's).
    # It equals the mean over the whole batch exactly when every micro-batch trains the same number of tokens.
    equal = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 0], [1, 0, 1, 0, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)
    torch.testing.assert_close(sft_gradients(equal, 2), sft_gradients(equal, 1), atol=1e-7, rtol=0)
    unequal = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 1, 1, 0], [1, 0, 0, 0, 0], [0, 1, 0, 0, 0]], dtype=torch.bool)
    assert not torch.allclose(sft_gradients(unequal, 2), sft_gradients(unequal, 1), atol=1e-6)
