"""``kto``: Kahneman-Tversky Optimization (Ethayarajh et al. 2024) on unpaired preferences, against a frozen reference
model, as TRL 1.16's ``KTOTrainer`` computes it (``losses.kto_loss``). AstrAI has no kto.

Data: records ``{"prompt"|"input", "completion", "label": true|false}`` (TRL's unpaired preference form; prompt and
completion as strings or chat messages), tokenised with the chat template; each record is one sample, truncated to
``--window_size``. The KL baseline is estimated from mismatched pairs, each prompt with another record's completion
(``data.records.UnpairedDataset``), over every sample of the micro-batch on every data-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric import assets
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.records import UnpairedDataset, collate_unpaired
from astrai_fabric.data.shapes import Shaper, shape_records
from astrai_fabric.data.storage import read_records
from astrai_fabric.lora import reference_context
from astrai_fabric.losses import kto_loss, with_moe_aux_loss
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.dpo import response_logprobs
from astrai_fabric.train.start import Start, reference_model, require_records, resolve_start


def kl_baseline(fabric: Fabric) -> Callable[[Tensor], Tensor]:
    """The KL baseline from the mismatched pairs' log-ratios ``[B]``: their mean over every data-parallel rank's
    samples (one all-reduce of a sum and a count), clamped at 0, as TRL's ``KTOTrainer`` does (it averages each
    process's mean)."""

    def baseline(log_ratios: Tensor) -> Tensor:
        total = torch.stack([log_ratios.sum(), torch.tensor(float(log_ratios.numel()), device=log_ratios.device)])
        total = fabric.all_reduce(total, reduce_op="sum") if fabric.world_size > 1 else total
        return (total[0] / total[1]).clamp(min=0)

    return baseline


def kto_batch_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    reference: nn.Module | None,
    baseline: Callable[[Tensor], Tensor],
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    moe_aux_loss_coef: float,
    loss_chunk_size: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``reference`` None: the policy with its LoRA adapters off (``lora.adapters_off``) is the reference."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    kl_ids, kl_mask = batch["kl_input_ids"], batch["kl_loss_mask"]
    with torch.no_grad():  # the baseline is a constant of the loss (TRL detaches it too)
        kl_policy, _ = response_logprobs(model, kl_ids, kl_mask, loss_chunk_size)
        with reference_context(model, reference):
            scorer = reference if reference is not None else model
            kl_reference, _ = response_logprobs(scorer, kl_ids, kl_mask, loss_chunk_size)
            ref, _ = response_logprobs(scorer, ids, mask, loss_chunk_size)
    kl = baseline(kl_policy - kl_reference)
    policy, out = response_logprobs(model, ids, mask, loss_chunk_size)  # last: its graph is the one backward needs
    loss, metrics = kto_loss(policy, ref, batch["desirable"], kl, beta, desirable_weight, undesirable_weight)
    loss, moe_metrics = with_moe_aux_loss(loss, out.aux_loss, out.router_stats, moe_aux_loss_coef)
    return loss, {**metrics, **moe_metrics}


def build_dataset(args: TrainArgs, start: Start) -> tuple[UnpairedDataset, str]:
    """The tokenised samples and a one-line description of them."""
    window_size = start.window_size
    data_path = require_records(assets.resolve(args.data_root_path), "kto")
    tokenizer = start.need_tokenizer("kto")
    schema_check = Shaper("kto", args.data_format, args.data_columns).check_schema
    records = read_records(data_path, subset=args.data_subset, split=args.data_split, schema_check=schema_check)
    records, shaper = shape_records(records, "kto", args.data_format, args.data_columns)
    shapes = shaper.describe() and f"{shaper.describe()}, "
    dataset = UnpairedDataset(records, tokenizer, window_size)
    dropped = f"; {dataset.num_dropped} dropped: nothing to train in the window" if dataset.num_dropped else ""
    summary = (
        f"{shapes}unpaired preferences from {data_path} ({dataset.num_desirable:,} desirable, "
        f"{len(dataset) - dataset.num_desirable:,} undesirable), at most {window_size} tokens each{dropped}"
    )
    return dataset, summary


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train kto on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(fabric, args)
    dataset, summary = build_dataset(args, start)
    reference, reference_meta = reference_model(fabric, start, args)
    compute_loss = partial(
        kto_batch_loss,
        reference=reference,
        baseline=kl_baseline(fabric),
        beta=args.preference_beta,
        desirable_weight=args.kto_desirable_weight,
        undesirable_weight=args.kto_undesirable_weight,
        moe_aux_loss_coef=args.moe_aux_loss_coef,
        loss_chunk_size=start.loss_chunk_size(args),
    )
    collate = partial(collate_unpaired, pad_id=start.need_tokenizer("kto").padding_id)
    task = TrainTask(dataset, summary, compute_loss, collate, checkpoint_meta={"reference": reference_meta})
    return train_on(fabric, args, start, task)
