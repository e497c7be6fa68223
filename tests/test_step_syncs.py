"""How often an optimizer step waits for the device: every read of a tensor's value on the host (``item``,
``tolist``, ``float()``, ``bool()``, ...) that the package's or Lightning's code makes inside ``train_step``, while
the batches are being made left out (the data pipeline reads CPU tensors; on a GPU those are no wait). torch's own
internals are not counted (its optimizers read CPU step counters). On a GPU each read stalls the stream, so the
step reads once: the logged numbers, the skip and stop decisions and the finiteness check of the last update
together (``loop/step.py``; docs/performance.md records before and after)."""

import sys
from pathlib import Path

import pytest
import torch

import astrai_fabric
import astrai_fabric.loop  # noqa: F401 - loads loop.fit, whose train_step the counter wraps
from astrai_fabric.cli import main

ROOT = Path(__file__).parents[1]
PACKAGE = str(Path(astrai_fabric.__file__).parent)
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def reads_per_step(monkeypatch):
    """The number of host reads of each optimizer step (``train_step`` call) of the runs in the test."""
    counts: list[int] = []
    counting = [False]

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counting[0]:
                caller = sys._getframe(1).f_code.co_filename
                counts[-1] += caller.startswith(PACKAGE) or "/lightning/" in caller
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    fit_module = sys.modules["astrai_fabric.loop.fit"]
    train_step = fit_module.train_step

    def batches_not_counted(micro_batches):
        while True:
            counting[0] = False
            batch = next(micro_batches, None)
            counting[0] = True
            if batch is None:
                return
            yield batch

    def counted_step(fabric, *, micro_batches, **kwargs):
        counts.append(0)
        counting[0] = True
        try:
            return train_step(fabric, micro_batches=batches_not_counted(micro_batches), **kwargs)
        finally:
            counting[0] = False

    monkeypatch.setattr(fit_module, "train_step", counted_step)
    return counts


def tiny(train_type: str, recipe: str, ckpt_dir: Path, *extra: str) -> list[str]:
    return [
        train_type,
        "--config",
        str(ROOT / "recipes" / recipe),
        "--ckpt_dir",
        str(ckpt_dir),
        "--max_steps",
        "3",
        "--window_size",
        "64",
        "--loggers",
        "[]",
        *extra,
    ]


def test_a_step_reads_from_the_device_once(reads_per_step, tmp_path):
    # sft: loss masks (a micro-batch's "anything to train?" is decided on the device), grad_snr on by default.
    assert main(tiny("sft", "tiny-sft.yaml", tmp_path / "sft")) == 0
    # dpo: padded pairs (the window's real tokens are counted on the device).
    assert main(tiny("dpo", "tiny-dpo.yaml", tmp_path / "dpo")) == 0
    assert reads_per_step == [1] * 6


def test_online_grpo_also_reads_each_updates_check_before_its_rollouts_sample(reads_per_step, tmp_path):
    assert main(tiny("grpo", "tiny-grpo-online.yaml", tmp_path / "grpo", "--max_steps", "2")) == 0
    assert reads_per_step == [2, 2]
