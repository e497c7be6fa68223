"""The checks ``TrainArgs.validate`` runs after each value's kind, one per section of its fields (their ranges
and their agreement with the other flags), each a list of one-line problems. A base class of ``TrainArgs``, which
holds the fields they read: the flags and their docstrings in one module, what is wrong with them in this one.

Nothing here imports torch where the defaults are checked (a mistaken flag is refused before torch loads,
tests/test_startup.py): the checks of options that need another part import it when those options are given.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

from astrai_fabric.config.combinations import dimension_problem, knob_problem
from astrai_fabric.config.devices import parse_device_memory
from astrai_fabric.config.lora import TARGETS, check_scaling
from astrai_fabric.config.pipeline import INTERLEAVED_SCHEDULES
from astrai_fabric.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38
"""``torch.finfo(torch.float32).max`` (tests/test_startup.py holds them equal): a finite float past it is inf in the
optimizer."""
MAX_WORKERS, MAX_THREADS = 256, 1024
"""The most loader workers and CPU threads per rank a run may ask for (the largest machines have a few hundred
CPUs)."""
KNOWN_METRICS = (
    "loss", "lr", "grad_norm", "grad_snr", "val_loss", "moe_aux_loss", "router_entropy", "dead_expert_fraction",
    "load_imbalance_mean", "load_imbalance_max", "tokens_per_sec", "samples_per_sec", "mfu",
)  # fmt: skip
"""Names ``--metrics`` accepts: AstrAI's, plus throughput (``tokens_per_sec``, ``samples_per_sec``, ``mfu``)."""
POSITIVE = (
    "n_epoch", "batch_per_device", "grad_accum_steps", "ckpt_interval", "val_step", "nprocs", "num_nodes",
    "muon_ns_steps", "rollout_interval", "rollout_max_tokens", "group_size", "t_mult", "grpo_num_iterations",
)  # fmt: skip
"""Counts of at least 1."""
OPTIONAL_POSITIVE = (
    "window_size", "stride", "max_steps", "stop_after_steps", "max_tokens", "tp_size", "cycle_length",
    "keep_last_k", "num_threads", "fsdp_shard_size", "cp_size", "ep_size", "pp_size", "pp_stages_per_rank",
)  # fmt: skip
"""Counts of at least 1, or None (unset)."""
NON_NEGATIVE = (
    "neftune_alpha", "moe_aux_loss_coef", "weight_decay", "label_smoothing", "rollout_top_k",
    "start_epoch", "start_samples", "max_lr", "max_bad_steps", "nora_lr",
)  # fmt: skip
"""Amounts of at least 0."""
MAX_LOCAL_RANKS, MAX_NODES, MAX_WORLD_SIZE = 4_096, 100_000, 100_000
"""The most ranks per machine, machines and ranks a run or its plan may ask for: past the largest clusters built
(~100,000 accelerators), and what the planner is measured to plan within its stated time (bench/planner.py)."""
MAX_SEED = 2**32 - 1
"""The largest ``--random_seed``: numpy's seeds are 32-bit, and the run seeds numpy with it (negative ones neither)."""
SPELLED = {"nprocs": "nprocs (devices)"}
"""A field's name in messages where users also spell it another way (the CLI's aliases: ``--devices``)."""


class TrainChecks:
    """``TrainArgs``' checks by section (``TrainArgs.validate`` joins them)."""

    def _range_problems(self) -> list[str]:
        """The ranges many fields share: finite floats (in float32 too: a rate of 1e39 is inf in the optimizer),
        positive counts, non-negative amounts."""
        largest = FLOAT32_MAX
        values = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        problems = [
            f"{name} must be a finite number, got {value}"
            for name, value in values
            if isinstance(value, float) and not abs(value) <= largest
        ]
        problems += [
            f"{SPELLED.get(name, name)} must be positive, got {getattr(self, name)}"
            for name in POSITIVE
            if getattr(self, name) < 1
        ]
        problems += [
            f"{name} must be positive, got {getattr(self, name)}"
            for name in OPTIONAL_POSITIVE
            if getattr(self, name) is not None and getattr(self, name) < 1
        ]
        problems += [
            f"{name} must be >= 0, got {getattr(self, name)}" for name in NON_NEGATIVE if getattr(self, name) < 0
        ]
        if not 0 <= self.random_seed <= MAX_SEED:  # Lightning's seed_everything seeds numpy too, which takes these
            problems.append(f"random_seed must be between 0 and {MAX_SEED:,}, got {self.random_seed:,}")
        return problems

    def _data_problems(self) -> list[str]:
        problems = []
        if self.data_root_path is None:
            problems.append("data_root_path is required")
        if self.data_split is not None and not re.fullmatch(r"\w+(\.\w+)*", self.data_split):
            problems.append(f"data_split must be a split name (letters, digits, _ and .), got {self.data_split!r}")
        if self.data_subset is not None and (not self.data_subset.strip() or not self.data_subset.isprintable()):
            problems.append(f"data_subset must be a subset name, got {self.data_subset!r}")
        if self.param_path is None:
            problems.append("param_path is required")
        if self.val_split is not None and not 0 < self.val_split < 1:
            problems.append(f"val_split must be in (0, 1), got {self.val_split}")
        if self.num_workers is not None and self.num_workers < 0:
            problems.append(f"num_workers must be >= 0, got {self.num_workers}")
        # Upper bounds no machine needs to pass: each worker is a process, each thread an OS thread (a million of
        # them exhausted the process limit inside the tokenizer's thread pool: a Rust panic, not a message).
        for name, most in (("num_workers", MAX_WORKERS), ("num_threads", MAX_THREADS)):
            if (getattr(self, name) or 0) > most:
                problems.append(f"{name} must be at most {most}, got {getattr(self, name)}")
        problems += self._packing_problems()
        if self.data_format != "auto" or self.data_columns is not None:  # the defaults need no check (nor torch)
            from astrai_fabric.data.shapes import settings_problems  # imports data/, and so torch

            problems += settings_problems(self.train_type, self.data_format, self.data_columns)
        return problems

    def _packing_problems(self) -> list[str]:
        """``packing false`` is sft's: seq has windows only, the others read one sample per record already."""
        if self.packing:
            return []
        if self.train_type == "seq":
            return ["packing false applies to sft: seq trains one token stream cut into windows, its only mode"]
        if self.train_type not in (None, "sft"):
            return [
                f"packing false applies to sft: {self.train_type} trains one sample per record already (cut to "
                "window_size); drop --packing"
            ]
        if self.stride is not None:
            return ["stride applies to packed windows; packing false reads each record from its start: drop --stride"]
        return []

    def _optimizer_problems(self) -> list[str]:
        problems = [
            f"{name} must be in [0, 1], got {getattr(self, name)}"
            for name in ("muon_momentum", "nora_momentum", "mano_momentum")
            if not 0 <= getattr(self, name) <= 1
        ]
        if not 0 <= self.nora_beta < 1:
            problems.append(f"nora_beta must be in [0, 1), got {self.nora_beta}")
        if self.nora_weight_decay is not None and self.nora_weight_decay < 0:
            problems.append(f"nora_weight_decay must be >= 0, got {self.nora_weight_decay}")
        if not self.max_grad_norm > 0:
            problems.append(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        return problems

    def _schedule_problems(self) -> list[str]:
        problems = [
            f"{name} must be >= 0, got {getattr(self, name)}"
            for name in ("stable_steps", "decay_steps")
            if getattr(self, name) is not None and getattr(self, name) < 0
        ]
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio <= 1:
            problems.append(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            problems.append(
                f"warmup_steps {self.warmup_steps} and warmup_ratio {self.warmup_ratio} both set the warmup: give one"
            )
        if self.min_rate is not None and not 0 <= self.min_rate <= 1:
            problems.append(f"min_rate must be in [0, 1], got {self.min_rate}")
        return problems

    def _loss_problems(self) -> list[str]:
        problems = []
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            problems.append(f"loss_chunk_size must be >= 0 (0: off), got {self.loss_chunk_size}")
        if not 0 <= self.label_smoothing < 1:
            problems.append(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        return problems

    def _rollout_problems(self) -> list[str]:
        """grpo's: its sampling, its rewards, its loss's options."""
        problems = []
        if not 0 < self.rollout_top_p <= 1:
            problems.append(f"rollout_top_p must be in (0, 1], got {self.rollout_top_p}")
        if self.rollout_temperature <= 0:
            problems.append(f"rollout_temperature must be > 0, got {self.rollout_temperature}")
        if self.reward is not None:
            from astrai_fabric.rewards import reward_spec_problem  # imports torch: only when a reward is named

            if problem := reward_spec_problem(self.reward, self.trust_code):
                problems.append(problem)
        if self.reward is not None and self.reward_model is not None:
            problems.append("reward and reward_model both score rollouts: pass one of them")
        if self.grpo_clip_eps_high is not None and not self.grpo_clip_eps_high > 0:
            problems.append(f"grpo_clip_eps_high must be > 0 (or unset: grpo_clip_eps), got {self.grpo_clip_eps_high}")
        if self.grpo_scale_rewards != "group" and self.grpo_loss == "astrai":
            problems.append(
                f"grpo_scale_rewards {self.grpo_scale_rewards} applies to --grpo_loss grpo, bnpo, dr_grpo and dapo "
                "(TRL's advantages); astrai keeps AstrAI's group normalisation"
            )
        problems += self._grpo_method_problems()
        if self.grpo_num_iterations > 1 and self.train_type not in (None, "grpo"):
            problems.append(
                f"grpo_num_iterations {self.grpo_num_iterations} applies to online grpo, not {self.train_type}"
            )
        return problems

    def _grpo_method_problems(self) -> list[str]:
        """GSPO, SAPO, two-sided clipping and RLOO: their values, and which combine (as TRL 1.16's do)."""
        problems = []
        for name in ("grpo_sapo_temperature_pos", "grpo_sapo_temperature_neg", "grpo_delta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                problems.append(f"{name} must be > 0, got {value}")
        if self.grpo_delta is not None and self.grpo_loss == "sapo":
            problems.append("grpo_delta clips the ratio of the clipped losses; --grpo_loss sapo clips nothing")
        trl_only = "TRL's losses (grpo, bnpo, dr_grpo, dapo, sapo); astrai is AstrAI's token-level loss"
        if self.grpo_importance_sampling_level == "sequence" and self.grpo_loss == "astrai":
            problems.append(
                f"grpo_importance_sampling_level sequence (GSPO) applies to {trl_only}: add --grpo_loss grpo"
            )
        if self.grpo_delta is not None and self.grpo_loss == "astrai" and self.grpo_advantage == "group":
            problems.append(f"grpo_delta applies to {trl_only}")
        if not 0 < self.grpo_top_entropy_quantile <= 1:
            problems.append(f"grpo_top_entropy_quantile must be in (0, 1], got {self.grpo_top_entropy_quantile}")
        elif self.grpo_top_entropy_quantile < 1 and self.grpo_loss == "astrai" and self.grpo_advantage == "group":
            problems.append(f"grpo_top_entropy_quantile applies to {trl_only}")
        if self.grpo_advantage == "rloo":
            changed = [
                flag
                for flag, default in (
                    ("grpo_loss", "astrai"),
                    ("grpo_importance_sampling_level", "token"),
                    ("grpo_scale_rewards", "group"),
                    ("grpo_delta", None),
                    ("grpo_top_entropy_quantile", 1.0),
                )
                if getattr(self, flag) != default
            ]
            if changed:
                problems.append(
                    "grpo_advantage rloo is RLOO whole (TRL's RLOOTrainer: its advantages, KL and objective), "
                    f"which {', '.join(changed)} would change: leave them unset"
                )
            if self.group_size < 2:
                problems.append(
                    f"grpo_advantage rloo needs group_size >= 2 (a leave-one-out baseline), got {self.group_size}"
                )
        elif self.rloo_normalize_advantages or self.reward_clip_range is not None:
            problems.append("rloo_normalize_advantages and reward_clip_range apply to --grpo_advantage rloo")
        if self.reward_clip_range is not None and (
            len(self.reward_clip_range) != 2 or not self.reward_clip_range[0] <= self.reward_clip_range[1]
        ):
            problems.append(
                f"reward_clip_range must be [low, high] with low <= high, got {list(self.reward_clip_range)}"
            )
        return problems

    def _parallel_problems(self) -> list[str]:
        problems = [
            f"{SPELLED.get(name, name)} must be at most {most:,}, got {getattr(self, name):,}"
            for name, most in (("nprocs", MAX_LOCAL_RANKS), ("num_nodes", MAX_NODES))
            if getattr(self, name) > most
        ]
        if not problems and self.nprocs * self.num_nodes > MAX_WORLD_SIZE:
            problems.append(
                f"nprocs x num_nodes must be at most {MAX_WORLD_SIZE:,} ranks, got {self.nprocs * self.num_nodes:,}"
            )
        if not self.dist_timeout > 0:
            problems.append(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if problem := dimension_problem("tp", self.tp_size or 1, self.parallel_mode, self.train_type):
            problems.append(problem)
        problems += self._context_parallel_problems()
        problems += self._expert_parallel_problems()
        problems += self._pipeline_problems()
        if self.fsdp_shard_size is not None and self.parallel_mode != "fsdp":
            problems.append(f"fsdp_shard_size needs parallel_mode fsdp, got {self.parallel_mode}")
        if self.sharded_checkpoint and self.parallel_mode != "fsdp":
            problems.append(f"sharded_checkpoint needs parallel_mode fsdp, got {self.parallel_mode}")
        if self.device_type not in (None, "cpu", "cuda"):
            problems.append(f"device_type must be cpu or cuda, got {self.device_type!r}")
        if self.device_memory is not None:
            try:
                parse_device_memory(self.device_memory)
            except ConfigError as err:
                problems.append(str(err))
        return problems

    def _context_parallel_problems(self) -> list[str]:
        """``--cp_size``: with FSDP, on windows it splits (samples padded to their batch's longest are padded on to
        a length it splits: ``model.context_parallel.pad_window``; the model's heads are checked where the model is
        known: ``check_context_parallel``)."""
        cp_size = self.cp_size or 1
        if cp_size == 1:
            return []
        if problem := dimension_problem("cp", cp_size, self.parallel_mode, self.train_type):
            return [problem]
        problems = []
        if self.window_size is not None and self.window_size % cp_size:
            problems.append(f"cp_size {cp_size} must divide window_size {self.window_size} (each rank's share)")
        if self.neftune_alpha:
            problems.append(knob_problem("cp", cp_size, "neftune_alpha"))
        return problems

    def _expert_parallel_problems(self) -> list[str]:
        """``--ep_size``: with FSDP (the model's experts are checked where it is known: ``check_expert_parallel``;
        the ranks by ``mesh.mesh_layout``)."""
        ep_size = self.ep_size or 1
        if ep_size == 1:
            return []
        problem = dimension_problem("ep", ep_size, self.parallel_mode, self.train_type)
        return [problem] if problem else []

    def _pipeline_problems(self) -> list[str]:
        """``--pp_size``: with FSDP, for seq and sft on windows of one shape (the ranks by ``mesh.mesh_layout``, the
        model's layers where it is known: ``model.pipeline.stage_layers``)."""
        pp_size = self.pp_size or 1
        if pp_size == 1:
            if (self.pp_stages_per_rank or 1) > 1:
                return [f"pp_stages_per_rank {self.pp_stages_per_rank} needs pipeline stages: set --pp_size"]
            return []
        if problem := dimension_problem("pp", pp_size, self.parallel_mode, self.train_type):
            return [problem]
        problems = []
        micro = self.grad_accum_steps
        if self.pp_schedule == "1f1b" and micro < pp_size:
            problems.append(
                f"pp_schedule 1f1b needs grad_accum_steps (the pipeline's micro-batches) >= pp_size {pp_size}, got "
                f"{micro}: raise it, or use --pp_schedule gpipe"
            )
        rounds = max(1, micro // pp_size)  # torch's interleaved 1F1B runs its micro-batches in rounds of equal size
        if self.pp_schedule == "interleaved_1f1b" and micro % rounds:
            problems.append(
                f"pp_schedule interleaved_1f1b runs grad_accum_steps {micro} in {rounds} rounds of equal size "
                f"(grad_accum_steps // pp_size), which must divide it: use a multiple of pp_size {pp_size}"
            )
        if self.num_stages_per_rank > 1 and self.pp_schedule not in INTERLEAVED_SCHEDULES:
            problems.append(
                f"pp_stages_per_rank {self.num_stages_per_rank} with pp_schedule {self.pp_schedule}, which runs one "
                f"stage per rank: use {' or '.join(INTERLEAVED_SCHEDULES)}"
            )
        knobs = {
            "--packing false": not self.packing,
            "neftune_alpha": bool(self.neftune_alpha),
            "quantize": self.quantize is not None,
            "compile": self.compile is not None,
            "fsdp_sync_each_micro_batch": self.fsdp_sync_each_micro_batch,
        }
        return problems + [knob_problem("pp", pp_size, knob) for knob, on in knobs.items() if on]

    def _output_problems(self) -> list[str]:
        """Checkpoints, metrics, logging, profiling, resuming."""
        problems = []
        if unknown := [m for m in self.metrics if m not in KNOWN_METRICS]:
            problems.append(f"metrics {unknown} are unknown; choose from {list(KNOWN_METRICS)}")
        if self.peak_flops is not None and self.peak_flops <= 0:
            problems.append(f"peak_flops must be positive, got {self.peak_flops}")
        if self.profile_steps is not None and self.profile_step_range is None:
            problems.append(
                f"profile_steps must be A:B with optimizer steps 1 <= A <= B (e.g. 10:12), got {self.profile_steps!r}"
            )
        if isinstance(self.resume, str) and not self.resume:
            problems.append("resume must be true, false, auto or a checkpoint path, got ''")
        return problems

    def _preference_problems(self) -> list[str]:
        problems = self._beta_problems()
        if not 0 <= self.dpo_label_smoothing < 0.5:
            problems.append(f"dpo_label_smoothing must be in [0, 0.5), got {self.dpo_label_smoothing}")
        elif self.dpo_label_smoothing and self.dpo_loss not in (smoothed := _smoothed_losses()):
            problems.append(
                f"dpo_label_smoothing applies to --dpo_loss {', '.join(smoothed)}, not {self.dpo_loss} (which has no "
                "smoothing term); drop it or choose one of those"
            )
        if not self.cpo_alpha >= 0:
            problems.append(f"cpo_alpha must be >= 0, got {self.cpo_alpha}")
        if not self.orpo_beta > 0:
            problems.append(f"orpo_beta must be > 0, got {self.orpo_beta}")
        if not self.reward_center_coef >= 0:
            problems.append(f"reward_center_coef must be >= 0 (0: off), got {self.reward_center_coef}")
        for name in ("kto_desirable_weight", "kto_undesirable_weight"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if not math.isfinite(self.simpo_gamma):
            problems.append(f"simpo_gamma must be a finite number, got {self.simpo_gamma}")
        return problems

    def _beta_problems(self) -> list[str]:
        """Each beta > 0; a method's own beta given to another method refused (as ``dpo_label_smoothing`` is), and
        beside a ``dpo_beta`` off its default (one of the two would be ignored); ``dpo_beta`` read for simpo, cpo or
        kto (``preference_beta``) warns (FutureWarning), naming the flag to write."""
        methods = {"simpo_beta": "dpo --dpo_loss simpo", "cpo_beta": "dpo --dpo_loss cpo", "kto_beta": "kto"}
        given = {name: getattr(self, name) for name in ("dpo_beta", *methods) if getattr(self, name) is not None}
        problems = [f"{name} must be > 0, got {value}" for name, value in given.items() if not value > 0]
        own, run = self.beta_flag, f"dpo --dpo_loss {self.dpo_loss}" if self.train_type == "dpo" else self.train_type
        problems += [
            f"{name} applies to {methods[name]}, not {run}; drop it or choose that method"
            for name in methods
            if name in given and name != own and self.train_type is not None
        ]
        if own != "dpo_beta" and self.dpo_beta != type(self).dpo_beta:  # the class attribute holds the default
            if own in given:
                problems.append(
                    f"{own} {given[own]} and dpo_beta {self.dpo_beta}, its deprecated spelling, both set "
                    f"{methods[own]}'s beta; drop --dpo_beta"
                )
            elif self.dpo_beta > 0:
                message = f"--dpo_beta {self.dpo_beta:g} read as --{own}, its deprecated spelling for {methods[own]}"
                warnings.warn(f"{message}: write {own}", FutureWarning, stacklevel=4)
        return problems

    def _lora_problems(self) -> list[str]:
        problems = []
        if self.lora_r < 0:
            problems.append(f"lora_r must be >= 0 (0 = off), got {self.lora_r}")
        if self.lora_alpha <= 0:
            problems.append(f"lora_alpha must be positive, got {self.lora_alpha}")
        elif self.lora_r > 0 and (scaling := check_scaling(self.lora_alpha, self.lora_r, "lora_alpha / lora_r")):
            problems.append(scaling)
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        unknown = [t for t in self.lora_targets if t not in TARGETS]
        if unknown:
            problems.append(f"lora_targets {unknown} are unknown; choose from {list(TARGETS)} (the router never)")
        elif not self.lora_targets:
            problems.append("lora_targets is empty; name at least one of " + ", ".join(TARGETS))
        elif len(set(self.lora_targets)) != len(self.lora_targets):
            problems.append(f"lora_targets {self.lora_targets} names a layer twice")
        if self.train_type == "reward_model" and (self.lora_r or self.quantize is not None):
            problems.append(
                "reward_model trains the whole network and its score head; LoRA (lora_r, quantize) would leave the "
                "head out of the adapter's checkpoint: drop --lora_r, --quantize"
            )
        if self.quantize is not None and self.lora_r == 0:
            problems.append(
                f"quantize {self.quantize} needs lora_r > 0: a 4-bit base is frozen (QLoRA trains adapters over it); "
                "add --lora_r 16, or drop --quantize to train the whole model"
            )
        if self.lora_r > 0:
            if self.reference_path is not None:
                problems.append(
                    "reference_path cannot be combined with lora_r: the reference is the base model (the adapters "
                    "switched off); drop --reference_path"
                )
            if (self.tp_size or 1) > 1:
                problems.append(f"tp_size {self.tp_size} with lora_r: LoRA adapters are not tensor-parallel; use fsdp")
            if self.sharded_checkpoint:
                problems.append(
                    "sharded_checkpoint with lora_r: a LoRA checkpoint holds only the adapters and their (small) "
                    "optimizer state; drop --sharded_checkpoint"
                )
        return problems


def _smoothed_losses() -> tuple[str, ...]:
    """``losses.SMOOTHED``, imported (with torch) only when ``dpo_label_smoothing`` is given."""
    from astrai_fabric.losses import SMOOTHED

    return SMOOTHED
