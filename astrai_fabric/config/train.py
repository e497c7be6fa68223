"""``TrainArgs``: every training flag, flat and spelled as AstrAI's ``scripts/tools/train.py`` spells it, with
AstrAI's defaults.

The CLI exposes each field as ``--name`` and a recipe is a flat YAML of the same keys. Departures from AstrAI's
defaults are the machine-dependent ones (``device_type``, ``backend``, ``precision``); new flags follow AstrAI's
spelling. ``validate()`` reports every bad value in one ``ConfigError`` (the checks by section: ``train_checks``).
One responsibility over 300 lines: every flag with its docstring (docs/recipes.md is rendered from them) and the
resolved recipe a run writes.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml

from astrai_fabric.config.combinations import DIMENSIONS
from astrai_fabric.config.kinds import kind_problem
from astrai_fabric.config.lora import DEFAULT_TARGETS
from astrai_fabric.config.pipeline import stages_per_rank
from astrai_fabric.config.train_checks import TrainChecks
from astrai_fabric.config.train_types import TrainType
from astrai_fabric.errors import ConfigError

COMMAND_LINE_ONLY = ("trust_code", "config")
"""Flags a recipe may not set, and which resolved recipes leave out: a recipe file is data, never a way to opt into
running code (nor to name other recipes: their order is the command line's)."""
READ_BY = {
    "packing": ("sft",),
    "label_smoothing": ("seq", "sft"),
    "reference_path": ("dpo", "kto", "grpo"),
    "dpo_beta": ("dpo", "kto"),
    **dict.fromkeys(
        ("simpo_beta", "cpo_beta", "dpo_loss", "dpo_label_smoothing", "simpo_gamma", "cpo_alpha", "orpo_beta"),
        ("dpo",),
    ),
    **dict.fromkeys(("kto_beta", "kto_desirable_weight", "kto_undesirable_weight"), ("kto",)),
    "reward_center_coef": ("reward_model",),
    **dict.fromkeys(
        (
            "group_size", "grpo_clip_eps", "grpo_kl_coef", "grpo_loss", "grpo_clip_eps_high", "grpo_scale_rewards",
            "grpo_num_iterations", "grpo_importance_sampling_level", "grpo_delta", "grpo_sapo_temperature_pos",
            "grpo_sapo_temperature_neg", "grpo_top_entropy_quantile", "grpo_advantage", "rloo_normalize_advantages",
            "reward_clip_range",
        ),
        ("grpo",),
    ),
    **dict.fromkeys(
        (
            "reward", "reward_model", "trust_code", "rollout_interval", "rollout_temperature", "rollout_top_k",
            "rollout_top_p", "rollout_max_tokens",
        ),
        ("dpo", "grpo"),
    ),
    **dict.fromkeys(("pp_size", "pp_schedule", "pp_stages_per_rank"), DIMENSIONS["pp"].train_types),
}  # fmt: skip
"""The flags only some train types read (online dpo samples and rewards rollouts as online grpo does; the pipeline's,
what ``config.combinations`` says pipelines train), and those;
every other flag is every train type's. ``COMMAND --help`` lists a train type's own and the common ones; the others
are accepted everywhere (AstrAI's command line takes every flag for every train type)."""
DATA_FORMATS = (
    "auto", "text", "messages", "sharegpt", "alpaca", "prompt_completion", "preference", "implicit_preference",
    "online_prompt", "unpaired", "groups", "prompt",
)  # fmt: skip
"""``--data_format``'s values, ``data.shapes.DATA_FORMATS`` spelled out (tests/test_startup.py holds them equal):
reading the flags imports nothing of ``data/``, whose package imports torch."""

ParallelMode = Literal["none", "ddp", "fsdp"]
Precision = Literal["auto", "bf16-true", "bf16-mixed", "32-true"]
DataFormat = Literal[DATA_FORMATS]


@dataclass
class TrainArgs(TrainChecks):
    """One training run. AstrAI's flag names and defaults unless a docstring says otherwise."""

    # --- what to train -------------------------------------------------------------------------------------------
    data_root_path: str | None = None
    """Training data (required): a JSONL file, a directory of JSONL files, or AstrAI bin shards; with the
    ``datasets`` extra also parquet, arrow, CSV and JSON files and directories of them, a ``save_to_disk``
    directory, or a Hub dataset id ``org/name[@revision]`` (docs/data.md, "Sources")."""
    data_subset: str | None = None
    """The subset (``datasets``' configuration name) of a ``datasets`` source that has several; default: its only
    one (or ``default``)."""
    data_split: str | None = None
    """The split of a ``datasets`` source (``train``, ``test``, ...); default: ``train``, or its only split."""
    data_format: DataFormat = "auto"
    """The shape of the records' columns (docs/data.md, "Record shapes"): ``auto`` detects each file's from its first
    record; or ``text`` (seq), ``messages``, ``sharegpt``, ``alpaca``, ``prompt_completion`` (sft), ``preference``,
    ``implicit_preference`` (dpo), ``prompt``, ``groups`` (grpo), every record read as that one."""
    data_columns: str | None = None
    """``field=column,...``: read a shape's field from another column (torchtune's ``column_map``), e.g.
    ``instruction=question,output=answer`` or ``prompt=problem``."""
    param_path: str | None = None
    """Model directory (config.json, optional weights) or checkpoint directory (required). ``bundled:tiny`` is the
    tiny model shipped with the package; a Hub id ``org/name[@revision]`` is fetched into the Hugging Face cache and
    recorded as ``org/name@commit`` (docs/huggingface.md, "Hub ids"; also ``tokenizer_path``, ``reference_path``)."""
    reference_path: str | None = None
    """dpo/grpo: weights of the frozen reference model; default: the run's starting weights (kept across resumes)."""
    tokenizer_path: str | None = None
    """Directory with tokenizer.json and tokenizer_config.json; default: ``param_path`` (AstrAI's rule)."""
    train_type: TrainType | None = None
    """AstrAI's ``--train_type``; the subcommand sets it, and a recipe that names another type is an error."""
    config: list[str] = field(default_factory=list)
    """The recipe files (``--config`` or ``-c``, repeatable): merged in the order given, a later file's keys over an
    earlier's, and the flags on the command line over every recipe; the plan names each file. Command line only:
    the resolved ``recipe.yaml`` is their one flat merge and leaves it out."""
    resume: bool | str = False
    """``true``: resume from ``param_path`` (a checkpoint, AstrAI's meaning); ``auto``: the newest checkpoint under
    ``ckpt_dir``, or a fresh start when there is none; a path: that checkpoint."""
    resume_optimizer: bool = True
    """``false``: resume weights, schedule and data position but start a fresh optimizer (for a checkpoint whose
    optimizer state cannot be restored, such as AstrAI's FSDP checkpoints, which hold rank 0's shard only)."""
    resume_schedule: bool = True
    """``true`` (AstrAI's rule): a resume continues the checkpoint's learning-rate schedule, whatever this run's
    length; when that schedule ends before this run does (``--n_epoch`` raised after a finished run), the extra steps
    run at the floor and the plan says so. ``false``: rebuild the schedule from this run's flags and length and
    continue it at the checkpoint's step."""
    window_size: int | None = None
    """Tokens per training sample (the positions the model reads); default: the model's
    ``max_position_embeddings``, for a model from Hugging Face at most ``HF_DEFAULT_WINDOW`` 1024 (TRL's
    ``max_length`` default: a Hub model's 32k-128k positions would not fit memory; the plan says so)."""
    stride: int | None = None
    """Tokens between the starts of consecutive windows; default: ``window_size`` (no overlap)."""
    packing: bool = True
    """sft: ``true`` (AstrAI's): the records run on as one token stream cut into windows of ``window_size``, a record
    split where a window ends and the stream's tail after the last whole window left out; ``false``: one sample per
    record (TRL's ``SFTTrainer(packing=False)``), its first ``window_size + 1`` tokens (``window_size`` positions
    read, each predicting the next), padded to the longest of its micro-batch, a record with no trained token there
    dropped. The plan counts what either mode cuts and leaves out. seq has windows only; dpo, kto, grpo and
    reward_model train one sample per record already."""
    val_split: float | None = None
    """Fraction of samples held out for validation, in (0, 1); default: no validation."""
    val_step: int = 1000
    """Optimizer steps between validations (the first runs at step 1)."""

    # --- batch, steps and budgets --------------------------------------------------------------------------------
    n_epoch: int = 1
    """Passes over the training data."""
    batch_per_device: int = 1
    """Samples per micro-batch on each rank."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    max_steps: int | None = None
    """The run's length in optimizer steps, over as many epochs as it takes (``n_epoch`` is then not read): the run
    ends there (with a final checkpoint), and the schedule (warmup, decay, cycles) is planned over it, as Hugging
    Face's ``max_steps`` overrides ``num_train_epochs``. A resume keeps its checkpoint's schedule
    (``resume_schedule``). AstrAI has no such flag."""
    stop_after_steps: int | None = None
    """Stop after this many optimizer steps of this run (counted from where it starts: a resume takes this many
    more), with a checkpoint, the schedule untouched: a long run split into job-sized pieces, each continued by
    ``--resume auto``, trains as the run would uninterrupted."""
    max_tokens: int | None = None
    """Stop once this many input tokens (all ranks together) have been trained on."""

    # --- optimizer -----------------------------------------------------------------------------------------------
    optimizer: Literal["muon_adamw", "adamw", "nora_nadamw", "mano_adamw"] | None = None
    """``muon_adamw``: Muon for weight matrices, AdamW for embeddings, head and norms (AstrAI's split by name);
    ``nora_nadamw``: Nora for the linear layers' weights (``nora_*``), Nesterov AdamW for the rest; ``mano_adamw``:
    Mano for the linear layers' weights (``mano_*``), AdamW for the rest (both AstrAI's split by module);
    ``adamw``: AdamW for everything (decay on matrices only). Default: ``muon_adamw``, or ``adamw`` when
    ``lora_r`` > 0 (LoRA's usual practice; Muon on r x d factors is untested)."""
    max_lr: float = 3e-4
    """Peak learning rate (the schedule's base)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrix parameters."""
    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value at every optimizer step."""
    muon_momentum: float = 0.95
    """Muon momentum."""
    muon_nesterov: bool = True
    """Muon Nesterov momentum."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon step."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Muon's per-matrix learning-rate scaling."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of Muon's Newton-Schulz iteration. ``bfloat16`` is AstrAI's (torch's) behaviour; ``auto`` picks
    ``float32`` on CPU, where bf16 matrix products are ~37x slower, and ``bfloat16`` on CUDA."""
    muon_spread_replicated: bool | None = None
    """Under DDP (and HSDP with one shard per replica): each matrix's Newton-Schulz iteration run by one rank and
    the results all-gathered, instead of every rank running every matrix's. It pays where a rank's link is fast
    next to its matrix throughput; default: on for CPU processes (measured faster over gloo, docs/performance.md),
    off on accelerators until measured there. FSDP's sharded matrices are always spread (no more traffic than the
    gather it replaces); the plan's ``muon`` line says how a run shares the work."""
    nora_lr: float = 5e-3
    """``nora_nadamw``: peak learning rate of the Nora matrices (the schedule scales it as it scales ``max_lr``)."""
    nora_beta: float = 0.95
    """``nora_nadamw``: EMA factor of Nora's momentum buffer, in [0, 1)."""
    nora_momentum: float = 0.95
    """``nora_nadamw``: Nesterov mix of Nora's update (the gradient moved this far towards the buffer), in [0, 1]."""
    nora_weight_decay: float | None = None
    """``nora_nadamw``: decoupled weight decay of the Nora matrices; default: ``weight_decay``. AstrAI's default is
    0.0, and its ``weight_decay`` reaches no parameter of its models, so nothing decays (its B18); ``0`` is that."""
    mano_momentum: float = 0.95
    """``mano_adamw``: Mano's momentum, in [0, 1] (AstrAI gives Mano ``muon_momentum`` instead, its B17)."""
    mano_nesterov: bool = True
    """``mano_adamw``: Mano's Nesterov momentum (AstrAI gives Mano ``muon_nesterov`` instead, its B17)."""

    # --- learning-rate schedule ----------------------------------------------------------------------------------
    schedule_type: Literal["cosine", "sgdr", "wsd"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_ratio: float | None = None
    """Warmup steps as a fraction of the schedule's steps (floored); default 0.05 (AstrAI's) unless ``warmup_steps``
    is given (the two are exclusive)."""
    warmup_steps: int | None = None
    """Warmup length in optimizer steps (transformers' ``warmup_steps``), at most the schedule's steps, instead of
    ``warmup_ratio``'s share; both in one recipe or on one command line is an error, and one given on the command line
    (or in a later recipe) replaces the other from an earlier recipe. The warmup rises from ``min_rate x max_lr``
    (AstrAI's rule; ``--min_rate 0`` rises from 0, as transformers' does)."""
    min_rate: float | None = None
    """Floor of the learning rate as a fraction of ``max_lr``; default 0.01 (AstrAI's); an explicit 0 is kept."""
    cycle_length: int | None = None
    """SGDR: steps in the first cycle; default: all steps after warmup."""
    t_mult: int = 2
    """SGDR: each cycle is ``t_mult`` times longer than the one before."""
    stable_steps: int | None = None
    """WSD: steps at full rate after warmup; default 80% of the rest; an explicit 0 is kept."""
    decay_steps: int | None = None
    """WSD: steps of the final decay; default: the steps left after the stable phase."""

    # --- losses --------------------------------------------------------------------------------------------------
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing (seq, sft)."""
    loss_chunk_size: int | None = None
    """Fuse the head with the loss and compute both this many positions at a time (every train type), so a
    micro-batch's whole ``[positions, vocab]`` float32 logits never exist; the same gradients (float32 sums in
    another order). 0: off. Default, in chunks of 32 MB of logits: on for seq and sft on CPU (never the slower there at
    any size measured), else where a micro-batch's logits would reach 256 MB."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss."""
    neftune_alpha: float = 0.0
    """NEFTune noise on the embeddings during training (AstrAI's Gaussian form); 0 disables it. The noise is
    seeded by ``random_seed``, data-parallel rank, step and micro-batch, so a resume draws the same."""
    dpo_beta: float = 0.1
    """DPO's temperature beta, and ipo's, hinge's and robust's (TRL's ``DPOConfig.beta``); for simpo, cpo and kto
    the deprecated spelling of ``simpo_beta``, ``cpo_beta`` and ``kto_beta``, read where those are unset."""
    simpo_beta: float | None = None
    """SimPO's beta, the scale of the length-normalised margin (TRL's ``CPOConfig.beta`` with ``loss_type="simpo"``;
    the paper uses 2 to 2.5). None: ``--dpo_beta``'s value (its deprecated spelling for simpo)."""
    cpo_beta: float | None = None
    """CPO's beta (TRL's ``CPOConfig.beta`` with ``loss_type="sigmoid"``, default 0.1). None: ``--dpo_beta``'s value
    (its deprecated spelling for cpo)."""
    kto_beta: float | None = None
    """KTO's beta, the scale of the reward against the KL baseline (TRL's ``KTOConfig.beta``, default 0.1). None:
    ``--dpo_beta``'s value (its deprecated spelling for kto)."""
    dpo_loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "cpo", "orpo"] = "sigmoid"
    """The preference loss of dpo, each as TRL 1.16 computes it: ``sigmoid`` (DPO, AstrAI's), ``ipo``, ``hinge``,
    ``robust`` (with ``dpo_label_smoothing``), and the reference-free ``simpo`` (length-normalised, margin
    ``simpo_gamma``), ``cpo`` (plus ``cpo_alpha`` x the chosen responses' NLL) and ``orpo`` (the chosen responses'
    NLL plus ``orpo_beta`` x the odds-ratio term), which build no reference model."""
    dpo_label_smoothing: float = 0.0
    """Probability that a pair's preference is flipped, in [0, 0.5): robust, simpo and cpo (TRL's
    ``label_smoothing``); ``--label_smoothing`` stays cross-entropy smoothing for seq/sft."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (TRL's default); the loss compares ``beta x margin - gamma``."""
    cpo_alpha: float = 1.0
    """CPO's weight of the chosen responses' NLL (TRL's default)."""
    orpo_beta: float = 0.1
    """ORPO's weight lambda of the odds-ratio term (TRL's ``beta``, default 0.1)."""
    kto_desirable_weight: float = 1.0
    """KTO's weight of the desirable samples' loss (TRL's ``desirable_weight``); with unbalanced data, KTO's paper
    suggests weights making ``desirable_weight x desirable / (undesirable_weight x undesirable)`` 1 to 4/3."""
    kto_undesirable_weight: float = 1.0
    """KTO's weight of the undesirable samples' loss (TRL's ``undesirable_weight``)."""
    reward_center_coef: float = 0.0
    """reward_model: weight of ``mean((r_chosen + r_rejected)^2)`` added to the loss, keeping scores centred on 0
    (TRL's ``center_rewards_coefficient``; Eisenstein et al. suggest 0.01); 0: off."""
    group_size: int = 4
    """GRPO responses per prompt."""
    grpo_clip_eps: float = 0.2
    """GRPO PPO clip range."""
    grpo_kl_coef: float = 0.01
    """GRPO weight of the KL penalty to the reference model."""
    grpo_loss: Literal["astrai", "grpo", "bnpo", "dr_grpo", "dapo", "sapo"] = "astrai"
    """How GRPO averages its per-token loss, and which advantages and KL estimate it uses: ``astrai`` (AstrAI's,
    the default: a token mean over the micro-batch, population std + 1e-8, ``r - log(r + 1e-8) - 1``), or TRL 1.16's
    ``grpo`` (per-response token means, then their mean), ``bnpo`` (a token mean over the micro-batch),
    ``dr_grpo`` (the token sum over responses x ``rollout_max_tokens``) and ``dapo`` (online only: a token mean over
    every response token of the optimizer step, all micro-batches and ranks; with ``rollout_interval`` k, the
    rollout's tokens / k, as TRL), each with TRL's advantages (Bessel std + 1e-4, or none: ``grpo_scale_rewards``)
    and KL ``r - log r - 1``; and ``sapo`` (SAPO: a soft, temperature-gated clip, averaged as ``grpo``;
    ``grpo_sapo_temperature_pos`` / ``_neg``)."""
    grpo_clip_eps_high: float | None = None
    """GRPO's upper clip bound ``1 + grpo_clip_eps_high`` on the ratio (DAPO's "clip higher", e.g. 0.28); None:
    ``grpo_clip_eps``, symmetric."""
    grpo_scale_rewards: Literal["group", "batch", "none"] = "group"
    """The TRL losses' advantages: centred in the group and divided by the group's reward std (``group``), by the
    std of every reward of the batch (``batch``: online, the whole rollout on every rank, TRL's generation batch;
    offline, the micro-batch), or only centred (``none``, as Dr. GRPO has it). ``astrai`` keeps AstrAI's."""
    grpo_num_iterations: int = 1
    """Online GRPO: optimizer passes over each rollout (TRL's ``num_iterations``, the paper's mu): its micro-batches
    are trained this many times in order, against the log-probabilities recorded at sampling; 1 samples anew after
    one pass."""
    grpo_importance_sampling_level: Literal["token", "sequence"] = "token"
    """The importance ratio of TRL's losses: one per token, or one per response (``sequence``: GSPO, the exponential
    of the response's mean token log-ratio, clipped as one; GSPO's paper pairs it with ``--grpo_loss grpo``).
    AstrAI's loss is token-level only."""
    grpo_delta: float | None = None
    """Two-sided clipping (TRL's ``delta``): the unclipped ratio is also capped at this value, bounding a negative
    advantage's loss; the paper that proposes it takes it above ``1 + grpo_clip_eps_high``. None: off. Not with
    ``sapo``, which clips nothing."""
    grpo_sapo_temperature_pos: float = 1.0
    """``--grpo_loss sapo``: the gate's temperature where the advantage is positive (TRL's
    ``sapo_temperature_pos``); higher: a sharper gate, the gradient fading sooner as the ratio leaves 1."""
    grpo_sapo_temperature_neg: float = 1.05
    """``--grpo_loss sapo``: the gate's temperature where the advantage is not positive (TRL's
    ``sapo_temperature_neg``)."""
    grpo_top_entropy_quantile: float = 1.0
    """Train the policy term on the top fraction of response tokens by the policy's entropy only (TRL's
    ``top_entropy_quantile``; Wang et al. 2025 keep 0.2, "the 80/20 rule"): its entropy at least the
    ``1 - quantile`` quantile of every response token's of the micro-batch, all data-parallel ranks together; the KL
    term and the averaging take every token. 1.0: all tokens. TRL's losses only."""
    grpo_advantage: Literal["group", "rloo"] = "group"
    """``group``: GRPO's advantages (``grpo_loss``, ``grpo_scale_rewards``); ``rloo``: RLOO as TRL 1.16's
    RLOOTrainer has it, whole: each response's reward less the mean of the others in its group, the KL to the
    reference in the reward (``grpo_kl_coef`` x the response's summed ``logp_old - logp_ref``), and one PPO-clipped
    ratio per response (of its summed token log-ratio), averaged over responses; ``grpo_loss`` stays unset."""
    rloo_normalize_advantages: bool = False
    """``--grpo_advantage rloo``: centre the advantages and divide by their std + 1e-4 (TRL's
    ``normalize_advantages``), over the whole rollout on every data-parallel rank (TRL's generation batch); offline,
    over the micro-batch's groups."""
    reward_clip_range: tuple[float, float] | None = None
    """``--grpo_advantage rloo``: clip each reward into ``[low, high]`` before the KL penalty (TRL's
    ``reward_clip_range``); None: unclipped."""
    reward: str | dict | None = None
    """Online GRPO: the reward function, an import path or ``{class_path, init_args}`` (e.g.
    ``astrai_fabric.rewards.LengthReward``); required when the grpo data holds prompts without responses. Only the
    bundled rewards (``astrai_fabric.rewards.*``) resolve unless ``--trust_code`` is given."""
    reward_model: str | None = None
    """Online grpo and dpo: score the rollouts with this reward model (a directory: ``astrai-fabric reward_model``'s
    checkpoint or export, or a transformers ``*ForSequenceClassification`` with one label) instead of ``--reward``.
    With the policy's vocabulary it reads the sampled ids; with a tokenizer of its own, each conversation rendered
    again with that tokenizer's chat template."""
    trust_code: bool = False
    """Allow import paths outside astrai_fabric (``--reward mypackage.score``): importing them runs their code.
    Command line only: a recipe cannot set it, and the resolved ``recipe.yaml`` leaves it out."""
    rollout_interval: int = 512
    """Online GRPO: optimizer steps' worth of prompts sampled at once (``rollout_interval x grad_accum_steps``
    micro-batches); each is trained ``grpo_num_iterations`` times, so a rollout every ``rollout_interval x
    grpo_num_iterations`` steps."""
    rollout_temperature: float = 0.7
    """Online GRPO: sampling temperature."""
    rollout_top_k: int = 0
    """Online GRPO: top-k sampling (0 = off)."""
    rollout_top_p: float = 0.9
    """Online GRPO: nucleus sampling threshold, in (0, 1]."""
    rollout_max_tokens: int = 1024
    """Online GRPO: most tokens generated per response."""

    # --- LoRA ----------------------------------------------------------------------------------------------------
    lora_r: int = 0
    """LoRA rank: train low-rank adapters on the ``lora_targets`` layers and freeze every base weight; 0 (the
    default) trains the whole model. Needs ``param_path`` with weights."""
    lora_alpha: int = 32
    """LoRA scale numerator: the adapter adds ``(B A) * lora_alpha / lora_r`` (AstrAI's default 32)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1); seeded by position like NEFTune, so a resume drops the same."""
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Layers to adapt, by name: any of ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate``, ``up``, ``down``
    (repeat the flag or separate by commas); the MoE router never. Default: AstrAI's ``inject_lora`` default."""
    lora_init: Literal["astrai", "kaiming"] = "astrai"
    """Adapter initialisation, ``B = 0`` in both: ``astrai``: ``A ~ N(0, 1) / r`` (AstrAI's); ``kaiming``:
    PEFT's default, ``A ~ U(-1/sqrt(in), 1/sqrt(in))``."""
    lora_save_full: bool = False
    """Also write the merged ``model.safetensors`` into each checkpoint (a directory AstrAI's ``Checkpoint.load``
    reads); by default a LoRA checkpoint holds the adapter and a hash-checked pointer to the base weights."""
    quantize: Literal["nf4"] | None = None
    """``nf4``: QLoRA. The frozen base's block linear weights are stored in 4 bits (torchao's NF4, quantised while
    they load; embeddings, norms and the head stay in the training dtype) under float32 adapters. Needs ``lora_r``
    and the ``.[qlora]`` extra; one device or ddp. Checkpoints record it: what they load is the adapter merged into
    the dequantised base, the model that was trained."""

    # --- parallelism and precision -------------------------------------------------------------------------------
    parallel_mode: ParallelMode = "fsdp"
    """``none``: one process; ``ddp``: replicated model; ``fsdp``: FSDP2 sharding (AstrAI's default). With one
    process every mode trains on a single device."""
    nprocs: int = 1
    """Local ranks to launch (``--devices`` is the same flag). Under ``fabric run``, torchrun or SLURM the
    environment decides; a value given that is neither its ranks per node nor its world size only warns."""
    num_nodes: int = 1
    """Machines in the run (with ``fabric run``/torchrun/SLURM, or ``NODE_RANK`` + ``MASTER_ADDR``); under those
    launchers the environment decides, and a value given that differs only warns."""
    device_type: str | None = None
    """``cuda`` or ``cpu``; default: cuda when available (AstrAI's default is always cuda). ``--dry_run`` plans for
    it even where this machine has none."""
    device_memory: str | None = None
    """Each device's memory for the plan's footprint (``--dry_run`` and the preflight's warning): an amount with its
    unit (``80GB`` = 80 x 10^9 bytes, ``141GiB`` = 141 x 2^30) or a device's name (``h100``, ``h200``, ``a100``,
    ``a100-40gb``, ``l40s``, ``b200``, ``mi300x``); default: the CUDA device's own when there is one, else none (the
    footprint is printed without a verdict)."""
    backend: Literal["gloo", "nccl"] | None = None
    """Process-group backend; default: nccl on CUDA, gloo on CPU (AstrAI: always nccl)."""
    precision: Precision = "auto"
    """``auto``: bf16-true on CUDA (AstrAI's pure bf16), 32-true on CPU (bf16 matmuls are slow there)."""
    num_threads: int | None = None
    """torch's CPU threads in each rank (``torch.set_num_threads``, and ``OMP_NUM_THREADS`` for the processes it
    starts); default: ``OMP_NUM_THREADS`` when set, else torch's own count for one local rank and the CPUs divided by
    the local ranks for several (Lightning's rule). Set by the command line only: a program calling ``train`` or
    ``run`` keeps its own setting. 1 can be several times faster for a small model on a busy machine
    (docs/performance.md). At most 1024."""
    reuse_freed_memory: bool = True
    """Keep the host memory that tensors free for the next ones instead of handing it back to the system (glibc's
    malloc thresholds, ``host_memory``): a step's tensors then need no fresh pages, 0.3-1% of a step for a
    5M-parameter model on CPU (docs/performance.md); the process's memory stays at its peak. Set by the command line
    only, in every rank it starts; nothing elsewhere than Linux with glibc."""
    fsdp_sync_each_micro_batch: bool = False
    """FSDP: reduce-scatter gradients after every micro-batch instead of only at the optimizer step, trading
    communication for the memory of unsharded gradients during accumulation. Decided by the Fabric's strategy (FSDP2's
    ``ModelParallelStrategy``), not by ``parallel_mode``: DDP and single-device runs keep the gate."""
    gradient_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass (less memory, ~30% more compute)."""
    compile: Literal["default", "reduce-overhead", "max-autotune"] | None = None
    """``torch.compile`` mode; default: no compilation. Saved keys never carry ``_orig_mod.``."""
    tp_size: int | None = None
    """Tensor-parallel degree (AstrAI accepts and discards it): attention heads and MLP width are split over groups
    of this many ranks (parallel_mode fsdp), and the world size must be a multiple of it."""
    cp_size: int | None = None
    """Context-parallel degree (parallel_mode fsdp): each rank of a group of this many holds 1/cp_size of every
    window's positions, attention trading positions for heads by all-to-all (DeepSpeed-Ulysses), so activation
    memory per rank falls with it for long windows. It must divide the world size (with ``tp_size``), the attention
    heads per tensor-parallel rank and the window (samples padded to their batch's longest are padded on to a
    multiple of it); the group's ranks read the same samples, and FSDP shards over them too (docs/distributed.md)."""
    ep_size: int | None = None
    """Expert-parallel degree (parallel_mode fsdp, MoE models): each rank of a group of this many consecutive data
    ranks holds 1/ep_size of every MoE layer's routed experts, tokens travelling to their experts' ranks by
    all-to-all, and FSDP shards the experts over the data shards left (``fsdp_shard_size`` / ep_size). It must divide
    the routed experts and the FSDP shards; not with ``tp_size``, ``cp_size``, ``quantize`` or ``sharded_checkpoint``
    (docs/distributed.md)."""
    pp_size: int | None = None
    """Pipeline stages (parallel_mode fsdp; seq and sft): the decoder blocks split into this many consecutive
    stages balanced by parameters (the embedding on the first, the final norm and head on the last), each held by
    world size / pp_size ranks that shard it with FSDP (and ``tp_size``) as a whole model would be; a window's
    ``grad_accum_steps`` micro-batches are the pipeline's micro-batches (docs/distributed.md). It must divide the
    world size and be at most the layers; not with ``cp_size``, ``ep_size``, MoE models, ``quantize``,
    ``neftune_alpha``, ``compile``, ``fsdp_sync_each_micro_batch`` (the schedule reduces once a window) or
    ``--packing false``."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"] = "1f1b"
    """The pipeline's schedule: ``gpipe`` (every micro-batch's forward, then every backward: activations of all
    micro-batches held at once), ``1f1b`` (one forward, one backward once the pipeline is full: at most pp_size
    micro-batches' activations held; it needs ``grad_accum_steps`` >= pp_size), or, with several stages per rank
    (``pp_stages_per_rank``, 2 by default for these), ``interleaved_1f1b`` (1F1B over each rank's stages: the bubble
    shrinks by the stages per rank; ``grad_accum_steps`` must be a multiple of pp_size when larger) or
    ``looped_bfs`` (each of a rank's stages runs every micro-batch before the next)."""
    pp_stages_per_rank: int | None = None
    """Pipeline stages each rank holds, looped (rank r holds stages r, r + pp_size, ...): the blocks split into
    pp_size x this many stages. Only with ``interleaved_1f1b`` and ``looped_bfs`` (default 2 there; 1 otherwise)."""
    fsdp_reshard_after_forward: bool = False
    """FSDP: free each block's gathered parameters after its forward (less memory, one more all-gather in backward);
    AstrAI keeps them (false)."""
    fsdp_param_dtype: Literal["bfloat16", "float32", "float16"] | None = None
    """FSDP mixed precision: dtype of the gathered parameters used in compute (e.g. bfloat16 over float32 master
    weights with ``--precision 32-true``); default: the parameters' own."""
    fsdp_reduce_dtype: Literal["bfloat16", "float32", "float16"] | None = None
    """FSDP mixed precision: dtype of the gradient reduce-scatter (float32 keeps reductions exact with bf16
    compute); default: the compute dtype."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory (for models that do not fit)."""
    fsdp_shard_size: int | None = None
    """FSDP: ranks each parameter is sharded over, the other data-parallel ranks holding replicas of those shards
    (HSDP), so that between shard groups only one gradient all-reduce per step travels; it must divide the
    data-parallel size (world size / ``tp_size`` / ``cp_size``: context ranks are not counted, FSDP shards over them
    as well). Default: all data-parallel ranks (plain FSDP). Across nodes the
    ranks per node is the usual choice (docs/distributed.md)."""
    sharded_checkpoint: bool = False
    """FSDP: save the resume state with torch distributed checkpoint, each rank writing its shard into the
    checkpoint's ``state/`` folder (resumable at another world size); the gathered ``optimizer.pt`` is left out."""
    master_addr: str = "localhost"
    """Accepted for AstrAI command lines; the launcher's environment (``MASTER_ADDR``) decides."""
    master_port: str = "29500"
    """Accepted for AstrAI command lines; the launcher's environment (``MASTER_PORT``) decides."""
    start_method: Literal["fork", "forkserver", "spawn"] = "spawn"
    """Accepted for AstrAI command lines; Fabric's launcher starts the local ranks."""

    # --- data loading --------------------------------------------------------------------------------------------
    random_seed: int = 3407
    """Seeds the sampler order (``seed + epoch``), the validation split, model initialisation, and by position
    (rank, step, epoch) NEFTune noise, loader workers and GRPO rollouts."""
    num_workers: int | None = None
    """DataLoader worker processes per rank; default: AstrAI's 4, capped by the CPUs this process may use divided by
    the local ranks (2 CPUs and one rank: 2; two ranks: 1 each; fewer CPUs than ranks: 0, loading in the rank itself).
    At most 256. The plan prints the number."""
    pin_memory: bool = True
    """Pin host memory for faster copies to the GPU (ignored on CPU)."""
    persistent_workers: bool = True
    """Keep DataLoader workers alive between epochs (when ``num_workers > 0``)."""

    # --- checkpoints and logging ---------------------------------------------------------------------------------
    ckpt_dir: str = "checkpoint"
    """Everything a run writes goes under this directory."""
    ckpt_interval: int = 5000
    """Optimizer steps between checkpoints (one is also written at the end)."""
    start_epoch: int = 0
    """AstrAI's manual start epoch (for fresh runs); ignored when resuming."""
    start_samples: int = 0
    """AstrAI's manual start offset, in samples per rank (for fresh runs); ignored when resuming."""
    metrics: list[str] = field(default_factory=lambda: ["loss", "lr", "grad_norm", "grad_snr", "tokens_per_sec"])
    """What ``metric.jsonl`` records besides the loss function's own metrics: AstrAI's names (``loss``, ``lr``,
    ``grad_norm``, ``grad_snr``, ``val_loss``, ``moe_aux_loss``, ``router_entropy``, ``dead_expert_fraction``,
    ``load_imbalance_mean``, ``load_imbalance_max``) and ``tokens_per_sec``, ``samples_per_sec``, ``mfu``.
    ``grad_snr`` keeps one gradient-sized float32 buffer (AstrAI keeps two); leave it out to save it."""
    loggers: list[Literal["csv", "tensorboard", "wandb"]] = field(default_factory=lambda: ["csv"])
    """Where every step's metrics also go: CSV and/or TensorBoard under ``ckpt_dir/logs/version_N`` (one folder per
    run, shared by both; TensorBoard needs ``pip install 'astrai-fabric[tensorboard]'``), and/or Weights & Biases
    (``pip install 'astrai-fabric[wandb]'``; files under ``ckpt_dir/logs/wandb``, the resolved recipe as the run's
    config, one W&B run continued by ``--resume``; ``WANDB_MODE=offline`` and ``WANDB_PROJECT`` are read as usual);
    ``[]`` for none."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, for model FLOPs utilisation (``mfu``); known CUDA devices need no value."""
    keep_last_k: int | None = None
    """Keep only the newest K checkpoints in ``ckpt_dir``, deleting older ones once a newer one is complete;
    default: keep all."""
    max_bad_steps: int = 5
    """A step whose loss or gradient norm is not finite is skipped (no update; its samples count as consumed); after
    more than this many in a row the run saves and stops with an error."""
    dist_timeout: float = 1800.0
    """Seconds a collective waits for the other ranks before the run stops with an error (a rank died or hangs)."""
    profile_steps: str | None = None
    """``A:B``: record a torch.profiler trace of optimizer steps A to B (inclusive, counted from 1 like ``step_S``)
    and, on CUDA, a memory snapshot, into ``ckpt_dir/profile`` (one file per rank); default: off (no profiler is
    created). docs/training.md says how to open them. In a recipe, quote it (``profile_steps: "10:12"``): YAML reads
    an unquoted ``10:12`` as the base-60 number 612."""
    dry_run: bool = False
    """Print the plan (model and data size, batch and step arithmetic, schedule, outputs) and exit without training;
    AstrAI's ``--dry-run`` works too."""

    def __post_init__(self) -> None:
        # `--lora_targets q_proj,v_proj` (commas) means the same as the repeated flag.
        if isinstance(self.lora_targets, list):
            self.lora_targets = [t.strip() for item in self.lora_targets for t in str(item).split(",") if t.strip()]

    @property
    def resolved_optimizer(self) -> str:
        """``optimizer``, or its default: ``adamw`` for LoRA runs, else ``muon_adamw``."""
        return self.optimizer or ("adamw" if self.lora_r else "muon_adamw")

    @property
    def profile_step_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as ``(first, last)``; None when off or malformed (``validate`` says which)."""
        first, colon, last = (self.profile_steps or "").partition(":")
        if not (colon and first.strip().isdecimal() and last.strip().isdecimal()):
            return None
        first_step, last_step = int(first), int(last)
        return (first_step, last_step) if 1 <= first_step <= last_step else None

    def recipe_values(self) -> dict:
        """The values a recipe holds: every field but the command-line-only ones (``recipe.yaml``, W&B's config)."""
        return {k: v for k, v in self.to_dict().items() if k not in COMMAND_LINE_ONLY}

    @property
    def num_stages_per_rank(self) -> int:
        """``pp_stages_per_rank``, or its default for ``pp_schedule`` (``config.pipeline.stages_per_rank``)."""
        return stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)

    @property
    def resolved_nora_weight_decay(self) -> float:
        """``nora_weight_decay``, or ``weight_decay`` when unset (the fix of AstrAI's B18)."""
        return self.weight_decay if self.nora_weight_decay is None else self.nora_weight_decay

    @property
    def beta_flag(self) -> str:
        """The flag naming the run's preference beta: ``kto_beta`` (kto), ``simpo_beta`` and ``cpo_beta`` (dpo's
        simpo and cpo losses), else ``dpo_beta`` (orpo reads ``orpo_beta`` instead)."""
        if self.train_type == "kto":
            return "kto_beta"
        return {"simpo": "simpo_beta", "cpo": "cpo_beta"}.get(self.dpo_loss, "dpo_beta")

    @property
    def preference_beta(self) -> float:
        """The beta the run's preference loss reads: its ``beta_flag``, or ``dpo_beta`` (the deprecated spelling)
        where that is unset."""
        own = getattr(self, self.beta_flag)
        return self.dpo_beta if own is None else own

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every field with a bad value: first its kind (``config.kinds``; a
        recipe's ``null`` or list reaches here where the parser lets it through), then its range and its agreement
        with the other flags, section by section (the sections of the fields above)."""
        hints = typing.get_type_hints(TrainArgs)
        kinds = [
            f"{f.name} {problem}"
            for f in dataclasses.fields(self)
            if (problem := kind_problem(getattr(self, f.name), hints[f.name]))
        ]
        if kinds:
            raise ConfigError("invalid training arguments: " + "; ".join(kinds))
        problems = [
            *self._range_problems(),
            *self._data_problems(),
            *self._optimizer_problems(),
            *self._schedule_problems(),
            *self._loss_problems(),
            *self._preference_problems(),
            *self._rollout_problems(),
            *self._lora_problems(),
            *self._parallel_problems(),
            *self._output_problems(),
        ]
        if problems:
            raise ConfigError("invalid training arguments: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


HF_DEFAULT_WINDOW = 1024
"""The default window of a model from Hugging Face (its ``max_position_embeddings`` when smaller): TRL's default
``max_length``, where a Hub model's own 32k-128k positions (Qwen3's 40,960) would not fit a micro-batch in memory."""


def default_window_size(max_position_embeddings: int, hugging_face: bool) -> int:
    """The window when ``--window_size`` is unset: AstrAI's ``max_position_embeddings``, capped at
    ``HF_DEFAULT_WINDOW`` for a model from Hugging Face (``hugging_face``: its directory, or our checkpoint of one)."""
    return min(max_position_embeddings, HF_DEFAULT_WINDOW) if hugging_face else max_position_embeddings


RECIPE_FILE = "recipe.yaml"
"""The resolved recipe every run writes in its ``ckpt_dir`` (and each checkpoint carries)."""
RECIPE_HEADER = "# Resolved recipe; rerun with: astrai-fabric"
"""How ``recipe.yaml`` begins: in a ``ckpt_dir`` without a manifest (an older run's) it marks the files as ours."""


def resolved_recipe(args: TrainArgs) -> str:
    """The run's full configuration as a flat recipe that ``--config`` accepts."""
    header = f"{RECIPE_HEADER} {args.train_type} --config {RECIPE_FILE}\n"
    return header + yaml.safe_dump(args.recipe_values(), sort_keys=False)
