"""Tokens per second the data pipeline delivers on its own, against what training consumes, single process on CPU.

    .venv/bin/python bench/data_pipeline.py [--batches 300]

Sources: the bundled seq corpus (146k tokens) and sft chats (76k tokens) read from JSONL (tokenised when the
dataset is built, which is timed apart) and from bin shards written by ``astrai-fabric prepare`` (memory-mapped);
windows of 128 tokens, 8 per batch, shuffled by our sampler, with 0 and 2 DataLoader workers. The loader is
iterated alone (batches touched, nothing computed). "consumed" is the tokens/s of ``fit()`` training the bundled
tiny model (1M parameters) on the same windows: the pipeline must deliver several times that so it never stalls
training; bigger models consume fewer tokens per second, so this is the hardest case.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from torch.utils.data import DataLoader

from astrai_fabric.assets import SEQ_DATA_DIR, SFT_DATA_DIR, TINY_MODEL_DIR
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data import ResumableSampler, load_window_dataset
from astrai_fabric.data.prepare import PipelineConfig, prepare
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train import run

WINDOW, BATCH = 128, 8
PIPELINES = {
    "seq": {"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 0}},
    "sft": {"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
            "mask": {"assistant": "train"}, "preprocessing": {"min_chars": 0}},
}  # fmt: skip


def delivered(dataset, workers: int, batches: int) -> float:
    """Tokens/s of the loader alone, after its first batch (worker start-up is not throughput)."""
    loader = DataLoader(dataset, batch_size=BATCH, sampler=ResumableSampler(len(dataset), seed=0), num_workers=workers)
    stream = itertools.cycle(loader) if workers == 0 else iter(_repeat(loader))
    next(stream)
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        tokens += next(stream)["input_ids"].numel()
    return tokens / (time.perf_counter() - start)


def _repeat(loader):
    while True:
        yield from loader


def consumed(train_type: str, data: Path) -> float:
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        args = TrainArgs(
            param_path=str(TINY_MODEL_DIR),
            data_root_path=str(data),
            train_type=train_type,
            ckpt_dir=out,
            window_size=WINDOW,
            batch_per_device=BATCH,
            max_steps=30,
            num_workers=0,
            parallel_mode="none",
            ckpt_interval=10**9,
            loggers=[],
            optimizer="adamw",
        )
        return statistics.median(r["tokens_per_sec"] for r in run(args)[5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=300)
    batches = parser.parse_args().batches
    tokenizer = Tokenizer.from_dir(TINY_MODEL_DIR)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for train_type, jsonl in (("seq", SEQ_DATA_DIR), ("sft", SFT_DATA_DIR)):
            shards = Path(scratch) / train_type
            started = time.perf_counter()
            prepare(
                sorted(jsonl.glob("*.jsonl")),
                shards,
                PipelineConfig.from_dict(PIPELINES[train_type], "bench"),
                tokenizer,
            )
            prepare_seconds = time.perf_counter() - started
            training = consumed(train_type, shards)
            for source, path, tok in (("jsonl", jsonl, tokenizer), ("bin", shards, None)):
                started = time.perf_counter()
                dataset = load_window_dataset(train_type, path, WINDOW, None, tok)
                build_seconds = time.perf_counter() - started
                if source == "bin":
                    build_seconds += prepare_seconds
                for workers in (0, 2):
                    rate = delivered(dataset, workers, batches)
                    rows.append((train_type, source, workers, build_seconds, rate, rate / training, training))
    print(f"\nwindows of {WINDOW} tokens, {BATCH} per batch, {batches} batches; consumed = fit() on the tiny model\n")
    print(
        f"{'type':<5} {'source':<6} {'workers':>7} {'build s':>8} {'delivered tok/s':>16} {'consumed tok/s':>15} "
        f"{'headroom':>9}"
    )
    for train_type, source, workers, build, rate, ratio, training in rows:
        print(
            f"{train_type:<5} {source:<6} {workers:>7} {build:>8.2f} {rate:>16,.0f} {training:>15,.0f} {ratio:>8.0f}x"
        )
    print("\nbuild s: tokenising JSONL when the run starts, or `prepare` once (bin shards are then memory-mapped)")


if __name__ == "__main__":
    main()
