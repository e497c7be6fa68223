"""Randomness drawn from the run's position only: NEFTune noise, loader seeds, and resumes that are bit-identical with
them (one process with loader workers; two DDP ranks on gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file
from spawn import run_ranks

from astrai_fabric.cli import main
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.randomness import ModuleNoise, derive_seed
from astrai_fabric.train import run
from astrai_fabric.train.loaders import SeededLoader

# 4 optimizer steps of 2 x 2 windows of 16 tokens with NEFTune; the interrupted run stops after step 2.
SEQ = dict(param_path="bundled:tiny", data_root_path="bundled:data/seq", window_size=16, batch_per_device=2,
           grad_accum_steps=2, optimizer="adamw", neftune_alpha=5.0, random_seed=5, ckpt_interval=1000, loggers=[],
           num_workers=0)  # fmt: skip


def test_derive_seed_is_a_stable_pure_function():
    assert derive_seed(7, "noise:embed_tokens", 0, 3, 1) == derive_seed(7, "noise:embed_tokens", 0, 3, 1)
    # Pinned: a changed derivation would give resumed runs of older checkpoints other noise than their first part.
    assert derive_seed(7, "noise:embed_tokens", 0, 3, 1) == 1808201611712815629
    others = [("loader", 0, 3, 1), ("noise:embed_tokens", 1, 3, 1), ("noise:embed_tokens", 0, 4, 1)]
    assert len({derive_seed(7, *o) for o in others} | {derive_seed(7, "noise:embed_tokens", 0, 3, 1)}) == 4


def test_neftune_noise_depends_only_on_seed_rank_step_and_micro_batch():
    model = AutoRegressiveLM(tiny_config(neftune_alpha=5.0)).train()
    noise = ModuleNoise(model, seed=7, rank=0, device="cpu")
    assert [name for name, _ in noise.modules] == ["embed_tokens"]
    ids = torch.randint(0, 32, (2, 8))

    def embedded(rank: int, step: int, micro_batch: int) -> torch.Tensor:
        noise.rank = rank
        noise.reseed(step, micro_batch)
        return model.embed_tokens(ids)

    first = embedded(0, 3, 1)
    assert not torch.equal(first, torch.nn.functional.embedding(ids, model.embed_tokens.weight))  # noise is on
    for other in [(1, 3, 1), (0, 4, 1), (0, 3, 0)]:
        assert not torch.equal(embedded(*other), first)
    torch.manual_seed(123)  # whatever the global RNG holds, and whatever was drawn before
    global_state = torch.get_rng_state()
    assert torch.equal(embedded(0, 3, 1), first)
    assert torch.equal(torch.get_rng_state(), global_state)  # and it is never drawn from
    fresh = AutoRegressiveLM(tiny_config(neftune_alpha=5.0)).train()  # another model (or process): the same noise
    fresh.load_state_dict(model.state_dict())
    ModuleNoise(fresh, seed=7, rank=0, device="cpu").reseed(3, 1)
    assert torch.equal(fresh.embed_tokens(ids), first)


def test_the_loader_leaves_the_global_rng_alone_and_seeds_its_workers_by_epoch():
    sampler = ResumableSampler(10, rank=1, num_dp_ranks=2, seed=3)
    loader = SeededLoader(list(range(10)), batch_size=2, sampler=sampler, generator=torch.Generator())
    state = torch.get_rng_state()
    base_seeds = []
    for epoch in (0, 1, 0):
        sampler.set_position(epoch)
        list(loader)
        base_seeds.append(loader.generator.initial_seed())
    assert torch.equal(torch.get_rng_state(), state)
    assert base_seeds[0] == base_seeds[2] != base_seeds[1]


def read_end(ckpt_dir: Path) -> tuple[list, dict, torch.Tensor]:
    """The step losses of ``metric.jsonl``, the weights and the saved RNG states of the step-4 checkpoint."""
    path = ckpt_dir / "epoch_0_step_4"
    entries = [json.loads(line) for line in (path / "metric.jsonl").read_text().splitlines()]
    losses = [(e["step"], e["loss"]) for e in entries if e["type"] == "step"]
    return losses, load_file(path / "model.safetensors"), torch.load(path / "rng.pt", weights_only=True)["torch"]


def assert_bit_identical(resumed: Path, uninterrupted: Path) -> None:
    (losses, weights, rng), (ref_losses, ref_weights, ref_rng) = read_end(resumed), read_end(uninterrupted)
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert losses == ref_losses  # the resumed steps 3 and 4 included, bit for bit
    assert weights.keys() == ref_weights.keys()
    for key, tensor in weights.items():
        torch.testing.assert_close(tensor, ref_weights[key], atol=0, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    assert torch.equal(rng, ref_rng)


def cli(ckpt_dir: Path, *flags: str) -> None:
    argv = ["seq", *(f for k, v in SEQ.items() if k != "loggers" for f in (f"--{k}", str(v)))]
    assert main([*argv, "--loggers", "[]", "--parallel_mode", "none", "--ckpt_dir", str(ckpt_dir), *flags]) == 0


def test_resume_with_neftune_and_loader_workers_is_bit_identical(tmp_path):
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    cli(interrupted, "--stop_after_steps", "2", "--num_workers", "2")
    cli(interrupted, "--stop_after_steps", "2", "--num_workers", "2", "--resume", "auto")
    cli(uninterrupted, "--stop_after_steps", "4", "--num_workers", "2")
    assert_bit_identical(interrupted, uninterrupted)


def two_rank_worker(root: str) -> None:
    """Each of 2 DDP ranks (1 sample per micro-batch): 2 steps, a resume for 2 more, and 4 steps uninterrupted."""
    root = Path(root)
    ddp = dict(SEQ, batch_per_device=1, nprocs=2, parallel_mode="ddp", train_type="seq")
    run(TrainArgs(**ddp, ckpt_dir=str(root / "interrupted"), stop_after_steps=2))
    run(TrainArgs(**ddp, ckpt_dir=str(root / "interrupted"), stop_after_steps=2, resume="auto"))
    run(TrainArgs(**ddp, ckpt_dir=str(root / "uninterrupted"), stop_after_steps=4))


@pytest.mark.slow
def test_two_rank_ddp_resume_with_neftune_is_bit_identical(tmp_path):
    run_ranks(two_rank_worker, 2, str(tmp_path))
    assert_bit_identical(tmp_path / "interrupted", tmp_path / "uninterrupted")
    assert read_end(tmp_path / "uninterrupted")[2].size(0) == 2  # one RNG state per rank
