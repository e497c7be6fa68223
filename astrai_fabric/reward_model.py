"""Reward models: a language model's network with a scalar ``score`` head in place of its LM head
(``ModelConfig.score_head``), scoring a sequence at its last token that is not padding, as transformers'
``*ForSequenceClassification`` with one label does, so that ``export --format hf`` scores the same.

``astrai-fabric reward_model`` trains one on preference pairs (``train/reward_model.py``); ``--reward_model PATH``
scores online grpo's and online dpo's rollouts with one (``RewardModelScorer``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor, nn

from astrai_fabric.checkpoint import Checkpoint, load_model, read_model_config
from astrai_fabric.checkpoint.files import StoredStateDict
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.data.records import encode, prompt_of
from astrai_fabric.errors import CheckpointError, UserError
from astrai_fabric.model import ModelOutput
from astrai_fabric.model.transformer import EMBED_KEY, LM_HEAD_KEY
from astrai_fabric.tokenizer import Tokenizer

SCORE_KEY = "score.weight"


def reward_model_config(config: ModelConfig, pad_token_id: int) -> ModelConfig:
    """A language model's config as a reward model's: the same network, a score head, padding ``pad_token_id``."""
    return dataclasses.replace(config, score_head=True, pad_token_id=pad_token_id)


def reward_model_weights(weights: Checkpoint, config: ModelConfig) -> Checkpoint:
    """A language model's weights as the start of a reward model: its LM head left out, a score head of zeros (every
    pair starts level: the first loss is log 2). The other tensors stay in their files, read as the model is built."""
    state = weights.state_dict
    if EMBED_KEY in state:  # the head is made here, before the model is built and loading compares every shape
        width = (state.shape(EMBED_KEY) if isinstance(state, StoredStateDict) else tuple(state[EMBED_KEY].shape))[-1]
        if width != config.hidden_size:
            raise CheckpointError(
                f"{weights.path}: does not match the model built from its config.json: hidden_size "
                f"{config.hidden_size}, but {EMBED_KEY} is {width} wide"
            )
    # A view of one zero: nothing the size of the config's width is allocated before the plan has checked memory
    # (loading copies it into the built head).
    head = {SCORE_KEY: torch.zeros(1, 1).expand(1, config.hidden_size)}
    if isinstance(state, StoredStateDict):
        state = state.with_tensors(head, without=[LM_HEAD_KEY])
    else:
        state = {**{k: v for k, v in state.items() if k != LM_HEAD_KEY}, **head}
    return dataclasses.replace(weights, state_dict=state, config=config.to_dict())


def last_token_index(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """Each row's rightmost position whose id is not ``pad_token_id`` (0 for a row of padding alone): transformers'
    rule in ``GenericForSequenceClassification``. Where padding shares its id with EOS, a row ending in EOS is read
    at the token before it, here as there."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(dim=-1)


def sequence_scores(model: nn.Module, input_ids: Tensor) -> tuple[Tensor, ModelOutput]:
    """A reward model's score of each right-padded sequence ``input_ids [N, L]`` → ``[N]`` float32, and the model's
    output (its MoE aux loss, if any)."""
    out = model(input_ids)
    index = last_token_index(input_ids, model.config.pad_token_id)
    scores = out.scores.gather(-1, index[:, None]).squeeze(-1)
    return scores.float(), out


class RewardModelScorer:
    """``--reward_model PATH``: rollouts scored by a trained reward model (ours, or a transformers
    ``*ForSequenceClassification`` directory with one label), frozen, a whole copy on every rank, in ``dtype``.

    With the policy's vocabulary it scores the prompt's and the response's ids as sampled. A reward model whose
    tokenizer has another vocabulary (``own_tokenizer``) scores each conversation rendered again with its own chat
    template, the record's prompt then the response's text as the assistant's turn, as TRL's trainers re-tokenise
    for a reward model of another tokenizer.
    """

    def __init__(
        self, path: Path, device: torch.device, policy_tokenizer: Tokenizer | None, dtype: torch.dtype | None = None
    ) -> None:
        self.name = f"model {path}"
        """How messages name it: ``reward model PATH``."""
        self.model = load_model(path, dtype=dtype).to(device).eval().requires_grad_(False)
        self.pad_token_id = self.model.config.pad_token_id
        self.tokenizer = own_tokenizer(path, policy_tokenizer)

    @torch.no_grad()
    def __call__(
        self, prompt_ids: list[list[int]], response_ids: list[list[int]], records: list[dict], texts: list[str]
    ) -> Tensor:
        """The score ``[N]`` (float32) of each of N sampled responses: its prompt's ids, its own ids, its prompt's
        record and its text."""
        if self.tokenizer is None:
            sequences = [p + r for p, r in zip(prompt_ids, response_ids, strict=True)]
        else:
            limit = self.model.config.max_position_embeddings
            sequences = []
            for record, text in zip(records, texts, strict=True):
                encoded = encode(self.tokenizer, prompt_of(record, "reward_model"), [text], limit)
                sequences.append(encoded.prompt_ids + encoded.response_ids[0])
        return self.score_ids(sequences)

    def score_ids(self, sequences: list[list[int]]) -> Tensor:
        """The score of each token sequence (its own ids) ``[N]``, padded with its padding id."""
        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(sequences):
            ids[row, : len(tokens)] = torch.tensor(tokens)
        scores, _ = sequence_scores(self.model, ids.to(next(self.model.parameters()).device))
        return scores


def own_tokenizer(path: Path, policy_tokenizer: Tokenizer | None) -> Tokenizer | None:
    """The reward model's tokenizer where its vocabulary differs from the policy's, else None (it reads the policy's
    ids; an export's tokenizer files differ in layout, not in vocabulary)."""
    theirs, _ = Tokenizer.from_dir_if_present(path)
    if theirs is None or policy_tokenizer is None or theirs.vocab() == policy_tokenizer.vocab():
        return None
    return theirs


def check_reward_model(path: Path, policy_vocab_size: int, tokenizer: Tokenizer | None) -> str:
    """``--reward_model``'s directory, checked before anything is built: a reward model (a score head) reading the
    policy's ids, or with a tokenizer of its own that renders a conversation. Returns how it reads the rollouts."""
    config = read_model_config(path)
    config.check_buildable(source=str(path / "config.json"))
    if not config.score_head:
        raise UserError(
            f"reward_model {path}: a language model, not a reward model (no score head); train one with "
            "astrai-fabric reward_model, or pass a *ForSequenceClassification directory"
        )
    theirs = own_tokenizer(path, tokenizer)
    if theirs is not None:
        theirs.render_chat(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], where=f"reward_model {path}"
        )
        return f"its own tokenizer of {theirs.vocab_size:,} ids, each conversation rendered again with its template"
    if config.vocab_size < policy_vocab_size:
        raise UserError(
            f"reward_model {path}: vocab_size {config.vocab_size:,} is smaller than the policy's "
            f"{policy_vocab_size:,} and it holds no tokenizer of its own to read the rollouts with; pass "
            "its directory with its tokenizer"
        )
    return "the policy's token ids"
