"""Where a run is, as a checkpoint's ``meta.json`` records it: ``RunPosition`` under ``RESUME_KEY``. Part of the
checkpoint format (``state.save_training_checkpoint`` writes it, ``train.resume`` reads it back, checked); the loop
advances it (``loop.state.TrainState``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from astrai_fabric.errors import CheckpointError

RESUME_KEY = "resume_position"


@dataclass
class RunPosition:
    """Where a run is: counters of the loop, enough to continue exactly. A checkpoint's ``meta.json`` records it
    under ``resume_position`` (``checkpoint.state.save_training_checkpoint``)."""

    epoch: int = 0
    """Epoch of the next sample (0-based)."""
    sample_index: int = 0
    """Samples each rank has consumed in ``epoch``."""
    world_size: int = 1
    """Data-parallel ranks that consumed them (the global position is ``sample_index * world_size``). Named as
    ``meta.json`` spells the key, which checkpoints already hold."""
    optimizer_step: int = 0
    """Optimizer steps taken since the run began (global, never reset per epoch)."""
    num_tokens: int = 0
    """Input tokens trained on, all ranks together."""
    consumed_samples: int = 0
    """AstrAI's counter: ``batch_per_device * world_size`` per micro-batch, short batches included."""
    skipped_steps: int = 0
    """Accumulation windows whose update was skipped for a non-finite loss or gradient norm (their samples count
    as consumed; ``optimizer_step`` and the schedule did not advance)."""

    @classmethod
    def from_meta(cls, value: Any, source: Path) -> RunPosition:
        """The position ``meta.json`` records under ``resume_position``, checked: exactly these fields, each a
        non-negative integer (``world_size`` positive)."""
        names = [f.name for f in fields(cls)]
        if not isinstance(value, dict) or sorted(value) != sorted(names):
            found = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise CheckpointError(f"{source}: {RESUME_KEY!r} must hold {names}, got {found}")
        wrong = [
            f"{k}={v!r}"
            for k, v in value.items()
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k == "world_size" else 0)
        ]
        if wrong:
            raise CheckpointError(f"{source}: {RESUME_KEY!r} needs non-negative integers, got {', '.join(wrong)}")
        return cls(**value)

    @property
    def last_epoch(self) -> int:
        """Epoch of the last sample consumed (names the checkpoint, AstrAI's ``epoch``); ``epoch`` is the next one's."""
        return self.epoch - 1 if self.sample_index == 0 and self.epoch > 0 else self.epoch

    def rescaled(self, num_dp_ranks: int, samples_per_rank: int) -> tuple[RunPosition, bool]:
        """The same global position for ``num_dp_ranks`` ranks; False when it falls between two samples."""
        global_index = self.sample_index * self.world_size
        index, exact = global_index // num_dp_ranks, global_index % num_dp_ranks == 0
        position = RunPosition(**{**asdict(self), "sample_index": index, "world_size": num_dp_ranks})
        if position.sample_index >= samples_per_rank:  # the epoch was complete
            position.epoch, position.sample_index = position.epoch + 1, 0
        return position, exact
