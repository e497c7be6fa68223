"""``--dry_run``: the plan of a run, printed without training, launching or writing anything."""

from __future__ import annotations

from pathlib import Path

import torch

from astrai_fabric import assets
from astrai_fabric.checkpoint import checkpoints_after
from astrai_fabric.checkpoint.ownership import in_use_message, lock_holder, not_ours_message, unowned
from astrai_fabric.checkpoint.weights import host_memory_bytes
from astrai_fabric.config.train import RECIPE_FILE, RECIPE_HEADER, TrainArgs
from astrai_fabric.errors import UserError
from astrai_fabric.schedule import ScheduleArgs, StepPlan
from astrai_fabric.strategy import (
    describe_cpu_threads,
    fsdp_layout,
    planned_cpu_threads,
    resolve_accelerator,
    resolve_num_workers,
    resolve_precision,
    resolve_topology,
)
from astrai_fabric.train.common import build_schedule
from astrai_fabric.train.loaders import split_validation
from astrai_fabric.train.models import meta_model
from astrai_fabric.train.outputs import written_names
from astrai_fabric.train.plan import (
    describe_data,
    describe_plan,
    describe_processes,
    describe_schedule,
    summarize_parameters,
)
from astrai_fabric.train.start import Start, read_start


def _memory_problems(
    args: TrainArgs, start: Start, precision: str, num_parameters: int, num_local_ranks: int
) -> list[str]:
    """Whether each process on a machine can hold the whole model in host memory, where it does: everywhere but
    FSDP from weights (built on the meta device, only each rank's shards materialised). Parameters alone: the
    optimizer state, gradients and activations come on top, so a pass here is no promise."""
    if args.parallel_mode == "fsdp" and start.weights is not None:
        return []
    half = start.weights is not None and precision in ("bf16-true", "16-true")  # read in the run's dtype
    bytes_per_parameter = 2 if half else 4  # a fresh model is initialised in float32, then cast
    needed, memory = num_parameters * bytes_per_parameter * num_local_ranks, host_memory_bytes()
    if needed <= memory:
        return []
    return [
        f"param_path {args.param_path}: this model does not fit in memory here: {num_parameters:,} parameters x "
        f"{bytes_per_parameter} bytes x {num_local_ranks} process(es) per machine need {needed / 2**30:,.1f} GiB "
        f"before any optimizer state; this machine has {memory / 2**30:,.1f} GiB"
    ]


def dry_run(args: TrainArgs, build_dataset) -> int:  # noqa: ANN001 - the train type's build_dataset
    """Print the plan; return 0 when the run could start, 2 (after listing what is missing or in the way) otherwise."""
    problems: list[str] = []
    topology = resolve_topology(args)
    layout = None
    if args.parallel_mode == "fsdp" and topology.world_size > 1:
        try:
            layout = fsdp_layout(args, topology.world_size).describe()
        except UserError as err:
            problems.append(str(err))
    accelerator = resolve_accelerator(args)
    precision = resolve_precision(args.precision, accelerator)
    processes = describe_processes(
        topology.world_size, topology.devices, args.parallel_mode, layout, accelerator, precision
    )
    problems += _ckpt_dir_problems(args)
    start = dataset = parameters = data = plan = schedule = note = None
    try:
        start = read_start(args)
    except UserError as err:
        problems.append(str(err))
        if not assets.resolve(args.data_root_path).exists():  # reported too: the data is not read without a model
            problems.append(f"data_root_path {args.data_root_path}: not found")
    if start is not None:
        parameters = summarize_parameters(meta_model(start.model_config, args), args)
        problems += _memory_problems(args, start, precision, parameters.total, topology.devices)
        if start.resume is None and (later := checkpoints_after(args.ckpt_dir, 0)):
            problems.append(
                f"ckpt_dir {args.ckpt_dir}: holds {len(later)} checkpoint(s) this fresh run would overwrite "
                "(--resume auto continues the newest)"
            )
        try:
            dataset, summary = build_dataset(args, start)
        except UserError as err:
            problems.append(str(err))
    if dataset is not None:
        train_set, val_set = split_validation(dataset, args.val_split, args.random_seed)
        data = describe_data(args, len(train_set), summary, val_set)
        plan = StepPlan.from_args(args, len(train_set), topology.world_size // (args.tp_size or 1))
        try:
            plan.check()
            saved = start.resume.extra.get("scheduler") if start.resume is not None else None
            lrs = saved.get("base_lrs") if isinstance(saved, dict) else None
            groups = len(lrs) if isinstance(lrs, list) and lrs else 1  # a stand-in with the saved schedule's groups
            optimizer = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)],
                                        lr=args.max_lr)  # fmt: skip
            scheduler, note = build_schedule(optimizer, ScheduleArgs.from_args(args), plan, start.resume)
            schedule = describe_schedule(args, scheduler)
        except UserError as err:
            problems.append(str(err))
    threads = None
    if accelerator == "cpu":
        threads = describe_cpu_threads(
            planned_cpu_threads(args.num_threads, topology.devices), args.num_threads is not None
        )
    print(
        describe_plan(
            args,
            dry_run=True,
            processes=processes,
            start=start,
            parameters=parameters,
            data=data,
            steps=plan,
            schedule=schedule,
            schedule_note=note,
            loader=resolve_num_workers(args.num_workers, topology.devices)[1],
            cpu_threads=threads,
        )  # fmt: skip
    )
    if problems:
        print("cannot start:\n" + "\n".join(f"  - {item}" for item in problems))
        return 2
    return 0


def _ckpt_dir_problems(args: TrainArgs) -> list[str]:
    """What a run would refuse in ``ckpt_dir``: another run holding it, files a run did not write (the lock is
    only probed, never taken)."""
    root = Path(args.ckpt_dir)
    problems = []
    if (holder := lock_holder(root)) is not None:
        problems.append(in_use_message(root, holder))
    try:
        if foreign := unowned(root, written_names(args), legacy=(RECIPE_FILE, RECIPE_HEADER)):
            problems.append(not_ours_message(root, foreign))
    except UserError as err:
        problems.append(str(err))
    return problems
