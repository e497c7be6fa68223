"""``astrai-fabric serve`` under concurrent clients over HTTP, against the floor of one static batch.

    .venv/bin/python bench/serve.py [--repeats 3] [--clients 1,8,32] [--max_tokens 64]

A server process (the bundled tiny architecture, random weights, on loopback, ``--max_num_seqs 64``) and, for each
number of clients, that many threads each sending streamed chat completions (greedy, ``max_tokens``, usage at the
end) one after another, ``2 x clients`` requests in all (at least 8), through the official ``openai`` client. Per
request: the time to its first token and to its end; per run: requests/s and sampled tokens/s. The floor beside it:
the same prompts' first ``clients`` as one left-padded batch through the static ``generate.generate`` in this
process (its first token after its prefill; no HTTP, no scheduling). Medians over the repeats; p50/p99 over each
run's requests, then the median of those.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from openai import OpenAI

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import save_checkpoint
from astrai_fabric.config import ModelConfig
from astrai_fabric.generate import generate
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(directory: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "astrai_fabric", "serve", str(directory), "--port", str(port), "--max_num_seqs", "64"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the server did not start: {process.stderr.read()[-2000:]}")


def one_request(url: str, messages: list[dict], max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, tokens sampled) of one streamed request."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    began, first, tokens = time.perf_counter(), None, 0
    usage = {"include_usage": True}
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, temperature=0, stream=True, stream_options=usage
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - began
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter() - began
    return (first if first is not None else end), end, tokens


def run_clients(url: str, conversations: list[list[dict]], clients: int, max_tokens: int) -> dict[str, float]:
    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda messages: one_request(url, messages, max_tokens), conversations))
    seconds = time.perf_counter() - began
    firsts = sorted(first for first, _, _ in results)
    return {
        "requests/s": len(results) / seconds,
        "tokens/s": sum(tokens for _, _, tokens in results) / seconds,
        "ttft p50": statistics.median(firsts),
        "ttft p99": firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))],
        "total p50": statistics.median(end for _, end, _ in results),
    }


def floor(model, tokenizer: Tokenizer, conversations: list[list[dict]], max_tokens: int) -> dict[str, float]:
    """One static batch of the conversations: its first token's time and its whole time."""
    prompts = [tokenizer.apply_chat_template(messages) for messages in conversations]
    began = time.perf_counter()
    generate(model, prompts, 1, temperature=0)
    first = time.perf_counter() - began
    began = time.perf_counter()
    outs = generate(model, prompts, max_tokens, temperature=0, stop_ids=tokenizer.stop_ids)
    seconds = time.perf_counter() - began
    tokens = sum(map(len, outs))
    return {
        "requests/s": len(prompts) / seconds,
        "tokens/s": tokens / seconds,
        "ttft p50": first,
        "ttft p99": first,
        "total p50": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(9)
    values = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    config = ModelConfig.from_dict({**values, "tie_word_embeddings": False})
    model = AutoRegressiveLM(config).eval()
    tokenizer = Tokenizer.from_dir(TINY_MODEL_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
        directory = save_checkpoint(Path(tmp) / "model", model.state_dict(), config.to_dict(), files=files)
        process, url = start(directory, args.threads)
        try:
            heads = ("req/s", "tokens/s", "ttft p50", "ttft p99", "total p50")
            print(f"{'clients':>7} {'side':>12} " + " ".join(f"{h:>9}" for h in heads))
            for clients in map(int, args.clients.split(",")):
                count = max(8, 2 * clients)
                conversations = [[{"role": "user", "content": f"question number {i}"}] for i in range(count)]
                runs = {"server": [], "one batch": []}
                with torch.no_grad():
                    for _ in range(args.repeats):
                        runs["server"].append(run_clients(url, conversations, clients, args.max_tokens))
                        runs["one batch"].append(floor(model, tokenizer, conversations[:clients], args.max_tokens))
                for side, results in runs.items():
                    m = {key: statistics.median(r[key] for r in results) for key in results[0]}
                    print(
                        f"{clients:>7} {side:>12} {m['requests/s']:7.1f} {m['tokens/s']:9.0f} {m['ttft p50']:9.3f} "
                        f"{m['ttft p99']:9.3f} {m['total p50']:9.3f}"
                    )
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
