"""The one training loop for step-based training (seq, sft, dpo, grpo). No callbacks, no hooks.

Read in this order: ``fit.fit`` (epochs, stop requests, validation, checkpoints) calls ``step.train_step`` (one
accumulation window: micro-batches, then clip, finiteness, optimizer step) on a ``state.TrainState`` (model,
optimizer, schedule, ``RunPosition``), reading only ``state.LoopArgs`` (the loop's slice of ``TrainArgs``). Both are
called by keyword.

Where batches come from (the seam): ``fit`` iterates ``batches`` once per epoch after setting ``sampler``, the
``ResumableSampler`` that orders the underlying loader, to the position; it needs only an iterable of micro-batch
dicts (``input_ids`` and what the loss reads). ``train.common.train_on`` passes the loader itself, or what the train
type's ``TrainTask.make_batches(state, loader, num_micro_batches)`` makes of it: online GRPO (``train.grpo.Rollouts``)
wraps the prompt loader and, as ``fit`` pulls micro-batches, samples responses with the live ``state.model`` seeded
by ``state.position`` (updated in place by the loop, so a rollout sees the step it trains), scores them and yields
the training batches, none past the ``num_micro_batches`` the run trains.
"""

from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.loop.fit import fit, validate
from astrai_fabric.loop.state import LoopArgs, LossFn, TrainState
from astrai_fabric.loop.step import StepResult, train_step, weights_are_finite

__all__ = [
    "LoopArgs", "LossFn", "RunPosition", "StepResult", "TrainState", "fit", "train_step", "validate",
    "weights_are_finite",
]  # fmt: skip
