"""``--dry_run``: the plan of a run, printed without training, launching or writing anything."""

from __future__ import annotations

from pathlib import Path

import torch

from astrai_fabric import assets
from astrai_fabric.checkpoint import checkpoints_after
from astrai_fabric.checkpoint.ownership import in_use_message, lock_holder, not_ours_message, unowned
from astrai_fabric.config.train import RECIPE_FILE, RECIPE_HEADER, TrainArgs
from astrai_fabric.data.records import PromptDataset
from astrai_fabric.errors import UserError
from astrai_fabric.hub import HUB_FLAGS, looks_like_hub_id, pin_cached_flags
from astrai_fabric.model.transformer import cycle_collection_paused
from astrai_fabric.optim.muon_owners import planned_layout, resolve_spread_replicated
from astrai_fabric.schedule import StepPlan
from astrai_fabric.strategy import (
    describe_cpu_threads,
    planned_accelerator,
    planned_cpu_threads,
    resolve_num_workers,
    resolve_precision,
    resolve_topology,
)
from astrai_fabric.train.checks import Placement, check_processes_fit, preflight
from astrai_fabric.train.common import build_schedule
from astrai_fabric.train.footprint_plan import plan_cluster
from astrai_fabric.train.layout import layout_of_flags
from astrai_fabric.train.loaders import split_validation
from astrai_fabric.train.models import meta_model
from astrai_fabric.train.outputs import written_names
from astrai_fabric.train.plan import (
    describe_data,
    describe_plan,
    describe_processes,
    describe_schedule,
    schedule_args,
    step_plan,
    summarize_parameters,
)
from astrai_fabric.train.resume import planned_position
from astrai_fabric.train.start import Start, WindowPastPositions, hub_values, read_start, set_values


def dry_run(args: TrainArgs, build_dataset) -> int:  # noqa: ANN001 - the train type's build_dataset
    """Print the plan; return 0 when the run could start, 2 (after listing what is missing or in the way) otherwise.
    The cycle collector rests meanwhile: the plan walks a model of up to hundreds of thousands of modules several
    times, and each collection would walk them all again (half the time of DeepSeek-V3's plan)."""
    with cycle_collection_paused():
        return _plan(args, build_dataset)


def _plan(args: TrainArgs, build_dataset) -> int:  # noqa: ANN001 - the train type's build_dataset
    problems: list[str] = []
    topology = resolve_topology(args.nprocs, args.num_nodes)
    layout, shards, num_dp_ranks = None, 1, topology.world_size
    if args.parallel_mode == "fsdp" and topology.world_size > 1:
        try:
            fsdp = layout_of_flags(args, topology.world_size)
            layout, shards, num_dp_ranks = fsdp.describe(), fsdp.num_fsdp_shards, fsdp.num_dp_ranks
        except UserError as err:
            problems.append(str(err))
    accelerator = planned_accelerator(args.device_type)  # a plan may be for devices this machine lacks
    spread = resolve_spread_replicated(args.muon_spread_replicated, accelerator)
    muon = planned_layout(topology.world_size, args.parallel_mode, args.tp_size, shards, spread, args.pp_size)
    precision = resolve_precision(args.precision, accelerator)
    processes = describe_processes(
        topology.world_size, topology.devices, args.parallel_mode, layout, accelerator, precision
    )
    problems += _ckpt_dir_problems(args)
    if accelerator == "cpu" or torch.cuda.is_available():  # else a plan for machines elsewhere, not this one
        try:
            check_processes_fit(topology.devices)
        except UserError as err:
            problems.append(str(err))
    start = dataset = parameters = data = plan = schedule = note = position = cluster = None
    try:  # a dry run downloads nothing: ids in the cache are read from it, the others only named in the plan
        pinned, uncached = pin_cached_flags(hub_values(args), args.data_subset, args.data_split)
        set_values(args, pinned)
    except UserError as err:
        problems.append(str(err))
        uncached = dict.fromkeys(HUB_FLAGS, "")
    try:
        if not uncached.keys() & {"param_path", "tokenizer_path"}:  # what read_start reads (the reference: not)
            try:
                start = read_start(args)
            except WindowPastPositions as err:  # refused; the plan made at the model's longest window instead
                problems.append(f"{err} (the plan above is for --window_size {err.positions}, its longest)")
                args.window_size = err.positions
                start = read_start(args)
    except UserError as err:
        problems.append(str(err))
        missing = not assets.resolve(args.data_root_path).exists() and not looks_like_hub_id(args.data_root_path)
        if missing:  # reported too: the data is not read without a model
            problems.append(f"data_root_path {args.data_root_path}: not found")
    if start is not None:
        num_shards = Placement.of_flags(args, topology, accelerator, precision).num_shards
        parameters = summarize_parameters(meta_model(start.model_config, args), args, precision, num_shards)
        cluster = plan_cluster(
            args, start.model_config, start.window_size, start.loss_chunk_size(args), topology, precision
        )
        if start.resume is None and (later := checkpoints_after(args.ckpt_dir, 0)):
            problems.append(
                f"ckpt_dir {args.ckpt_dir}: holds {len(later)} checkpoint(s) this fresh run would overwrite "
                "(--resume auto continues the newest)"
            )
        try:
            if "data_root_path" not in uncached:
                dataset, summary = build_dataset(args, start)
        except UserError as err:
            problems.append(str(err))
    if dataset is not None:
        train_set, val_set = split_validation(dataset, args.val_split, args.random_seed)
        data = describe_data(args, len(train_set), summary, val_set)
        plan = step_plan(args, len(train_set), num_dp_ranks, online=isinstance(dataset, PromptDataset))
        problems += preflight(args, start, plan, Placement.of_flags(args, topology, accelerator, precision))
        try:
            plan.check()
        except UserError:
            pass  # listed by the preflight; no schedule to describe
        else:
            try:
                schedule, note = _schedule(args, start, plan)
                position = planned_position(start.resume, args, plan)[0]
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
            position=position,
            fetched=[line for line in uncached.values() if line],
            muon=muon,
            cluster=cluster,
        )
    )
    if problems:
        print("cannot start:\n" + "\n".join(f"  - {item}" for item in problems))
        return 2
    return 0


def _schedule(args: TrainArgs, start: Start, plan: StepPlan) -> tuple[str, str | None]:
    """The plan's schedule line and note, from the run's own ``build_schedule`` over a stand-in optimizer with the
    saved schedule's number of groups."""
    saved = start.resume.extra.get("scheduler") if start.resume is not None else None
    lrs = saved.get("base_lrs") if isinstance(saved, dict) else None
    groups = len(lrs) if isinstance(lrs, list) and lrs else 1
    optimizer = torch.optim.SGD(
        [{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=args.max_lr
    )
    scheduler, note = build_schedule(optimizer, schedule_args(args), plan, start.resume)
    return describe_schedule(args, scheduler), note


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
