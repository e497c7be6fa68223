"""``seq`` (pretraining) and ``sft``: next-token prediction over fixed windows of a token stream (spec §3.1-3.2).

``seq`` attends causally across the whole window and trains every token. ``sft`` restarts positions and stops
attention at document boundaries (from the stored position ids) and trains only the tokens its loss mask
selects (assistant turns).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, random_split

from astrai_fabric import assets
from astrai_fabric.checkpoint import find_latest_checkpoint
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler, load_window_dataset
from astrai_fabric.loop import fit
from astrai_fabric.losses import causal_lm_loss, with_moe_aux_loss
from astrai_fabric.model import make_doc_boundary_mask
from astrai_fabric.schedule import StepPlan
from astrai_fabric.train.common import (
    RECIPE_FILE,
    build_model,
    build_optimizer_and_schedule,
    load_tokenizer,
    make_saver,
    resolve_start,
    resolved_recipe,
    start_position,
)


def lm_loss(model: nn.Module, batch: dict[str, Tensor], label_smoothing: float, moe_aux_loss_coef: float):
    """Mean next-token cross-entropy of one micro-batch (+ the weighted MoE aux loss)."""
    if "position_ids" in batch:  # sft: documents packed in one window must not see each other
        position_ids = batch["position_ids"]
        out = model(batch["input_ids"], input_mask=make_doc_boundary_mask(position_ids), position_ids=position_ids)
    else:
        out = model(batch["input_ids"])
    loss = causal_lm_loss(out["logits"], batch["target_ids"], batch.get("loss_mask"), label_smoothing)
    return with_moe_aux_loss(loss, out.get("aux_loss"), moe_aux_loss_coef)


def split_validation(dataset: Dataset, val_split: float | None, seed: int) -> tuple[Dataset, Dataset | None]:
    """AstrAI's split: ``max(1, int(len * val_split))`` samples, chosen by ``random_split`` seeded with ``seed``."""
    if val_split is None:
        return dataset, None
    num_val = max(1, int(len(dataset) * val_split))
    train, val = random_split(dataset, [len(dataset) - num_val, num_val], generator=torch.Generator().manual_seed(seed))
    return train, val


def make_loader(
    fabric: Fabric, dataset: Dataset, args: TrainArgs, shuffle: bool
) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(len(dataset), fabric.global_rank, fabric.world_size, args.random_seed, shuffle)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_per_device,
        sampler=sampler,
        num_workers=args.num_workers,
        pin_memory=args.pin_memory and fabric.device.type == "cuda",
        persistent_workers=args.persistent_workers and args.num_workers > 0,
    )
    # Our sampler already shards by rank in AstrAI's order; Fabric must not replace it.
    return fabric.setup_dataloaders(loader, use_distributed_sampler=False), sampler


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train seq or sft on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(args)
    tokenizer = load_tokenizer(start)
    window_size = args.window_size or start.model_config.max_position_embeddings
    data_path = assets.resolve(args.data_root_path)
    dataset = load_window_dataset(args.train_type, data_path, window_size, args.stride, tokenizer)
    train_set, val_set = split_validation(dataset, args.val_split, args.random_seed)
    plan = StepPlan(
        len(train_set), fabric.world_size, args.batch_per_device, args.grad_accum_steps, args.n_epoch, args.warmup_ratio
    )
    plan.check()

    model = build_model(fabric, start, args)
    optimizer, scheduler = build_optimizer_and_schedule(fabric, model, start, args, plan)
    position = start_position(fabric, start, args, plan)
    train_loader, sampler = make_loader(fabric, train_set, args, shuffle=True)
    val_loader = make_loader(fabric, val_set, args, shuffle=False)[0] if val_set is not None else None

    num_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
    fabric.print(
        f"{args.train_type}: {num_params:,} parameters | {len(train_set):,} training windows of {window_size} tokens "
        f"({dataset.stream.num_tokens:,} tokens) from {data_path}"
        + (f", {len(val_set):,} held out" if val_set is not None else "")
        + f"\n{plan.describe()}\noutputs: {Path(args.ckpt_dir).resolve()}"
    )
    if start.resume is not None:
        fabric.print(
            f"resuming from {start.resume.path} at step {position.optimizer_step}, epoch {position.epoch}, "
            f"sample {position.sample_index} of {plan.samples_per_rank} per rank"
        )
    if fabric.global_rank == 0:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.ckpt_dir) / RECIPE_FILE).write_text(resolved_recipe(args))

    compute_loss = partial(lm_loss, label_smoothing=args.label_smoothing, moe_aux_loss_coef=args.moe_aux_loss_coef)
    save = make_saver(fabric, model, optimizer, scheduler, start, args, tokenizer)
    history = fit(fabric, model, optimizer, scheduler, train_loader, sampler, compute_loss, args, plan, position, save,
                  val_loader)  # fmt: skip
    latest = find_latest_checkpoint(args.ckpt_dir)
    fabric.print(f"done after step {position.optimizer_step}; latest checkpoint: {latest}")
    return history
