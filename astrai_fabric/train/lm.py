"""``seq`` (pretraining) and ``sft``: next-token prediction over fixed windows of a token stream, as
AstrAI's ``seq`` and ``sft`` strategies.

``seq`` attends causally across the whole window and trains every token. ``sft`` restarts positions and stops
attention at document boundaries (from the stored position ids) and trains only the tokens its loss mask
selects (assistant turns).
"""

from __future__ import annotations

from functools import partial

from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric import assets
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import TokenStream, WindowDataset, load_window_dataset
from astrai_fabric.data.dataset_config import render_stream
from astrai_fabric.data.datasets import window_dataset
from astrai_fabric.data.shapes import Shaper, check_not_shaped, shape_records
from astrai_fabric.data.storage import detect_format, read_records
from astrai_fabric.data.tokenize import tokenize_chats, tokenize_text
from astrai_fabric.losses import causal_lm_loss, token_nll_weights, with_moe_aux_loss
from astrai_fabric.model import forward_window
from astrai_fabric.train.common import train_on
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
        out = forward_window(model, batch["input_ids"], batch.get("position_ids"), nll_targets=batch["target_ids"],
                             nll_chunk_size=loss_chunk_size, label_smoothing=label_smoothing,
                             nll_weights=weights)  # fmt: skip
        loss = out["nll_loss"]
    else:
        out = forward_window(model, batch["input_ids"], batch.get("position_ids"))  # sft's documents apart
        loss = causal_lm_loss(out["logits"], batch["target_ids"], batch.get("loss_mask"), label_smoothing)
    return with_moe_aux_loss(loss, out, moe_aux_loss_coef)


def build_dataset(args: TrainArgs, start: Start) -> tuple[WindowDataset, str]:
    """The training windows and a one-line description of them."""
    window_size = start.window_size
    data_path = assets.resolve(args.data_root_path)
    config = start.model_config
    kind = detect_format(data_path)
    shown = "JSONL" if kind == "jsonl" else kind
    tokenizer = start.need_tokenizer(f"{args.train_type} on {shown} data") if kind != "bin" else start.tokenizer
    note, shapes = "", ""
    if start.dataset_config is not None:  # AstrAI's dataset_config.json route
        check_not_shaped(args.data_format, args.data_columns, f"{start.dataset_config.path} renders these records")
        records = read_records(data_path, subset=args.data_subset, split=args.data_split)  # JSONL or any source
        stream, dropped = render_stream(start.dataset_config, tokenizer, records)
        stream = TokenStream({k: [v] for k, v in stream.items()})
        dataset = window_dataset(stream, args.train_type, data_path, window_size, args.stride, config.vocab_size,
                                 config.max_position_embeddings)  # fmt: skip
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items())
        note = f"; records rendered by {start.dataset_config.path}" + (f", dropped: {reasons}" if reasons else "")
    elif kind != "bin":  # records of any shape (data/shapes.py), tokenised as the canonical ones
        schema_check = Shaper(args.train_type, args.data_format, args.data_columns).check_schema
        records = read_records(data_path, subset=args.data_subset, split=args.data_split, schema_check=schema_check)
        records, shaper = shape_records(records, args.train_type, args.data_format, args.data_columns)
        tokenize = tokenize_chats if args.train_type == "sft" else tokenize_text
        stream = TokenStream({k: [v] for k, v in tokenize(records, tokenizer).items()})
        dataset = window_dataset(stream, args.train_type, data_path, window_size, args.stride, config.vocab_size,
                                 config.max_position_embeddings)  # fmt: skip
        shapes = shaper.describe() and f"{shaper.describe()}, "
    else:
        check_not_shaped(args.data_format, args.data_columns, f"data_root_path {data_path} holds bin shards (tokens)")
        dataset = load_window_dataset(args.train_type, data_path, window_size, args.stride, tokenizer,
                                      config.vocab_size, config.max_position_embeddings, args.data_subset,
                                      args.data_split)  # fmt: skip
    summary = f"{shapes}windows of {window_size} tokens from {data_path} ({dataset.stream.num_tokens:,} tokens){note}"
    if tokenizer is None:
        summary += (
            f"\nwarning: no tokenizer ({start.no_tokenizer.split(':')[0]} is missing): bin shards need none, so this "
            "run trains without one and its checkpoints carry none; generate and JSONL data need one (--tokenizer_path)"
        )
    if dataset.num_untrained_windows:
        summary += (
            f"\nwarning: {dataset.num_untrained_windows:,} of {len(dataset):,} windows hold no trained token "
            "(loss_mask 0 throughout): they count as samples but add nothing to the gradient"
        )
    return dataset, summary


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train seq or sft on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(fabric, args)
    dataset, summary = build_dataset(args, start)
    compute_loss = partial(lm_loss, label_smoothing=args.label_smoothing, moe_aux_loss_coef=args.moe_aux_loss_coef,
                           loss_chunk_size=start.loss_chunk_size(args))  # fmt: skip
    return train_on(fabric, args, start, dataset, summary, compute_loss)
