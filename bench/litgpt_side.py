"""The LitGPT side of ``bench/step_overhead.py --vs litgpt``: LitGPT 0.5.13's pretraining step on the same model shape.

    .bench-venvs/litgpt/bin/python bench/litgpt_side.py MODEL_DIR DATA_DIR OUT_DIR --steps 24 --batch 4 --window 256

Run by the LitGPT venv's python (``step_overhead.litgpt_python`` makes it: torch CPU and litgpt only), so it
imports nothing of astrai_fabric: the ``config.json`` and the bin shard ``step_overhead.py`` writes are read here
with json and numpy. What it runs is what ``litgpt/pretrain.py`` (``main`` and ``fit``) does per step, so that a
LitGPT user's step is what is timed:

- ``litgpt.GPT`` from a ``litgpt.Config`` with our model's shape, each field mapped in ``litgpt_config`` (RMSNorm,
  ``LLaMAMLP`` = SwiGLU, no biases, sequential residual, full rotary, grouped-query attention, the vocabulary
  unpadded), built under ``fabric.init_module(empty_init=True)`` after ``fabric.seed_everything`` and initialised by
  ``litgpt.pretrain.initialize_weights``; the embedding tied to ``lm_head`` as ``pretrain.py`` ties it when our
  config ties it (``model.transformer.wte.weight = model.lm_head.weight``). RoPE is LitGPT's default rotate-half
  form, ours rotates adjacent pairs: the same family of models (a fixed permutation of each query/key head's
  weights turns one into the other), and LitGPT's ``rope_interleave`` exists for importing DeepSeek checkpoints.
  Different initialisation from ours, so step 1's loss differs from ours; it is printed anyway.
- ``lightning.Fabric(accelerator="cpu", devices=1, precision="32-true")``, ``fabric.setup`` and
  ``fabric.setup_optimizers``; eager (``pretrain.py`` wraps the model in ``torch.compile``; ours runs eager, so both
  are compared eager); one thread.
- ``torch.optim.AdamW`` through ``litgpt.utils.instantiate_torch_optimizer`` as ``pretrain.py`` calls it (``fused``
  only on CUDA, so on CPU torch's per-tensor loop), with our ``adamw``'s lr, betas (0.9, 0.95), weight decay 0.1
  and eps (torch's 1e-8). LitGPT decays every parameter in one group; ours decays the matrices only.
- Per step, ``fit``'s: the learning rate set on each group, the forward under ``fabric.no_backward_sync``,
  ``litgpt.utils.chunked_cross_entropy`` at its defaults, ``fabric.backward(loss / 1)`` (one accumulation step),
  the loss into a ``RunningMean``, ``fabric.clip_gradients(max_norm=1.0)``, ``optimizer.step()``,
  ``optimizer.zero_grad()``; on logged steps ``fit``'s logging (the running loss read, ``ThroughputMonitor``, its
  metrics into ``pretrain.py``'s CSV logger under OUT_DIR), its progress line replaced by ``step S/N | loss L``.
- The learning rate follows our cosine schedule (``astrai_fabric.schedule.cosine_factor``: warmup over 5% of the
  steps from 1% of the rate, then cosine to 1%), computed here as ``fit`` computes LitGPT's own ``get_lr``.
- Windows of ``WINDOW + 1`` tokens at stride ``WINDOW`` of the same shard in the same order as ours
  (``ResumableSampler``: ``torch.randperm`` seeded ``seed + epoch``), sliced into inputs and targets as ``fit``
  slices a batch.

It prints ``step S/N | loss L``, flushed, after step 1, every ``--log_every`` steps and the last (the cadence
of ``step_plain.py``), which the benchmark times.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.throughput import ThroughputMonitor, measure_flops
from litgpt import GPT, Config
from litgpt.pretrain import initialize_weights
from litgpt.utils import choose_logger, chunked_cross_entropy, instantiate_torch_optimizer
from torchmetrics.aggregation import RunningMean

ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}
"""Our ``adamw``: ``OptimArgs``'s lr and weight decay, ``ADAMW_BETAS``, torch's eps (``--max_lr`` overrides lr)."""
WARMUP_RATIO, MIN_RATE = 0.05, 0.01
"""Our defaults: ``--warmup_ratio`` and the cosine schedule's floor (``DEFAULT_WARMUP_RATIO``, ``DEFAULT_MIN_RATE``)."""
MAPPED_FIELDS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "head_dim",
    "model_type",
}  # fmt: skip
"""The ``config.json`` keys ``litgpt_config`` maps; any other key could change the architecture, so it is refused."""


def litgpt_config(ours: dict) -> Config:
    """Our ``config.json`` (a dense GQA model with AstrAI's defaults) as a ``litgpt.Config`` of the same shape."""
    unmapped = sorted(set(ours) - MAPPED_FIELDS)
    if unmapped:
        raise ValueError(f"config.json keys this side does not map to LitGPT: {unmapped}")
    heads = ours["num_attention_heads"]
    eps = ours.get("rms_norm_eps")
    return Config(
        name="astrai-bench",
        block_size=ours["max_position_embeddings"],
        n_layer=ours["num_hidden_layers"],
        n_embd=ours["hidden_size"],
        vocab_size=ours["vocab_size"],
        padded_vocab_size=ours["vocab_size"],  # ours has no padding rows
        norm_class_name="RMSNorm",
        norm_eps=torch.finfo(torch.float32).eps if eps is None else eps,  # ours: None = F.rms_norm's default
        parallel_residual=False,  # ours: x + attn(norm(x)), then x + mlp(norm(x))
        shared_attention_norm=False,
        n_head=heads,
        head_size=ours.get("head_dim") or ours["hidden_size"] // heads,
        n_query_groups=ours.get("num_key_value_heads") or heads,
        attn_bias=False,
        bias=False,
        lm_head_bias=False,
        rope_base=int(ours.get("rope_theta") or 10000),
        rotary_percentage=1.0,
        mlp_class_name="LLaMAMLP",  # SwiGLU: proj(silu(fc_1 x) * fc_2 x)
        intermediate_size=ours["intermediate_size"],
    )


def cosine_lr(base_lr: float, t: int, warmup_steps: int, total_steps: int) -> float:
    """Our cosine schedule's rate for the step after ``t`` steps: ``max(MIN_RATE, t / warmup)`` during the warmup,
    then ``max(MIN_RATE, (1 + cos(pi p)) / 2)`` over the remaining steps (``astrai_fabric.schedule``)."""
    if t < warmup_steps:
        return base_lr * max(MIN_RATE, t / max(warmup_steps, 1))
    progress = min((t - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return base_lr * max(MIN_RATE, 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_order(num_samples: int, seed: int) -> Iterator[int]:
    """Window indices in ``ResumableSampler``'s order on one rank: a ``torch.randperm`` per epoch, seeded
    ``seed + epoch``."""
    epoch = 0
    while True:
        yield from torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1


def step_flops(config: Config, batch: int, window: int) -> int:
    """FLOPs of one training step on a meta-device copy of the model, as ``fit`` counts them for its throughput."""
    with torch.device("meta"):
        meta_model = GPT(config)
        x = torch.randint(0, 1, (batch, window))
        return measure_flops(meta_model, lambda: meta_model(x), lambda y: chunked_cross_entropy(y, x, chunk_size=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("out_dir", type=Path, help="where LitGPT's CSV logger writes")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--lr", type=float, default=ADAMW["lr"])
    parser.add_argument("--seed", type=int, default=3407)
    parser.add_argument("--log_every", type=int, default=1, help="print steps 1, k, 2k, ... and the last")
    options = parser.parse_args()
    torch.set_num_threads(1)

    meta = json.loads((options.data_dir / "meta.json").read_text())["sequence"]
    tokens = np.memmap(options.data_dir / "sequence.bin", dtype=meta["dtype"], mode="r", shape=tuple(meta["shape"]))
    window = options.window
    num_samples = (len(tokens) - 1 - window) // window + 1  # stride = window, as ours
    ours = json.loads((options.model_dir / "config.json").read_text())
    config = litgpt_config(ours)

    logger = choose_logger("csv", options.out_dir, name="step_overhead", log_interval=options.log_every)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true", loggers=[logger])
    fabric.launch()
    fabric.seed_everything(options.seed)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if ours.get("tie_word_embeddings") is True:  # ours ties only when exactly true
        model.transformer.wte.weight = model.lm_head.weight
    model.max_seq_length = window
    model = fabric.setup(model)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {**ADAMW, "lr": options.lr}}
    optimizer = instantiate_torch_optimizer(optimizer, model.parameters(), fused=fabric.device.type == "cuda")
    optimizer = fabric.setup_optimizers(optimizer)

    throughput = ThroughputMonitor(fabric, window_size=5)
    measured_flops = step_flops(model.config, options.batch, window)
    running_loss = RunningMean(window=1, sync_on_compute=False).to(fabric.device)
    warmup_steps = int(WARMUP_RATIO * options.steps)
    order = sample_order(num_samples, options.seed)
    total_t0 = time.perf_counter()

    for step in range(1, options.steps + 1):
        lr = cosine_lr(options.lr, step - 1, warmup_steps, options.steps)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        iter_t0 = time.perf_counter()
        begins = [next(order) * window for _ in range(options.batch)]
        train_data = torch.from_numpy(np.stack([tokens[b : b + window + 1] for b in begins]))
        input_ids = train_data[:, 0:window].contiguous().long()
        targets = train_data[:, 1 : window + 1].contiguous().long()
        with fabric.no_backward_sync(model, enabled=False):  # one micro-batch per step
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / 1)
        running_loss.update(loss.detach())
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()

        if step == 1 or step % options.log_every == 0 or step == options.steps:
            loss_value = running_loss.compute().item()
            t1 = time.perf_counter()
            throughput.update(
                time=t1 - total_t0,
                flops=measured_flops * options.log_every,
                batches=step,
                samples=step * options.batch,
                lengths=step * options.batch * window,
            )
            metrics = {
                "loss": loss_value,
                "iter": step,
                "step": step,
                "iter_time": t1 - iter_t0,
                "tokens": step * options.batch * window,
                "learning_rate": lr,
                **throughput.compute(),
            }
            fabric.print(f"step {step}/{options.steps} | loss {loss_value:.4f}", flush=True)
            fabric.log_dict(metrics, step=step - 1)
    fabric.logger.finalize("success")


if __name__ == "__main__":
    main()
