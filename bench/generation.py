"""Generation: the engine (``astrai_fabric.inference``: continuous batching, paged KV cache, prefix reuse) against
the static batch of ``generate.generate`` it replaces.

    .venv/bin/python bench/generation.py [--repeats 3] [--threads 2] [--workloads wave,stream,group]
        [--astrai ../main/.astrai-venv/bin/python]

Workloads (greedy, no stop token; prompts of random token ids, 8-128 tokens, the same on both sides):

- ``wave``: 32 requests at once, 64 new tokens each, on the bundled tiny model (4 layers, 128 wide): the static
  side is one left-padded batch of 32;
- ``stream``: 128 requests with 16-96 new tokens each (their own ``max_tokens``), through 32 slots, on a ~20M
  model (6 layers, 512 wide, the bundled tokenizer's 2,048 tokens, random weights): the static side runs waves of
  32 in arrival order, each until its longest request ends (the shorter ones' extra tokens not counted);
- ``group``: GRPO's rollout, 8 prompts x 8 completions of 64 tokens on the tiny model: the static side prefills
  each prompt 8 times (one batch of 64 rows), the engine once (``n`` = 8); its KV memory is counted too.

With ``--astrai PYTHON`` (AstrAI's interpreter; ``PYTHONPATH`` or ``ASTRAI_SRC`` pointing at its source), also
``astrai``: the stream workload as text (128 prompts, greedy, ending at the tokenizer's stop tokens or their own
16-96 tokens) on the ~20M model saved as a checkpoint, through AstrAI's own continuous-batching engine
(``bench/astrai_engine_side.py``, in its process; the model loaded before the clock starts) as well as ours and the
static batch; tokens/s there counts the tokens each side sampled.

Each side: wall seconds, new tokens per second (the tokens each request asked for), the mean time to first token
(static: its wave's start plus the wave's prefill and first token, timed by a 1-token run). The sides take turns
within each repeat; the table prints medians and engine / static (above 1: the engine is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.generate import generate
from astrai_fabric.inference import Engine, SamplingParams
from astrai_fabric.model import AutoRegressiveLM


def tiny() -> AutoRegressiveLM:
    """The bundled tiny model's architecture (it ships a config only), random weights."""
    torch.manual_seed(0)
    return AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json")).eval()


def twenty_million() -> AutoRegressiveLM:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=2048,  # the bundled tokenizer's, for the text workload (--astrai)
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    return AutoRegressiveLM(config).eval()


def requests(count: int, vocab: int, new_tokens: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(count):
        length = int(torch.randint(8, 129, (1,), generator=generator))
        wanted = int(torch.randint(new_tokens[0], new_tokens[1] + 1, (1,), generator=generator))
        made.append((torch.randint(0, vocab, (length,), generator=generator).tolist(), wanted))
    return made


def static_side(model, work: list[tuple[list[int], int]], slots: int, copies: int = 1) -> dict[str, float]:
    """Waves of ``slots`` requests (each prompt ``copies`` times), each run until its longest request ends."""
    start, firsts, tokens = time.perf_counter(), [], 0
    for first in range(0, len(work), slots):
        wave = work[first : first + slots]
        prompts = [prompt for prompt, _ in wave for _ in range(copies)]
        wave_start = time.perf_counter() - start
        began = time.perf_counter()
        generate(model, prompts, 1, temperature=0)  # the wave's prefill and first token
        firsts += [wave_start + time.perf_counter() - began] * len(prompts)
        generate(model, prompts, max(wanted for _, wanted in wave), temperature=0)
        tokens += sum(wanted for _, wanted in wave) * copies
    return _figures(time.perf_counter() - start, tokens, firsts)


def engine_side(model, work: list[tuple[list[int], int]], slots: int, copies: int = 1) -> dict[str, float]:
    engine = Engine(model, max_num_seqs=slots, block_size=16)
    start, firsts = time.perf_counter(), {}
    for prompt, wanted in work:
        engine.add_request(prompt, SamplingParams(max_tokens=wanted, temperature=0, n=copies))
    while engine.has_work():
        for completion, _ in engine.step():
            firsts.setdefault((completion.request_id, completion.index), time.perf_counter() - start)
    tokens = sum(wanted for _, wanted in work) * copies
    figures = _figures(time.perf_counter() - start, tokens, list(firsts.values()))
    figures["prefill positions"] = engine.num_prefill_positions
    return figures


def _figures(seconds: float, tokens: int, firsts: list[float]) -> dict[str, float]:
    return {"s": seconds, "tokens/s": tokens / seconds, "ttft s": statistics.fmean(firsts)}


def kv_bytes(model, work, copies: int, block_size: int = 16) -> tuple[int, int]:
    """The KV cache bytes of ``work`` (each prompt ``copies`` times): the static batch's (every row as long as the
    longest prompt plus the new tokens) and the engine's blocks (a prompt's full blocks once, each completion's own
    after them)."""
    config = model.config
    per_position = 2 * config.num_hidden_layers * (config.num_key_value_heads or config.num_attention_heads)
    per_position *= config.attention_head_dim * 4
    rows = len(work) * copies
    longest = max(len(prompt) for prompt, _ in work) + max(wanted for _, wanted in work)
    static = rows * longest * per_position
    blocks = 0
    for prompt, wanted in work:
        shared = len(prompt) // block_size
        blocks += shared + copies * (-(-(len(prompt) + wanted - 1) // block_size) - shared)
    return static, blocks * block_size * per_position


WORKLOADS = {  # name: (model, requests, slots, copies)
    "wave": (tiny, lambda vocab: requests(32, vocab, (64, 64), seed=1), 32, 1),
    "stream": (twenty_million, lambda vocab: requests(128, vocab, (16, 96), seed=2), 32, 1),
    "group": (tiny, lambda vocab: requests(8, vocab, (64, 64), seed=3), 64, 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--astrai", help="AstrAI's interpreter: time its engine on the text workload too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'workload':>8} {'side':>7} {'s':>7} {'tokens/s':>9} {'ttft s':>7}  engine/static (tokens/s)")
    for name in args.workloads.split(","):
        build, make, slots, copies = WORKLOADS[name]
        model = build()
        work = make(model.config.vocab_size)
        runs = {"static": [], "engine": []}
        with torch.no_grad():
            for repeat in range(args.repeats):
                for side in ("static", "engine") if repeat % 2 == 0 else ("engine", "static"):
                    run = static_side if side == "static" else engine_side
                    runs[side].append(run(model, work, slots, copies))
        medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
        for side, figures in medians.items():
            ratio = medians["engine"]["tokens/s"] / medians["static"]["tokens/s"] if side == "engine" else ""
            ratio = f"{ratio:.2f}x" if ratio else ""
            print(
                f"{name:>8} {side:>7} {figures['s']:7.2f} {figures['tokens/s']:9.0f} {figures['ttft s']:7.3f}  {ratio}"
            )
        if copies > 1:
            static, paged = kv_bytes(model, work, copies)
            prefill = medians["engine"]["prefill positions"]
            prompt_positions = sum(len(prompt) for prompt, _ in work)
            print(
                f"{'':>8} KV cache: static {static / 2**20:.1f} MiB, engine {paged / 2**20:.1f} MiB "
                f"({paged / static:.2f}x); prefill positions: static {prompt_positions * copies}, engine "
                f"{prefill:.0f} ({prefill / (prompt_positions * copies):.3f}x)"
            )
    issue_group_kv()
    if args.astrai:
        astrai_comparison(args.astrai, args.repeats, args.threads)


def astrai_comparison(python: str, repeats: int, threads: int) -> None:
    """The ``astrai`` workload: text prompts through the static batch, our engine and AstrAI's (its process)."""
    import json
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    from astrai_fabric.checkpoint import save_checkpoint
    from astrai_fabric.tokenizer import Tokenizer

    model, tokenizer = twenty_million(), Tokenizer.from_dir(TINY_MODEL_DIR)
    texts = [(tokenizer.decode(prompt), wanted) for prompt, wanted in requests(128, 2048, (16, 96), seed=4)]
    work = [(tokenizer.encode(text), wanted) for text, wanted in texts]
    stops = tokenizer.stop_ids
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
        checkpoint = save_checkpoint(Path(tmp) / "model", model.state_dict(), model.config.to_dict(), files=files)
        (Path(tmp) / "work.json").write_text(json.dumps(texts))
        env = dict(os.environ, PYTHONPATH=os.environ.get("ASTRAI_SRC", os.environ.get("PYTHONPATH", "")))
        script = str(Path(__file__).with_name("astrai_engine_side.py"))

        def astrai() -> dict[str, float]:
            argv = [python, script, str(checkpoint), str(Path(tmp) / "work.json"), "32", str(threads)]
            result = json.loads(subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout)
            return _figures(result["s"], sum(result["tokens"]), [f for f in result["firsts"] if f is not None])

        def ours() -> dict[str, float]:
            engine = Engine(model, max_num_seqs=32)
            start, firsts = time.perf_counter(), {}
            for prompt, wanted in work:
                engine.add_request(prompt, SamplingParams(max_tokens=wanted, temperature=0, stop_token_ids=stops))
            while engine.has_work():
                for completion, _ in engine.step():
                    firsts.setdefault(completion.request_id, time.perf_counter() - start)
            tokens = sum(len(c.tokens) for group in engine.completions.values() for c in group)
            return _figures(time.perf_counter() - start, tokens, list(firsts.values()))

        def static() -> dict[str, float]:
            start, firsts, tokens = time.perf_counter(), [], 0
            for first in range(0, len(work), 32):
                wave, began = work[first : first + 32], time.perf_counter()
                generate(model, [prompt for prompt, _ in wave], 1, temperature=0)
                firsts += [began - start + time.perf_counter() - began] * len(wave)
                outs = generate(model, [p for p, _ in wave], max(w for _, w in wave), temperature=0, stop_ids=stops)
                tokens += sum(min(len(out), wanted) for out, (_, wanted) in zip(outs, wave, strict=True))
            return _figures(time.perf_counter() - start, tokens, firsts)

        sides = {"static": static, "engine": ours, "astrai": astrai}
        runs = {side: [] for side in sides}
        with torch.no_grad():
            for repeat in range(repeats):
                order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
                for side in order:
                    runs[side].append(sides[side]())
    for side, rs in runs.items():
        figures = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        times = f"{figures['s']:7.2f} {figures['tokens/s']:9.0f} {figures['ttft s']:7.3f}"
        print(f"{'astrai':>8} {side:>7} {times}")


def issue_group_kv() -> None:
    """The KV memory of GRPO's group of 8 with a 200-token prompt and 64 new tokens, blocks of 16 (issue 63's
    target: the engine's at most 0.4x the static batch's)."""
    static, paged = kv_bytes(tiny(), [([0] * 200, 64)], copies=8)
    print(f"group of 8, 200-token prompt, 64 new tokens: KV engine / static = {paged / static:.2f}x")


if __name__ == "__main__":
    main()
