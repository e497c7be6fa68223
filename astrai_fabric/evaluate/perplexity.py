"""Perplexity of a model on held-out data: the summed negative log-likelihood of each scored unit (a training window,
or a record), then the token-weighted mean loss, its perplexity and a bootstrap 95% interval over the units.

``windows`` reads the data exactly as training does (``data.windows.build_windows``, training's own: the same
windows, stride, sft loss masks and document boundaries, and ``model.forward_window``), so the mean loss is the run's
validation loss with each token weighted alike (the run's is a mean of per-micro-batch means). ``records`` scores each
record alone from its first token, in rolling windows of the most context where it is longer than the window (lm-eval's
``loglikelihood_rolling`` order, with no prefix token), as AstrAI's ``scripts/eval/evaluate_ppl.py`` does for records
that fit (docs/astrai-compat.md says where that script differs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from astrai_fabric import assets
from astrai_fabric.config.evaluate import EvaluateArgs
from astrai_fabric.data.shapes import shape_records
from astrai_fabric.data.storage import read_records
from astrai_fabric.data.windows import WindowData, build_windows, evaluation_start
from astrai_fabric.errors import UserError
from astrai_fabric.evaluate.results import LARGEST_LOSS
from astrai_fabric.losses import loss_chunk_positions, token_logprobs
from astrai_fabric.model import forward_window
from astrai_fabric.tokenizer import Tokenizer


@dataclass
class Scores:
    """Each scored unit's summed negative log-likelihood (nats) and its number of scored tokens."""

    nll_sums: np.ndarray
    token_counts: np.ndarray
    description: str
    """What was scored, for the table (``312 windows of 128 tokens from data/val.jsonl``)."""


def score_data(model: nn.Module, tokenizer: Tokenizer | None, args: EvaluateArgs, progress: bool) -> Scores:
    """The units of ``args.data_root_path`` scored by ``model`` (in eval mode, on its device)."""
    if args.perplexity_unit == "records":
        return _score_records(model, tokenizer, args, progress)
    return _score_windows(model, tokenizer, args, progress)


def summarize(scores: Scores, bootstrap_iters: int, seed: int) -> dict[str, Any]:
    """Mean loss (nats per scored token), perplexity, tokens, units and, with ``bootstrap_iters``, the percentile
    95% interval of both from that many resamples of the units with replacement (a unit's tokens move together)."""
    total_tokens = int(scores.token_counts.sum())
    if total_tokens == 0:
        raise UserError(f"perplexity: {scores.description} holds no scored token")
    loss = float(scores.nll_sums.sum() / total_tokens)
    if not math.isfinite(loss) or loss > LARGEST_LOSS:
        raise UserError(
            f"perplexity: the mean loss on {scores.description} is {loss:g} nats per token; the model's "
            "weights or outputs are not finite (or of no use): nothing to report"
        )
    metrics: dict[str, Any] = {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": total_tokens,
        "units": len(scores.token_counts),
    }
    if bootstrap_iters > 0:
        rng = np.random.default_rng(seed)
        count = len(scores.token_counts)
        resampled = np.empty(bootstrap_iters)
        for i in range(bootstrap_iters):
            picks = rng.integers(0, count, size=count)
            resampled[i] = scores.nll_sums[picks].sum() / max(scores.token_counts[picks].sum(), 1)
        low, high = np.percentile(resampled, [2.5, 97.5])
        metrics["loss_ci95"] = [float(low), float(high)]
        metrics["perplexity_ci95"] = [math.exp(low), math.exp(high)]
    return metrics


def _score_windows(model: nn.Module, tokenizer: Tokenizer | None, args: EvaluateArgs, progress: bool) -> Scores:
    # The windows training builds (one definition), so that nothing about windows or masks can drift from what
    # training scores.
    data, config = WindowData.of(args), model.config
    start = evaluation_start(config.vocab_size, config.max_position_embeddings, tokenizer, data, args.window_size)
    dataset, summary = build_windows(data, start)
    device = next(model.parameters()).device
    rank, world_size = evaluation_world()
    mine = range(rank, len(dataset), world_size)  # the others' windows are scored by the other ranks
    chunk_size = loss_chunk_positions(None, model.config.vocab_size, args.batch_size * start.window_size)
    nll_sums, token_counts = np.zeros(len(dataset)), np.zeros(len(dataset), dtype=np.int64)
    bar = tqdm(total=len(mine), unit="window", desc="perplexity", disable=not progress, dynamic_ncols=True)
    for begin in range(0, len(mine), args.batch_size):
        indices = list(mine[begin : begin + args.batch_size])
        samples = [dataset[i] for i in indices]
        batch = {key: torch.stack([s[key] for s in samples]).to(device) for key in samples[0]}
        with torch.no_grad():
            if chunk_size:  # the head fused with the loss, as training computes it: never the whole logits
                out = forward_window(
                    model,
                    batch["input_ids"],
                    batch.get("position_ids"),
                    nll_targets=batch["target_ids"],
                    nll_chunk_size=chunk_size,
                )
                nll = out.token_nll
            else:
                logits = forward_window(model, batch["input_ids"], batch.get("position_ids")).logits
                nll = -token_logprobs(logits, batch["target_ids"])
        mask = batch.get("loss_mask", torch.ones_like(nll, dtype=torch.bool))
        nll_sums[indices] = (nll * mask).sum(dim=1).double().cpu().numpy()
        token_counts[indices] = mask.sum(dim=1).cpu().numpy()
        bar.update(len(samples))
    bar.close()
    description = summary.splitlines()[0]
    return Scores(_gathered(nll_sums, device), _gathered(token_counts, device), description)


def evaluation_world() -> tuple[int, int]:
    """This process's rank and the number evaluating together: ``torch.distributed``'s default group where one is
    set up (``astrai-fabric evaluate --nprocs``, torchrun, or a program of your own), else ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(values: np.ndarray, device: torch.device) -> np.ndarray:
    """Every rank's scores, each rank's zero where another scored, summed: the whole array on every rank, as one
    process computes it (adding zeros is exact; counts stay exact in float64 below 2**53)."""
    if evaluation_world()[1] == 1:
        return values
    total = torch.from_numpy(values.astype(np.float64)).to(device)
    dist.all_reduce(total)
    return total.cpu().numpy().astype(values.dtype)


def rolling_windows(num_tokens: int, window_size: int) -> Iterator[tuple[int, int, int]]:
    """``(begin, end, num_scored)`` covering a record of ``num_tokens`` tokens: the window's inputs are tokens
    ``[begin, end - 1)`` (at most ``window_size``), its targets ``[begin + 1, end)``, of which the last ``num_scored``
    count. Every token after the first is scored exactly once, each with as much context as the window holds."""
    next_target = 1
    while next_target < num_tokens:
        end = min(next_target + window_size, num_tokens)
        begin = max(0, end - 1 - window_size)
        yield begin, end, end - next_target
        next_target = end


def _score_records(model: nn.Module, tokenizer: Tokenizer | None, args: EvaluateArgs, progress: bool) -> Scores:
    data_path = assets.resolve(args.data_root_path)
    if tokenizer is None:
        raise UserError(
            f"perplexity_unit records: data_root_path {data_path} is text and needs a tokenizer (--tokenizer_path)"
        )
    records = read_records(data_path, subset=args.data_subset, split=args.data_split)
    records, shaper = shape_records(records, "seq", args.data_format, args.data_columns)
    texts = []
    for where, record in records:
        if not isinstance(record.get("text"), str):
            raise UserError(f"{where}: a record needs a string field 'text', got {type(record.get('text')).__name__}")
        texts.append(record["text"])
    # The tokenizer's own special tokens, as lm-eval's rolling log-likelihood and AstrAI's script encode a record.
    encoded = tokenizer.encode_batch(texts)
    window_size = args.window_size or model.config.max_position_embeddings
    if window_size > model.config.max_position_embeddings:
        raise UserError(
            f"window_size {window_size} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}: lower --window_size"
        )
    rank, world_size = evaluation_world()
    pieces = [
        (row, *piece)
        for row, ids in enumerate(encoded)
        if row % world_size == rank  # the others': theirs
        for piece in rolling_windows(len(ids), window_size)
    ]
    nll_sums, token_counts = np.zeros(len(encoded)), np.zeros(len(encoded), dtype=np.int64)
    mine = range(rank, len(encoded), world_size)
    bar = tqdm(total=len(mine), unit="record", desc="perplexity", disable=not progress, dynamic_ncols=True)
    pieces_left = np.bincount([piece[0] for piece in pieces], minlength=len(encoded))
    bar.update(int((pieces_left[mine] == 0).sum()))  # records of one token or none: nothing to score
    for batch in _batches_by_length(pieces, args.batch_size):
        inputs = [encoded[row][begin : end - 1] for row, begin, end, _ in batch]
        targets = [encoded[row][begin + 1 : end] for row, begin, end, _ in batch]
        scored = right_padded_logprobs(model, inputs, targets)
        for (row, _, _, num_scored), logprobs in zip(batch, scored, strict=True):
            nll_sums[row] -= float(logprobs[len(logprobs) - num_scored :].double().sum())
            token_counts[row] += num_scored
            pieces_left[row] -= 1
            bar.update(int(pieces_left[row] == 0))
    bar.close()
    shape = shaper.describe() and f"{shaper.describe()}, "
    description = f"{shape}{len(encoded):,} records from {data_path}, each alone in windows of {window_size} tokens"
    device = next(model.parameters()).device
    return Scores(_gathered(nll_sums, device), _gathered(token_counts, device), description)


def _batches_by_length(pieces: list[tuple[int, int, int, int]], batch_size: int) -> Iterator[list]:
    """Pieces in batches of similar lengths (longest first: a memory error shows at once); the order of results does
    not matter, each piece carries its record."""
    ordered = sorted(pieces, key=lambda piece: piece[1] - piece[2])  # begin - end: the longest first
    for begin in range(0, len(ordered), batch_size):
        yield ordered[begin : begin + batch_size]


def right_padded_logprobs(
    model: nn.Module, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], with_greedy: bool = False
) -> Any:
    """``log p(target)`` at each position of each row (float32), and with ``with_greedy`` whether each target is the
    most likely token there; the rows padded on the right, where causal attention never looks, so the padding
    cannot change them. One forward for the batch (evaluation's records, lm-eval's requests)."""
    device = next(model.parameters()).device
    width = max(len(row) for row in inputs)
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    wanted = torch.zeros(len(inputs), width, dtype=torch.long)
    for i, (row, target) in enumerate(zip(inputs, targets, strict=True)):
        ids[i, : len(row)] = torch.as_tensor(row)
        wanted[i, : len(target)] = torch.as_tensor(target)
    wanted = wanted.to(device)
    with torch.no_grad():
        logits = model(ids.to(device)).logits
        logprobs = token_logprobs(logits, wanted).cpu()
        greedy = (logits.argmax(dim=-1) == wanted).cpu() if with_greedy else None
    rows = [logprobs[i, : len(row)] for i, row in enumerate(inputs)]
    if not with_greedy:
        return rows
    return rows, [greedy[i, : len(row)] for i, row in enumerate(inputs)]
