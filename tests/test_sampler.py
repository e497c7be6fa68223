"""The sampler: AstrAI's (DistributedSampler's) order, world-size invariance of the data stream, resume."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from astrai_fabric.data import ResumableSampler


@pytest.mark.parametrize("num_samples, world_size", [(10, 1), (10, 2), (11, 4)])
def test_order_equals_torch_distributed_sampler(num_samples, world_size):
    dataset = list(range(num_samples))
    for rank in range(world_size):
        ours = ResumableSampler(num_samples, rank, world_size, seed=3407)
        theirs = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=3407)
        for epoch in (0, 1):
            ours.set_position(epoch)
            theirs.set_epoch(epoch)  # torch seeds with seed + epoch, as AstrAI does
            assert list(ours) == list(theirs)


def test_two_ranks_of_one_see_what_one_rank_of_two_sees():
    single = list(ResumableSampler(16, 0, 1, seed=1))
    ranks = [list(ResumableSampler(16, r, 2, seed=1)) for r in range(2)]
    for step in range(8):
        # step k: rank 0 and rank 1 each take one sample; the single rank takes both, in the same order
        assert [ranks[0][step], ranks[1][step]] == single[2 * step : 2 * step + 2]


def test_resume_mid_epoch_continues_exactly():
    sampler = ResumableSampler(9, 1, 2, seed=5)
    whole = sampler.epoch_indices(3)
    sampler.set_position(3, 2)
    assert list(sampler) == whole[2:] and len(sampler) == len(whole) - 2


def test_padding_wraps_around():
    sampler = ResumableSampler(3, 1, 2, shuffle=False)
    assert list(sampler) == [1, 0]  # [0, 1, 2] padded with 0 -> rank 1 takes positions 1 and 3
    assert torch.equal(torch.tensor(ResumableSampler(3, 0, 2, shuffle=False).epoch_indices(0)), torch.tensor([0, 2]))
