"""Fixed windows over a token stream, for ``seq`` and ``sft`` (AstrAI's ``astrai/dataset/dataset.py``).

With ``T`` tokens, window ``W`` and stride ``s`` there are ``0 if T <= W else (T - 1 - W) // s + 1`` samples;
sample ``i`` reads ``[b, b + W)`` as input and ``[b + 1, b + W + 1)`` as target, ``b = min(i * s, T - 1 - W)``,
so every sample has exactly ``W`` tokens and none reads past the stream (AstrAI's indexing, exactly).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from astrai_fabric.data.storage import detect_format, read_bin_shards, read_records
from astrai_fabric.data.tokenize import tokenize_chats, tokenize_text
from astrai_fabric.errors import UserError
from astrai_fabric.tokenizer import Tokenizer

REQUIRED_KEYS = {"seq": ("sequence",), "sft": ("sequence", "loss_mask", "position_ids")}


class TokenStream:
    """Named 1-D streams, each possibly split over several shards, read as if concatenated."""

    def __init__(self, segments: dict[str, Sequence[np.ndarray]]) -> None:
        self._segments = {k: list(v) for k, v in segments.items()}
        self._ends = {k: np.cumsum([len(s) for s in v]).tolist() for k, v in self._segments.items()}
        self.num_tokens = min(ends[-1] if ends else 0 for ends in self._ends.values())
        """Length of the shortest key (AstrAI's rule when keys disagree)."""

    @property
    def keys(self) -> list[str]:
        return list(self._segments)

    def check_range(self, key: str, limit: int, expected: str) -> None:
        """Every value of ``key`` in ``[0, limit)``: one vectorised min/max per shard, the culprit named."""
        for index, segment in enumerate(self._segments[key]):
            if not len(segment):
                continue
            low, high = segment.min(), segment.max()
            if low < 0 or high >= limit:
                where = getattr(segment, "filename", None) or f"{key} (part {index})"
                raise UserError(f"{where}: holds {key} values in [{low}, {high}]; {expected}")

    def read(self, key: str, begin: int, end: int) -> np.ndarray:
        """Tokens ``[begin, end)`` of ``key``, across shard boundaries."""
        ends, segments = self._ends[key], self._segments[key]
        first = bisect.bisect_right(ends, begin)
        pieces = []
        while begin < end:
            start = ends[first - 1] if first else 0
            stop = min(end, ends[first])
            pieces.append(segments[first][begin - start : stop - start])
            begin, first = stop, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class WindowDataset(Dataset):
    """``seq`` samples (``input_ids``, ``target_ids``), plus ``position_ids`` and ``loss_mask`` for ``sft``."""

    def __init__(self, stream: TokenStream, train_type: str, window_size: int, stride: int | None = None) -> None:
        self.stream, self.train_type = stream, train_type
        self.window_size, self.stride = window_size, stride or window_size
        total = stream.num_tokens
        self.num_samples = 0 if total <= window_size else (total - 1 - window_size) // self.stride + 1
        self.num_untrained_windows = 0
        """sft: windows whose loss mask selects no token (set by ``load_window_dataset``)."""

    def __len__(self) -> int:
        return self.num_samples

    def window(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        begin = min(index * self.stride, self.stream.num_tokens - 1 - self.window_size)
        return begin, begin + self.window_size

    def count_untrained_windows(self) -> int:
        """Windows whose shifted loss mask is 0 everywhere (vectorised over the whole stream)."""
        trained = np.zeros(self.stream.num_tokens + 1, dtype=np.int64)
        np.cumsum(self.stream.read("loss_mask", 0, self.stream.num_tokens).astype(np.bool_), out=trained[1:])
        begins = np.minimum(np.arange(self.num_samples) * self.stride, self.stream.num_tokens - 1 - self.window_size)
        return int(np.count_nonzero(trained[begins + self.window_size + 1] == trained[begins + 1]))

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        begin, end = self.window(index)
        read = self.stream.read
        sample = {
            "input_ids": torch.from_numpy(read("sequence", begin, end).astype(np.int64)),
            "target_ids": torch.from_numpy(read("sequence", begin + 1, end + 1).astype(np.int64)),
        }
        if self.train_type == "sft":
            sample["position_ids"] = torch.from_numpy(read("position_ids", begin, end).astype(np.int64))
            # The mask is shifted with the targets: it says which *predicted* tokens are trained.
            sample["loss_mask"] = torch.from_numpy(read("loss_mask", begin + 1, end + 1).astype(np.bool_))
        return sample


def load_window_dataset(
    train_type: str,
    path: str | Path,
    window_size: int,
    stride: int | None,
    tokenizer: Tokenizer | None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    subset: str | None = None,
    split: str | None = None,
) -> WindowDataset:
    """Windows over AstrAI bin shards, or records (JSONL, a ``datasets`` source: ``subset`` and ``split`` chosen in
    it) tokenised here, at ``path`` (see ``window_dataset``)."""
    path = Path(path)
    kind = detect_format(path)
    if kind == "bin":
        if subset is not None or split is not None:
            read_records(path, subset=subset, split=split)  # the one line saying bin shards have neither
        stream = TokenStream(read_bin_shards(path))
    else:
        if tokenizer is None:
            shown = "JSONL" if kind == "jsonl" else kind
            raise UserError(f"data_root_path {path}: {shown} data needs a tokenizer (--tokenizer_path)")
        records = read_records(path, subset=subset, split=split)
        tokenize = tokenize_chats if train_type == "sft" else tokenize_text
        stream = TokenStream({k: [v] for k, v in tokenize(records, tokenizer).items()})
    return window_dataset(stream, train_type, path, window_size, stride, vocab_size, max_positions)


def window_dataset(
    stream: TokenStream,
    train_type: str,
    path: Path,
    window_size: int,
    stride: int | None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> WindowDataset:
    """Windows over ``stream`` (read from ``path``); one clear error when empty, when a token id is not below
    ``vocab_size``, a position id not below ``max_positions``, or (sft) no window trains any token.
    ``num_untrained_windows`` counts the sft windows without a trained token."""
    missing = [k for k in REQUIRED_KEYS[train_type] if k not in stream.keys]
    if missing:
        raise UserError(f"data_root_path {path}: {train_type} data needs keys {missing}; the shards hold {stream.keys}")
    if vocab_size is not None:
        stream.check_range("sequence", vocab_size, f"token ids must be below the model's vocab_size {vocab_size:,}")
    if max_positions is not None and train_type == "sft":  # seq never reads them (positions 0..window-1)
        limit = f"position ids must be below the model's max_position_embeddings {max_positions:,}"
        stream.check_range("position_ids", max_positions, limit)
    dataset = WindowDataset(stream, train_type, window_size, stride)
    if len(dataset) == 0:
        raise UserError(
            f"data_root_path {path}: {stream.num_tokens} tokens hold no window of window_size={window_size} "
            f"(a sample needs window_size + 1 tokens); lower window_size or add data"
        )
    if train_type == "sft":
        dataset.num_untrained_windows = dataset.count_untrained_windows()
        if dataset.num_untrained_windows == len(dataset):
            raise UserError(
                f"data_root_path {path}: no window of {window_size} tokens holds a trained token (loss_mask is 0 "
                "everywhere: sft trains the assistant turns); the run would learn nothing"
            )
    return dataset
