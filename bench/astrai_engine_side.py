"""AstrAI's own inference engine on a workload of ``bench/generation.py``, run under AstrAI's interpreter (its venv,
``../shared/astrai/setup-venv.sh``) by that bench: not a module of ours, and it imports nothing of ours.

    ASTRAI_PYTHON bench/astrai_engine_side.py CHECKPOINT WORK.json SLOTS THREADS

``WORK.json``: ``[[prompt text, max_tokens], ...]``. Greedy (temperature 0, top-k 1), every request added at once
to AstrAI's continuous-batching scheduler (``max_batch_size`` SLOTS); prints one JSON line: the seconds from the
first request added until the last ended, the tokens each request sampled, and each one's time to first token.
"""

import json
import sys
import threading
import time

import torch
from astrai.inference import InferenceEngine
from astrai.inference.task import STOP
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer


def main() -> None:
    checkpoint, work_file, slots, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    model = AutoModel.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with open(work_file) as f:
        work = json.load(f)
    lock, done = threading.Lock(), threading.Event()
    counts, firsts, left = [0] * len(work), [None] * len(work), [len(work)]
    engine = InferenceEngine(model=model, tokenizer=tokenizer, max_batch_size=slots, enable_cuda_graph=False)

    def callback(token, index):
        with lock:
            if token is STOP:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
                return
            counts[index] += 1
            if firsts[index] is None:
                firsts[index] = time.perf_counter() - start

    start = time.perf_counter()
    for index, (text, max_tokens) in enumerate(work):
        engine.scheduler.add_task(
            text,
            max_tokens=max_tokens,
            temperature=0.0,
            top_k=1,
            top_p=1.0,
            stream_callback=lambda token, index=index: callback(token, index),
        )
    done.wait()
    seconds = time.perf_counter() - start
    engine.shutdown()
    print(json.dumps({"s": seconds, "tokens": counts, "firsts": firsts}))


if __name__ == "__main__":
    main()
