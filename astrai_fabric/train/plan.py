"""The plan of a run: what it trains, on what, how many steps and where its outputs go. ``describe_plan`` renders
it for the run, before its first step, and for ``--dry_run``, instead of training: one renderer, so the two show
the same lines in the same form (the dry run adds what is missing)."""

from __future__ import annotations

import contextlib
from collections.abc import Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from astrai_fabric import assets, lora
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.config.train import HF_DEFAULT_WINDOW, TrainArgs
from astrai_fabric.data.windows import PACKING_LINE
from astrai_fabric.errors import UserError
from astrai_fabric.losses import REFERENCE_FREE, loss_chunk_reason
from astrai_fabric.model.ffn import describe_routing
from astrai_fabric.model.pipeline import describe_pipeline
from astrai_fabric.optim import OptimArgs, optimizer_groups, optimizer_state_bytes, resolve_ns_dtype
from astrai_fabric.optim.muon_owners import resolve_spread_replicated
from astrai_fabric.parallel.context import describe_context_parallel
from astrai_fabric.parallel.expert import describe_expert_parallel
from astrai_fabric.profiling import describe_profiling
from astrai_fabric.quantize import plan_quantization
from astrai_fabric.schedule import ScheduleArgs, StepPlan
from astrai_fabric.train.footprint_plan import ClusterPlan, describe_comms, describe_memory
from astrai_fabric.train.models import lora_spec
from astrai_fabric.train.start import Start


def step_plan(args: TrainArgs, num_samples: int, num_dp_ranks: int, online: bool = False) -> StepPlan:
    """The step plan of a run of ``args`` over ``num_samples`` training samples (prompts, where ``online`` rollouts
    sample the responses) on ``num_dp_ranks`` ranks (the run and its dry run both build it here)."""
    return StepPlan(
        num_samples,
        num_dp_ranks,
        args.batch_per_device,
        args.grad_accum_steps,
        args.n_epoch,
        args.warmup_ratio,
        args.max_steps,
        args.stop_after_steps,
        args.grpo_num_iterations,
        fixed_warmup_steps=args.warmup_steps,
        rollout_micro_batches=args.rollout_interval * args.grad_accum_steps if online else None,
    )


def schedule_args(args: TrainArgs) -> ScheduleArgs:
    """The flags of ``args`` the learning-rate schedule reads."""
    return ScheduleArgs(
        args.schedule_type,
        args.min_rate,
        args.cycle_length,
        args.t_mult,
        args.stable_steps,
        args.decay_steps,
        args.resume_schedule,
    )


def optim_args(args: TrainArgs, device: torch.device) -> OptimArgs:
    """The flags of ``args`` the optimizer reads, Muon's Newton-Schulz dtype and DDP spread resolved for
    ``device``."""
    return OptimArgs(
        name=args.resolved_optimizer,
        lr=args.max_lr,
        weight_decay=args.weight_decay,
        momentum=args.muon_momentum,
        nesterov=args.muon_nesterov,
        ns_steps=args.muon_ns_steps,
        adjust_lr_fn=args.muon_adjust_lr,
        ns_dtype=resolve_ns_dtype(args.muon_ns_dtype, device),
        nora_lr=args.nora_lr,
        nora_weight_decay=args.resolved_nora_weight_decay,
        nora_beta=args.nora_beta,
        nora_momentum=args.nora_momentum,
        mano_momentum=args.mano_momentum,
        mano_nesterov=args.mano_nesterov,
        muon_spread_replicated=resolve_spread_replicated(args.muon_spread_replicated, device.type),
    )


@dataclass(frozen=True)
class ParameterSummary:
    """What trains: parameter counts, the optimizer's groups and its state's size, the adapters."""

    total: int
    trainable: int
    optimizer: str
    groups: str
    """Each non-empty group: its part, tensors, learning rate and decay."""
    state_bytes: int
    """The optimizer state's bytes, all ranks together."""
    lora: str | None
    """The adapters (rank, scale, targets), or None without LoRA."""
    quantize: str | None = None
    """The 4-bit base (QLoRA: what is quantised, its bytes, what is kept), or None."""

    def describe(self) -> str:
        line = f"{self.total:,} parameters"
        if self.trainable != self.total:
            line += f", {self.trainable:,} trainable ({self.trainable / self.total:.2%})"
        return (
            f"{line}; optimizer {self.optimizer}: {self.groups}; state {self.state_bytes / 2**20:,.1f} MiB "
            "(all ranks together)"
        )

    def counts(self) -> dict[str, int]:
        """The numbers ``metric.jsonl``'s ``parameters`` entry records."""
        return {
            "trainable_parameters": self.trainable,
            "total_parameters": self.total,
            "optimizer_state_bytes": self.state_bytes,
        }


def summarize_parameters(model: nn.Module, args: TrainArgs, precision: str, num_shards: int = 1) -> ParameterSummary:
    """The parameters of the run's whole model, built from its config on the meta device (``models.meta_model``: a
    rank holds a pipeline stage's blocks or an expert group's experts only), under ``args``' optimizer;
    ``precision``: the run's (its parameters' dtype, so the optimizer state's; the bytes a quantised weight would
    otherwise take). The run prints and records these, and its dry run plans with them."""
    optim_args = OptimArgs(
        args.resolved_optimizer,
        args.max_lr,
        args.weight_decay,
        nora_lr=args.nora_lr,
        nora_weight_decay=args.resolved_nora_weight_decay,
    )
    groups = optimizer_groups(model, optim_args)  # one walk of the model for both (DeepSeek-V3: 45,000 tensors)
    # The state is held in each parameter's dtype in the run: the precision's for the model's own weights (bfloat16
    # under bf16-true), float32 for LoRA's adapters; here every parameter is float32.
    weight_bytes = 2 if precision in ("bf16-true", "16-true") else 4
    adapters_of = {id(p) for _, layer in lora.lora_layers(model) for p in (layer.lora_A, layer.lora_B)}
    described = ", ".join(
        f"{g.part} {len(g.params)} tensors (lr {g.lr:g}, decay {g.weight_decay:g})" for g in groups if g.params
    )
    adapters = None
    if (spec := lora_spec(args)) is not None:
        adapters = (
            f"r={spec.r}, alpha={spec.alpha}, dropout {spec.dropout}, init {spec.init}, on {','.join(spec.targets)} "
            f"({len(adapters_of) // 2} linear layers); base weights frozen, adapters float32"
        )
        if args.resolved_optimizer == "muon_adamw":
            adapters += "; note: Muon on LoRA's r x d factors is untested (adamw is the LoRA default)"
    quantized = None
    if args.quantize is not None:
        float_bytes = 2 if precision in ("bf16-true", "16-true") else 4
        quantized = plan_quantization(model, num_shards).describe(float_bytes)
    return ParameterSummary(
        total=model.num_parameters(),
        trainable=model.num_parameters(trainable_only=True),
        optimizer=args.resolved_optimizer,
        groups=described,
        state_bytes=optimizer_state_bytes(
            groups, lambda p: lora.ADAPTER_DTYPE.itemsize if id(p) in adapters_of else weight_bytes
        ),
        lora=adapters,
        quantize=quantized,
    )


def describe_data(args: TrainArgs, num_training_samples: int, summary: str, val_set: Sized | None) -> str:
    """The plan's ``data`` line: the samples trained on, what they are, and those held out for validation; the
    summary's later lines (``packing: ...``, warnings) after it."""
    held_out = f", {len(val_set):,} held out for validation every {args.val_step} steps" if val_set else ""
    first, *rest = summary.split("\n")
    return "\n".join([f"{num_training_samples:,} samples: {first}{held_out}", *rest])


def _data_rows(data: str) -> list[tuple[str, str]]:
    """The ``data`` row (warnings on the lines after it, as the summary has them) and the ``packing`` row, from
    ``describe_data``'s text."""
    first, *rest = data.split("\n")
    packing = [line.removeprefix(PACKING_LINE) for line in rest if line.startswith(PACKING_LINE)]
    others = [line for line in rest if not line.startswith(PACKING_LINE)]
    return [("data", "\n".join([first, *others])), *(("packing", line) for line in packing)]


def describe_window(args: TrainArgs, start: Start) -> str | None:
    """The plan's ``window`` line where the default window is not the model's ``max_position_embeddings`` (a model
    from Hugging Face: ``config.train.default_window_size``); None elsewhere."""
    positions = start.model_config.max_position_embeddings
    if args.window_size is not None or start.window_size is None or start.window_size >= positions:
        return None
    return (
        f"{start.window_size} tokens: the model's max_position_embeddings {positions:,} capped at "
        f"{HF_DEFAULT_WINDOW} for a model from Hugging Face (TRL's max_length default); --window_size sets it"
    )


def describe_preference(args: TrainArgs, start: Start | None) -> str | None:
    """The plan's ``preference`` line of dpo and kto: the loss and its settings, the beta as read (and the flag it
    was read from) and the frozen reference model; None for the other train types."""
    if args.train_type == "dpo":
        settings = {
            "robust": f"label smoothing {args.dpo_label_smoothing:g}",
            "simpo": f"gamma {args.simpo_gamma:g}, label smoothing {args.dpo_label_smoothing:g}",
            "cpo": f"alpha {args.cpo_alpha:g}, label smoothing {args.dpo_label_smoothing:g}",
            "orpo": f"lambda {args.orpo_beta:g}",
        }.get(args.dpo_loss)
        words = f"dpo loss {args.dpo_loss}" + (f" ({settings})" if settings else "")
    elif args.train_type == "kto":
        weights = f"desirable weight {args.kto_desirable_weight:g}, undesirable {args.kto_undesirable_weight:g}"
        words = f"kto ({weights})"
    else:
        return None
    if args.train_type == "kto" or args.dpo_loss != "orpo":  # orpo has no beta: its lambda is above
        flag = args.beta_flag if getattr(args, args.beta_flag) is not None else "dpo_beta"
        read = f"--{flag}" + (f", {args.beta_flag} unset" if flag != args.beta_flag else "")
        words += f", beta {args.preference_beta:g} ({read})"
    if args.train_type == "dpo" and args.dpo_loss in REFERENCE_FREE:
        return f"{words}; no reference model (reference-free: chosen against rejected alone)"
    return f"{words}; reference model: {describe_reference(args, start)}"


def describe_reference(args: TrainArgs, start: Start | None) -> str:
    """Where dpo's and kto's frozen reference comes from, by ``train.start.reference_model``'s rules (its meta.json
    entry is what tests compare this with)."""
    if args.lora_r:
        base = start.lora_base if start is not None else args.param_path
        return f"the base weights {base} (the trained network, its LoRA adapters off)"
    if args.reference_path is not None:
        return f"{args.reference_path} (--reference_path)"
    if start is None:
        return "the run's starting weights"
    if start.resume is not None and "reference" in start.resume.meta:
        recorded = start.resume.meta["reference"]
        path = recorded.get("param_path") or f"AstrAI's init, seed {recorded.get('random_seed')}"
        return f"{path} (where the run started: {start.resume.path.name}/meta.json records it)"
    if start.resume is not None:
        return f"the resumed policy {start.resume.path} (AstrAI's checkpoint records no reference: AstrAI's rule)"
    if start.weights is not None:
        return f"{start.weights.path} (the starting weights, frozen)"
    return f"AstrAI's init, seed {args.random_seed} (the policy's starting point, frozen)"


def describe_schedule(args: TrainArgs, scheduler: Any) -> str:
    """The plan's ``schedule`` line (``scheduler`` is one of ``schedule.py``'s)."""
    return f"{scheduler.describe()}, peak learning rate {args.max_lr}"


def describe_features(args: TrainArgs, start: Start | None = None) -> str | None:
    """The plan's ``training`` line: each option on that changes how a step trains, stores or checkpoints (LoRA,
    HSDP's layout and profiling have lines of their own), and the fused loss with why it was chosen
    (``Start.loss_chunk_size``); None when all are at their defaults."""
    loss_chunk_size = start.loss_chunk_size(args) if start is not None else 0
    fused_why = loss_chunk_reason(args.loss_chunk_size, start.fused_loss_is_faster(args)) if loss_chunk_size else ""
    on = [
        _reward_model_loss(args) if args.train_type == "reward_model" else None,
        f"NEFTune (alpha {args.neftune_alpha:g})" if args.neftune_alpha else None,
        f"label smoothing {args.label_smoothing:g}" if args.label_smoothing else None,
        f"loss fused with the head, {loss_chunk_size} positions at a time ({fused_why})" if loss_chunk_size else None,
        "gradient checkpointing" if args.gradient_checkpointing else None,
        f"torch.compile ({args.compile})" if args.compile else None,
        "FSDP: gradients reduced each micro-batch" if args.fsdp_sync_each_micro_batch else None,
        "FSDP: reshard after forward" if args.fsdp_reshard_after_forward else None,
        f"FSDP: compute in {args.fsdp_param_dtype}" if args.fsdp_param_dtype else None,
        f"FSDP: reduce in {args.fsdp_reduce_dtype}" if args.fsdp_reduce_dtype else None,
        "FSDP: CPU offload" if args.fsdp_cpu_offload else None,
        f"tensor parallel over {args.tp_size} ranks" if (args.tp_size or 1) > 1 else None,
        "sharded checkpoints" if args.sharded_checkpoint else None,
        f"keep the last {args.keep_last_k} checkpoints" if args.keep_last_k is not None else None,
    ]
    return ", ".join(item for item in on if item) or None


def _reward_model_loss(args: TrainArgs) -> str:
    centred = f", centred (coef {args.reward_center_coef:g})" if args.reward_center_coef else ""
    return f"reward model: a score head read at each sequence's last token, Bradley-Terry loss{centred}"


def describe_processes(
    world_size: int, devices: int, parallel_mode: str, layout: str | None, accelerator: str, precision: str
) -> str:
    """The plan's ``processes`` line: ranks, nodes, strategy (and FSDP's layout), device and precision."""
    mode = parallel_mode if world_size > 1 else "single device"
    return (
        f"{world_size} ({devices} per node x {world_size // devices} node(s)), parallel_mode {mode}"
        + (f" ({layout})" if layout is not None else "")
        + f", {accelerator}, precision {precision}"
    )


def describe_recipes(paths: list[str]) -> str:
    """The plan's ``recipe`` line: each ``--config`` file in the order merged (a later one's keys win)."""
    if len(paths) == 1:
        return paths[0]
    return ", then ".join(paths) + " (merged in this order: a later file's keys win; flags over all)"


def describe_plan(
    args: TrainArgs,
    *,
    dry_run: bool,
    processes: str,
    start: Start | None,
    parameters: ParameterSummary | None,
    data: str | None,
    steps: StepPlan | None,
    schedule: str | None,
    schedule_note: str | None,
    loader: str,
    cpu_threads: str | None,
    position: RunPosition | None = None,
    fetched: list[str] = (),
    muon: str | None = None,
    cluster: ClusterPlan | None = None,
) -> str:
    """The plan as printed: one labelled line per part, in the order a run goes. A part given as None is left out
    (the dry run could not work it out: it lists why beneath). ``position``: where the run starts (default: the
    beginning); ``fetched``: the dry run's words for the Hub ids the run would download first; ``muon``: how Muon's
    iteration is shared among several ranks (``optim.muon_owners.planned_layout``), shown with ``muon_adamw``;
    ``cluster``: the footprint per rank and the communication per step (``train.footprint_plan``)."""
    rows: list[tuple[str, str]] = [("processes", processes), *(("hub", line) for line in fetched)]
    if args.config:
        rows.insert(0, ("recipes" if len(args.config) > 1 else "recipe", describe_recipes(args.config)))
    if start is not None:
        weights = start.weights.path if start.weights is not None else f"none: AstrAI's init, seed {args.random_seed}"
        rows.append(("model", f"{assets.resolve(args.param_path)}: weights {weights}"))
        if routing := describe_routing(start.model_config):
            rows.append(("routing", routing))
        if (args.cp_size or 1) > 1:
            context = describe_context_parallel(start.model_config, args.cp_size, args.tp_size or 1)
            if args.train_type != "seq" and not (args.train_type == "sft" and args.packing):
                context += f"; samples padded to a multiple of {args.cp_size} positions (untrained, unseen)"
            rows.append(("context", context))
        if (args.ep_size or 1) > 1 and start.model_config.num_moe_layers:
            rows.append(("experts", describe_expert_parallel(start.model_config, args.ep_size)))
        if (args.pp_size or 1) > 1:
            with contextlib.suppress(UserError):  # the preflight names a model the stages cannot split
                pipeline = describe_pipeline(
                    start.model_config, args.pp_size, args.num_stages_per_rank, args.pp_schedule, args.grad_accum_steps
                )
                rows.append(("pipeline", pipeline))
    if parameters is not None:
        rows.append(("parameters", parameters.describe()))
        if muon is not None and args.resolved_optimizer == "muon_adamw":
            rows.append(("muon", muon))
        if parameters.lora is not None:
            rows.append(("lora", parameters.lora))
        if parameters.quantize is not None:
            rows.append(("quantize", parameters.quantize))
    if cluster is not None:
        for label, text in (("memory", describe_memory(cluster)), ("comms", describe_comms(cluster))):
            lines = text.split("\n") if text else []
            rows += [(label if i == 0 else "", line) for i, line in enumerate(lines)]
    if start is not None:
        if start.tokenizer is not None:
            tokenizer = f"{start.tokenizer.directory} ({start.tokenizer.vocab_size:,} ids)"
        else:
            tokenizer = f"none ({start.no_tokenizer}); checkpoints will carry none"
        rows.append(("tokenizer", tokenizer))
        if start.resume is not None:
            where = f"from {start.resume.path}"
            if position is not None and steps is not None:
                where += (
                    f" at step {position.optimizer_step}, epoch {position.epoch}, sample {position.sample_index} of "
                    f"{steps.samples_per_rank} per rank"
                )
            rows.append(("resume", where))
    if start is not None and (window := describe_window(args, start)):
        rows.append(("window", window))
    if data is not None:
        rows += _data_rows(data)
    if preference := describe_preference(args, start):
        rows.append(("preference", preference))
    if steps is not None:
        rows += steps.describe(position, args.max_tokens)
    if schedule is not None:
        rows.append(("schedule", schedule))
        if schedule_note:
            rows.append(("", schedule_note))
    rows.append(("loader", loader))
    if cpu_threads is not None:
        rows.append(("cpu threads", cpu_threads))
    if features := describe_features(args, start):
        rows.append(("training", features))
    last_step = steps.last_step(position) if steps is not None else args.max_steps  # None: the dry run can't tell
    if profiling := describe_profiling(args.profile_step_range, args.ckpt_dir, last_step):  # warns of steps past it
        rows.append(("profiling", profiling))
    rows.append(
        (
            "outputs",
            f"{Path(args.ckpt_dir).resolve()}: epoch_E_step_S/ every {args.ckpt_interval} steps and at the end"
            f"{', sharded state/' if args.sharded_checkpoint else ''}; recipe.yaml, logs/, plot.png",
        )
    )
    title = f"plan for `astrai-fabric {args.train_type}`" + (
        " (dry run: nothing is trained or written)" if dry_run else ""
    )
    return "\n".join([title, *(f"  {label:<12} {text}" for label, text in rows)])
