"""Where training's random numbers come from: every stochastic part has its own generator, seeded from its place
in the run, so a resumed run draws exactly what the uninterrupted one draws at the same position.

``derive_seed(seed, stream, *position)`` is the one derivation: ``random_seed``, the name of the stream and the
position in the run go in, 62 bits come out, and nothing else (no history, no global RNG) matters. The streams:

- ``noise:<module>`` — every module with a ``generator`` attribute (NEFTune's ``Embedding``; LoRA dropout is meant
  to join the same way): ``(data-parallel rank, optimizer step, micro-batch in the window)``, reseeded by
  ``ModuleNoise.reseed`` before each micro-batch's forward.
- ``loader`` — the base seed of a data loader's workers: ``(data-parallel rank, epoch)``.
- ``rollout`` — online GRPO sampling: ``(data-parallel rank, optimizer step, micro-batch in the rollout chunk)``.

The rank is the data-parallel one: the tensor-parallel ranks of one group compute one replica and must draw the
same numbers. The global torch RNG is then used only to initialise the model (AstrAI's seeded init); it is still
saved in ``rng.pt`` and restored on resume, and is the same in a resumed and an uninterrupted run.

A module that draws random numbers while training declares ``generator: torch.Generator | None = None`` and draws
with ``generator=self.generator`` (None falls back to the global RNG, for use outside our loop). Caveat for modules
inside an activation-checkpointed block (``--gradient_checkpointing``): torch's recomputation restores only the
global RNG, not these generators, so such a module must make its draw repeatable for the recomputed forward
(NEFTune's embedding sits outside the blocks).
"""

from __future__ import annotations

import random

import torch
from torch import nn


def derive_seed(seed: int, stream: str, *position: int) -> int:
    """A 62-bit seed that is a pure function of its arguments.

    ``random.Random`` seeded with a string hashes it with SHA-512, so the value is the same in every process,
    Python version and run (``hash()`` is salted per process).
    """
    return random.Random("/".join(map(str, (seed, stream, *position)))).getrandbits(62)


def seeded_generator(device: torch.device | str, seed: int, stream: str, *position: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``derive_seed(seed, stream, *position)``."""
    return torch.Generator(device).manual_seed(derive_seed(seed, stream, *position))


class ModuleNoise:
    """The generators of a model's stochastic modules (those with a ``generator`` attribute), one per module, on
    ``device``; ``reseed(step, micro_batch)`` seeds each from ``noise:<module name>``, ``rank`` and the position.

    Pass the unwrapped model (not Fabric's, DDP's or ``torch.compile``'s wrapper), so module names, and with them
    the noise, do not depend on the strategy.
    """

    def __init__(self, model: nn.Module, seed: int, rank: int, device: torch.device | str) -> None:
        self.seed, self.rank = seed, rank
        self.modules = [(name, m) for name, m in model.named_modules() if hasattr(m, "generator")]
        for _, module in self.modules:
            module.generator = torch.Generator(device)

    def reseed(self, step: int, micro_batch: int) -> None:
        """Before the forward of micro-batch ``micro_batch`` (0-based in its window) of optimizer step ``step``."""
        for name, module in self.modules:
            module.generator.manual_seed(derive_seed(self.seed, f"noise:{name}", self.rank, step, micro_batch))
