"""The run's data loaders: AstrAI's validation split, the resumable sampler sharded over the data-parallel ranks
(``data/sampler.py``), a loader that never draws from the global RNG, and stopping its workers whatever ended the
loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset, random_split

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler
from astrai_fabric.preemption import ignore_stop_signals
from astrai_fabric.randomness import derive_seed
from astrai_fabric.strategy import DataParallel, local_ranks, resolve_num_workers
from astrai_fabric.torch_private import shut_down_loader_workers


def split_validation(dataset: Dataset, val_split: float | None, seed: int) -> tuple[Dataset, Dataset | None]:
    """AstrAI's split: ``max(1, int(len * val_split))`` samples, chosen by ``random_split`` seeded with ``seed``."""
    if val_split is None:
        return dataset, None
    num_val = max(1, int(len(dataset) * val_split))
    train, val = random_split(dataset, [len(dataset) - num_val, num_val], generator=torch.Generator().manual_seed(seed))
    return train, val


class SeededLoader(DataLoader):
    """A ``DataLoader`` that never draws from the global RNG (a plain one draws its workers' base seed there at
    every ``iter()``, so a resume would shift the global stream): the base seed comes from the loader's own
    generator, reseeded at each ``iter()`` from (seed, data-parallel rank, epoch) of its ``ResumableSampler``.
    Persistent workers keep the seeds of the first epoch this process iterates."""

    def __iter__(self):  # noqa: ANN204 - DataLoader's signature
        sampler = self.sampler
        self.generator.manual_seed(derive_seed(sampler.seed, "loader", sampler.rank, sampler.epoch))
        return super().__iter__()


@dataclass(frozen=True)
class LoaderArgs:
    """The flags the loaders read (``TrainArgs`` documents each; ``from_args`` takes them from it)."""

    batch_per_device: int
    num_workers: int | None
    pin_memory: bool
    persistent_workers: bool
    random_seed: int

    @classmethod
    def from_args(cls, args: TrainArgs) -> LoaderArgs:
        return cls(args.batch_per_device, args.num_workers, args.pin_memory, args.persistent_workers, args.random_seed)


def make_loader(
    fabric: Fabric,
    place: DataParallel,
    dataset: Dataset,
    args: LoaderArgs,
    shuffle: bool,
    collate: Callable | None = None,
) -> tuple[DataLoader, ResumableSampler]:
    """The loader of ``dataset`` on this rank (Fabric-wrapped) and the ``ResumableSampler`` that orders it, reading
    this rank's ``place`` on the data axis (the run's layout's)."""
    sampler = ResumableSampler(len(dataset), *place, args.random_seed, shuffle)
    num_workers = resolve_num_workers(args.num_workers, local_ranks(fabric))[0]
    loader = SeededLoader(
        dataset,
        batch_size=args.batch_per_device,
        sampler=sampler,
        generator=torch.Generator(),
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=args.pin_memory and fabric.device.type == "cuda",
        persistent_workers=args.persistent_workers and num_workers > 0,
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
    )
    # Our sampler already shards by rank in AstrAI's order; Fabric must not replace it.
    return fabric.setup_dataloaders(loader, use_distributed_sampler=False), sampler


def shut_down_workers(*loaders: DataLoader | None) -> None:
    """Stop the loaders' worker processes now, whatever ended the loop. A loader with persistent workers keeps them
    alive while it is referenced, and after an exception its traceback references it until the interpreter exits,
    where multiprocessing joins them: they ignore SIGTERM (``ignore_stop_signals``), so that join would never end."""
    for loader in loaders:
        shut_down_loader_workers(getattr(loader, "_dataloader", loader))  # Fabric's wrapper, then torch's loader
