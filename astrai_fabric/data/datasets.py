"""Fixed windows over a token stream, for ``seq`` and ``sft`` (AstrAI's ``astrai/dataset/dataset.py``).

With ``T`` tokens, window ``W`` and stride ``s`` there are ``0 if T <= W else (T - 1 - W) // s + 1`` samples;
sample ``i`` reads ``[b, b + W)`` as input and ``[b + 1, b + W + 1)`` as target, ``b = min(i * s, T - 1 - W)``,
so every sample has exactly ``W`` tokens and none reads past the stream (AstrAI's indexing, exactly).

sft with ``--packing false`` reads the same stream as ``RecordDataset``: one sample per record (records begin where
the stored position ids restart at 0, AstrAI's ``doc_reset``), its first ``W + 1`` tokens, of varying length, padded
per micro-batch by ``collate_records``. Both count what their samples leave out, for the plan.
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

    def check_range(self, key: str, limit: int, expected: str, source: Path) -> None:
        """Every value of ``key`` in ``[0, limit)``: one vectorised min/max per shard, the culprit named (a shard's
        file, else ``source``, the data the stream was read from)."""
        segments = self._segments[key]
        for index, segment in enumerate(segments):
            if not len(segment):
                continue
            low, high = segment.min(), segment.max()
            if low < 0 or high >= limit:
                part = f" (part {index})" if len(segments) > 1 else ""
                where = getattr(segment, "filename", None) or f"data_root_path {source}{part}"
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
        trained = _trained_prefix(self.stream)
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

    def count_left_over(self) -> tuple[int, int | None]:
        """Tokens that no window predicts (the stream's first aside, which nothing precedes), and how many of them
        the loss mask trains (None for seq, which trains all): the tail after the last window, which AstrAI's
        windows leave out rather than pad, and with a stride longer than the window the gaps between windows."""
        total, size, count = self.stream.num_tokens, self.window_size, self.num_samples
        left_over = total - 1 - ((count - 1) * min(self.stride, size) + size)
        if self.train_type != "sft":
            return left_over, None
        trained = _trained_prefix(self.stream)
        begins = np.arange(count) * self.stride  # i * stride <= T - 1 - W for every sample (the module docstring)
        if self.stride <= size:  # the windows' targets cover [1, last begin + W + 1) without a gap
            predicted = trained[begins[-1] + size + 1] - trained[1]
        else:
            predicted = (trained[begins + size + 1] - trained[begins + 1]).sum()
        return left_over, int(trained[total] - trained[1] - predicted)

    def count_split_records(self) -> tuple[int, int]:
        """sft: the records (``record_bounds``) that no one window holds whole (first token read to last token
        predicted), the tail's aside (``count_left_over`` counts it), and the number of records."""
        starts, ends = record_bounds(self.stream)
        size, stride, count = self.window_size, self.stride, self.num_samples
        begin = np.minimum(starts // stride, count - 1) * stride  # the last window to read a record's first token
        whole = (begin <= starts) & (ends <= begin + size + 1)
        reached = starts < (count - 1) * stride + size  # the record's first token is read by some window
        return int(np.count_nonzero(~whole & reached)), len(starts)


def _trained_prefix(stream: TokenStream) -> np.ndarray:
    """``p[k]``: the trained tokens among the stream's first ``k`` (``p[0] = 0``), int64."""
    prefix = np.zeros(stream.num_tokens + 1, dtype=np.int64)
    np.cumsum(stream.read("loss_mask", 0, stream.num_tokens).astype(np.bool_), out=prefix[1:])
    return prefix


def record_bounds(stream: TokenStream) -> tuple[np.ndarray, np.ndarray]:
    """Where each record of an sft stream begins and ends: where its position ids restart at 0 (AstrAI's
    ``doc_reset``; a stream that starts inside a record begins one there too, and one whose positions never restart
    is one record)."""
    positions = stream.read("position_ids", 0, stream.num_tokens)
    starts = np.flatnonzero(positions == 0)
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([np.zeros(1, dtype=starts.dtype), starts])
    return starts, np.append(starts[1:], stream.num_tokens)


class RecordDataset(Dataset):
    """sft with ``--packing false``: one sample per record of the stream that trains a token within its cut, the
    first ``window_size + 1`` tokens: ``window_size`` positions read, each predicting the next token (as a window
    does; TRL's ``max_length`` L reads L positions and predicts L - 1). Samples are ``input_ids``, ``target_ids``
    and ``loss_mask`` (aligned with the targets) of one record's length; no ``position_ids``: a record alone needs
    no document mask, plain causal attention from position 0 is its own.

    A record with no trained token within its cut is dropped (TRL's ``SFTTrainer`` drops it too): every kept
    record trains, and none is read twice."""

    def __init__(self, stream: TokenStream, window_size: int) -> None:
        self.stream, self.window_size = stream, window_size
        starts, ends = record_bounds(stream)
        trained = _trained_prefix(stream)
        cuts = np.minimum(ends, starts + window_size + 1)
        keep = trained[cuts] - trained[starts + 1] > 0  # a trained token among the predicted ones (not the first)
        self.begins, self.ends = starts[keep], cuts[keep]
        self.num_records = len(starts)
        """Records in the stream, kept or dropped."""
        self.num_dropped = int(np.count_nonzero(~keep))
        """Records dropped: no trained token within their cut."""
        self.num_cut = int(np.count_nonzero(keep & (ends > cuts)))
        """Kept records longer than the cut."""
        self.num_trained_tokens = int(trained[-1])
        """Trained tokens in the stream (the loss mask's ones)."""
        self.num_trained_in_samples = int((trained[self.ends] - trained[self.begins + 1]).sum())
        """Trained tokens some sample predicts: the others lie past a cut, in a dropped record, or first in their
        record (nothing before them to predict them from)."""
        self.tokens_past_cuts = int((ends - cuts)[keep].sum())
        """Tokens of kept records after their cut, never read."""

    def __len__(self) -> int:
        return len(self.begins)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        begin, end = int(self.begins[index]), int(self.ends[index])
        read = self.stream.read
        return {
            "input_ids": torch.from_numpy(read("sequence", begin, end - 1).astype(np.int64)),
            "target_ids": torch.from_numpy(read("sequence", begin + 1, end).astype(np.int64)),
            "loss_mask": torch.from_numpy(read("loss_mask", begin + 1, end).astype(np.bool_)),
        }


def collate_records(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """``RecordDataset`` samples right-padded to the longest of the micro-batch: padding is never trained
    (``loss_mask`` 0) nor seen by a real token (causal attention, padding after it), and ``attention_mask`` marks the
    real positions, which the loop counts as the step's tokens."""
    length = max(len(sample["input_ids"]) for sample in samples)
    batch = {
        "input_ids": torch.zeros(len(samples), length, dtype=torch.long),  # id 0: any id will do, none reads it
        "target_ids": torch.zeros(len(samples), length, dtype=torch.long),
        "loss_mask": torch.zeros(len(samples), length, dtype=torch.bool),
        "attention_mask": torch.zeros(len(samples), length, dtype=torch.bool),
    }
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        for key in ("input_ids", "target_ids", "loss_mask"):
            batch[key][row, :size] = sample[key]
        batch["attention_mask"][row, :size] = True
    return batch


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
        stream = bin_stream(path, subset, split)
    else:
        if tokenizer is None:
            shown = "JSONL" if kind == "jsonl" else kind
            raise UserError(f"data_root_path {path}: {shown} data needs a tokenizer (--tokenizer_path)")
        records = read_records(path, subset=subset, split=split)
        tokenize = tokenize_chats if train_type == "sft" else tokenize_text
        stream = TokenStream({k: [v] for k, v in tokenize(records, tokenizer).items()})
    return window_dataset(stream, train_type, path, window_size, stride, vocab_size, max_positions)


def bin_stream(path: Path, subset: str | None = None, split: str | None = None) -> TokenStream:
    """The token stream of AstrAI bin shards at ``path`` (which have neither subsets nor splits)."""
    if subset is not None or split is not None:
        read_records(path, subset=subset, split=split)  # the one line saying bin shards have neither
    return TokenStream(read_bin_shards(path))


def check_stream(
    stream: TokenStream, train_type: str, path: Path, vocab_size: int | None = None, max_positions: int | None = None
) -> None:
    """One clear error when ``stream`` (read from ``path``) lacks a key ``train_type`` reads, holds a token id not
    below ``vocab_size`` or (sft) a position id not below ``max_positions``."""
    missing = [k for k in REQUIRED_KEYS[train_type] if k not in stream.keys]
    if missing:
        raise UserError(f"data_root_path {path}: {train_type} data needs keys {missing}; the shards hold {stream.keys}")
    if vocab_size is not None:
        expected = f"token ids must be below the model's vocab_size {vocab_size:,}"
        stream.check_range("sequence", vocab_size, expected, path)
    if max_positions is not None and train_type == "sft":  # seq never reads them (positions 0..window-1)
        expected = (
            f"position ids must be below the model's max_position_embeddings {max_positions:,} (a conversation "
            "longer than that: shorten it, or --packing false cuts each record at the window)"
        )
        stream.check_range("position_ids", max_positions, expected, path)


def record_dataset(
    stream: TokenStream,
    path: Path,
    window_size: int,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> RecordDataset:
    """sft's samples of one record each over ``stream`` (``--packing false``), checked as ``window_dataset``
    checks its windows but for the stored positions: a sample reads positions 0 to window_size - 1, below
    ``max_positions`` (the window is), whatever a record's length past its cut. One clear error when no record trains
    a token within its cut."""
    del max_positions  # taken for window_dataset's signature: the stored positions are never read here
    check_stream(stream, "sft", path, vocab_size)
    dataset = RecordDataset(stream, window_size)
    if len(dataset) == 0:
        raise UserError(
            f"data_root_path {path}: no record trains a token in its first {window_size + 1} tokens (loss_mask 0 "
            "there: sft trains the assistant turns, and --packing false reads each record up to window_size + 1 "
            "tokens); the run would learn nothing"
        )
    return dataset


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
    check_stream(stream, train_type, path, vocab_size, max_positions)
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
