"""The footprint's figures (``astrai_fabric/footprint/``) against what one training step holds and sends (issue 45).

    .venv/bin/python bench/footprint.py [--layouts one,ddp2,...] [--window 128]

Each layout runs a small decoder (4 heads, 2 KV heads, hidden 256, 2 layers, vocabulary 4,096; the MoE layout 4
routed experts, top 2, and a shared one) on gloo ranks, one thread each, built as a run builds it
(``parallelize`` for FSDP, HSDP, tensor, context, expert and pipeline parallelism, the pipeline's micro-batch through
``parallel.pipeline``; torch's DDP for ddp), through two steps (forward, loss, backward, AdamW), the second measured, on
the rank the plan describes (a pipeline's fullest stage):

- live bytes per rank at the step's peak, by kind, from torch's ``MemTracker`` (a dispatch mode that follows every
  storage; not RSS): parameters, gradients, optimizer state, and everything else (activations, the head and loss,
  gathered parameters and temporaries), against the plan's same figures;
- bytes handed to each kind of collective per step (an all-gather's output, a reduce-scatter's input, an
  all-reduce's tensor, an all-to-all's input, a send's tensor), counted where every collective passes, torch's
  dispatcher (``c10d`` and ``_c10d_functional`` ops); all-reduces of fewer than 64 bytes are the step's scalars (the
  loss and gradient norm), left out.

4-rank layouts are counted, not timed (2 cores). The table goes in docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import torch  # noqa: E402
from spawn import run_ranks  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

LAYOUTS = {
    "one": dict(ranks=1, mode="none"),
    "ddp2": dict(ranks=2, mode="ddp"),
    "fsdp2": dict(ranks=2, mode="fsdp"),
    "cp2": dict(ranks=2, mode="fsdp", cp=2),
    "ep2_moe": dict(ranks=2, mode="fsdp", ep=2, moe=True),
    "ep2_moe_ckpt": dict(ranks=2, mode="fsdp", ep=2, moe=True, checkpointing=True),  # each block recomputed
    # grpo's step: one prompt's 4 responses (--group_size 4), the frozen reference's no-grad pass, then the policy's
    # forward and the clipped objective.
    "fsdp2_grpo": dict(ranks=2, mode="fsdp", group_size=4),
    "hsdp2x2": dict(ranks=4, mode="fsdp", shard=2),
    "hsdp2x1": dict(ranks=2, mode="fsdp", shard=1),
    "fsdp2_tp2": dict(ranks=4, mode="fsdp", tp=2),
    "fsdp2_cp2": dict(ranks=4, mode="fsdp", cp=2),
    "fsdp2_muon": dict(ranks=2, mode="fsdp", optimizer="muon_adamw"),
    "fsdp4_muon": dict(ranks=4, mode="fsdp", optimizer="muon_adamw"),
    "ddp2_muon": dict(ranks=2, mode="ddp", optimizer="muon_adamw"),
    "ddp4_muon": dict(ranks=4, mode="ddp", optimizer="muon_adamw"),
    "pp2": dict(ranks=2, mode="fsdp", pp=2),
    "pp2_fsdp2": dict(ranks=4, mode="fsdp", pp=2),
    # 2 stages per rank, looped (4 blocks: one a stage), through interleaved 1F1B.
    "pp2_interleaved": dict(ranks=2, mode="fsdp", pp=2, stages_per_rank=2, schedule="interleaved_1f1b", layers=4),
}
SMALL_ALL_REDUCE = 64
"""All-reduces this small are the step's scalars (the loss, the gradient norm), not in the plan."""


def config(moe: bool, layers: int = 2):
    from astrai_fabric.config import ModelConfig

    values = dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if moe:
        values |= dict(
            ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=1, moe_intermediate_size=128
        )
    return ModelConfig(**values)


class Collectives(TorchDispatchMode):
    """Bytes handed to each kind of collective (see the module docstring)."""

    KINDS = {"allgather": "all-gather", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
             "allreduce": "all-reduce", "all_reduce": "all-reduce", "alltoall": "all-to-all",
             "all_to_all": "all-to-all", "c10d.send": "send"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        if "c10d" in name:
            kind = next((k for key, k in self.KINDS.items() if key in name), None)
            if kind is not None:
                handed = self._handed(kind, name, args)
                if not (kind == "all-reduce" and handed < SMALL_ALL_REDUCE):
                    self.bytes[kind] = self.bytes.get(kind, 0) + handed
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _handed(kind: str, name: str, args: tuple) -> int:
        def size(value) -> int:  # noqa: ANN001
            if isinstance(value, torch.Tensor):
                return value.numel() * value.element_size()
            if isinstance(value, list | tuple):
                return sum(size(item) for item in value)
            return 0

        if "_c10d_functional" in name:  # (input, ..., group size for an all-gather)
            return size(args[0]) * (args[1] if kind == "all-gather" else 1)
        if kind in ("all-reduce", "send"):  # (tensors, ...)
            return size(args[0])
        if kind == "all-gather":  # (outputs, input)
            return size(args[0])
        return size(args[1])  # reduce-scatter and all-to-all: (outputs, inputs)


def worker(name: str, window: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.optim import OptimArgs, build_optimizer
    from astrai_fabric.parallel.parallelize import parallelize
    from astrai_fabric.train.grpo import grpo_batch_loss

    layout = LAYOUTS[name]
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoRegressiveLM(config(layout.get("moe", False), layout.get("layers", 2))).train()
    model.gradient_checkpointing = layout.get("checkpointing", False)
    ranks = dist.get_world_size()
    # grpo's frozen reference, a whole copy on each rank, run under no_grad (its parameters keep requires_grad: the
    # tracker hooks every parameter it meets). Its weights are taken out of the measured parameters, as the plan
    # leaves them out; its pass's activations stay in (freed before the policy's forward).
    reference = copy.deepcopy(model) if layout.get("group_size") else None
    reference_bytes = {}
    if reference is not None:
        parts = {"PARAM": reference.parameters(), "BUFFER": reference.buffers()}
        reference_bytes = {kind: sum(t.numel() * t.element_size() for t in held) for kind, held in parts.items()}
    if layout["mode"] == "fsdp":
        tp = layout.get("tp", 1)
        mesh = init_device_mesh("cpu", (ranks // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        model = parallelize(
            model,
            mesh,
            fsdp_shard_size=layout.get("shard"),
            cp_size=layout.get("cp"),
            ep_size=layout.get("ep"),
            pp_size=layout.get("pp"),
            pp_stages_per_rank=layout.get("stages_per_rank", 1),
        )
    elif layout["mode"] == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    name_and_spread = dict(name=layout.get("optimizer", "adamw"), muon_spread_replicated=True)  # CPU's default
    optimizer = build_optimizer(model, OptimArgs(**name_and_spread, ns_dtype=torch.float32))
    ids = torch.randint(0, 4096, (2, window + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    group_size = layout.get("group_size")
    if group_size:  # one prompt (the first half of the window) and its responses, window positions each
        sampled = torch.randint(0, 4096, (1, group_size, window), generator=torch.Generator().manual_seed(0))
        response = torch.zeros_like(sampled, dtype=torch.bool)
        response[..., window // 2 :] = True
        rollout = dict(input_ids=sampled, loss_mask=response, rewards=torch.arange(group_size)[None].float())
    pipeline = None
    if layout.get("pp"):  # one micro-batch through the stages (the run's path: parallel.pipeline), GPipe by default
        from lightning.fabric import Fabric

        from astrai_fabric.model.pipeline import StageLoss
        from astrai_fabric.parallel.pipeline import Pipeline

        fabric = Fabric(accelerator="cpu", devices=1)
        schedule = layout.get("schedule", "gpipe")
        pipeline = Pipeline(fabric, model, schedule, 1, 2, torch.float32, StageLoss(), Path(out).parent)

    def step() -> None:
        if pipeline is not None:
            pipeline.train_window([{"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}])
        elif group_size:
            grpo_batch_loss(model, rollout, reference, 0.2, 0.04, 0.01)[0].backward()
        else:
            out = model(ids[:, :-1])
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            if out.aux_loss is not None:
                loss = loss + 0.01 * out.aux_loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    tracker, collectives = MemTracker(), Collectives()
    parts = [part for part in getattr(optimizer, "parts", {}).values() if part is not None] or [optimizer]
    tracker.track_external(model, *parts)  # a composite optimizer's parts are torch optimizers
    with tracker, collectives:
        step()
    # The optimizer step alone (after a forward and backward outside the tracker): its own peak.
    if pipeline is not None:
        pipeline.train_window([{"input_ids": ids[:, :-1], "target_ids": ids[:, 1:]}])
    elif group_size:
        grpo_batch_loss(model, rollout, reference, 0.2, 0.04, 0.01)[0].backward()
    else:
        output = model(ids[:, :-1])
        F.cross_entropy(output.logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    step_tracker = MemTracker()
    step_tracker.track_external(model, *parts)
    with step_tracker:
        optimizer.step()
    step_peak = step_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    peak = {
        str(kind).split(".")[-1]: value
        for kind, value in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    step_total = next(value for kind, value in step_peak.items() if str(kind) == "Total")
    every_rank = [None] * ranks  # a pipeline's stages differ: the plan names the fullest
    for kind, held_bytes in reference_bytes.items():
        peak[kind] -= held_bytes
        peak["Total"] -= held_bytes
    dist.all_gather_object(every_rank, dict(peak=peak, step_peak=step_total, collectives=collectives.bytes))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every_rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--window", type=int, default=128)
    options = parser.parse_args()
    print("| layout | kind | planned MiB | measured MiB | planned / measured |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for name in options.layouts.split(","):
            out = Path(scratch) / f"{name}.json"
            ranks = LAYOUTS[name]["ranks"]
            if ranks == 1:
                import os

                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
                worker(name, options.window, str(out))
                import torch.distributed as dist

                dist.destroy_process_group()
            else:
                run_ranks(worker, ranks, name, options.window, str(out))
            measured = json.loads(out.read_text())
            for kind, planned, found in compare(name, options.window, measured):
                ratio = planned / found if found else float("nan")
                print(f"| {name} | {kind} | {planned / 2**20:,.3f} | {found / 2**20:,.3f} | {ratio:.3f} |")


def compare(name: str, window: int, measured: dict) -> list[tuple[str, int, int]]:
    """``(kind, planned bytes, measured bytes)`` for each figure the plan gives."""
    from astrai_fabric.footprint import Layout, Workload, footprint
    from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout

    layout = LAYOUTS[name]
    ranks = layout["ranks"]
    if layout["mode"] == "fsdp":
        sizes = (layout.get(key) for key in ("tp", "shard", "cp", "ep", "pp"))
        mesh = mesh_layout(ranks, *sizes)
    else:
        mesh = MeshLayout(replicas=ranks, shards=1)
    plan = footprint(
        config(layout.get("moe", False), layout.get("layers", 2)),
        Layout(layout["mode"], mesh, ranks_per_node=ranks),
        Workload(
            layout.get("group_size", 2),  # grpo: one prompt's responses; else 2 sequences
            window,
            1,
            param_bytes=4,
            compute_bytes=4,
            gather_bytes=4,
            reduce_bytes=4,
            optimizer=layout.get("optimizer", "adamw"),
            ns_bytes=4,
            muon_spread=True,
            pp_schedule=layout.get("schedule", "gpipe"),
            pp_stages_per_rank=layout.get("stages_per_rank", 1),
            gradient_checkpointing=layout.get("checkpointing", False),
        ),
    )
    measured = measured[(plan.stage or 0) * mesh.ranks_per_stage]  # the plan's rank: the fullest place's first
    peak = measured["peak"]
    rest = peak["Total"] - peak["PARAM"] - peak["OPT"] - peak["BUFFER"]  # DDP's buckets among the rest
    rows = [
        ("parameters (FSDP's gathered too)", plan.parameters + plan.gathered_parameters, peak["PARAM"]),
        ("optimizer state", plan.optimizer_state, peak["OPT"]),
        ("buffers", plan.buffers, peak["BUFFER"]),
        (
            "activations, head, gradients, buckets",
            plan.total - plan.parameters - plan.gathered_parameters - plan.optimizer_state - plan.buffers,
            rest,
        ),
        ("total at the peak", plan.total, peak["Total"]),
        (  # DDP's buckets, made before this tracker started, are not among what it follows
            "the optimizer step's peak",
            plan.parameters + plan.optimizer_state + plan.buffers + plan.gradients + plan.step_temporaries,
            measured["step_peak"],
        ),
    ]
    planned_kinds: dict[str, int] = {}
    for collective in plan.collectives:
        kinds = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "send")
        kind = next(k for k in kinds if k in collective.name)
        planned_kinds[kind] = planned_kinds.get(kind, 0) + collective.handed_bytes
    for kind in sorted(planned_kinds.keys() | measured["collectives"].keys()):
        rows.append((kind, planned_kinds.get(kind, 0), measured["collectives"].get(kind, 0)))
    return rows


if __name__ == "__main__":
    main()
