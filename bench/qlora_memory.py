"""Peak memory of full fine-tuning, LoRA and QLoRA at Qwen2.5-0.5B's shape, each with and without the chunked loss;
the head-plus-loss peak alone; and step-time ratios on a smaller shape.

    OMP_NUM_THREADS=2 .venv/bin/python bench/qlora_memory.py [--parts memory,head,time] [--keep DIR] [--smoke]

Model: a random model of Qwen2.5-0.5B's shape (``qwen2``: vocabulary 151,936, hidden 896, 24 layers, 14/2 heads,
q/k/v biases, SwiGLU 4,864, tied; 494M parameters), written once in AstrAI's layout (one ``model.safetensors``,
**bf16 on disk** as Qwen ships it, 0.99 GB, with the bundled tokenizer) to a temporary directory (``--keep DIR``
writes it there and reuses it).

``memory``: each of the six runs (full / lora / qlora x ``loss_chunk_size`` 0 / auto) is a fresh process calling
``astrai_fabric.train.run`` on ``bundled:data/seq``: 1 x 1,024 tokens, 2 optimizer steps, float32 (``32-true``,
the weights read from bf16 as float32), AdamW on every side (the run's default optimizer is ``muon_adamw``, whose
state is half AdamW's on matrices), ``grad_snr`` left out of the metrics (it keeps a gradient-sized buffer: +1.8
GiB for full), one process, no workers; LoRA and QLoRA r=16 on all seven targets. Peak is the process's ``VmHWM``
(reset after the imports through ``/proc/self/clear_refs``) at the moment the final checkpoint would be written:
loading plus two steps. The final checkpoint is not written (the bench replaces ``save_training_checkpoint`` with
the measurement: full's would be 6 GB of weights and AdamW state). In this part and the next, glibc maps every
allocation from 1 MiB on its own (``MALLOC_MMAP_THRESHOLD_``, ``--malloc mmap``), so that the RSS follows the live
tensors; its default keeps freed activations in its heap (``--malloc default`` measures that). The whole script takes
about 40 minutes on 2 busy cores (the six runs 4-7 minutes each).

``head``: the head and the loss alone, each in a fresh process: hidden states [1,024, 896] float32 (requiring
grad), the tied head's weight [151,936, 896] float32, trainable (full fine-tuning) or frozen (LoRA, QLoRA); forward
and backward of ``causal_lm_loss(hidden @ weight.T)`` against ``head_nll_loss`` (seq's and sft's fused loss, its
gradients taken in the forward) with the default chunking (55 positions). Peak is ``VmHWM`` above the RSS after
the inputs are allocated (weight gradient included where it is trainable); medians of 3 processes, sides
alternating.

``time``: one process (the sides alternate inside it: which goes first rotates each round), a smaller shape where a
step takes seconds (vocabulary 151,936 kept, since the head is what chunking changes; hidden 256, 4 layers, 4/2
heads, SwiGLU 1,024), batch 1 x 512, float32, the training loop's loss (``train.lm.lm_loss``), backward, AdamW step;
the median of 7 steps per side after one untimed round.

Targets: the NF4 weights <= 0.3 x the same weights' bf16 bytes; the chunked loss cuts the head-plus-loss peak >= 3x;
chunked / unchunked step time at most 1.1 (chunking costs at most 10% more time). QLoRA / LoRA step time is
reported. ``bench/gpu_check.py --qlora`` runs the same comparison on a CUDA device (``torch.cuda.max_memory_allocated``
instead of RSS). ``--smoke``: a tiny shape (chunks of 16 positions), to check the script itself (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN_05B = dict(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16",
)  # fmt: skip
TIME_SHAPE = dict(QWEN_05B, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
SMOKE_SHAPE = dict(QWEN_05B, vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
LORA_R = 16
METHODS = ("full", "lora", "qlora")
LOSSES = ("unchunked", "chunked")
GIB, MIB = 2**30, 2**20
PRECISION_NAMES = {"32-true": "float32", "bf16-true": "bfloat16", "16-true": "float16"}


# --- measuring: RSS on CPU, the caching allocator's count on CUDA ----------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def reset_peak(device: str) -> int:
    """Start counting the peak from now; returns the current bytes (the baseline)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (the peak since exec would include the imports' transients)
    return _status("VmRSS")


def peak_bytes(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status("VmHWM")


def current_bytes(device: str) -> dict[str, int]:
    if device == "cuda":
        return {"now": torch.cuda.memory_allocated()}
    return {"now": _status("VmRSS"), "anon": _status("RssAnon"), "file": _status("RssFile")}


# --- the model on disk ----------------------------------------------------------------------------------------------


def write_model(directory: Path, hf_config: dict) -> Path:
    """A random bf16 model of ``hf_config``'s shape in AstrAI's layout, with the bundled tokenizer."""
    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.checkpoint import hf, save_checkpoint
    from astrai_fabric.model import AutoRegressiveLM

    config = hf.model_config_from_hf(hf_config)
    with torch.device("meta"):
        shapes = {key: tuple(value.shape) for key, value in AutoRegressiveLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {}
    for key, shape in shapes.items():  # one float32 tensor at a time, kept as bf16
        if key.endswith("norm.weight"):
            state[key] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            state[key] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    return save_checkpoint(directory, state, config.to_dict(), files=files)


# --- the children: each runs in its own process -------------------------------------------------------------------


def train_child(spec: dict) -> dict:
    """One run through ``astrai_fabric.train.run``: peak after loading, after each step, and at the final save."""
    import importlib

    from astrai_fabric import quantize
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.train import run

    # By module path: ``astrai_fabric.loop`` exports a function named ``fit`` that hides its module.
    fit_module, common, outputs = (
        importlib.import_module(f"astrai_fabric.{name}") for name in ("loop.fit", "train.common", "train.outputs")
    )
    device = spec["device"]
    method = spec["method"]
    record: dict = {"step_s": [], "step_peak": []}
    build_model, train_step = common.build_model, fit_module.train_step

    def measured_build_model(fabric, start, args):
        started = time.perf_counter()
        module = build_model(fabric, start, args)
        record["load_s"] = time.perf_counter() - started
        record["load_peak"] = peak_bytes(device)
        record["after_load"] = current_bytes(device)
        nf4_bytes, nf4_elements = quantize.quantized_bytes(module)
        base = [(n, p) for n, p in module.named_parameters() if not n.endswith(("lora_A", "lora_B"))]
        float_base = sum(p.numel() * p.element_size() for _, p in base if not quantize.is_quantized(p))
        record.update(
            nf4_bytes=nf4_bytes,
            nf4_elements=nf4_elements,
            base_bytes=float_base + nf4_bytes,
            base_elements=sum(p.numel() for _, p in base),
            trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
        )
        return module

    def measured_train_step(*args, **kwargs):
        started = time.perf_counter()
        result = train_step(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        record["step_s"].append(time.perf_counter() - started)
        record["step_peak"].append(peak_bytes(device))
        return result

    def measured_save(*args, **kwargs):  # instead of writing the checkpoint
        record["peak"] = peak_bytes(device)
        record["at_end"] = current_bytes(device)

    common.build_model, fit_module.train_step = measured_build_model, measured_train_step
    outputs.save_training_checkpoint = measured_save
    lora = {} if method == "full" else dict(lora_r=LORA_R, lora_targets=list(LORA_TARGETS))
    args = TrainArgs(
        train_type="seq",
        param_path=spec["model_dir"],
        data_root_path="bundled:data/seq",
        ckpt_dir=spec["ckpt_dir"],
        window_size=spec["window"],
        batch_per_device=1,
        grad_accum_steps=1,
        max_steps=spec["steps"],
        n_epoch=1000,
        parallel_mode="none",
        nprocs=1,
        device_type=device,
        precision=spec["precision"],
        num_workers=0,
        ckpt_interval=10**9,
        loggers=[],
        optimizer="adamw",
        metrics=["loss", "lr", "grad_norm", "tokens_per_sec"],
        loss_chunk_size=spec["chunk"],
        quantize="nf4" if method == "qlora" else None,
        **lora,
    )
    record["baseline"] = reset_peak(device)
    history = run(args)
    record["loss"] = [r["loss"] for r in history]
    return record


def head_child(spec: dict) -> dict:
    """Forward and backward of the head and the loss alone, unchunked or fused and chunked."""
    from astrai_fabric.losses import causal_lm_loss, head_nll_loss, loss_chunk_positions, token_nll_weights

    device, vocab, hidden, positions = spec["device"], spec["vocab"], spec["hidden"], spec["positions"]
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(positions, hidden, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(device).requires_grad_(spec["trainable"])
    targets = torch.randint(0, vocab, (positions,), generator=generator).to(device)
    chunk = spec["chunk"] if spec["chunk"] is not None else loss_chunk_positions(None, vocab, positions)
    baseline = reset_peak(device)
    if spec["loss"] == "chunked":
        loss, _ = head_nll_loss(states, weight, targets, token_nll_weights(targets), chunk)  # as train.lm.lm_loss
    else:  # what the model's lm_head and the loop's loss do without chunking
        loss = causal_lm_loss(torch.nn.functional.linear(states, weight)[None], targets[None])
    loss.backward()
    return {"peak_above": peak_bytes(device) - baseline, "chunk": chunk if spec["loss"] == "chunked" else 0}


def time_child(spec: dict) -> dict:
    """The six sides' step times in one process, alternating, with the training loop's loss."""
    from astrai_fabric import lora, quantize
    from astrai_fabric.checkpoint import hf
    from astrai_fabric.losses import loss_chunk_positions
    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.optim import OptimArgs, build_optimizer
    from astrai_fabric.train.lm import lm_loss

    device, window = spec["device"], spec["window"]
    config = hf.model_config_from_hf(spec["shape"])
    dtype = torch.bfloat16 if spec["precision"].startswith("bf16") else torch.float32
    models = {}
    for method in METHODS:
        torch.manual_seed(0)
        model = AutoRegressiveLM(config).to(device=device, dtype=dtype)
        if method == "qlora":
            for key in quantize.plan_quantization(model).quantized:
                quantize.quantize_weight(model, key)
        if method != "full":
            lora.inject(model, lora.LoRASpec(r=LORA_R, targets=LORA_TARGETS), seed=0)  # adapters on the weight's device
        models[method] = (model, build_optimizer(model, OptimArgs("adamw", 1e-5, 0.1)))
    chunked = spec["chunk"] if spec["chunk"] is not None else loss_chunk_positions(None, config.vocab_size, window)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, window + 1), generator=generator).to(device)
    batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}

    def step(method: str, loss: str) -> float:
        model, optimizer = models[method]
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        value, _ = lm_loss(model, batch, 0.0, 0.01, chunked if loss == "chunked" else 0)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    sides = [(method, loss) for method in METHODS for loss in LOSSES]
    times: dict[str, list[float]] = {f"{m} {s}": [] for m, s in sides}
    for round_ in range(spec["steps"] + 1):  # round 0 is the untimed warm-up (allocations, AdamW's state)
        shift = round_ % len(sides)
        for method, loss in sides[shift:] + sides[:shift]:
            seconds = step(method, loss)
            if round_:
                times[f"{method} {loss}"].append(seconds)
    return {"times": times, "chunk": chunked, "threads": torch.get_num_threads()}


CHILDREN = {"train": train_child, "head": head_child, "time": time_child}


MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc maps each allocation on its own (``MALLOC_MMAP_THRESHOLD_``) in the memory and head parts:
its default, dynamic threshold rises to 32 MiB, so freed activations stay in its heap and the RSS keeps them."""


def in_child(kind: str, spec: dict, threads: int, exact_rss: bool = False) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    if exact_rss:  # the RSS then follows the live tensors (each freed one is unmapped) instead of the heap's history
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} {spec} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    line = next(line for line in reversed(out.stdout.splitlines()) if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# --- the three parts --------------------------------------------------------------------------------------------------


def memory_part(model_dir: Path, work: Path, options: argparse.Namespace) -> None:
    rows = {}
    for method in METHODS:
        for loss in LOSSES:
            chunk = 0 if loss == "unchunked" else options.chunk
            spec = dict(
                device=options.device,
                method=method,
                chunk=chunk,
                model_dir=str(model_dir),
                ckpt_dir=str(work / f"run_{method}_{loss}"),
                window=options.window,
                steps=2,
                precision=options.precision,
            )
            started = time.perf_counter()
            rows[method, loss] = in_child("train", spec, options.threads, options.malloc == "mmap")
            rows[method, loss]["wall_s"] = time.perf_counter() - started
            shutil.rmtree(work / f"run_{method}_{loss}", ignore_errors=True)
            print(
                f"  {method} {loss}: {rows[method, loss]['peak'] / GIB:.2f} GiB peak, "
                f"{rows[method, loss]['wall_s']:.0f} s",
                flush=True,
            )
    unit = "RSS" if options.device == "cpu" else "max_memory_allocated"
    first = rows["full", "unchunked"]
    print(
        f"\nmodel: {first['base_elements'] / 1e6:.0f}M parameters ({options.shape_name}), bf16 on disk, "
        f"{options.precision}, adamw, 1 x {options.window} tokens, 2 steps; lora/qlora r={LORA_R} on all 7 targets; "
        f"peak = {unit}, a fresh process per row, {options.threads} threads, malloc {options.malloc}\n"
    )
    print(
        f"{'method':<6} {'loss':<10} {'trainable':>11} {'base GiB':>8} {'load s':>6} {'load peak':>9} "
        f"{'step-1 peak':>11} {'peak GiB':>8} {'peak-base':>9} {'step s':>7}"
    )
    for (method, loss), r in rows.items():
        print(
            f"{method:<6} {loss:<10} {r['trainable']:>11,} {r['base_bytes'] / GIB:>8.2f} {r['load_s']:>6.1f} "
            f"{r['load_peak'] / GIB:>9.2f} {r['step_peak'][0] / GIB:>11.2f} {r['peak'] / GIB:>8.2f} "
            f"{(r['peak'] - r['baseline']) / GIB:>9.2f} {statistics.median(r['step_s']):>7.1f}"
        )
    print(
        f"\nbaseline (torch, lightning and astrai_fabric imported): {first['baseline'] / GIB:.2f} GiB; "
        "step s: median of the 2 steps"
    )
    q = rows["qlora", "unchunked"]
    bf16 = q["nf4_elements"] * 2
    ratio = q["nf4_bytes"] / bf16
    print(
        f"nf4 weights: {q['nf4_elements'] / 1e6:.1f}M in {q['nf4_bytes'] / MIB:.1f} MiB, against {bf16 / MIB:.1f} "
        f"MiB in bf16: {ratio:.3f}x (target <= 0.3: {'ok' if ratio <= 0.3 else 'MISSED'})"
    )
    whole_bf16 = first["base_elements"] * 2
    print(
        f"whole base, qlora: {q['base_bytes'] / MIB:,.1f} MiB (embedding, norms and biases in "
        f"{PRECISION_NAMES.get(options.precision, options.precision)}), against {whole_bf16 / MIB:,.1f} MiB for "
        f"the whole model in bf16 ({q['base_bytes'] / whole_bf16:.2f}x) and {first['base_bytes'] / MIB:,.1f} MiB "
        "at the run's precision"
    )
    for method in METHODS:
        off, on = rows[method, "unchunked"], rows[method, "chunked"]
        print(
            f"{method}: chunked loss saves {(off['peak'] - on['peak']) / GIB:.2f} GiB of the run's peak "
            f"({off['peak'] / on['peak']:.2f}x); losses step 1 {off['loss'][0]:.4f} / {on['loss'][0]:.4f}"
        )


def head_part(options: argparse.Namespace) -> None:
    vocab, hidden = options.shape["vocab_size"], options.shape["hidden_size"]
    cases = [(trainable, loss) for trainable in (True, False) for loss in LOSSES]
    results: dict[tuple[bool, str], list[dict]] = {case: [] for case in cases}
    for repeat in range(options.repeats):
        for trainable, loss in cases if repeat % 2 == 0 else cases[::-1]:  # alternate the sides
            spec = dict(
                device=options.device,
                vocab=vocab,
                hidden=hidden,
                positions=options.window,
                trainable=trainable,
                loss=loss,
                chunk=options.chunk,
            )
            results[trainable, loss].append(in_child("head", spec, options.threads, options.malloc == "mmap"))
    logits = options.window * vocab * 4
    print(
        f"\nhead + loss alone: hidden [{options.window}, {hidden}], head weight [{vocab:,}, {hidden}], float32 "
        f"(the logits: {logits / MIB:.0f} MiB); peak above the inputs, median of {options.repeats} processes, "
        f"malloc {options.malloc}\n"
    )
    print(f"{'head weight':<12} {'loss':<10} {'chunk':>6} {'peak MiB':>9}")
    peaks = {}
    for (trainable, loss), runs in results.items():
        peaks[trainable, loss] = statistics.median(r["peak_above"] for r in runs)
        weight = "trainable" if trainable else "frozen"
        print(f"{weight:<12} {loss:<10} {runs[0]['chunk']:>6} {peaks[trainable, loss] / MIB:>9.0f}")
    print()
    for trainable in (True, False):
        ratio = peaks[trainable, "unchunked"] / peaks[trainable, "chunked"]
        weight = "trainable (full)" if trainable else "frozen (lora, qlora)"
        print(
            f"unchunked / chunked, head weight {weight}: {ratio:.2f}x (target >= 3: {'ok' if ratio >= 3 else 'MISSED'})"
        )


def time_part(options: argparse.Namespace) -> None:
    shape = options.time_shape
    spec = dict(
        device=options.device,
        shape=shape,
        window=options.time_window,
        steps=options.steps,
        precision=options.precision,
        chunk=options.chunk,
    )
    result = in_child("time", spec, options.threads)
    medians = {side: statistics.median(times) for side, times in result["times"].items()}
    print(
        f"\nstep time: vocabulary {shape['vocab_size']:,}, hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, 1 x {options.time_window} tokens, {options.precision}, adamw, "
        f"chunks of {result['chunk']} positions; median of {options.steps} steps, sides alternating in one "
        f"process, {result['threads']} thread(s)\n"
    )
    print(f"{'method':<6} {'unchunked s':>11} {'chunked s':>9} {'chunked/unchunked':>17}")
    slowest = 0.0
    for method in METHODS:
        off, on = medians[f"{method} unchunked"], medians[f"{method} chunked"]
        slowest = max(slowest, on / off)
        print(f"{method:<6} {off:>11.3f} {on:>9.3f} {on / off:>17.3f}")
    # The target bounds what chunking costs: a chunked step faster than the unchunked one meets it.
    print(
        f"\nchunked / unchunked: at most {slowest:.3f} (target: chunking costs at most 10% more time, <= 1.1: "
        f"{'ok' if slowest <= 1.1 else 'MISSED'})"
    )
    for loss in LOSSES:
        print(f"qlora / lora, {loss}: {medians[f'qlora {loss}'] / medians[f'lora {loss}']:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="memory,head,time", help="any of memory, head, time (commas)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true", help="the runs' precision (bf16-true on a GPU, say)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--repeats", type=int, default=None, help="processes per side of the head part (3; 1 on CUDA)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per side of the time part")
    parser.add_argument(
        "--malloc",
        default="mmap",
        choices=("mmap", "default"),
        help="glibc's allocation in the memory and head parts: each allocation from 1 MiB mapped "
        "alone (the RSS follows the tensors), or glibc's default (it keeps freed blocks)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="write the model here, reuse it, leave it")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape: checks the script itself")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        kind, spec = options.child
        print("RESULT " + json.dumps(CHILDREN[kind](json.loads(spec))), flush=True)
        return
    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("qlora_memory: no CUDA device visible")
    if options.repeats is None:  # the caching allocator's count repeats exactly; RSS moves with the heap's history
        options.repeats = 1 if options.device == "cuda" else 3
    if options.smoke:  # chunks of 16 positions: auto would leave so small a head unchunked
        options.shape, options.time_shape, options.shape_name = SMOKE_SHAPE, SMOKE_SHAPE, "smoke shape"
        options.window, options.time_window, options.chunk, options.steps, options.repeats = 64, 64, 16, 2, 1
    else:
        options.shape, options.shape_name, options.window, options.chunk = QWEN_05B, "Qwen2.5-0.5B's shape", 1024, None
        # On a GPU a step of the real shape takes milliseconds: time that one there.
        options.time_shape, options.time_window = (QWEN_05B, 1024) if options.device == "cuda" else (TIME_SHAPE, 512)
    parts = set(options.parts.split(","))
    if unknown := parts - {"memory", "head", "time"}:
        raise SystemExit(f"unknown parts: {sorted(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="qlora_memory-"))
    try:
        if "memory" in parts:
            model_dir = (options.keep or work) / ("model_smoke" if options.smoke else "model")
            if not (model_dir / "model.safetensors").exists():
                started = time.perf_counter()
                write_model(model_dir, options.shape)
                print(f"wrote {model_dir} in {time.perf_counter() - started:.0f} s", flush=True)
            memory_part(model_dir, work, options)
        if "head" in parts:
            head_part(options)
        if "time" in parts:
            time_part(options)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
