"""What every train type shares once its data is read: ``train_on`` builds the model, the optimizer and schedule,
the loaders and the saver, prints the plan and runs ``loop.fit``.

A train type's ``main`` reads downward: ``start.resolve_start`` (where the run starts), its own ``build_dataset``
and loss, handed over as a ``TrainTask``, then ``train_on``. The model (``build_model``), optimizer and schedule
(``build_optimizer_and_schedule``, ``build_schedule``: the dry run uses the same) are built here; loaders, outputs,
models and resume have their own modules beside this one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import Dataset

from astrai_fabric import lora, quantize
from astrai_fabric.checkpoint import (
    ADAPTER_FILE,
    Checkpoint,
    find_latest_checkpoint,
    remove_stale_staging,
)
from astrai_fabric.checkpoint.gather import local_optimizer_state
from astrai_fabric.checkpoint.ownership import record_written
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.checkpoint.state import (
    STATE_DIR,
    load_optimizer_state,
    load_sharded_optimizer_state,
    optimizer_parts,
)
from astrai_fabric.config.train import RECIPE_FILE, TrainArgs, resolved_recipe
from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.loop import LoopArgs, LossFn, TrainState, fit
from astrai_fabric.metrics import MetricLog, flops_per_token, peak_flops
from astrai_fabric.model.pipeline import StageLoss
from astrai_fabric.optim import build_optimizer
from astrai_fabric.optim.muon_owners import planned_layout, resolve_spread_replicated
from astrai_fabric.parallel.parallelize import DTYPES
from astrai_fabric.parallel.pipeline import Pipeline
from astrai_fabric.peak_memory import PeakMemory
from astrai_fabric.plot import PLOT_FILE, plot_runs
from astrai_fabric.preemption import StopRequest
from astrai_fabric.profiling import StepProfiler
from astrai_fabric.reporting import Reporter
from astrai_fabric.schedule import ScheduleArgs, StepPlan
from astrai_fabric.strategy import (
    Topology,
    check_applied_layout,
    data_parallel,
    describe_cpu_threads,
    is_fsdp,
    layout_of,
    local_ranks,
    precision_of,
    resolve_num_workers,
)
from astrai_fabric.torch_private import uncompiled
from astrai_fabric.train.checks import Placement, preflight
from astrai_fabric.train.footprint_plan import ClusterPlan, human_bytes, plan_cluster
from astrai_fabric.train.layout import layout_of_flags
from astrai_fabric.train.loaders import LoaderArgs, make_loader, shut_down_workers, split_validation
from astrai_fabric.train.models import initial_model, load_sharded_weights, lora_spec, meta_model
from astrai_fabric.train.outputs import hold_ckpt_dir, make_saver, refuse_to_overwrite, written_names
from astrai_fabric.train.plan import (
    ParameterSummary,
    describe_data,
    describe_plan,
    describe_processes,
    describe_schedule,
    optim_args,
    schedule_args,
    step_plan,
    summarize_parameters,
)
from astrai_fabric.train.resume import start_position
from astrai_fabric.train.start import Start


def build_model(fabric: Fabric, start: Start, args: TrainArgs) -> nn.Module:
    """The trained model, handed to Fabric (which shards it under FSDP and casts it to the run's precision)."""
    config = dataclasses.replace(start.model_config, neftune_alpha=args.neftune_alpha)
    model = initial_model(
        fabric,
        config,
        start.weights,
        args.random_seed,
        f"param_path {args.param_path}",
        quantize=args.quantize is not None,
        num_shards=Placement.of_fabric(fabric).num_shards,
    )
    adapter = None
    if (spec := lora_spec(args)) is not None:
        lora.inject(model, spec, args.random_seed)  # base frozen, adapters float32 (lora.py)
        if start.resume is not None:
            adapter = dict(start.resume.lora.state_dict)
            lora.load_adapter(model, adapter, str(start.resume.path / ADAPTER_FILE))  # no-op on the meta device
        else:
            adapter = lora.initial_adapter_state(model, spec, args.random_seed)
    if args.quantize is not None:  # every rank read the same codes: DDP's broadcast from rank 0 must not touch them
        quantize.hide_from_ddp(model)
    model.gradient_checkpointing = args.gradient_checkpointing
    if args.compile:
        model = torch.compile(model, mode=args.compile)
    module = fabric.setup_module(model)  # under FSDP on the meta device: sharded, then materialised on the device
    check_applied_layout(fabric, module.module)
    if is_fsdp(fabric) and args.quantize is None:  # a 4-bit base was read whole above (initial_model), then sharded
        raw = module.module  # Fabric's wrapper, then torch.compile's: the model whose names the file uses
        load_sharded_weights(uncompiled(raw), start.weights, adapter)
    return module


def build_optimizer_and_schedule(fabric: Fabric, model: nn.Module, start: Start, args: TrainArgs, plan: StepPlan):
    """Optimizer and schedule; a resume restores both (the checkpoint's schedule wins unless
    ``--resume_schedule false``). Also returns the plan's note on the schedule (see ``build_schedule``).

    Built after sharding: an optimizer built before would step the pre-shard tensors, silently.
    """
    optimizer = build_optimizer(model, optim_args(args, fabric.device))
    if start.resume is not None and args.resume_optimizer:  # its optimizer.pt fits: checked by the preflight
        if (start.resume.path / STATE_DIR).is_dir():
            load_sharded_optimizer_state(optimizer, start.resume.path / STATE_DIR, model)
        else:
            source = start.resume.path / "optimizer.pt"
            state = local_optimizer_state(start.resume.extra["optimizer"], optimizer_parts(optimizer), model, source)
            load_optimizer_state(optimizer, state, source)
    elif start.resume is not None:
        fabric.print("optimizer: starting fresh (--resume_optimizer false)")
    optimizer = fabric.setup_optimizers(optimizer)  # after loading: Fabric copies the optimizer's param groups
    scheduler, note = build_schedule(optimizer.optimizer, schedule_args(args), plan, start.resume)
    return optimizer, scheduler, note


def build_schedule(optimizer: Any, args: ScheduleArgs, plan: StepPlan, resume: Checkpoint | None):
    """The learning-rate schedule: this run's, or on a resume the checkpoint's (AstrAI's rule) unless
    ``--resume_schedule false`` rebuilds it for this run's length from the checkpoint's step. Returns it and a note
    for the plan (or None): the checkpoint's schedule ends before this run does, or it was rebuilt. The run and
    its dry run both build it here."""
    scheduler = args.build(optimizer, plan)
    if resume is None or "scheduler" not in resume.extra:
        return scheduler, None
    try:
        scheduler.load_state_dict(resume.extra["scheduler"])
    except UserError as err:
        raise CheckpointError(f"{resume.path / 'scheduler.pt'}: {err}") from None
    step = scheduler.last_epoch
    if not args.resume_schedule:
        scheduler = args.build(optimizer, plan)
        scheduler.continue_at(step)
        return scheduler, (
            f"schedule: rebuilt for this run's {plan.total_steps} steps (--resume_schedule false), continuing at step "
            f"{step}"
        )
    end = getattr(scheduler, "total_steps", None)  # cosine and wsd end; sgdr restarts
    if end is not None and end < plan.total_steps:
        return scheduler, (
            f"note: the checkpoint's schedule ends at step {end}, before this run's {plan.total_steps} steps: steps "
            f"{max(end, step) + 1}-{plan.total_steps} run at the floor ({scheduler.min_rate:g} x max_lr); "
            f"--resume_schedule false rebuilds the schedule for {plan.total_steps} steps"
        )
    if end is not None and end > plan.total_steps and plan.max_steps is not None:
        return scheduler, (
            f"note: the checkpoint's schedule runs to step {end}; max_steps {plan.max_steps} ends this run before it "
            f"has decayed (the checkpoint's schedule wins on a resume); --resume_schedule false rebuilds it to end at "
            f"step {plan.total_steps}"
        )
    return scheduler, None


def describe_run_plan(
    fabric: Fabric,
    args: TrainArgs,
    start: Start,
    parameters: ParameterSummary,
    plan: StepPlan,
    scheduler: Any,
    schedule_note: str | None,
    position: RunPosition,
    data: str,
    cluster: ClusterPlan | None,
) -> str:
    """The plan this run prints before its first step: the dry run's lines (``plan.describe_plan``), told by the
    Fabric the run has (its ranks, strategy, device and precision: a Fabric built by the caller may differ from the
    flags); ``cluster``: its footprint (``run_footprint``)."""
    world_size, devices = fabric.world_size, local_ranks(fabric)
    layout, shards = None, 1
    if is_fsdp(fabric) and world_size > 1:
        try:
            fsdp = layout_of_flags(args, world_size)
            layout, shards = fsdp.describe(), fsdp.num_fsdp_shards
        except UserError:  # a caller's own ModelParallelStrategy, laid out otherwise: its layout is not ours to say
            layout = None
    mode = "fsdp" if is_fsdp(fabric) else "ddp"
    spread = resolve_spread_replicated(args.muon_spread_replicated, fabric.device.type)
    muon = planned_layout(world_size, mode, args.tp_size, shards, spread, args.pp_size)
    processes = describe_processes(world_size, devices, mode, layout, fabric.device.type, precision_of(fabric))
    threads = None
    if fabric.device.type == "cpu":
        threads = describe_cpu_threads(torch.get_num_threads(), args.num_threads is not None)
    return describe_plan(
        args,
        dry_run=False,
        processes=processes,
        start=start,
        parameters=parameters,
        data=data,
        steps=plan,
        schedule=describe_schedule(args, scheduler),
        schedule_note=schedule_note,
        loader=resolve_num_workers(args.num_workers, devices)[1],
        cpu_threads=threads,
        position=position,
        muon=muon,
        cluster=cluster,
    )


def run_footprint(fabric: Fabric, args: TrainArgs, start: Start) -> ClusterPlan | None:
    """The footprint the plan gives this run, on the Fabric it has (``footprint_plan.plan_cluster``)."""
    devices = local_ranks(fabric)
    topology = Topology(devices, fabric.world_size // devices, False)
    window, chunk = start.window_size, start.loss_chunk_size(args)
    return plan_cluster(args, start.model_config, window, chunk, topology, precision_of(fabric))


def loop_args(args: TrainArgs, *, num_epochs: int, dp_rank: int, fsdp: bool, live_batches: bool = False) -> LoopArgs:
    """The loop's flags from ``args``, the plan's epochs, and what the caller knows of the Fabric: this rank's
    data-parallel rank, whether its strategy shards with FSDP (the loop itself never asks the strategy), and whether
    the batches are made by the live model (``check_weights_each_step``)."""
    return LoopArgs(
        num_epochs=num_epochs,
        batch_per_device=args.batch_per_device,
        grad_accum_steps=args.grad_accum_steps,
        max_steps=args.max_steps,
        stop_after_steps=args.stop_after_steps,
        max_tokens=args.max_tokens,
        max_grad_norm=args.max_grad_norm,
        max_bad_steps=args.max_bad_steps,
        val_step=args.val_step,
        ckpt_interval=args.ckpt_interval,
        ckpt_dir=args.ckpt_dir,
        random_seed=args.random_seed,
        grad_snr="grad_snr" in args.metrics,
        skip_sync=not (args.fsdp_sync_each_micro_batch and fsdp),
        dp_rank=dp_rank,
        check_weights_each_step=live_batches,
    )


@dataclasses.dataclass(frozen=True)
class TrainTask:
    """What one train type hands the run all train types share (``train_on``): its data, its loss, and what its
    checkpoints record beyond the common meta."""

    dataset: Dataset
    """The samples, before ``--val_split`` takes the validation set from them."""
    data_summary: str
    """The data's description in the printed plan (``plan.describe_data``)."""
    compute_loss: LossFn
    """``compute_loss(model, batch) -> (loss, metrics)``: one micro-batch's mean loss, what to log (``loop.LossFn``)."""
    collate: Callable | None = None
    """How the loaders stack samples into a micro-batch; None: torch's default collate."""
    checkpoint_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra ``meta.json`` keys of every checkpoint of the run (dpo's, kto's and grpo's reference model)."""
    pipeline_loss: StageLoss | None = None
    """How a pipeline's last stage takes this train type's loss (``--pp_size``); None: not trained in stages."""
    make_batches: Callable[[TrainState, Iterable, int], Iterable] | None = None
    """``make_batches(state, loader, num_micro_batches)``: the training batches made from the loader's with the live
    model and position, at most ``num_micro_batches`` (what the run trains to its planned end: online grpo and dpo
    sample no prompt past it), the loop's seam (``loop/__init__.py``); None: the loader's batches are trained on as
    they are."""


def train_on(fabric: Fabric, args: TrainArgs, start: Start, task: TrainTask) -> list[dict[str, float]]:
    """Everything after the data is read, for every train type: split, plan, model, optimizer, resume, loop."""
    train_set, val_set = split_validation(task.dataset, args.val_split, args.random_seed)
    layout = layout_of(fabric)  # the layout the Fabric applies, read once and handed down
    place = data_parallel(fabric, layout)
    plan = step_plan(args, len(train_set), place.num_dp_ranks, online=task.make_batches is not None)
    if problems := preflight(args, start, plan, Placement.of_fabric(fabric)):  # what --dry_run lists
        raise UserError(problems[0])

    with hold_ckpt_dir(fabric, args):  # before anything is written there, until the end
        model = build_model(fabric, start, args)
        optimizer, scheduler, schedule_note = build_optimizer_and_schedule(fabric, model, start, args, plan)
        position = start_position(fabric, start.resume, args, plan)
        refuse_to_overwrite(fabric, args.ckpt_dir, position.optimizer_step)
        loader_args = LoaderArgs.from_args(args)
        train_loader, sampler = make_loader(fabric, place, train_set, loader_args, shuffle=True, collate=task.collate)
        val_loader = None
        if val_set is not None:
            val_loader = make_loader(fabric, place, val_set, loader_args, shuffle=False, collate=task.collate)[0]
        state = TrainState(model, optimizer, scheduler, position)
        pipeline = None
        if layout.pp > 1:
            compute_dtype = DTYPES.get(args.fsdp_param_dtype) or next(model.parameters()).dtype
            pipeline = Pipeline(
                fabric,
                model,
                args.pp_schedule,
                args.grad_accum_steps,
                args.batch_per_device,
                compute_dtype,
                task.pipeline_loss,
                Path(args.ckpt_dir),
            )
        last_step = plan.last_step(position)
        if task.make_batches is not None:
            num_micro_batches = (last_step - position.optimizer_step) * args.grad_accum_steps
            batches = task.make_batches(state, train_loader, num_micro_batches)
        else:
            batches = train_loader
        profiler = StepProfiler.for_run(fabric, args.profile_step_range, args.ckpt_dir, position)  # or None
        batches = profiler.steps_of(batches) if profiler is not None else batches

        whole = meta_model(start.model_config, args)  # a rank may hold a stage's blocks or its experts only
        num_shards = Placement.of_fabric(fabric).num_shards
        parameters = summarize_parameters(whole, args, precision_of(fabric), num_shards)
        data = describe_data(args, len(train_set), task.data_summary, val_set)
        cluster = run_footprint(fabric, args, start)
        fabric.print(
            describe_run_plan(fabric, args, start, parameters, plan, scheduler, schedule_note, position, data, cluster)
        )
        if fabric.global_rank == 0:
            if stale := remove_stale_staging(args.ckpt_dir):
                fabric.print(f"removed {len(stale)} partial checkpoint(s) left by an interrupted save")
            record_written(args.ckpt_dir, written_names(args))  # in the manifest before they exist
            (Path(args.ckpt_dir) / RECIPE_FILE).write_text(resolved_recipe(args))

        # A resumed run continues its checkpoint's metric history (AstrAI starts a new one at every resume).
        metric_log = MetricLog.resumed(args.metrics, start.resume.path if start.resume is not None else None)
        if start.resume is None:  # recorded once per run, at its start
            metric_log.add(
                "parameters", position.epoch, position.optimizer_step, position.consumed_samples, **parameters.counts()
            )
        peak = PeakMemory.start(fabric.device, model)  # each checkpoint records the peak so far, the run's last too
        memory = functools.partial(peak_figures, fabric, peak, cluster)
        save = make_saver(fabric, model, optimizer, scheduler, start, args, metric_log, task.checkpoint_meta, memory)
        reporter = Reporter(
            fabric,
            plan,
            metric_log,
            first_step=position.optimizer_step + 1,
            last_step=last_step,
            flops_per_token=flops_per_token(start.model_config, start.window_size),
            peak_flops=peak_flops(fabric.device, precision_of(fabric), args.peak_flops),
            compiled=bool(args.compile),
        )
        try:
            with StopRequest() as stop:
                loop_settings = loop_args(
                    args,
                    num_epochs=plan.num_epochs,
                    dp_rank=place.dp_rank,
                    fsdp=is_fsdp(fabric),
                    live_batches=task.make_batches is not None,
                )
                history = fit(
                    fabric,
                    state=state,
                    batches=batches,
                    sampler=sampler,
                    compute_loss=task.compute_loss,
                    args=loop_settings,
                    save=save,
                    reporter=reporter,
                    val_loader=val_loader,
                    stop=stop,
                    pipeline=pipeline,
                )
        finally:
            shut_down_workers(train_loader, val_loader)
            if profiler is not None:
                profiler.close()  # writes the trace, also when the run ended before the last profiled step
        fabric.print(describe_peak(peak_figures(fabric, peak, cluster), peak))
        latest = find_latest_checkpoint(args.ckpt_dir)
        skipped = f" ({position.skipped_steps} skipped: non-finite loss)" if position.skipped_steps else ""
        if stop.honoured:
            cause = stop.signal_name or "a signal to another rank"
            fabric.print(
                f"stopped by {cause} after step {position.optimizer_step}{skipped}; latest checkpoint: {latest}\n"
                f"continue with: astrai-fabric {args.train_type} --config {Path(args.ckpt_dir) / RECIPE_FILE} "
                "--resume auto"
            )
        else:
            fabric.print(f"done after step {position.optimizer_step}{skipped}; latest checkpoint: {latest}")
        if fabric.global_rank == 0 and latest is not None:
            try:
                fabric.print(f"plot: {plot_runs([Path(args.ckpt_dir)], Path(args.ckpt_dir) / PLOT_FILE)}")
            except UserError as err:  # the run is done and saved: a history it cannot plot is only a warning
                fabric.print(f"warning: no plot ({err})")
    return history


def peak_figures(fabric: Fabric, peak: PeakMemory, cluster: ClusterPlan | None) -> dict[str, int]:
    """metric.jsonl's ``memory`` entry: the fullest rank's measured peak so far (``peak_memory``) and the plan's
    figure, each absent where unknown. Every rank calls it (the ranks' peaks are gathered)."""
    measured = peak.measured()
    unknown = fabric.all_reduce(torch.tensor(float(measured is None), device=fabric.device), reduce_op="max")
    figures = {}
    if not unknown:
        fullest = fabric.all_reduce(torch.tensor(float(measured), device=fabric.device), reduce_op="max")
        figures["measured_peak_bytes"] = int(fullest)
    if cluster is not None:
        figures["planned_peak_bytes"] = cluster.footprint.total
    return figures


def describe_peak(figures: dict[str, int], peak: PeakMemory) -> str:
    """The run's last memory line, from ``peak_figures``."""
    measured, planned = figures.get("measured_peak_bytes"), figures.get("planned_peak_bytes")
    shown = f"{human_bytes(measured)} per rank at its peak, measured ({peak.how})" if measured else "not measured here"
    return f"memory: {shown}; planned {human_bytes(planned) if planned else 'none (no layout to plan)'}"
