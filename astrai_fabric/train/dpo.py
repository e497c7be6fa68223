"""``dpo``: Direct Preference Optimization against a frozen reference model (AstrAI's ``astrai/trainer/strategy.py``).

Data: JSONL records ``{"prompt"|"input", "chosen", "rejected"}`` (strings or chat messages), tokenised with the
chat template; each pair is one sample, truncated to ``--window_size``. Online (``online_dpo``, AstrAI's name for
it): records holding prompts alone, two responses sampled from the live policy for each (``grpo.Rollouts``), ranked
by ``--reward`` into a pair (``ranked_pairs``), then the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric import assets
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.dataset_config import render_pair, unrendered_warning
from astrai_fabric.data.records import PreferenceDataset, PromptDataset, collate_preferences, collate_prompts
from astrai_fabric.data.shapes import Shaper, check_not_shaped, shape_records
from astrai_fabric.data.storage import read_records
from astrai_fabric.errors import ConfigError
from astrai_fabric.loop.state import TrainState
from astrai_fabric.lora import reference_context
from astrai_fabric.losses import REFERENCE_FREE, PairLogps, preference_loss, with_moe_aux_loss
from astrai_fabric.model import next_token_logprobs
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.grpo import Rollouts, check_rollout_reward, rollout_metrics, rollout_reward
from astrai_fabric.train.start import Start, reference_model, require_records, resolve_start


def response_logprobs(
    model: nn.Module, ids: Tensor, loss_mask: Tensor, loss_chunk_size: int = 0
) -> tuple[Tensor, dict]:
    """Summed log-probabilities of the response tokens of each right-padded sequence ``ids [N, L]``.

    Right padding needs no attention mask: under causal attention a real token never sees the padding after it.
    """
    logprobs, out = next_token_logprobs(model, ids, loss_chunk_size)
    return (logprobs * loss_mask[:, 1:]).sum(dim=-1), out


@dataclass(frozen=True)
class PreferenceArgs:
    """The slice of the flags a preference loss reads (``losses.preference_loss``)."""

    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    orpo_beta: float = 0.1

    @classmethod
    def from_args(cls, args: TrainArgs) -> PreferenceArgs:
        return cls(
            args.dpo_loss,
            args.preference_beta,
            args.dpo_label_smoothing,
            args.simpo_gamma,
            args.cpo_alpha,
            args.orpo_beta,
        )


def dpo_batch_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    reference: nn.Module | None,
    beta: float,
    moe_aux_loss_coef: float,
    loss_chunk_size: int = 0,
    preference: PreferenceArgs | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``reference`` None: the policy with its LoRA adapters off (``lora.adapters_off``) is the reference; a
    reference-free ``preference.kind`` (simpo, cpo, orpo) runs none. ``preference`` None: DPO's sigmoid at ``beta``."""
    preference = preference or PreferenceArgs(beta=beta)
    ids, loss_mask = batch["input_ids"].flatten(0, 1), batch["loss_mask"].flatten(0, 1)  # pairs: chosen, rejected
    trained = loss_mask[:, 1:]
    ref = None
    if preference.kind not in REFERENCE_FREE:
        # The reference first: with LoRA it is the same (possibly sharded) network, run without gradients before
        # the policy's forward, so the policy's graph is the last forward before backward.
        with torch.no_grad(), reference_context(model, reference):
            ref, _ = response_logprobs(reference if reference is not None else model, ids, loss_mask, loss_chunk_size)
            ref = ref.view(-1, 2)
    logprobs, out = next_token_logprobs(model, ids, loss_chunk_size)
    policy = (logprobs * trained).sum(dim=-1).view(-1, 2)
    tokens = trained.sum(dim=-1).view(-1, 2)
    chosen_rows = slice(0, None, 2)  # each pair's chosen sequence, then its rejected one
    chosen_nll = -(logprobs[chosen_rows] * trained[chosen_rows]).sum() / trained[chosen_rows].sum().clamp(min=1)
    pairs = PairLogps(
        policy[:, 0],
        policy[:, 1],
        tokens[:, 0],
        tokens[:, 1],
        chosen_nll,
        *((ref[:, 0], ref[:, 1]) if ref is not None else ()),
    )
    loss, metrics = preference_loss(
        preference.kind,
        pairs,
        preference.beta,
        preference.label_smoothing,
        preference.simpo_gamma,
        preference.cpo_alpha,
        preference.orpo_beta,
    )
    loss, moe_metrics = with_moe_aux_loss(loss, out.aux_loss, out.router_stats, moe_aux_loss_coef)
    return loss, {**metrics, **moe_metrics}


def ranked_pairs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Online dpo's rollouts (two sampled responses per prompt, ``[B, 2, ...]``, scored ``rewards [B, 2]``) as
    preference pairs: the higher-scored response first, the first one on a tie (TRL's ``OnlineDPOTrainer``:
    ``first_half >= second_half``)."""
    second_wins = (batch["rewards"][:, 1] > batch["rewards"][:, 0]).long()
    order = torch.stack([second_wins, 1 - second_wins], dim=1)  # [B, 2]: chosen's index, then rejected's

    def reorder(tensor: Tensor) -> Tensor:
        index = order.view(*order.shape, *([1] * (tensor.dim() - 2))).expand_as(tensor)
        return tensor.gather(1, index)

    return {key: reorder(value) if value.dim() >= 2 else value for key, value in batch.items()}


def online_dpo_batch_loss(model: nn.Module, batch: dict[str, Tensor], **dpo: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """``dpo_batch_loss`` on the rollouts ranked into pairs, plus the reward metrics (the mean, and the chosen minus
    the rejected response's)."""
    pairs = ranked_pairs(batch)
    loss, metrics = dpo_batch_loss(model, pairs, **dpo)
    metrics["reward"] = batch["rewards"].mean()
    metrics["reward_gap"] = (pairs["rewards"][:, 0] - pairs["rewards"][:, 1]).mean()
    return loss, {**metrics, **rollout_metrics(batch)}


def build_dataset(
    args: TrainArgs, start: Start, train_type: str = "dpo"
) -> tuple[PreferenceDataset | PromptDataset, str]:
    """The tokenised pairs (or, online dpo, the prompts) and a one-line description of them; ``train_type``
    ``reward_model`` reads the same pairs, and refuses prompts alone."""
    window_size = start.window_size
    data_path = require_records(assets.resolve(args.data_root_path), train_type)
    tokenizer = start.need_tokenizer(train_type)
    config = start.dataset_config
    schema_check = None if config is not None else Shaper("dpo", args.data_format, args.data_columns).check_schema
    records = read_records(data_path, subset=args.data_subset, split=args.data_split, schema_check=schema_check)
    shapes = ""
    if config is not None:
        check_not_shaped(args.data_format, args.data_columns, f"{config.path} renders these records")
    else:  # records of any dpo shape (data/shapes.py), read as prompt/chosen/rejected, or prompts alone (online)
        records, shaper = shape_records(records, "dpo", args.data_format, args.data_columns)
        shapes = shaper.describe() and f"{shaper.describe()}, "
        if records and "chosen" not in records[0][1]:
            if train_type == "reward_model":
                raise ConfigError(
                    f"data_root_path {data_path}: records hold prompts without responses; a reward "
                    "model trains on preference pairs (prompt, chosen, rejected)"
                )
            scorer = check_rollout_reward(args, start, data_path, "dpo")
            summary = f"{shapes}prompts from {data_path} (online: 2 samples each, ranked by {scorer})"
            return PromptDataset(records, tokenizer, window_size), summary
    render = partial(render_pair, config, tokenizer) if config is not None else None
    dataset = PreferenceDataset(records, tokenizer, window_size, render)
    dropped = f"; {dataset.num_dropped} dropped: nothing to train in the window" if dataset.num_dropped else ""
    summary = f"{shapes}preference pairs from {data_path}, at most {window_size} tokens each{dropped}"
    if config is not None:
        # AstrAI's train.py always passes a tokenizer_path, so its built-in dpo rendering wins over the file there.
        summary += (
            f"\nnote: records rendered by {config.path} (AstrAI's DatasetFactory reads it; its train.py does not)"
        )
        summary += unrendered_warning(dataset.num_unrendered, len(dataset))
    if dataset.num_identical:
        summary += (
            f"\nwarning: {dataset.num_identical:,} of {len(dataset):,} pairs have chosen equal to rejected: they "
            "add nothing to the gradient"
        )
    return dataset, summary


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train dpo on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(fabric, args)
    dataset, summary = build_dataset(args, start)
    if args.dpo_loss in REFERENCE_FREE:  # nothing to build or record: a resume needs no reference either
        fabric.print(f"reference model: none (--dpo_loss {args.dpo_loss} compares chosen and rejected alone)")
        reference, extra_meta = None, {}
    else:
        reference, reference_meta = reference_model(fabric, start, args)
        extra_meta = {"reference": reference_meta}
    dpo = dict(
        reference=reference,
        beta=args.preference_beta,
        moe_aux_loss_coef=args.moe_aux_loss_coef,
        loss_chunk_size=start.loss_chunk_size(args),
        preference=PreferenceArgs.from_args(args),
    )
    if isinstance(dataset, PreferenceDataset):
        collate = partial(collate_preferences, pad_id=start.need_tokenizer("dpo").padding_id)
        task = TrainTask(dataset, summary, partial(dpo_batch_loss, **dpo), collate, checkpoint_meta=extra_meta)
        return train_on(fabric, args, start, task)
    reward = rollout_reward(fabric, args, start.need_tokenizer("dpo"))

    def rollouts(
        state: TrainState, loader: Any, num_micro_batches: int
    ) -> Rollouts:  # the loop's seam, as online grpo's
        return Rollouts(
            fabric,
            state.model,
            loader,
            start.need_tokenizer("dpo"),
            reward,
            args,
            start.window_size,
            state.position,
            num_micro_batches,
            start.loss_chunk_size(args),
            group_size=2,
        )

    online_loss = partial(online_dpo_batch_loss, **dpo)
    task = TrainTask(dataset, summary, online_loss, collate_prompts, checkpoint_meta=extra_meta, make_batches=rollouts)
    return train_on(fabric, args, start, task)
