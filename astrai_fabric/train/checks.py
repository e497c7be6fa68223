"""What a run checks once its files are read and its data planned, before it builds a model or writes anything:
``preflight`` lists the problems, the run raises the first (``common.train_on``) and ``--dry_run`` lists them all
(``dry_run.py``). One function for both, so a dry run that passes is a run that starts. The checks made while
files are read happen where they are read, for both alike (``start.read_start``, each train type's
``build_dataset``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from astrai_fabric.checkpoint.sharded_state import check_sharded_state
from astrai_fabric.checkpoint.state import ENTRIES_KEY, STATE_DIR, check_optimizer_coverage, load_optimizer_state
from astrai_fabric.checkpoint.weights import host_memory_bytes
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import CheckpointError, ConfigError, UserError
from astrai_fabric.model import count_parameters, rope_table_bytes
from astrai_fabric.model.pipeline import check_pipeline
from astrai_fabric.optim import build_optimizer
from astrai_fabric.parallel.context import check_context_parallel
from astrai_fabric.parallel.expert import check_expert_parallel
from astrai_fabric.parallel.parallelize import check_tensor_parallel
from astrai_fabric.quantize import BYTES_PER_WEIGHT, plan_quantization
from astrai_fabric.schedule import StepPlan
from astrai_fabric.strategy import Topology, layout_of, local_ranks, precision_of
from astrai_fabric.train.footprint_plan import human_bytes, plan_cluster
from astrai_fabric.train.layout import layout_of_flags
from astrai_fabric.train.models import meta_model
from astrai_fabric.train.plan import optim_args
from astrai_fabric.train.resume import check_position
from astrai_fabric.train.start import Start


@dataclass(frozen=True)
class Placement:
    """Where a run's model lives, as far as its memory is concerned."""

    accelerator: str
    precision: str
    num_local_ranks: int
    """Processes on one machine, sharing its host memory."""
    num_shards: int
    """Ranks one copy of the model is sharded over (FSDP's shards x tensor parallelism); 1 when each rank holds it
    whole."""
    world_size: int = 1
    """Ranks in the run, all machines together."""

    @classmethod
    def of_fabric(cls, fabric: Fabric) -> Placement:
        layout = layout_of(fabric)  # DDP's and one process's: one shard
        shards = layout.num_fsdp_shards * layout.tp * layout.pp  # stages: a share of the blocks each
        return cls(fabric.device.type, precision_of(fabric), local_ranks(fabric), shards, fabric.world_size)

    @classmethod
    def of_flags(cls, args: TrainArgs, topology: Topology, accelerator: str, precision: str) -> Placement:
        shards = 1
        if args.parallel_mode == "fsdp" and topology.world_size > 1:
            try:
                layout = layout_of_flags(args, topology.world_size)
                shards = layout.num_fsdp_shards * layout.tp * layout.pp  # stages: a share of the blocks each
            except UserError:  # the dry run lists the layout's own problem
                shards = 1
        return cls(accelerator, precision, topology.devices, shards, topology.world_size)


PROCESS_BYTES = 2**29
"""Host memory each rank's process takes of its own, before any model: Python with torch and Lightning imported
(438 MiB resident, measured on CPU with torch 2.13 on this project's test machine), rounded up."""


def check_processes_fit(num_local_ranks: int) -> None:
    """Refuse, before any is started, more processes than this machine's memory holds with no model in them (300
    ranks on a 24 GiB machine would otherwise be started, and swap or be killed one by one)."""
    needed, memory = num_local_ranks * PROCESS_BYTES, host_memory_bytes()
    if needed > memory:
        raise ConfigError(
            f"nprocs {num_local_ranks}: {num_local_ranks:,} processes on this machine take {needed / 2**30:,.1f} GiB "
            f"of their own ({PROCESS_BYTES / 2**30:g} GiB each: Python, torch, Lightning) before any model; this "
            f"machine has {memory / 2**30:,.1f} GiB (fewer --nprocs, or more machines with --num_nodes)"
        )


def preflight(args: TrainArgs, start: Start, plan: StepPlan, placement: Placement) -> list[str]:
    """Every problem that would stop the run before its first step, past reading its files: the step arithmetic,
    memory, and a resumed checkpoint's position and optimizer state against this run."""
    problems = []
    try:
        plan.check()
    except UserError as err:
        problems.append(str(err))
    problems += _memory_problems(args, start, placement)
    problems += _footprint_problems(args, start, placement)
    problems += _context_parallel_problems(args, start)
    if (args.tp_size or 1) > 1 and args.parallel_mode == "fsdp":
        try:
            check_tensor_parallel(start.model_config, args.tp_size)
        except UserError as err:
            problems.append(str(err))
    if (args.ep_size or 1) > 1 and args.parallel_mode == "fsdp":
        try:
            check_expert_parallel(start.model_config, args.ep_size)
        except UserError as err:
            problems.append(str(err))
    if (args.pp_size or 1) > 1 and args.parallel_mode == "fsdp":
        try:
            check_pipeline(start.model_config, args.pp_size, args.num_stages_per_rank)
        except UserError as err:
            problems.append(str(err))
    if start.resume is not None:
        try:
            check_position(start.resume, plan)
            _check_optimizer_state(args, start)
        except UserError as err:
            problems.append(str(err))
    return problems


def _context_parallel_problems(args: TrainArgs, start: Start) -> list[str]:
    """``--cp_size`` against the model's heads and layers and the window the run resolved (the flags alone are
    checked in ``TrainArgs``)."""
    cp_size = args.cp_size or 1
    if cp_size == 1 or args.parallel_mode != "fsdp":
        return []
    problems = []
    try:
        check_context_parallel(start.model_config, cp_size, args.tp_size or 1)
    except UserError as err:
        problems.append(str(err))
    if args.window_size is None and start.window_size % cp_size:
        problems.append(f"cp_size {cp_size} must divide the window ({start.window_size}, the model's default)")
    return problems


def _footprint_problems(args: TrainArgs, start: Start, placement: Placement) -> list[str]:
    """Each device's memory against the run's footprint (``train.footprint_plan``), when it is known (a CUDA device,
    or ``--device_memory``): refused when the model states alone are over it (they are counted to 1%), a warning
    when the whole estimate is (the activations' estimate may run high; ``--dry_run`` shows the figures)."""
    if placement.accelerator != "cuda" and args.device_memory is None:
        return []
    topology = Topology(placement.num_local_ranks, max(1, placement.world_size // placement.num_local_ranks), False)
    cluster = plan_cluster(
        args, start.model_config, start.window_size, start.loss_chunk_size(args), topology, placement.precision
    )
    if cluster is None or cluster.fits in (None, True):
        return []
    states, memory = human_bytes(cluster.footprint.model_states), human_bytes(cluster.device_memory)
    if cluster.clearly_over:
        return [
            f"param_path {args.param_path}: parameters, gradients and optimizer state alone take {states} per rank "
            f"in this layout, over each device's {memory}; --dry_run shows the footprint and what to change"
        ]
    if not args.dry_run:  # once, not from every rank
        total = human_bytes(cluster.footprint.total)
        rank_zero_warn(
            f"the footprint estimate, {total} per rank, is over each device's {memory}; --dry_run shows it and "
            "what to change"
        )
    return []


def _memory_problems(args: TrainArgs, start: Start, placement: Placement) -> list[str]:
    """Whether each process on a machine can hold its part of the model, counted from the config (nothing is built:
    ``model.count_parameters``). Parameters, the RoPE table and each process's own memory on the host
    (``PROCESS_BYTES``) alone: the optimizer state, gradients and activations come on top, so a pass here is no
    promise.

    A rank holds the whole model, initialised in float32 (then cast) or read from weights in the run's dtype; FSDP
    from weights builds it on the meta device and materialises only each rank's shards, on the rank's device (a
    GPU's memory, when this machine has one to ask; the dry run of a GPU recipe elsewhere cannot)."""
    config = start.model_config
    num_parameters = count_parameters(config)
    half = start.weights is not None and placement.precision in ("bf16-true", "16-true")
    bytes_per_parameter = 2 if half else 4
    # A 4-bit base is read whole on each rank before it is sharded (train/models.py): its load is the peak.
    shards = placement.num_shards if start.weights is not None and args.quantize is None else 1
    # LoRA's adapters (float32, sharded like the rest), counted on the meta device: their rank reaches no size check
    # of the config's.
    adapters = meta_model(config, args).num_parameters(trainable_only=True) if args.lora_r else 0
    weight_bytes = num_parameters * bytes_per_parameter
    if args.quantize is not None:  # QLoRA: the block linear weights at NF4's size
        quantized = plan_quantization(meta_model(config, args), placement.num_shards).num_quantized
        weight_bytes -= int(quantized * (bytes_per_parameter - BYTES_PER_WEIGHT))
    per_rank = (weight_bytes + adapters * 4) // shards + rope_table_bytes(config)
    if placement.accelerator == "cuda" and not torch.cuda.is_available():
        return []  # a dry run planning for machines elsewhere: their memory is not this one's
    if shards > 1 and placement.accelerator == "cuda":
        memory, ranks, where = torch.cuda.get_device_properties(0).total_memory, 1, "each GPU"
    else:
        memory, ranks, where = host_memory_bytes(), placement.num_local_ranks, "this machine"
    own = PROCESS_BYTES if where == "this machine" else 0
    needed = (per_rank + own) * ranks
    if needed <= memory or own * ranks > memory:  # the processes alone: check_processes_fit names them
        return []
    sharded = f" / {shards} shards" if shards > 1 else ""
    sharded = f" and {adapters:,} adapter parameters x 4 bytes{sharded}" if adapters else sharded
    table = rope_table_bytes(config)
    table = f" and a {table / 2**30:,.1f} GiB RoPE table" if table >= 2**30 else ""
    process = f", and {own / 2**30:g} GiB of the process's own," if own else ""
    return [
        f"param_path {args.param_path}: this model does not fit in memory here: {num_parameters:,} parameters x "
        f"{bytes_per_parameter} bytes{sharded}{table}{process} x {ranks} process(es) per machine need "
        f"{needed / 2**30:,.1f} GiB before any optimizer state; {where} has {memory / 2**30:,.1f} GiB"
    ]


def _check_optimizer_state(args: TrainArgs, start: Start) -> None:
    """The resumed ``optimizer.pt`` loaded into this run's optimizer over the model on the meta device (nothing
    allocated): another ``--optimizer``, other shapes or groups are refused before anything is built. A sharded
    state (``state/``) is read shard by shard into the live optimizer (``common.build_optimizer_and_schedule``): here
    its index is read (never unpickled whole) and checked against its files."""
    resume = start.resume
    if not args.resume_optimizer:
        return
    if (resume.path / STATE_DIR).is_dir():
        check_sharded_state(resume.path / STATE_DIR)
        return
    if "optimizer" not in resume.extra:
        raise CheckpointError(
            f"--resume: {resume.path} has no optimizer.pt (add --resume_optimizer false to start a fresh one)"
        )
    model = meta_model(start.model_config, args)
    optimizer = build_optimizer(model, optim_args(args, torch.device("cpu")))
    load_optimizer_state(optimizer, resume.extra["optimizer"], resume.path / "optimizer.pt")
    # After the load's own checks, which name what is wrong with a state of another kind (AstrAI's sharded one).
    check_optimizer_coverage(resume.extra["optimizer"], resume.meta.get(ENTRIES_KEY), resume.path / "optimizer.pt")
