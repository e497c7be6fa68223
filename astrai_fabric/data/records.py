"""Record datasets for ``dpo`` and ``grpo`` (AstrAI's ``astrai/dataset/dataset.py``): one independent sample per record.

Every record is tokenised when the dataset is built, so a malformed one fails before training starts with an
error that names its file and line. Prompts go through the chat template with the generation prompt; a response
is what the template adds for one assistant turn after it (its closing tokens included, so the model learns to
stop). Sequences are truncated to ``max_len`` tokens (``--window_size``; AstrAI truncates DPO to 2048 whatever the
window). Batches are right-padded with explicit masks: token id 0 is a real token here (AstrAI treats it as
padding, B23).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from astrai_fabric.data.storage import Record
from astrai_fabric.errors import UserError, brief
from astrai_fabric.tokenizer import Message, Tokenizer

FLOAT32_MAX = torch.finfo(torch.float32).max
"""Rewards are trained on in float32: a larger magnitude (or NaN, which fails every comparison) is refused."""


def as_messages(value: Any, where: str, field: str) -> list[Message]:
    """A prompt as chat messages: a string is one user message (AstrAI's rule)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return value
    raise UserError(f"{where}: {field!r} must be a string or a list of {{role, content}} messages, got {brief(value)}")


def as_text(value: Any, where: str, field: str) -> str:
    """A response as text: a list of messages counts as their concatenated contents (AstrAI's rule)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "".join(str(m.get("content", "")) for m in value)
    raise UserError(f"{where}: {field!r} must be a string or a list of messages, got {brief(value)}")


def prompt_of(record: dict[str, Any], where: str) -> list[Message]:
    value = record.get("prompt", record.get("input"))
    if value is None:
        raise UserError(f"{where}: the record needs 'prompt' (or 'input'), got keys {brief(sorted(record))}")
    return as_messages(value, where, "prompt")


@dataclass
class Encoded:
    prompt_ids: list[int]
    response_ids: list[list[int]]
    response_masks: list[list[int]] | None = None
    """Which response tokens are trained (1), per response; None: all of them. Set by a ``dataset_config.json``
    route, whose sections decide the mask token by token (``data/dataset_config.py``)."""

    def masks(self) -> list[list[int]]:
        return self.response_masks or [[1] * len(r) for r in self.response_ids]

    def cut(self, max_len: int) -> Encoded:
        """Prompt + each response cut to ``max_len`` tokens (the prompt first), masks with their tokens."""
        room = max(0, max_len - len(self.prompt_ids))
        masks = [m[:room] for m in self.response_masks] if self.response_masks is not None else None
        return Encoded(self.prompt_ids[:max_len], [r[:room] for r in self.response_ids], masks)

    def trains_every_response(self) -> bool:
        """Every response has a trained token the model predicts (the sequence's first token is never predicted)."""
        return all(any(m[1:] if not self.prompt_ids else m) for m in self.masks())


Render = Callable[[dict[str, Any], str], Any]
"""``render(record, where)``: a record's sample by a ``dataset_config.json``, or None where AstrAI drops it."""


def check_rewards(rewards: Any, num_responses: int, where: str) -> list[float]:
    """One number per response, finite in float32 (bools are not numbers here)."""
    if not isinstance(rewards, list) or len(rewards) != num_responses:
        count = len(rewards) if isinstance(rewards, list) else brief(rewards)
        raise UserError(f"{where}: 'rewards' must list one number per response: {count} for {num_responses}")
    numbers = all(isinstance(r, int | float) and not isinstance(r, bool) for r in rewards)
    if not numbers or not all(abs(r) <= FLOAT32_MAX for r in rewards):
        raise UserError(f"{where}: 'rewards' must be numbers finite in float32 (|r| <= 3.4e38), got {brief(rewards)}")
    return [float(r) for r in rewards]


def encode(tokenizer: Tokenizer, prompt: list[Message], responses: list[str], max_len: int, where: str = "") -> Encoded:
    """Prompt ids (with the generation prompt) and each response's ids, prompt + response cut to ``max_len``."""
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, where=where)
    response_ids = []
    for text in responses:
        answered = [*prompt, {"role": "assistant", "content": text}]
        full = tokenizer.apply_chat_template(answered, add_generation_prompt=False, where=where)
        if full[: len(prompt_ids)] != prompt_ids:
            raise UserError(
                "the chat template renders a prompt with its generation prompt differently from the same prompt "
                "followed by an answer, so response tokens cannot be located (fix the template's generation prompt)"
            )
        response_ids.append(full[len(prompt_ids) : max_len])
    return Encoded(prompt_ids[:max_len], response_ids)


class PreferenceDataset(Dataset):
    """DPO pairs ``{"prompt"|"input", "chosen", "rejected"}`` as ``(prompt_ids, chosen_ids, rejected_ids)``."""

    def __init__(self, records: list[Record], tokenizer: Tokenizer, max_len: int, render: Render | None = None) -> None:
        self.samples, self.num_dropped, self.num_unrendered = [], 0, 0
        """``num_dropped``: pairs with nothing left to train in the window; ``num_unrendered``: records ``render``
        gave no sample (AstrAI drops them)."""
        self.num_identical = 0
        """Pairs whose chosen and rejected tokens are the same: their loss is log 2 and their gradient zero."""
        self.margins: list[float] = []
        """Each pair's ``margin`` (a reward model's, TRL's column; 0 where the record has none)."""
        for where, record in records:
            if render is not None:
                encoded = render(record, where)
                if encoded is None:
                    self.num_unrendered += 1
                    continue
                encoded = encoded.cut(max_len)
            else:
                missing = [k for k in ("chosen", "rejected") if k not in record]
                if missing:
                    raise UserError(f"{where}: a dpo record needs {missing}, got keys {brief(sorted(record))}")
                texts = [as_text(record[k], where, k) for k in ("chosen", "rejected")]
                encoded = encode(tokenizer, prompt_of(record, where), texts, max_len, where)
            if not encoded.trains_every_response():
                self.num_dropped += 1  # the prompt fills the window: nothing left to prefer
                continue
            chosen, rejected = zip(encoded.response_ids, encoded.masks(), strict=True)
            self.num_identical += chosen == rejected
            self.samples.append(encoded)
            self.margins.append(_margin(record, where))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Encoded:
        return self.samples[index]


def _margin(record: dict[str, Any], where: str) -> float:
    margin = record.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        raise UserError(
            f"{where}: 'margin' must be a finite number (how much chosen should outscore rejected), got "
            f"{json.dumps(margin)[:60]}"
        )
    return float(margin)


@dataclass
class Unpaired:
    """A kto sample: the prompt and its completion (``encoded``), whether it is desirable, and the completion of
    another record after the same prompt (``kl_response_ids``), for the KL baseline."""

    encoded: Encoded
    desirable: bool
    kl_response_ids: list[int]


class UnpairedDataset(Dataset):
    """KTO's unpaired preferences ``{"prompt"|"input", "completion", "label": true|false}`` (TRL's form; prompt and
    completion as strings or messages).

    Each sample also carries a mismatched completion for the KL baseline: the previous record's (the last record's
    for the first), TRL's rotation by one (which it applies within each per-device batch of records in order). Fixed
    per sample, the mismatched pairs do not depend on how samples are batched, so the baseline reduced over a step's
    samples is the same on any number of ranks.
    """

    def __init__(self, records: list[Record], tokenizer: Tokenizer, max_len: int) -> None:
        self.num_dropped = 0
        """Records whose prompt fills the window: nothing left to train."""
        kept = []
        for where, record in records:
            missing = [k for k in ("completion", "label") if k not in record]
            if missing:
                raise UserError(f"{where}: a kto record needs {missing}, got keys {brief(sorted(record))}")
            if not isinstance(record["label"], bool):
                raise UserError(
                    f"{where}: 'label' must be true (desirable) or false (undesirable), got {brief(record['label'])}"
                )
            completion = as_text(record["completion"], where, "completion")
            encoded = encode(tokenizer, prompt_of(record, where), [completion], max_len, where)
            if not encoded.trains_every_response():
                self.num_dropped += 1
                continue
            kept.append((encoded, record["label"]))
        room = [max_len - len(encoded.prompt_ids) for encoded, _ in kept]
        self.samples = [
            Unpaired(encoded, label, kept[i - 1][0].response_ids[0][: room[i]])
            for i, (encoded, label) in enumerate(kept)
        ]
        self.num_desirable = sum(sample.desirable for sample in self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Unpaired:
        return self.samples[index]


class GroupDataset(Dataset):
    """Offline GRPO groups ``{"prompt", "responses": [G texts], "rewards": [G floats]}``."""

    def __init__(self, records: list[Record], tokenizer: Tokenizer, max_len: int, render: Render | None = None) -> None:
        self.samples: list[tuple[Encoded, list[float]]] = []
        self.num_flat_groups = 0
        """Groups whose rewards are all equal: zero advantage, so they train nothing but the KL term."""
        self.num_unrendered = 0
        """Records ``render`` gave no sample (AstrAI drops them)."""
        group_size = None
        for where, record in records:
            if render is not None:
                rendered = render(record, where)
                if rendered is None:
                    self.num_unrendered += 1
                    continue
                encoded, rewards = rendered
                encoded = encoded.cut(max_len)
                rewards = check_rewards(rewards, len(encoded.response_ids), where)
            else:
                responses = record.get("responses")
                if not isinstance(responses, list) or not responses:
                    raise UserError(
                        f"{where}: a grpo record needs a non-empty list 'responses', got {brief(responses)}"
                    )
                rewards = check_rewards(record.get("rewards"), len(responses), where)
                texts = [as_text(r, where, "responses") for r in responses]
                encoded = encode(tokenizer, prompt_of(record, where), texts, max_len, where)
            self.num_flat_groups += len(set(rewards)) == 1
            if group_size is not None and len(rewards) != group_size:
                raise UserError(f"{where}: {len(rewards)} responses; earlier records have {group_size}")
            group_size = len(rewards)
            self.samples.append((encoded, rewards))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Encoded, list[float]]:
        return self.samples[index]


class PromptDataset(Dataset):
    """Online GRPO prompts ``{"prompt"|"input", ...}``; the whole record goes to the reward function."""

    def __init__(self, records: list[Record], tokenizer: Tokenizer, max_len: int) -> None:
        self.samples = []
        for where, record in records:
            prompt = prompt_of(record, where)
            prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, where=where)
            if len(prompt_ids) >= max_len:
                raise UserError(f"{where}: the prompt has {len(prompt_ids)} tokens, window_size is {max_len}")
            self.samples.append((prompt_ids, record))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[list[int], dict[str, Any]]:
        return self.samples[index]


def pack(
    sequences: list[tuple[list[int], list[int]]], pad_id: int, masks: list[list[int]] | None = None
) -> dict[str, Tensor]:
    """``(prompt, response)`` pairs → right-padded ``input_ids``, ``attention_mask`` and ``loss_mask [N, L]``.

    ``loss_mask`` marks response tokens (aligned with the tokens themselves, not shifted): all of them, or those
    ``masks[i]`` (one flag per token of response ``i``) selects.
    """
    length = max(len(p) + len(r) for p, r in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), length), dtype=torch.bool)
    loss = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(sequences):
        tokens = prompt + response
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = True
        loss[row, len(prompt) : len(tokens)] = torch.tensor(masks[row], dtype=torch.bool) if masks else True
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def _grouped(packed: dict[str, Tensor], groups: int) -> dict[str, Tensor]:
    return {k: v.unflatten(0, (groups, -1)) for k, v in packed.items()}


def collate_preferences(batch: list[Encoded], pad_id: int) -> dict[str, Tensor]:
    """``[B, 2, L]`` tensors: index 0 the chosen, 1 the rejected continuation of each prompt."""
    pairs = [(e.prompt_ids, response) for e in batch for response in e.response_ids]
    return _grouped(pack(pairs, pad_id, [m for e in batch for m in e.masks()]), len(batch))


def collate_unpaired(batch: list[Unpaired], pad_id: int) -> dict[str, Tensor]:
    """``[B, L]`` tensors of the samples, ``kl_*`` tensors of their mismatched pairs (each prompt with another
    record's completion), and ``desirable [B]`` (bool)."""
    out = pack([(s.encoded.prompt_ids, s.encoded.response_ids[0]) for s in batch], pad_id)
    kl = pack([(s.encoded.prompt_ids, s.kl_response_ids) for s in batch], pad_id)
    return {**out, **{f"kl_{k}": v for k, v in kl.items()}, "desirable": torch.tensor([s.desirable for s in batch])}


def collate_groups(batch: list[tuple[Encoded, list[float]]], pad_id: int) -> dict[str, Tensor]:
    """``[B, G, L]`` tensors for the G responses of each prompt, and ``rewards [B, G]`` (float32)."""
    pairs = [(e.prompt_ids, response) for e, _ in batch for response in e.response_ids]
    out = _grouped(pack(pairs, pad_id, [m for e, _ in batch for m in e.masks()]), len(batch))
    out["rewards"] = torch.tensor([rewards for _, rewards in batch], dtype=torch.float32)
    return out


def collate_prompts(batch: list[tuple[list[int], dict[str, Any]]]) -> dict[str, list]:
    return {"prompt_ids": [p for p, _ in batch], "records": [r for _, r in batch]}
