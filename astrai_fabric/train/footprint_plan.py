"""The plan's ``memory`` and ``comms`` lines: the footprint (``astrai_fabric.footprint``) of a run's flags, against
each device's memory, with what to change when it does not fit."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from astrai_fabric.config.devices import parse_device_memory
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.pipeline import stages_of_rank
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import UserError
from astrai_fabric.footprint import Adapters, Footprint, Layout, Workload, footprint
from astrai_fabric.losses import REFERENCE_FREE
from astrai_fabric.optim.muon_owners import resolve_spread_replicated
from astrai_fabric.parallel.mesh import MeshLayout
from astrai_fabric.strategy import Topology, planned_accelerator
from astrai_fabric.train.layout import layout_of_flags

PAIRED = ("dpo", "reward_model")
"""Train types whose forward takes a chosen and a rejected sequence per sample."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CLEARLY_OVER = 1.0
"""The preflight refuses a run whose model states alone (exact to 1%: tests/test_footprint.py) exceed each
device's memory by this factor; the activations' estimate (within 10%) only warns."""


@dataclass(frozen=True)
class ClusterPlan:
    """A run's footprint, the flags it came from, and each device's memory (None: unknown)."""

    config: ModelConfig
    layout: Layout
    workload: Workload
    footprint: Footprint
    """The footprint of ``config`` under ``layout`` and ``workload``."""
    device_memory: int | None
    """Bytes of each device (``--device_memory``, or the CUDA device's own); None: unknown."""
    sequences_per_sample: int = 1
    """Sequences in the forward per sample of ``--batch_per_device`` (a preference pair's two, a GRPO prompt's
    ``--group_size`` responses)."""
    left_out: tuple[str, ...] = ()
    """What the run holds that the footprint does not count (a frozen reference model, a reward model): said in the
    plan's memory line."""

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.footprint.total <= self.device_memory

    @property
    def clearly_over(self) -> bool:
        return self.device_memory is not None and self.footprint.model_states > CLEARLY_OVER * self.device_memory

    def with_workload(self, **changes: object) -> ClusterPlan:
        """This plan with ``changes`` to its workload (``Workload``'s fields), its footprint computed again."""
        workload = dataclasses.replace(self.workload, **changes)
        return dataclasses.replace(self, workload=workload, footprint=footprint(self.config, self.layout, workload))

    def largest_micro_batch(self) -> int:
        """The most sequences per micro-batch that fit each device (0: not one, or the memory is unknown)."""
        if self.device_memory is None:
            return 0

        def fits(sequences: int) -> bool:
            return bool(self.with_workload(sequences_per_micro_batch=sequences).fits)

        low, high = 0, 1
        while fits(high):  # the footprint grows with the sequences: double, then halve the gap
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


def plan_cluster(
    args: TrainArgs, config: ModelConfig, window: int, loss_chunk_size: int, topology: Topology, precision: str
) -> ClusterPlan | None:
    """The footprint of this run's flags; None when the layout does not divide (the dry run lists why) and under
    FSDP's CPU offload (the states leave the device: not modelled)."""
    if args.fsdp_cpu_offload:
        return None
    world = topology.world_size
    if args.parallel_mode == "fsdp" and world > 1:
        try:
            mesh = layout_of_flags(args, world)
        except UserError:
            return None
    else:
        mesh = MeshLayout(replicas=world, shards=1)
    layout = Layout(args.parallel_mode, mesh, topology.devices)
    half = precision in ("bf16-true", "16-true")
    cpu = planned_accelerator(args.device_type) == "cpu"  # Newton-Schulz in float32 there by default
    param_bytes = 2 if half else 4
    gather_bytes = DTYPE_BYTES[args.fsdp_param_dtype] if args.fsdp_param_dtype else param_bytes
    per_sample = 2 if args.train_type in PAIRED else args.group_size if args.train_type == "grpo" else 1
    workload = Workload(
        sequences_per_micro_batch=args.batch_per_device * per_sample,
        window=window,
        grad_accum_steps=args.grad_accum_steps,
        param_bytes=param_bytes,
        compute_bytes=2 if half or precision == "bf16-mixed" or gather_bytes == 2 else 4,
        gather_bytes=gather_bytes,
        reduce_bytes=DTYPE_BYTES[args.fsdp_reduce_dtype] if args.fsdp_reduce_dtype else gather_bytes,
        optimizer=args.resolved_optimizer,
        gradient_checkpointing=args.gradient_checkpointing,
        loss_chunk_size=loss_chunk_size,
        reshard_after_forward=args.fsdp_reshard_after_forward,
        sync_each_micro_batch=args.fsdp_sync_each_micro_batch,
        adapters=adapters_of(args),
        ns_bytes=4 if args.muon_ns_dtype == "float32" or (args.muon_ns_dtype == "auto" and cpu) else 2,
        muon_spread=resolve_spread_replicated(args.muon_spread_replicated, "cpu" if cpu else "cuda"),
        attention_copies_kv=not cpu,
        adamw_foreach=not cpu,
        pp_schedule=args.pp_schedule,
        pp_stages_per_rank=args.num_stages_per_rank,
        carries_positions=args.train_type == "sft",
    )
    plan = footprint(config, layout, workload)
    return ClusterPlan(config, layout, workload, plan, device_memory(args), per_sample, left_out(args))


def left_out(args: TrainArgs) -> tuple[str, ...]:
    """The models a run holds beside the one it trains, which the footprint does not count."""
    found = []
    reference = args.train_type in ("kto", "grpo") or (args.train_type == "dpo" and args.dpo_loss not in REFERENCE_FREE)
    if reference and not args.lora_r:  # LoRA's reference is its own base, adapters off: nothing more held
        found.append("the frozen reference model (the weights once more, without gradients or optimizer state)")
    if args.reward_model is not None:
        found.append(f"the reward model ({args.reward_model}: its weights, whole on each rank)")
    return tuple(found)


def adapters_of(args: TrainArgs) -> Adapters | None:
    """LoRA's flags as the footprint reads them (``--quantize nf4`` is QLoRA); None without ``--lora_r``."""
    if not args.lora_r:
        return None
    return Adapters(args.lora_r, tuple(args.lora_targets), args.lora_dropout > 0, args.quantize is not None)


def device_memory(args: TrainArgs) -> int | None:
    """``--device_memory``, else the CUDA device's own where a CUDA run has one, else None."""
    if args.device_memory is not None:
        return parse_device_memory(args.device_memory)
    if args.device_type != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def _pipeline_place(plan: ClusterPlan) -> str:
    """The pipeline place the plan's figures are of: ``stage 1``, or with several stages per rank ``pipeline rank
    1 (stages 1, 3)``."""
    rank, num_ranks = plan.footprint.stage, plan.layout.mesh.pp
    if plan.workload.pp_stages_per_rank == 1:
        return f"stage {rank}"
    stages = stages_of_rank(rank, num_ranks, plan.workload.pp_stages_per_rank)
    return f"pipeline rank {rank} (stages {', '.join(map(str, stages))})"


def human_bytes(num_bytes: float) -> str:
    """``num_bytes`` in GiB, MiB or KiB, whichever keeps a figure of at least 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes / 2**10:,.1f} KiB"


def describe_memory(plan: ClusterPlan) -> str:
    """The plan's ``memory`` line (and the lines under it)."""
    fp, work = plan.footprint, plan.workload
    verdict = ""
    if plan.device_memory is not None:
        verdict = f" of {human_bytes(plan.device_memory)} per device: " + ("fits" if plan.fits else "DOES NOT FIT")
    optimizer = f"optimizer {human_bytes(fp.optimizer_state)} ({work.optimizer})"
    checkpointing = "on" if work.gradient_checkpointing else "off"
    head = f"chunks of {work.loss_chunk_size}" if work.loss_chunk_size else "whole logits"
    held = f"{fp.micro_batches_held} micro-batches of " if fp.micro_batches_held > 1 else ""
    adapters = ""
    if work.adapters is not None:
        kind = "QLoRA" if work.adapters.quantized else "LoRA"
        adapters = f" ({kind}: gradients and optimizer state are the adapters')"
    lines = [
        f"per rank at its peak (the forward's end), estimated: {human_bytes(fp.total)}{verdict}{adapters}"
        + (f" ({_pipeline_place(plan)}'s ranks, the fullest)" if fp.stage is not None else ""),
        f"parameters {human_bytes(fp.parameters)}, gradients {human_bytes(fp.gradients)}, {optimizer}"
        + (f", gathered by FSDP {human_bytes(fp.gathered_parameters)}" if fp.gathered_parameters else "")
        + (f", DDP's buckets {human_bytes(fp.gradient_buckets)}" if fp.gradient_buckets else "")
        + f", activations {human_bytes(fp.activations)} ({held}{work.sequences_per_micro_batch} x {work.window} "
        f"positions, checkpointing {checkpointing}), head and loss {human_bytes(fp.head_and_loss)} ({head})",
    ]
    if plan.device_memory is not None:
        largest = plan.largest_micro_batch() // plan.sequences_per_sample
        lines.append(
            f"largest micro-batch that fits: --batch_per_device {largest}" if largest else "no micro-batch fits"
        )
        if not plan.fits:
            lines.append("to fit, try: " + "; ".join(remedies(plan)))
    if plan.left_out:
        lines.append("not counted: " + "; ".join(plan.left_out))
    return "\n".join(lines)


def remedies(plan: ClusterPlan) -> list[str]:
    """What would bring the estimate under each device's memory, each change alone with its estimate."""
    work, mesh = plan.workload, plan.layout.mesh
    found = []
    options = []
    if not work.gradient_checkpointing:
        options.append(("--gradient_checkpointing true", dict(gradient_checkpointing=True)))
    if plan.layout.fsdp and not work.reshard_after_forward:
        options.append(("--fsdp_reshard_after_forward true", dict(reshard_after_forward=True)))
    if work.loss_chunk_size == 0:
        options.append(("--loss_chunk_size 4096", dict(loss_chunk_size=4096)))
    together, flags, one_fits = {}, [], False
    for flag, change in options:
        alone = plan.with_workload(**change)
        one_fits = one_fits or alone.fits
        found.append(f"{flag} ({human_bytes(alone.footprint.total)}{': fits' if alone.fits else ''})")
        together |= change
        flags.append(flag)
        if not one_fits and len(flags) > 1 and (combined := plan.with_workload(**together)).fits:
            found.append(f"{' and '.join(flags)} together ({human_bytes(combined.footprint.total)}: fits)")
            break
    largest = plan.largest_micro_batch() // plan.sequences_per_sample
    if largest and largest * plan.sequences_per_sample < work.sequences_per_micro_batch:
        found.append(f"--batch_per_device {largest} (more --grad_accum_steps for the same batch)")
    if plan.layout.fsdp and mesh.num_fsdp_shards < mesh.world_size // mesh.tp:
        found.append("more FSDP shards (--fsdp_shard_size)")
    if plan.layout.fsdp:
        found.append("--cp_size for long windows, --tp_size, --pp_size, or more ranks")
    return found


def describe_comms(plan: ClusterPlan) -> str | None:
    """The plan's ``comms`` line: each collective's bytes per optimizer step and rank."""
    if not plan.footprint.collectives:
        return None
    lines = []
    for collective in plan.footprint.collectives:
        handed, on_link = human_bytes(collective.handed_bytes), human_bytes(collective.link_bytes)
        where = f"{collective.group_size}: {handed} handed per step, {on_link} on {collective.link} links"
        lines.append(f"{collective.name} over {where}")
    return "\n".join(lines)
