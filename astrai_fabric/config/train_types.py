"""The train types, listed once: the commands (``cli``), ``--train_type``'s values (``config.train``), what each
parallel dimension trains (``config.combinations``) and the mains (``train``) all read this list."""

from __future__ import annotations

from typing import Literal, get_args

TrainType = Literal["seq", "sft", "dpo", "kto", "grpo", "reward_model"]
TRAIN_TYPES: tuple[str, ...] = get_args(TrainType)
