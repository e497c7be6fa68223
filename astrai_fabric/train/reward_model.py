"""``reward_model``: a reward model trained on preference pairs with the Bradley-Terry loss
(``losses.reward_model_loss``, as TRL 1.16's ``RewardTrainer``). AstrAI has none.

The network is the starting model's with a scalar ``score`` head in place of its LM head (``reward_model.py``): from a
language model, the head starts at zeros, so every pair starts level (loss log 2). It starts from any model directory
read here (AstrAI's layout, a Hugging Face directory, our checkpoint of one, a LoRA checkpoint merged); from a Hugging
Face model its checkpoints' ``meta.json`` ``source`` is the family's classifier (``hf.HFSource.describing``).
Data: the dpo pairs in any of their shapes, ``{"prompt"|"input", "chosen", "rejected"}`` and an optional ``margin``
per pair; each sequence (prompt then response) is scored at its last token. Checkpoints are our layout with
``score_head`` in ``config.json`` (a ``model_type`` AstrAI refuses: its loader would drop the head); ``export
--format hf`` writes the architecture's ``*ForSequenceClassification``; ``--reward_model PATH`` scores online grpo's
and dpo's rollouts with one.
"""

from __future__ import annotations

from functools import partial

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.records import Encoded, PreferenceDataset, collate_preferences
from astrai_fabric.losses import reward_model_loss, with_moe_aux_loss
from astrai_fabric.reward_model import sequence_scores
from astrai_fabric.train import dpo
from astrai_fabric.train.common import TrainTask, train_on
from astrai_fabric.train.start import Start, resolve_start


class MarginPairs(torch.utils.data.Dataset):
    """The pairs with their margins: ``(encoded pair, margin)`` samples."""

    def __init__(self, pairs: PreferenceDataset) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Encoded, float]:
        return self.pairs[index], self.pairs.margins[index]


def collate_margin_pairs(batch: list[tuple[Encoded, float]], pad_id: int) -> dict[str, Tensor]:
    """``collate_preferences`` of the pairs, and ``margin [B]`` (float32)."""
    out = collate_preferences([pair for pair, _ in batch], pad_id)
    out["margin"] = torch.tensor([margin for _, margin in batch], dtype=torch.float32)
    return out


def reward_model_batch_loss(
    model: nn.Module, batch: dict[str, Tensor], center_coef: float, moe_aux_loss_coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The scores of each pair's chosen and rejected sequence, and their Bradley-Terry loss."""
    scores, out = sequence_scores(model, batch["input_ids"].flatten(0, 1))  # pairs: chosen, rejected
    pairs = scores.view(-1, 2)
    loss, metrics = reward_model_loss(pairs[:, 0], pairs[:, 1], batch["margin"], center_coef)
    loss, moe_metrics = with_moe_aux_loss(loss, out.aux_loss, out.router_stats, moe_aux_loss_coef)
    return loss, {**metrics, **moe_metrics}


def build_dataset(args: TrainArgs, start: Start) -> tuple[MarginPairs, str]:
    """dpo's pairs (prompts alone refused) with their margins, and a description of them."""
    pairs, summary = dpo.build_dataset(args, start, train_type="reward_model")
    return MarginPairs(pairs), summary


def main(fabric: Fabric, args: TrainArgs) -> list[dict[str, float]]:
    """Train a reward model on a launched Fabric; returns the per-step records (see ``loop.fit``)."""
    start = resolve_start(fabric, args)
    pairs, summary = build_dataset(args, start)
    compute_loss = partial(
        reward_model_batch_loss, center_coef=args.reward_center_coef, moe_aux_loss_coef=args.moe_aux_loss_coef
    )
    collate = partial(collate_margin_pairs, pad_id=start.model_config.pad_token_id)
    return train_on(fabric, args, start, TrainTask(pairs, summary, compute_loss, collate))
