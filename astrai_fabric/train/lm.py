"""``seq`` (pretraining) and ``sft``: next-token prediction over fixed windows of a token stream, as
AstrAI's ``seq`` and ``sft`` strategies.

``seq`` attends causally across the whole window and trains every token. ``sft`` restarts positions and stops
attention at document boundaries (from the stored position ids) and trains only the tokens its loss mask
selects (assistant turns). sft with ``--packing false`` trains one record per sample instead, padded per micro-batch
(``data.datasets.RecordDataset``); the loss is the same mean over the micro-batch's trained tokens.
"""

from __future__ import annotations

from functools import partial

from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import WindowDataset
from astrai_fabric.data.datasets import RecordDataset, collate_records
from astrai_fabric.data.windows import WindowData, build_windows
from astrai_fabric.losses import causal_lm_loss, token_nll_weights, with_moe_aux_loss
from astrai_fabric.model import forward_window
from astrai_fabric.model.pipeline import StageLoss
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.start import Start, resolve_start


def lm_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    label_smoothing: float,
    moe_aux_loss_coef: float,
    loss_chunk_size: int = 0,
):
    """Mean next-token cross-entropy of one micro-batch (+ the weighted MoE aux loss); with ``loss_chunk_size``, the
    head fused with the loss inside the model's forward (no whole logits). The mean's per-token weights are known
    before the forward, so the fused head takes its gradients there and recomputes no logits in the backward."""
    if loss_chunk_size:
        weights = token_nll_weights(batch["target_ids"], batch.get("loss_mask"))  # token_nll_loss's mean, B8 included
        out = forward_window(
            model,
            batch["input_ids"],
            batch.get("position_ids"),
            nll_targets=batch["target_ids"],
            nll_chunk_size=loss_chunk_size,
            label_smoothing=label_smoothing,
            nll_weights=weights,
        )
        loss = out.nll_loss
    else:
        out = forward_window(model, batch["input_ids"], batch.get("position_ids"))  # sft's documents apart
        loss = causal_lm_loss(out.logits, batch["target_ids"], batch.get("loss_mask"), label_smoothing)
    return with_moe_aux_loss(loss, out.aux_loss, out.router_stats, moe_aux_loss_coef)


def build_dataset(args: TrainArgs, start: Start) -> tuple[WindowDataset | RecordDataset, str]:
    """The training windows (or records, ``--packing false``) and a description of them
    (``data.windows.build_windows``, which evaluate's perplexity reads held-out data with)."""
    return build_windows(WindowData.of(args), start.data_start())


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train seq or sft on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(fabric, args)
    dataset, summary = build_dataset(args, start)
    compute_loss = partial(
        lm_loss,
        label_smoothing=args.label_smoothing,
        moe_aux_loss_coef=args.moe_aux_loss_coef,
        loss_chunk_size=start.loss_chunk_size(args),
    )
    collate = collate_records if isinstance(dataset, RecordDataset) else None  # records vary in length: padded
    pipeline_loss = StageLoss(start.loss_chunk_size(args), args.label_smoothing)
    task = TrainTask(dataset, summary, compute_loss, collate, pipeline_loss=pipeline_loss)
    return train_on(fabric, args, start, task)
