"""Runs AstrAI's own training CLI (``scripts/tools/train.py``) under AstrAI's interpreter, in float32.

Not a test module: ``tests/astrai_oracle.py::run_astrai_cli`` starts it as ``python astrai_cli_driver.py JOBS.json``
with AstrAI on ``PYTHONPATH``. ``JOBS.json`` is a list of ``{"argv": [...], "dump": PATH, "peek": N, "probe": bool,
"copy": [CHECKPOINT, COPY, TOKENIZER_DIR]}`` (all but ``argv`` optional), run in order in this one process (each
AstrAI start costs seconds of imports). Two changes to AstrAI, made here and nowhere else, so that its numbers can
be compared with ours in float32:

- the CLI's ``create_model`` keeps AstrAI's model in float32 (AstrAI's casts it to bfloat16);
- torch's Muon orthogonalises in float32 (torch's Newton-Schulz casts to bfloat16), as ``--muon_ns_dtype float32``.

``dump``: right after AstrAI's ``TrainContextBuilder.build`` (AstrAI's own resume: ``Checkpoint.load_any``, its
``load_state_dict`` calls, its sampler offset), the states it loaded are saved there: model weights, optimizer and
scheduler ``state_dict()``, the parameter names in each sub-optimizer's order, AstrAI's ``epoch``,
``consumed_samples`` and ``optimizer_step``, the sampler's position and the next ``peek`` sample indices it will
draw. ``probe``: stop after that dump instead of training. ``copy``: first copy a checkpoint and add a tokenizer to
the copy (AstrAI's dpo and grpo read it from ``--param_path``, and its checkpoints hold none, B22), leaving the
original as AstrAI wrote it.
"""

import copy
import importlib.util
import itertools
import json
import os
import shutil
import sys

import torch
import torch.optim._muon as torch_muon
from astrai.model import AutoRegressiveLM
from astrai.trainer import train_context


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch's quintic Newton-Schulz (same signature) computed in float32 instead of bfloat16."""
    a, b, c = ns_coefficients
    x = grad.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def optimizer_params(model, optimizer) -> dict:
    """The parameter names each sub-optimizer holds, in its order (``optimizer.pt`` indexes them by position)."""
    names = {id(param): name for name, param in model.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)  # AstrAI's AccumOptimizer wraps its composite
    parts = {part: getattr(inner, part) for part in inner.state_dict()}  # muon/adamw, nora/nadamw or mano/adamw
    return {
        part: None if sub is None else [names[id(p)] for group in sub.param_groups for p in group["params"]]
        for part, sub in parts.items()
    }


class Probed(Exception):
    """Raised after a probe's dump: AstrAI's resume was set up and read, no training wanted."""


def main(jobs_file: str) -> None:
    torch_muon._zeropower_via_newtonschulz = newton_schulz_float32
    spec = importlib.util.spec_from_file_location(
        "astrai_train_cli", os.path.join(os.environ["ASTRAI_SRC"], "scripts", "tools", "train.py")
    )
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    cli.create_model = AutoRegressiveLM  # float32: AstrAI's own create_model adds .to(torch.bfloat16)

    job: dict = {}
    build = train_context.TrainContextBuilder.build

    def build_and_dump(self):
        context = build(self)
        if job.get("dump"):
            sampler = context.dataloader.sampler
            torch.save(
                {
                    "model": {k: v.detach().clone() for k, v in context.model.state_dict().items()},
                    "optimizer": copy.deepcopy(context.optimizer.state_dict()),
                    "scheduler": copy.deepcopy(context.scheduler.state_dict()),
                    "epoch": context.epoch,
                    "consumed_samples": context.consumed_samples,
                    "optimizer_step": context.optimizer_step,
                    "sampler_epoch": sampler.epoch,
                    "sampler_iter": sampler.iter,
                    "next_indices": list(itertools.islice(iter(copy.deepcopy(sampler)), job["peek"])),
                    "num_samples": len(context.dataloader.dataset),
                    "optimizer_params": optimizer_params(context.model, context.optimizer),
                },
                job["dump"],
            )
        if job.get("probe"):
            raise Probed
        return context

    train_context.TrainContextBuilder.build = build_and_dump
    with open(jobs_file) as file:
        jobs = json.load(file)
    for entry in jobs:
        job.clear()
        job.update(entry)
        if job.get("copy"):
            checkpoint, copy_dir, tokenizer_dir = job["copy"]
            if not os.path.isdir(checkpoint):  # an earlier job did not write it: the test that needs it says so
                continue
            shutil.copytree(checkpoint, copy_dir)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(tokenizer_dir, name), copy_dir)
        try:
            cli.train_command.main(args=job["argv"], standalone_mode=False)
        except Probed:
            pass


if __name__ == "__main__":
    main(sys.argv[1])
