"""``grpo``: Group Relative Policy Optimization, offline (scored responses in the data) or online (sampled here).

Offline data: JSONL ``{"prompt", "responses": [G texts], "rewards": [G floats]}``. Online data: JSONL prompts
``{"prompt", ...}``; the current policy samples ``--group_size`` responses per prompt for ``--rollout_interval``
steps' micro-batches at once, the ``--reward`` function scores them, and ``--grpo_num_iterations`` passes over them
train (a rollout every ``rollout_interval x grpo_num_iterations`` steps). Loss and advantages: ``policy_losses``
(AstrAI's formulas, ``astrai/trainer/strategy.py``; TRL 1.16's with ``--grpo_loss``, RLOO's with ``--grpo_advantage``).

Departure from AstrAI (B11): the ratio's "old" policy is the policy as it was when the batch was drawn: the
current one for offline data (ratio 1, the on-policy gradient) and the sampling policy's log-probabilities,
recorded at rollout, online. AstrAI keeps a frozen copy of the *initial* policy as "old" for a whole offline run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric import assets, hub
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.dataset_config import render_group, unrendered_warning
from astrai_fabric.data.records import GroupDataset, PromptDataset, collate_groups, collate_prompts, pack
from astrai_fabric.data.shapes import Shaper, check_not_shaped, shape_records
from astrai_fabric.data.storage import read_records
from astrai_fabric.errors import ConfigError, UserError
from astrai_fabric.inference import Engine, SamplingParams
from astrai_fabric.inference.engine import blocks_needed
from astrai_fabric.loop.state import REUSED, TrainState
from astrai_fabric.lora import reference_context
from astrai_fabric.losses import with_moe_aux_loss
from astrai_fabric.model import next_token_logprobs
from astrai_fabric.policy_losses import (
    RatioShape,
    grpo_advantages,
    grpo_loss,
    high_entropy_mask,
    rloo_advantages,
    rloo_loss,
    rloo_penalised_rewards,
)
from astrai_fabric.randomness import derive_seed
from astrai_fabric.reward_model import RewardModelScorer, check_reward_model
from astrai_fabric.rewards import Reward, check_finite, load_reward, score
from astrai_fabric.strategy import data_parallel
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.start import Start, raise_together, reference_model, require_records, resolve_start


@dataclass(frozen=True)
class GRPOLossArgs:
    """The slice of the flags GRPO's and RLOO's losses read (``policy_losses``); each field is the flag of its name
    (``TrainArgs`` documents each: ``kind`` is ``--grpo_loss``, ``shape`` the ratio's flags)."""

    kind: str = "astrai"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.01
    scale_rewards: str = "group"
    max_response_tokens: int = 1024
    shape: RatioShape = RatioShape()
    advantage: str = "group"
    """``--grpo_advantage``: ``rloo`` is RLOO whole (its advantages, its KL in the reward, its objective)."""
    top_entropy_quantile: float = 1.0
    rloo_normalize_advantages: bool = False
    reward_clip_range: tuple[float, float] | None = None

    @classmethod
    def from_args(cls, args: TrainArgs) -> GRPOLossArgs:
        return cls(
            args.grpo_loss,
            args.grpo_clip_eps,
            args.grpo_clip_eps_high,
            args.grpo_kl_coef,
            args.grpo_scale_rewards,
            args.rollout_max_tokens,
            RatioShape(
                args.grpo_importance_sampling_level == "sequence",
                args.grpo_delta,
                args.grpo_sapo_temperature_pos,
                args.grpo_sapo_temperature_neg,
            ),
            args.grpo_advantage,
            args.grpo_top_entropy_quantile,
            args.rloo_normalize_advantages,
            None if args.reward_clip_range is None else tuple(args.reward_clip_range),
        )


def grpo_batch_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    reference: nn.Module | None,
    clip_eps: float,
    kl_coef: float,
    moe_aux_loss_coef: float,
    loss_chunk_size: int = 0,
    loss: GRPOLossArgs | None = None,
    quantile: Callable[[Tensor, float], Tensor] = torch.quantile,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``loss`` None: AstrAI's loss at ``clip_eps`` and ``kl_coef``. ``quantile(values, q)``: of the values of every
    data-parallel rank (``entropy_quantile``), for ``--grpo_top_entropy_quantile``."""
    loss = loss or GRPOLossArgs(clip_eps=clip_eps, kl_coef=kl_coef)
    ids = batch["input_ids"].flatten(0, 1)  # [B * G, L]: prompt then one response, right-padded
    mask = batch["loss_mask"].flatten(0, 1)[:, 1:]  # predicted tokens that belong to the response
    ref_logprobs = None
    if ADVANTAGES not in batch:  # (online RLOO's rollout used the reference already)
        with torch.no_grad(), reference_context(model, reference):  # None: the policy with its LoRA adapters off
            ref_logprobs, _ = next_token_logprobs(reference if reference is not None else model, ids, loss_chunk_size)
    top_entropy = loss.top_entropy_quantile < 1.0
    logprobs, out = next_token_logprobs(model, ids, loss_chunk_size, entropy=top_entropy)
    policy_tokens = None
    if top_entropy:  # the policy's own entropies, as it stands: TRL's
        entropies = out.token_entropy[:, :-1]
        policy_tokens = high_entropy_mask(
            entropies, mask, quantile(entropies[mask.bool()], 1.0 - loss.top_entropy_quantile)
        )
    old = batch["old_logprobs"].flatten(0, 1) if "old_logprobs" in batch else logprobs.detach()
    if loss.advantage == "rloo":  # RLOO's KL is in its rewards; its objective is per response
        if ADVANTAGES in batch:  # made at rollout (online), normalised over the whole rollout
            advantages, kl = batch[ADVANTAGES].flatten(), batch[RLOO_KL]
        else:  # offline: from this micro-batch alone
            rewards, kl = rloo_penalised_rewards(
                batch["rewards"].flatten(), old, ref_logprobs, mask, loss.kl_coef, loss.reward_clip_range
            )
            normalize = loss.rloo_normalize_advantages
            advantages = rloo_advantages(rewards.view_as(batch["rewards"]), normalize).flatten()
        value, metrics = rloo_loss(logprobs, old, mask, advantages, loss.clip_eps, loss.clip_eps_high)
        metrics["kl"] = kl
    else:
        # The whole rollout's statistics, where online rollouts attached them (batch_statistics): dapo's and "batch"'s
        reward_std, tokens_per_micro_batch = batch.get(REWARD_STD), batch.get(TOKENS_PER_MICRO_BATCH)
        advantages = grpo_advantages(batch["rewards"], loss.kind, loss.scale_rewards, reward_std).flatten()
        value, metrics = grpo_loss(
            logprobs,
            old,
            ref_logprobs,
            mask,
            advantages,
            loss.clip_eps,
            loss.kl_coef,
            loss.kind,
            loss.clip_eps_high,
            loss.max_response_tokens,
            tokens_per_micro_batch,
            loss.shape,
            policy_tokens,
        )
        if policy_tokens is not None:
            metrics["policy_token_fraction"] = policy_tokens.sum() / mask.sum().clamp(min=1)
    metrics["reward"] = batch["rewards"].mean()
    value, moe_metrics = with_moe_aux_loss(value, out.aux_loss, out.router_stats, moe_aux_loss_coef)
    return value, {**metrics, **moe_metrics, **rollout_metrics(batch)}


def reused(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """A rollout's micro-batch trained again (``REUSED``): its sampling took no time this time."""
    again = {**batch, REUSED: True}
    if ROLLOUT_S in batch:
        again[ROLLOUT_S] = torch.zeros_like(batch[ROLLOUT_S])
    return again


def rollout_metrics(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """What an online rollout measured of its sampling (``ROLLOUT_S``, ``PREFIX_HIT_RATE``), for the step's
    metrics; none for offline batches."""
    return {key: batch[key] for key in (ROLLOUT_S, PREFIX_HIT_RATE) if key in batch}


def entropy_quantile(fabric: Fabric) -> Callable[[Tensor, float], Tensor]:
    """``quantile(values, q)`` of the values of every data-parallel rank together (the tensor and context ranks of a
    replica hold the same values: counted once), as TRL gathers its processes' entropies; collective, every rank
    calls it at the same micro-batch. An empty set gives +inf (no token is kept, as TRL's all-False mask)."""
    replica = data_parallel(fabric).dp_rank

    def quantile(values: Tensor, q: float) -> Tensor:
        values = values.float()
        if fabric.world_size > 1:
            count = torch.tensor([values.numel(), replica], device=values.device)
            counts = fabric.all_gather(count)  # [world, 2]
            longest = int(counts[:, 0].max())
            padded = torch.cat([values, values.new_zeros(longest - values.numel())])
            gathered = fabric.all_gather(padded)  # [world, longest]
            sizes, replicas = counts[:, 0].tolist(), counts[:, 1].tolist()
            firsts = [rank for rank, r in enumerate(replicas) if r not in replicas[:rank]]  # one rank per replica
            values = torch.cat([gathered[rank, : sizes[rank]] for rank in firsts])
        if values.numel() == 0:
            return torch.tensor(math.inf, device=values.device)
        return torch.quantile(values, q)

    return quantile


ROLLOUT_S = "rollout_s"
"""Batch key and metric: seconds the rollout of this micro-batch spent sampling (0 for its repeats, ``REUSED``)."""
PREFIX_HIT_RATE = "prefix_hit_rate"
"""Batch key and metric: of the rollout's prompt positions (each completion's counted), the share the engine did not
compute (a group's prompt is prefilled once: 1 - 1/G at least)."""
ROLLOUT_BLOCK_SIZE = 16
"""The rollout engine's KV blocks, in positions."""
ROLLOUT_PREFILL_TOKENS = 2048
"""Prompt positions the rollout engine prefills per step at least (every prompt of a rollout waits for none)."""
REWARD_STD = "reward_std"
"""Batch key: the Bessel-corrected std of every reward of the rollout, all data-parallel ranks together
(``--grpo_scale_rewards batch``)."""
TOKENS_PER_MICRO_BATCH = "tokens_per_micro_batch"
"""Batch key: the rollout's response tokens over its micro-batches, all data-parallel ranks together (dapo's
normaliser, ``policy_losses.grpo_loss``)."""
ADVANTAGES = "advantages"
"""Batch key: online RLOO's advantages ``[B, G]``, made at rollout as TRL's RLOOTrainer makes them at generation
(the KL in the rewards from the sampling policy's log-probabilities and the reference's), normalised over the whole
rollout with ``--rloo_normalize_advantages``."""
RLOO_KL = "rloo_kl"
"""Batch key: online RLOO's mean per-token KL estimate of the micro-batch, for the log."""


def batch_statistics(fabric: Fabric, rolled: list[dict[str, Tensor]]) -> None:
    """Attach to each micro-batch of ``rolled`` (a rollout, this rank's share) what is taken over the whole rollout
    and every data-parallel rank: ``TOKENS_PER_MICRO_BATCH`` and ``REWARD_STD``, or, where the rollout made RLOO's
    ``ADVANTAGES``, those normalised (TRL's ``normalize_advantages`` over its generation batch). Collective: every
    rank calls it at the same rollout (they sample in lockstep); one all-reduce."""
    sums = rollout_sums(rolled)
    if fabric.world_size > 1:
        # Summed over the world: the tensor-parallel ranks of a replica hold the same rollout, counted once
        ranks_per_replica = fabric.world_size // data_parallel(fabric).num_dp_ranks
        sums = fabric.all_reduce(sums, reduce_op="sum") / ranks_per_replica
    attach_statistics(rolled, sums)


def rollout_sums(rolled: list[dict[str, Tensor]]) -> Tensor:
    """``[response tokens, micro-batches, values, their sum, the sum of their squares]`` of ``rolled``, float64
    (exact counts; the sums add over ranks); the values: the rewards, or RLOO's ``ADVANTAGES`` where present."""
    key = ADVANTAGES if ADVANTAGES in rolled[0] else "rewards"
    values = torch.cat([batch[key].flatten() for batch in rolled]).double()
    tokens = sum(batch["loss_mask"].flatten(0, 1)[:, 1:].sum() for batch in rolled)  # grpo_batch_loss's mask
    local = [tokens, len(rolled), values.numel(), values.sum(), values.square().sum()]
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=values.device) for v in local])


def attach_statistics(rolled: list[dict[str, Tensor]], sums: Tensor) -> None:
    """``batch_statistics`` from the whole rollout's ``rollout_sums``."""
    num_tokens, num_micro_batches, count, total, squares = sums.tolist()
    # Bessel-corrected, as TRL's nanstd; NaN for a single reward (advantage 0, as TRL's nan_to_num)
    variance = max(squares - total * total / count, 0.0) / (count - 1) if count > 1 else math.nan
    device = sums.device
    per_micro_batch = torch.tensor(max(num_tokens, 1.0) / num_micro_batches, device=device)
    std = torch.tensor(math.sqrt(variance), device=device)
    for batch in rolled:
        batch[TOKENS_PER_MICRO_BATCH], batch[REWARD_STD] = per_micro_batch, std
        if ADVANTAGES in batch:  # RLOO's, normalised as TRL's (nanstd + 1e-4; one advantage: 0)
            centred = batch[ADVANTAGES] - total / count
            batch[ADVANTAGES] = torch.nan_to_num(centred / (std + 1e-4), nan=0.0)


class Rollouts:
    """Training batches sampled from the live policy: for each ``micro_batches`` prompt batches at a time, the
    policy samples ``group_size`` responses per prompt (``--group_size``; online dpo: 2), the reward scores them,
    and the sampling policy's log-probabilities are kept as the "old" ones. All ranks sample in lockstep (a sharded
    forward is collective).

    Each rollout's micro-batches are then yielded ``--grpo_num_iterations`` times in order (TRL's ``num_iterations``:
    its buffered generation batch reused, the old log-probabilities kept from sampling); the repeats are marked
    ``REUSED``, so the loop counts their prompts once (``RunPosition.sample_index`` counts prompts consumed).
    """

    def __init__(
        self,
        fabric: Fabric,
        model: nn.Module,
        prompts: Any,
        tokenizer: Tokenizer,
        reward: Reward,
        args: TrainArgs,
        window_size: int,
        position: RunPosition,
        num_micro_batches: int,
        loss_chunk_size: int = 0,
        group_size: int | None = None,
        reference: nn.Module | None = None,
    ) -> None:
        self.fabric, self.model, self.prompts, self.tokenizer, self.reward = fabric, model, prompts, tokenizer, reward
        self.args, self.window_size, self.position = args, window_size, position
        self.micro_batches_left = num_micro_batches
        """Micro-batches the run still trains, repeats included: a rollout samples no prompt past them."""
        self.dp_rank = data_parallel(fabric).dp_rank  # this rank's replica: what its samples are seeded by
        self.loss_chunk_size = loss_chunk_size  # the policy's log-probabilities as the loss computes them
        self.micro_batches = args.rollout_interval * args.grad_accum_steps
        self.group_size = group_size or args.group_size
        self.num_iterations = args.grpo_num_iterations if group_size is None else 1  # grpo's; online dpo samples anew
        # RLOO's advantages are made here, as TRL's RLOOTrainer makes them at generation: the KL in the rewards
        # needs the reference's log-probabilities of the samples (None: the policy, its LoRA adapters off)
        self.rloo = group_size is None and args.grpo_advantage == "rloo"
        self.reference = reference
        # What the whole rollout decides, besides each micro-batch's own (online dpo: neither)
        self.statistics = group_size is None and (
            args.grpo_loss == "dapo"
            or args.grpo_scale_rewards == "batch"
            or (self.rloo and args.rloo_normalize_advantages)
        )

    def __iter__(self):
        prompt_batches = iter(self.prompts)
        # The run's last rollout is cut to what it trains: with several passes, only its first pass's micro-batches
        # can be short of the end (the repeats past it are not trained).
        while self.micro_batches_left > 0 and (
            chunk := list(islice(prompt_batches, min(self.micro_batches, self.micro_batches_left)))
        ):
            rolled = [self.rollout(batch, k) for k, batch in enumerate(chunk)]  # all sampled by the same policy
            self.micro_batches_left -= len(rolled) * self.num_iterations
            if self.statistics:
                batch_statistics(self.fabric, rolled)
            yield from rolled
            for _ in range(self.num_iterations - 1):
                yield from (reused(batch) for batch in rolled)

    @torch.no_grad()
    def rollout(self, batch: dict[str, list], index: int) -> dict[str, Tensor]:
        args, tokenizer, group = self.args, self.tokenizer, self.group_size
        prompts = [p for p in batch["prompt_ids"] for _ in range(group)]
        max_new = min(args.rollout_max_tokens, self.window_size - max(len(p) for p in prompts))
        # Seeded by position (data-parallel rank, step, micro-batch of the chunk, prompt): a resume at a rollout
        # boundary samples exactly what the first run did, and the tensor-parallel ranks of one replica sample alike.
        rank, step = self.dp_rank, self.position.optimizer_step
        self.model.eval()
        started = time.perf_counter()
        # A fresh engine each rollout: the policy has changed since the last, and so would every cached block. Its
        # pool holds exactly the rollout; a prompt's group shares its prompt's blocks (prefilled once).
        engine = Engine(
            self.model,
            block_size=ROLLOUT_BLOCK_SIZE,
            num_blocks=sum(blocks_needed(len(p), max_new, group, ROLLOUT_BLOCK_SIZE) for p in batch["prompt_ids"]),
            max_num_seqs=len(prompts),
            max_prefill_tokens=max(ROLLOUT_PREFILL_TOKENS, max(len(p) for p in prompts)),
            lockstep=self._lockstep if self.fabric.world_size > 1 else None,
        )
        for number, prompt in enumerate(batch["prompt_ids"]):
            params = SamplingParams(
                max_tokens=max_new,
                temperature=args.rollout_temperature,
                top_k=args.rollout_top_k,
                top_p=args.rollout_top_p,
                seed=derive_seed(args.random_seed, "rollout", rank, step, index, number),
                stop_token_ids=tokenizer.stop_ids,
                n=group,
            )
            engine.add_request(list(prompt), params)
        while engine.keep_stepping():
            engine.step()
        responses = [c.tokens for number in range(len(batch["prompt_ids"])) for c in engine.completions[number]]
        rollout_metrics = {
            ROLLOUT_S: torch.tensor(time.perf_counter() - started, device=self.fabric.device),
            PREFIX_HIT_RATE: torch.tensor(engine.prefix_hit_rate, device=self.fabric.device),
        }
        texts = [tokenizer.decode(r) for r in responses]
        prompt_texts = [tokenizer.decode(p) for p in batch["prompt_ids"]]
        grouped = [texts[i : i + group] for i in range(0, len(texts), group)]
        rewards, refusal = None, None
        try:
            if isinstance(self.reward, RewardModelScorer):  # the user's model: its scores checked as a function's
                records = [record for record in batch["records"] for _ in range(group)]
                rewards = check_finite(
                    self.reward(prompts, responses, records, texts).view(-1, group), self.reward.name
                )
            else:
                rewards = score(self.reward, prompt_texts, grouped, batch["records"], Path(args.ckpt_dir))
        except UserError as err:  # the user's reward raised, or returned what is not a reward
            refusal = err
        if self.fabric.world_size > 1:  # every rank stops here, together
            raise_together(self.fabric, refusal, lambda n: f"the reward was refused on {n} other rank(s)")
        if refusal is not None:
            raise refusal
        packed = pack(list(zip(prompts, responses, strict=True)), tokenizer.padding_id)
        packed = {k: v.to(self.fabric.device) for k, v in packed.items()}
        old_logprobs, _ = next_token_logprobs(self.model, packed["input_ids"], self.loss_chunk_size)
        num_prompts = len(batch["prompt_ids"])
        out = {k: v.unflatten(0, (num_prompts, group)) for k, v in packed.items()}
        out["old_logprobs"] = old_logprobs.unflatten(0, (num_prompts, group))
        out["rewards"] = rewards.to(self.fabric.device)
        out.update(rollout_metrics)
        if self.rloo:
            with reference_context(self.model, self.reference):
                policy_or_reference = self.reference if self.reference is not None else self.model
                ref_logprobs, _ = next_token_logprobs(policy_or_reference, packed["input_ids"], self.loss_chunk_size)
            penalised, out[RLOO_KL] = rloo_penalised_rewards(
                out["rewards"].flatten(),
                old_logprobs,
                ref_logprobs,
                packed["loss_mask"][:, 1:],
                args.grpo_kl_coef,
                args.reward_clip_range,
            )
            out[ADVANTAGES] = rloo_advantages(penalised.view(num_prompts, group))  # normalised over the rollout
        self.model.train()
        return out

    def _lockstep(self, has_work: bool) -> bool:
        """Whether any rank's engine still has work (each forward of a sharded policy is a collective)."""
        pending = torch.tensor(1.0 if has_work else 0.0, device=self.fabric.device)
        return self.fabric.all_reduce(pending, reduce_op="sum").item() > 0


def build_dataset(args: TrainArgs, start: Start) -> tuple[GroupDataset | PromptDataset, str]:
    """Scored groups (offline) or prompts (online: the data holds no responses), and a description of them."""
    window_size = start.window_size
    data_path = require_records(assets.resolve(args.data_root_path), "grpo")
    config = start.dataset_config
    schema_check = None if config is not None else Shaper("grpo", args.data_format, args.data_columns).check_schema
    records = read_records(data_path, subset=args.data_subset, split=args.data_split, schema_check=schema_check)
    shapes = ""
    tokenizer = start.need_tokenizer("grpo")
    if config is not None:
        check_not_shaped(args.data_format, args.data_columns, f"{config.path} renders these records")
    else:  # prompts (online) or scored groups (offline), their other columns kept for the reward (data/shapes.py)
        records, shaper = shape_records(records, "grpo", args.data_format, args.data_columns)
        shapes = shaper.describe() and f"{shaper.describe()}, "
    if config is not None or "responses" in records[0][1]:
        # Both are defined over a batch of rollouts: offline groups come from the loader one micro-batch at a time
        if args.grpo_loss == "dapo":
            raise ConfigError(
                f"--grpo_loss dapo needs online grpo (its normaliser counts the tokens of a whole batch of rollouts); "
                f"data_root_path {data_path} holds scored responses: use bnpo, its token mean per micro-batch"
            )
        if args.grpo_num_iterations > 1:
            raise ConfigError(
                f"--grpo_num_iterations {args.grpo_num_iterations} needs online grpo (passes over each rollout); "
                f"data_root_path {data_path} holds scored responses: use --n_epoch for more passes"
            )
        render = partial(render_group, config, tokenizer) if config is not None else None
        groups = GroupDataset(records, tokenizer, window_size, render)
        summary = f"{shapes}scored response groups from {data_path} (offline)"
        if config is not None:
            summary += f"; records rendered by {config.path}" + unrendered_warning(groups.num_unrendered, len(groups))
        if groups.num_flat_groups:
            summary += (
                f"\nwarning: {groups.num_flat_groups:,} of {len(groups):,} groups have all-equal rewards (zero "
                "advantage): they train only the KL term"
            )
        return groups, summary
    scorer = check_rollout_reward(args, start, data_path, "grpo")
    summary = f"{shapes}prompts from {data_path} (online: {args.group_size} samples each, scored by {scorer})"
    return PromptDataset(records, tokenizer, window_size), summary


def check_rollout_reward(args: TrainArgs, start: Start, data_path: Path, train_type: str) -> str:
    """The scorer of online rollouts (``--reward`` or ``--reward_model``), checked where the data says one is needed
    (the dry run too); returns its name."""
    if args.reward_model is not None:
        path = hub.resolve_model(args.reward_model, "reward_model")
        reads = check_reward_model(path, start.model_config.vocab_size, start.tokenizer)
        return f"the reward model {path} ({reads})"
    if args.reward is None:
        raise ConfigError(
            f"data_root_path {data_path}: records hold prompts without responses (online {train_type}), which needs "
            "--reward (e.g. --reward astrai_fabric.rewards.LengthReward) or --reward_model PATH"
        )
    load_reward(args.reward, args.trust_code)
    return str(args.reward)


def rollout_reward(fabric: Fabric, args: TrainArgs, tokenizer: Tokenizer) -> Reward | RewardModelScorer:
    """What scores online rollouts: the reward model (a whole copy on each rank), else the reward function."""
    if args.reward_model is not None:
        return RewardModelScorer(hub.resolve_model(args.reward_model, "reward_model"), fabric.device, tokenizer)
    return load_reward(args.reward, args.trust_code)


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train grpo (offline or online, by what the data holds) on a launched Fabric; returns the per-step records."""
    start = resolve_start(fabric, args)
    dataset, summary = build_dataset(args, start)
    reference, reference_meta = reference_model(fabric, start, args)
    compute_loss = partial(
        grpo_batch_loss,
        reference=reference,
        clip_eps=args.grpo_clip_eps,
        kl_coef=args.grpo_kl_coef,
        moe_aux_loss_coef=args.moe_aux_loss_coef,
        loss=GRPOLossArgs.from_args(args),
        loss_chunk_size=start.loss_chunk_size(args),
        quantile=entropy_quantile(fabric),
    )
    meta = {"reference": reference_meta}
    if isinstance(dataset, GroupDataset):
        collate = partial(collate_groups, pad_id=start.need_tokenizer("grpo").padding_id)
        return train_on(fabric, args, start, TrainTask(dataset, summary, compute_loss, collate, checkpoint_meta=meta))
    reward = rollout_reward(fabric, args, start.need_tokenizer("grpo"))

    def rollouts(
        state: TrainState, loader: Any, num_micro_batches: int
    ) -> Rollouts:  # the loop's seam (loop/__init__.py)
        tokenizer = start.need_tokenizer("grpo")
        return Rollouts(
            fabric,
            state.model,
            loader,
            tokenizer,
            reward,
            args,
            start.window_size,
            state.position,
            num_micro_batches,
            start.loss_chunk_size(args),
            reference=reference,
        )

    task = TrainTask(dataset, summary, compute_loss, collate_prompts, checkpoint_meta=meta, make_batches=rollouts)
    return train_on(fabric, args, start, task)
