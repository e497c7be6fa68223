"""Per-request sampling: ``SamplingParams`` (checked, one line naming the field) and ``sample``, which turns one
request's logits into its next token.

Each request is sampled from its own row of logits with its own generator, one row at a time, so its token does not
depend on what else is in the batch (given the same logits: the model's own logits may move by ~1e-7 with the batch's
composition on CPU). The order is vLLM's: the logit bias, the penalties, then temperature, top-k, top-p and min-p.
Log-probabilities reported are the model's own (a log-softmax of the raw logits), as vLLM reports them by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from astrai_fabric.errors import UserError

MAX_N = 256
"""The most completions one request may ask for."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
"""The longest stop string: a stop string is looked for at every token, across token boundaries."""
MAX_LOGPROBS = 20
"""The most top log-probabilities a token reports (OpenAI's ``top_logprobs`` limit)."""
MAX_LOGIT_BIAS = 300


class RequestError(UserError):
    """A request the engine refuses, one line naming the field; the engine keeps serving the others."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued. Defaults: one completion of up to 16 tokens at temperature 1."""

    max_tokens: int = 16
    """New tokens at most (a stop ends it sooner)."""
    temperature: float = 1.0
    """0: greedy (the highest logit, after the bias and the penalties)."""
    top_k: int = 0
    """Keep the k highest logits (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less probable than min_p times the most probable one, in [0, 1]."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on every token of the prompt and the completion: positive logits divided by it, negative
    multiplied (> 0; 1: off)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the completion holds (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per time the completion holds a token (OpenAI's, in [-2, 2])."""
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Added to the logits of the tokens named, each in [-100, 100] (OpenAI's)."""
    seed: int | None = None
    """The request's own generator's seed (completion i of n: ``seed + i``); None: drawn from the engine's."""
    stop_token_ids: Sequence[int] = ()
    """A completion ends after sampling one of these (it is kept)."""
    stop: Sequence[str] = ()
    """A completion ends when its text holds one of these (needs the engine's tokenizer); the text is cut before it."""
    n: int = 1
    """Completions of the prompt, its blocks shared: the prompt is prefilled once."""
    logprobs: int | None = None
    """None: no log-probabilities; 0: the sampled token's; k: and the k most probable tokens'."""

    def check(self, vocab_size: int) -> None:
        """``RequestError`` naming the first field out of its range."""
        if problem := self._problem(vocab_size):
            raise RequestError(problem)

    def _problem(self, vocab_size: int) -> str | None:
        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: object) -> bool:
            return (integer(value) or isinstance(value, float)) and math.isfinite(value)

        if not integer(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}"
        if not number(self.temperature) or self.temperature < 0:
            return f"temperature: expected a finite number >= 0, got {self.temperature!r}"
        if not integer(self.top_k) or self.top_k < 0:
            return f"top_k: expected an integer >= 0 (0: off), got {self.top_k!r}"
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p: expected a number in (0, 1], got {self.top_p!r}"
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            return f"min_p: expected a number in [0, 1], got {self.min_p!r}"
        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            return f"repetition_penalty: expected a finite number > 0 (1: off), got {self.repetition_penalty!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not number(value) or not -2 <= value <= 2:
                return f"{name}: expected a number in [-2, 2], got {value!r}"
        if not isinstance(self.logit_bias, Mapping) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            return f"logit_bias: expected a mapping of at most {MAX_LOGIT_BIAS} token ids to numbers"
        for token, bias in self.logit_bias.items():
            if not integer(token) or not 0 <= token < vocab_size or not number(bias) or not -100 <= bias <= 100:
                return f"logit_bias: expected token ids in [0, {vocab_size}) to numbers in [-100, 100], got {token!r}"
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**63 - MAX_N):
            return f"seed: expected an integer in [0, 2^63 - {MAX_N}), got {self.seed!r}"
        if any(not integer(t) or not 0 <= t < vocab_size for t in self.stop_token_ids):
            return f"stop_token_ids: expected token ids in [0, {vocab_size})"
        if isinstance(self.stop, str) or len(self.stop) > MAX_STOP_STRINGS:
            return f"stop: expected a list of at most {MAX_STOP_STRINGS} strings"
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            return f"stop: expected non-empty strings of at most {MAX_STOP_CHARS} characters"
        if not integer(self.n) or not 1 <= self.n <= MAX_N:
            return f"n: expected an integer in [1, {MAX_N}], got {self.n!r}"
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            return f"logprobs: expected an integer in [0, {MAX_LOGPROBS}] or none, got {self.logprobs!r}"
        return None


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model, and the most probable tokens' (``logprobs`` k)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def sample(
    logits: Tensor, params: SamplingParams, history: Tensor | None, num_prompt: int, generator: torch.Generator
) -> tuple[int, TokenLogprobs | None]:
    """The next token of one request from its ``logits [V]``; ``history`` its tokens so far (prompt then
    completion, the first ``num_prompt`` its prompt's), needed by the penalties only."""
    if params.temperature == 0:
        token = int(_penalised(logits, params, history, num_prompt).argmax())
    else:
        probs = token_probabilities(logits, params, history, num_prompt)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if params.logprobs is None:
        return token, None
    logprobs = logits.float().log_softmax(dim=-1)
    top = ()
    if params.logprobs:
        values, indices = logprobs.topk(params.logprobs)
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
    return token, TokenLogprobs(float(logprobs[token]), top)


def token_probabilities(logits: Tensor, params: SamplingParams, history: Tensor | None, num_prompt: int) -> Tensor:
    """What a request at ``params.temperature`` > 0 samples from: ``[V]`` float32 probabilities after the bias, the
    penalties, temperature, top-k, top-p and min-p ."""
    scores = _penalised(logits, params, history, num_prompt) / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = scores.softmax(dim=-1)
    if params.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(dim=-1) - ordered > params.top_p  # after the nucleus; the first always stays
        probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _penalised(logits: Tensor, params: SamplingParams, history: Tensor | None, num_prompt: int) -> Tensor:
    """``logits`` (float32) with the logit bias and the penalties applied."""
    scores = logits.float().clone()
    if params.logit_bias:
        tokens = torch.tensor(list(params.logit_bias), device=scores.device)
        scores[tokens] += torch.tensor(list(params.logit_bias.values()), device=scores.device)
    if params.repetition_penalty != 1.0:
        seen = history.unique()
        picked = scores[seen]
        scores[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(history[num_prompt:], minlength=scores.numel()).to(scores.dtype)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores
