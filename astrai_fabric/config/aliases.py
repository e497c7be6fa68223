"""Other projects' names for the training flags. ``ALIASES``: the Hugging Face ``TrainingArguments``/TRL names (and
a few others) that mean what one of ours means, read as ours on the command line and in recipes; ``NOT_TAKEN``:
names that look like ours but mean something we do not do, or do under another flag, each answered with what to
use instead. The CLI reads both before anything heavy is imported, so a mistaken flag is refused at once;
docs/coming-from-trl.md ("Flag names") shows the same tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Alias:
    """Another project's name for one of our flags."""

    flag: str
    """Ours: the ``TrainArgs`` field it sets."""
    origin: str
    """Whose name it is (``transformers``, ``TRL``, ``Lightning``, ``AstrAI``)."""
    values: dict[str, str] = field(default_factory=dict)
    """Their values spelled as ours (``--bf16 true`` is ``--precision bf16-mixed``), where those differ; empty: the
    value is ours as given. A value not listed is refused with ``expected`` (and ``unlisted``'s hint if it has one)."""
    expected: str = ""
    """What a value not in ``values`` is told (``unlisted`` says more for some)."""
    unlisted: dict[str, str] = field(default_factory=dict)
    """Values of theirs we do not take, each with what to give instead."""
    whole_number: str = ""
    """Non-empty where their value may be a fraction and ours counts whole steps or epochs: why a fraction is
    refused (an integral ``3.0`` is read as 3)."""
    differs: str = ""
    """How our flag's meaning differs from theirs, for the docs table; empty where it is the same."""

    @property
    def takes_bare(self) -> bool:
        """Whether the name alone (``--bf16``) means ``true``, as a boolean flag's does: their flag is a boolean."""
        return "true" in self.values


PRECISION = {"true": "bf16-mixed", "false": "32-true"}
"""transformers' ``bf16``: autocast to bfloat16 over float32 weights (Fabric's ``bf16-mixed``); off, float32."""
SCHEDULES = {"cosine": "cosine"}
"""transformers' ``lr_scheduler_type`` values we have: the same curve (warmup from 0 with ``--min_rate 0``)."""
SCHEDULES_WE_LACK = {
    "constant": "--min_rate 1 keeps any schedule at --max_lr",
    "cosine_with_restarts": "--schedule_type sgdr restarts in cycles growing --t_mult times (1: equal cycles)",
    "cosine_with_min_lr": "--schedule_type cosine with --min_rate R: its floor is max(R, cosine), not affine",
    "warmup_stable_decay": "--schedule_type wsd: its decay is quadratic, transformers' cosine by default",
}  # fmt: skip
"""transformers' schedules we do not have, each with the nearest of ours (the others: none near)."""

ALIASES: dict[str, Alias] = {
    "devices": Alias("nprocs", "Lightning"),
    "dry-run": Alias("dry_run", "AstrAI"),
    "learning_rate": Alias("max_lr", "transformers"),
    "lr": Alias("max_lr", "LitGPT"),
    "model_name_or_path": Alias("param_path", "transformers"),
    "max_length": Alias(
        "window_size", "TRL",
        differs="TRL's counts the tokens kept (max_length - 1 predicted); ours the positions read, from "
        "window_size + 1 tokens: one more predicted (TRL's cut exactly: --window_size max_length - 1)",
    ),
    "max_seq_length": Alias("window_size", "TRL (before 0.20), LitGPT", differs="as max_length's"),
    "per_device_train_batch_size": Alias(
        "batch_per_device", "transformers",
        differs="grpo: ours counts prompts (each with --group_size responses), TRL's counts responses",
    ),
    "gradient_accumulation_steps": Alias(
        "grad_accum_steps", "transformers",
        differs="the loss: each micro-batch's mean over its tokens / grad_accum_steps (AstrAI's); transformers' is the "
        "mean over every token of the step's micro-batches (equal when micro-batches hold equal token counts)",
    ),
    "num_train_epochs": Alias(
        "n_epoch", "transformers", whole_number="ours runs whole epochs (--n_epoch); for part of one, --max_steps",
    ),
    "seed": Alias("random_seed", "transformers"),
    "output_dir": Alias("ckpt_dir", "transformers"),
    "save_steps": Alias(
        "ckpt_interval", "transformers",
        whole_number="transformers reads a save_steps below 1 as a fraction of the run; --ckpt_interval counts "
        "optimizer steps",
    ),
    "save_total_limit": Alias("keep_last_k", "transformers"),
    "dataloader_num_workers": Alias(
        "num_workers", "transformers", differs="ours defaults to 4 (capped by the CPUs), transformers' to 0",
    ),
    "dataloader_pin_memory": Alias("pin_memory", "transformers"),
    "dataloader_persistent_workers": Alias("persistent_workers", "transformers", differs="ours defaults to true"),
    "ddp_timeout": Alias("dist_timeout", "transformers"),
    "lr_scheduler_type": Alias(
        "schedule_type", "transformers", values=SCHEDULES, unlisted=SCHEDULES_WE_LACK,
        expected="not one of ours: --schedule_type takes cosine (transformers' cosine), sgdr and wsd",
        differs="cosine only (sgdr and wsd are ours); its floor is --min_rate, 0.01 by default (transformers' 0)",
    ),
    "bf16": Alias(
        "precision", "transformers", values=PRECISION,
        expected="expected true or false (--precision bf16-mixed or 32-true; also auto and bf16-true)",
    ),
    "dataset_name": Alias("data_root_path", "TRL", differs="ours also takes a JSONL file or AstrAI's bin shards"),
    "dataset_config": Alias("data_subset", "TRL"),
    "dataset_train_split": Alias("data_split", "TRL"),
    "importance_sampling_level": Alias("grpo_importance_sampling_level", "TRL"),
    "delta": Alias("grpo_delta", "TRL"),
    "sapo_temperature_pos": Alias("grpo_sapo_temperature_pos", "TRL"),
    "sapo_temperature_neg": Alias("grpo_sapo_temperature_neg", "TRL"),
    "top_entropy_quantile": Alias("grpo_top_entropy_quantile", "TRL"),
    "normalize_advantages": Alias(
        "rloo_normalize_advantages", "TRL", differs="offline data: over the micro-batch's groups (no rollout to gather)"
    ),
}  # fmt: skip
"""Their name → ours. Where the meanings differ in more than a default, ``differs`` says how (docs/coming-from-trl.md);
a name whose meaning is not ours is in ``NOT_TAKEN`` instead."""

NOT_TAKEN: dict[str, str] = {
    "logging_steps": "every optimizer step is logged (stdout, metric.jsonl, --loggers): there is no interval",
    "log_interval": "every optimizer step is logged (stdout, metric.jsonl, --loggers): there is no interval",
    "logging_dir": "logs are written under --ckpt_dir (ckpt_dir/logs)",
    "report_to": "--loggers csv, tensorboard or wandb",
    "eval_steps": "--val_step, with --val_split holding out a fraction for validation",
    "eval_strategy": "--val_step, with --val_split holding out a fraction for validation",
    "per_device_eval_batch_size": "validation runs at --batch_per_device",
    "save_strategy": "a checkpoint every --ckpt_interval optimizer steps and one at the end",
    "lr_warmup_steps": "--warmup_steps",
    "lr_scheduler_kwargs": "--min_rate, --cycle_length, --t_mult, --stable_steps, --decay_steps",
    "min_lr": "--min_rate, the floor as a fraction of --max_lr",
    "optim": "--optimizer adamw, muon_adamw (the default), nora_nadamw or mano_adamw",
    "adam_beta1": "AdamW's betas are (0.9, 0.95) here, not a flag (transformers' beta2 is 0.999)",
    "adam_beta2": "AdamW's betas are (0.9, 0.95) here, not a flag (transformers' beta2 is 0.999)",
    "adam_epsilon": "AdamW's epsilon is torch's 1e-8 here, not a flag",
    "fp16": "float16 is not offered: --precision bf16-mixed (or --bf16) or 32-true",
    "tf32": "not a flag: torch's float32 matmul precision is left as it is",
    "resume_from_checkpoint": "--resume PATH, or --resume auto (the newest checkpoint under --ckpt_dir)",
    "torch_compile": "--compile default (or reduce-overhead, max-autotune)",
    "neftune_noise_alpha": "--neftune_alpha, AstrAI's Gaussian NEFTune (transformers' noise is uniform)",
    "label_smoothing_factor": "--label_smoothing (seq, sft)",
    "data_seed": "--random_seed, which seeds the sampler too",
    "use_cpu": "--device_type cpu",
    "beta": "--dpo_beta (dpo; its simpo, cpo and orpo losses: --simpo_beta, --cpo_beta, --orpo_beta), --kto_beta (kto)",
    "loss_type": "--dpo_loss (dpo) or --grpo_loss (grpo)",
    "num_generations": "--group_size (grpo's responses per prompt)",
    "max_completion_length": "--rollout_max_tokens (online grpo and dpo)",
    "max_prompt_length": "--window_size bounds prompt and response together",
    "temperature": "--rollout_temperature (online grpo and dpo)",
    "use_peft": "--lora_r R (R > 0) trains LoRA adapters",
    "lora_target_modules": "--lora_targets",
    "load_in_4bit": "--quantize nf4 (QLoRA, with --lora_r)",
    "micro_batch_size": "--batch_per_device",
    "global_batch_size": "not a flag: --batch_per_device x --grad_accum_steps x the data-parallel ranks",
    "epochs": "--n_epoch",
    "out_dir": "--ckpt_dir",
    "checkpoint_dir": "--param_path (the model to start from; --ckpt_dir is where the run writes)",
    "save_interval": "--ckpt_interval",
    "assistant_only_loss": "sft trains every assistant turn whole, its role header included, and masks system and "
    "user turns (the chat template's roles, AstrAI's); TRL's marks the tokens its template's generation blocks "
    "cover, without the header: a few tokens a turn apart",
    "completion_only_loss": "sft trains the completion of prompt/completion records and masks the prompt, always "
    "(TRL's default); seq trains every token",
    "dataset_text_field": "seq reads the column text; another: --data_columns text=COLUMN (any shape's field, "
    "e.g. prompt=question)",
    "torch_dtype": "the weights load in the run's dtype: --precision bf16-true for bfloat16, float32 otherwise",
    "dtype": "the weights load in the run's dtype: --precision bf16-true for bfloat16, float32 otherwise",
    "eos_token": "the tokenizer's own end-of-sequence token (its tokenizer_config.json); --tokenizer_path for "
    "another tokenizer",
}  # fmt: skip
"""Names we do not take, each answered with what to give instead (the CLI's suggestion for an unknown flag or recipe
key, before the closest spelling)."""


WHOLE_NUMBERS = {
    "warmup_steps": "transformers 5 reads a warmup_steps below 1 as a fraction of the run, which is --warmup_ratio "
    "here; --warmup_steps counts optimizer steps",
}
"""Our flags spelled as transformers spells its own, where its value may be a fraction and ours may not: why a
fraction is refused (checked like an alias's ``whole_number``)."""


def alias_problem(name: str, value: object) -> tuple[object, str | None]:
    """``value`` given for ``ALIASES[name]`` spelled as ours, and None; or the value and what is wrong with it (the
    words after ``--name VALUE: ``). ``value`` is a command line's string or a recipe's YAML value."""
    alias = ALIASES[name]
    if alias.values:
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if text in alias.values:
            return alias.values[text], None
        return value, f"not one of ours; {alias.unlisted[text]}" if text in alias.unlisted else alias.expected
    if alias.whole_number:
        return whole_number(value, alias.whole_number)
    return value, None


def whole_number(value: object, why: str) -> tuple[object, str | None]:
    """An integral ``value`` (``3``, ``3.0``, ``"3.0"``) as ours reads it, or the value and why a fraction is refused
    (``why``). Anything else passes as given, for the parser to name."""
    if isinstance(value, bool) or not isinstance(value, str | float):  # an int is whole already (and may be huge)
        return value, None
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        return value, None
    if number.is_integer():
        return (str(int(number)) if isinstance(value, str) else int(number)), None
    return value, f"a fraction; {why}"
