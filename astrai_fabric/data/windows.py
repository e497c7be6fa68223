"""The windows seq and sft read from a data directory, and what reading them takes of where the run starts: one
definition for training (``train/lm.py`` builds its windows here, ``train/start.py`` its tokenizer rule) and for
``astrai-fabric evaluate``'s perplexity (``evaluate/perplexity.py``), which reads held-out data exactly as training
reads it without importing ``train/``.

``WindowData`` is the data flags the windows read (the fields of these names of ``TrainArgs`` and ``EvaluateArgs``);
``DataStart`` what they read of a run's start (the tokenizer, AstrAI's ``dataset_config.json``, the window, and the
model's vocabulary and positions, as numbers: data knows nothing of the model); ``evaluation_start`` resolves it for
a loaded model, as ``train.start.read_start`` resolves a run's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from astrai_fabric import assets, hub
from astrai_fabric.data.dataset_config import DatasetConfig, read_dataset_config, render_stream
from astrai_fabric.data.datasets import (
    RecordDataset,
    TokenStream,
    WindowDataset,
    bin_stream,
    record_dataset,
    window_dataset,
)
from astrai_fabric.data.shapes import Shaper, check_not_shaped, shape_records
from astrai_fabric.data.storage import detect_format, read_records
from astrai_fabric.data.tokenize import tokenize_chats, tokenize_text
from astrai_fabric.errors import ConfigError, UserError
from astrai_fabric.tokenizer import Tokenizer


@dataclass(frozen=True)
class WindowData:
    """The data flags the windows read."""

    train_type: str
    """``seq`` or ``sft``: how the records are tokenised and which tokens are trained (scored)."""
    data_root_path: str
    stride: int | None = None
    data_subset: str | None = None
    data_split: str | None = None
    data_format: str = "auto"
    data_columns: str | None = None
    packing: bool = True
    """sft: windows over the records run together (AstrAI's); False: one sample per record (``RecordDataset``)."""

    @classmethod
    def of(cls, args: Any) -> WindowData:
        """The fields of these names of ``args`` (``TrainArgs``, ``EvaluateArgs``), the defaults for those it lacks
        (evaluate reads windows: it has no ``packing``)."""
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})


@dataclass
class DataStart:
    """What the windows read of where a run starts."""

    vocab_size: int
    max_position_embeddings: int
    """The model's: every token id and position id read is checked against them."""
    window_size: int
    tokenizer: Tokenizer | None
    """None only where the model's directory holds none (bin shards need none)."""
    no_tokenizer: str | None = None
    """Why there is no tokenizer (the loader's own message), raised by ``need_tokenizer``."""
    dataset_config: DatasetConfig | None = None
    """AstrAI's ``dataset_config.json`` of a data directory, checked (``data/dataset_config.py``)."""

    def need_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer, or the one-line error saying ``what`` needs one and why there is none."""
        if self.tokenizer is None:
            raise UserError(f"{what} needs a tokenizer: {self.no_tokenizer}")
        return self.tokenizer


def build_windows(data: WindowData, start: DataStart) -> tuple[WindowDataset | RecordDataset, str]:
    """The windows of ``data`` (sft with ``packing`` off: its records, ``RecordDataset``) and a one-line description
    of them; on the lines after it, ``packing: ...`` (what the samples cut and leave out: ``describe_packing``) and
    warnings."""
    window_size = start.window_size
    data_path = assets.resolve(data.data_root_path)
    kind = detect_format(data_path)
    shown = "JSONL" if kind == "jsonl" else kind
    tokenizer = start.need_tokenizer(f"{data.train_type} on {shown} data") if kind != "bin" else start.tokenizer
    sizes = (start.vocab_size, start.max_position_embeddings)
    note, shapes, shape_names = "", "", set()
    if start.dataset_config is not None:  # AstrAI's dataset_config.json route
        check_not_shaped(data.data_format, data.data_columns, f"{start.dataset_config.path} renders these records")
        records = read_records(data_path, subset=data.data_subset, split=data.data_split)  # JSONL or any source
        stream, dropped = render_stream(start.dataset_config, tokenizer, records)
        stream = TokenStream({k: [v] for k, v in stream.items()})
        reasons = ", ".join(f"{n} {reason}" for reason, n in dropped.items())
        note = f"; records rendered by {start.dataset_config.path}" + (f", dropped: {reasons}" if reasons else "")
    elif kind != "bin":  # records of any shape (data/shapes.py), tokenised as the canonical ones
        schema_check = Shaper(data.train_type, data.data_format, data.data_columns).check_schema
        records = read_records(data_path, subset=data.data_subset, split=data.data_split, schema_check=schema_check)
        records, shaper = shape_records(records, data.train_type, data.data_format, data.data_columns)
        tokenize = tokenize_chats if data.train_type == "sft" else tokenize_text
        stream = TokenStream({k: [v] for k, v in tokenize(records, tokenizer).items()})
        shapes = shaper.describe() and f"{shaper.describe()}, "
        shape_names = {shape.name for shape, _ in shaper.sources.values()}
    else:
        check_not_shaped(data.data_format, data.data_columns, f"data_root_path {data_path} holds bin shards (tokens)")
        stream = bin_stream(data_path, data.data_subset, data.data_split)
    if data.packing or data.train_type != "sft":
        dataset = window_dataset(stream, data.train_type, data_path, window_size, data.stride, *sizes)
        samples = f"windows of {window_size} tokens"
    else:
        dataset = record_dataset(stream, data_path, window_size, *sizes)
        samples = f"one per record, at most {window_size} positions each,"
    summary = f"{shapes}{samples} from {data_path} ({stream.num_tokens:,} tokens){note}"
    summary += f"\n{PACKING_LINE}{describe_packing(dataset, shape_names)}"
    if tokenizer is None:
        summary += (
            f"\nwarning: no tokenizer ({start.no_tokenizer.split(':')[0]} is missing): bin shards need none, so this "
            "run trains without one and its checkpoints carry none; generate and JSONL data need one (--tokenizer_path)"
        )
    if getattr(dataset, "num_untrained_windows", 0):
        summary += (
            f"\nwarning: {dataset.num_untrained_windows:,} of {len(dataset):,} windows hold no trained token "
            "(loss_mask 0 throughout): they count as samples but add nothing to the gradient"
        )
    return dataset, summary


PACKING_LINE = "packing: "
"""How the data summary's line saying what the samples cut and leave out begins (the plan shows it as a row)."""
TRL_SHAPES = ("messages", "prompt_completion")
"""Record shapes TRL's ``SFTTrainer`` reads, which it trains one record per sample by default."""


def describe_packing(dataset: WindowDataset | RecordDataset, shape_names: set[str] = frozenset()) -> str:
    """Which of sft's two modes runs and what its samples cut or leave out, counted (seq: its windows' tail);
    ``shape_names``: the records' shapes (``data/shapes.py``), for the way to TRL's mode where they are its own."""
    if isinstance(dataset, RecordDataset):
        cut = (
            f"{dataset.num_cut:,} cut after {dataset.window_size + 1} tokens ({dataset.tokens_past_cuts:,} tokens "
            "past the cuts not read)"
        )
        dropped = f"{dataset.num_dropped:,} dropped (no trained token before the cut)" if dataset.num_dropped else ""
        trained = f"the samples predict {dataset.num_trained_in_samples:,} of the {dataset.num_trained_tokens:,}"
        return (
            f"off: each record alone, padded to the longest of its micro-batch (TRL's SFTTrainer(packing=False)); of "
            f"{dataset.num_records:,} records {cut}, {dropped or 'none dropped'}; {trained} "
            "trained tokens"
        )
    left_over, trained = dataset.count_left_over()
    tail = f"the last {left_over:,} tokens" if dataset.stride <= dataset.window_size else f"{left_over:,} tokens"
    tail = f"{tail} ({trained:,} trained)" if trained is not None else tail
    tail = f"{tail} fall in no window" if left_over else "no token is left out"
    if dataset.train_type != "sft":
        return f"on (seq: the stream cut into windows, its only mode); {tail}"
    split, num_records = dataset.count_split_records()
    way = "as TRL's SFTTrainer does by default" if shape_names & set(TRL_SHAPES) else "each record alone"
    return (
        f"on (AstrAI's sft: the records run on from one window into the next); {split:,} of {num_records:,} records "
        f"not whole in one window; {tail}; --packing false trains one sample per record, {way}"
    )


def evaluation_start(
    vocab_size: int,
    max_position_embeddings: int,
    tokenizer: Tokenizer | None,
    data: WindowData,
    window_size: int | None,
) -> DataStart:
    """What ``build_windows`` reads of a start, for scoring a loaded model (its vocabulary and positions, its
    tokenizer) on ``data`` as training reads it (``astrai-fabric evaluate``): the data directory's
    ``dataset_config.json`` and its tokenizer rule, the window (default: ``max_position_embeddings``)."""
    window_size = window_size or max_position_embeddings
    if window_size > max_position_embeddings:
        raise ConfigError(
            f"window_size {window_size} exceeds the model's max_position_embeddings {max_position_embeddings}: "
            "lower --window_size"
        )
    dataset_config = read_dataset_config(hub.local_path(data.data_root_path, "dataset"), data.train_type)
    if dataset_config is not None and dataset_config.tokenizer_dir is not None:
        tokenizer = data_tokenizer(dataset_config, tokenizer)
    no_tokenizer = None if tokenizer is not None else "the model directory holds no tokenizer (pass --tokenizer_path)"
    return DataStart(vocab_size, max_position_embeddings, window_size, tokenizer, no_tokenizer, dataset_config)


def data_tokenizer(config: DatasetConfig, run_tokenizer: Tokenizer | None) -> Tokenizer:
    """The tokenizer AstrAI tokenises a ``dataset_config.json`` route with; it must be the run's (the one checkpoints
    carry and the model was built for) where the run has one."""
    directory = assets.resolve(str(config.tokenizer_dir))
    from_data = Tokenizer.from_dir(directory)
    if run_tokenizer is None:
        return from_data
    if from_data.contents() != run_tokenizer.contents():
        raise ConfigError(
            f"{config.path}: its records are tokenised with {directory} (AstrAI's rule: the file's tokenizer_path, "
            f"else the data directory), which differs from the run's tokenizer {run_tokenizer.directory}; pass "
            f"--tokenizer_path {directory}, or make the two the same"
        )
    return run_tokenizer
