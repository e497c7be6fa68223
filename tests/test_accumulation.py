"""Gradient accumulation: AstrAI's counter, equality with one big batch (and when sft has it), and the no-sync
gate counted on 2 real gloo processes: how many gradient reductions each accumulation window issues."""

import functools
import json
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import tiny_config
from equality import assert_same_training, initial_weights
from safetensors.torch import load_file
from spawn import run_ranks

from astrai_fabric.accumulation import GradientState
from astrai_fabric.assets import TINY_MODEL_DIR
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
        param_path="bundled:tiny",
        data_root_path="bundled:data/seq",
        train_type="seq",
        ckpt_dir=str(tmp_path),
        window_size=16,
        max_steps=2,
        max_lr=1e-3,
        warmup_ratio=0.0,
        num_workers=0,
        parallel_mode="none",
        optimizer="adamw",
        random_seed=5,
        ckpt_interval=1000,
    )
    values.update(overrides)
    return TrainArgs(**values)


def test_seq_accumulating_4_of_2_equals_one_batch_of_8(tmp_path):
    small = run(seq_args(tmp_path / "small", batch_per_device=2, grad_accum_steps=4))
    big_args = seq_args(tmp_path / "big", batch_per_device=8, grad_accum_steps=1)
    big = run(big_args)
    for a, b in zip(small, big, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-5)  # float32 CPU norm noise
    small_w = load_file(tmp_path / "small" / "epoch_0_step_2" / "model.safetensors")
    big_w = load_file(tmp_path / "big" / "epoch_0_step_2" / "model.safetensors")
    assert_same_training(small_w, big_w, initial_weights(big_args))


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


# --- The gate, counted: every parity test passes with or without it (the numbers are the same), only the
# communication differs, so these runs count the reductions themselves.
STEPS, ACCUM = 2, 3
COUNTED = dict(nprocs=2, batch_per_device=1, grad_accum_steps=ACCUM, max_steps=STEPS)


class CallCounter:
    """Counts calls of functions looked up on a module at call time (outermost calls only: a deprecated alias
    that delegates to its replacement is one call)."""

    def __init__(self) -> None:
        self.calls = 0
        self._depth = 0

    def wrap(self, module: ModuleType, name: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.calls += self._depth == 0
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(module, name, counted)


def ddp_all_reduces(fabric_args: TrainArgs, train_args: TrainArgs) -> int:
    """Train with the Fabric ``build_run_fabric`` makes from ``fabric_args`` (DDP) and count the backward passes whose
    gradients DDP all-reduced: a comm hook that all-reduces as DDP would, counting each backward's last bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from astrai_fabric.train import build_run_fabric, train

    fabric = build_run_fabric(fabric_args)
    reductions = 0
    wrap_in_ddp = fabric.strategy.setup_module

    def hook(state, bucket):
        nonlocal reductions
        reductions += bucket.is_last()  # a backward may fill several buckets; exactly one is its last
        return allreduce_hook(None, bucket)  # DDP's own averaging all-reduce on the default group

    def setup_module(module):
        ddp = wrap_in_ddp(module)
        ddp.register_comm_hook(None, hook)
        return ddp

    fabric.strategy.setup_module = setup_module  # this Fabric only: the DDP it wraps the model in gets the hook
    fabric.launch(train, train_args)  # what train.run does, on this instrumented Fabric
    return reductions


def count_reductions_worker(root: str) -> None:
    """In each of 2 processes: train STEPS windows of ACCUM micro-batches per setting and count the reductions."""
    import torch.distributed as dist

    root = Path(root)
    # FSDP2 reduce-scatters through torch.distributed's module attribute (reduce_scatter_single from torch 2.13,
    # reduce_scatter_tensor before), so wrapping the attribute sees every call its param groups issue.
    reduce_scatters = CallCounter()
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        reduce_scatters.wrap(dist, name)
    counts = {}
    ddp = seq_args(root / "ddp", parallel_mode="ddp", **COUNTED)
    counts["ddp"] = ddp_all_reduces(ddp, ddp)
    # A DDP Fabric handed to train() with arguments that ask FSDP to reduce every micro-batch: DDP stays gated.
    asks_fsdp = seq_args(root / "ddp_fsdp_args", parallel_mode="fsdp", fsdp_sync_each_micro_batch=True, **COUNTED)
    counts["ddp_given_fsdp_sync_each_micro_batch"] = ddp_all_reduces(ddp, asks_fsdp)
    for name, each in (("fsdp", False), ("fsdp_sync_each_micro_batch", True)):
        before = reduce_scatters.calls
        run(seq_args(root / name, parallel_mode="fsdp", fsdp_sync_each_micro_batch=each, **COUNTED))
        counts[name] = reduce_scatters.calls - before
    (root / f"counts_{os.environ['RANK']}.json").write_text(json.dumps(counts))


@pytest.mark.slow
def test_gradients_reduce_once_per_window_and_each_micro_batch_only_when_fsdp_is_asked(tmp_path):
    run_ranks(count_reductions_worker, 2, str(tmp_path))
    # FSDP2 reduce-scatters once per FSDP unit per synchronised backward: every decoder block and the root.
    units = json.loads((TINY_MODEL_DIR / "config.json").read_text())["num_hidden_layers"] + 1
    expected = {
        "ddp": STEPS,
        "ddp_given_fsdp_sync_each_micro_batch": STEPS,  # the flag is FSDP's; a DDP Fabric ignores it
        "fsdp": STEPS * units,
        "fsdp_sync_each_micro_batch": STEPS * ACCUM * units,
    }
    for rank in (0, 1):
        assert json.loads((tmp_path / f"counts_{rank}.json").read_text()) == expected, f"rank {rank}"
