"""The policy-gradient losses of online and offline RL (``train.grpo``): GRPO's advantages and clipped objective
with TRL's loss types and ratio shapes (GSPO, SAPO, two-sided clipping), the top-entropy tokens, and RLOO's
leave-one-out advantages, KL-in-the-reward and per-response objective. Pure tensor functions, as ``losses``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor) -> Tensor:
    """GRPO's group-normalised advantage ``(r - mean_G r) / (std_G r + 1e-8)`` over the last axis (population std)."""
    return (rewards - rewards.mean(dim=-1, keepdim=True)) / (rewards.std(dim=-1, unbiased=False, keepdim=True) + 1e-8)


GRPO_LOSSES = ("astrai", "grpo", "bnpo", "dr_grpo", "dapo", "sapo")
"""``--grpo_loss``: AstrAI's GRPO loss (the default) and TRL 1.16's ``loss_type`` values of the same name."""


@dataclass(frozen=True)
class RatioShape:
    """How the TRL losses of ``grpo_loss`` shape the importance ratio (TRL 1.16's GRPOConfig names in brackets)."""

    sequence_level: bool = False
    """GSPO (``importance_sampling_level="sequence"``): one ratio per response, the exponential of its mean token
    log-ratio, clipped as a whole; else one per token."""
    delta: float | None = None
    """Two-sided clipping (``delta``): the unclipped ratio capped at ``delta`` as well, so a negative advantage's
    large ratio cannot grow its loss without bound; None: off."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature where the advantage is positive (``sapo_temperature_pos``)."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature where it is not (``sapo_temperature_neg``)."""


def grpo_advantages(
    rewards: Tensor, kind: str = "astrai", scale: str = "group", batch_std: Tensor | None = None
) -> Tensor:
    """Each response's advantage from the rewards of its group ``[..., G]``.

    ``astrai``: ``group_advantages`` (population std + 1e-8). The TRL losses use TRL's: ``r - mean_G r``, divided by
    the group's Bessel-corrected std + 1e-4 (``scale`` group), by ``batch_std`` + 1e-4 (``batch``: the
    Bessel-corrected std of every reward of the batch, TRL's generation batch; None: of ``rewards``, all groups
    together) or not at all (``none``, Dr. GRPO's choice); a group of one has no std, and its advantage is 0 (TRL's
    ``nan_to_num``).
    """
    if kind == "astrai":
        return group_advantages(rewards)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "batch":
        if batch_std is None:
            batch_std = rewards.std() if rewards.numel() > 1 else torch.full((), math.nan, device=rewards.device)
        return torch.nan_to_num(centred / (batch_std + 1e-4), nan=0.0)
    std = rewards.std(dim=-1, keepdim=True) if rewards.shape[-1] > 1 else torch.full_like(centred, float("nan"))
    return torch.nan_to_num(centred / (std + 1e-4), nan=0.0)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    clip_eps: float,
    kl_coef: float,
    kind: str = "astrai",
    clip_eps_high: float | None = None,
    max_response_tokens: int = 1024,
    tokens_per_micro_batch: Tensor | float | None = None,
    shape: RatioShape = RatioShape(),
    policy_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO (Shao et al. 2024): PPO's clipped objective and a KL penalty to the reference, per response token.

    ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are ``[N, T]`` (response tokens of N sequences),
    ``advantages`` is ``[N]``. With ``ratio = exp(logp - logp_old)`` each token's objective is
    ``-min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) A)`` (``clip_eps_high`` None: ``clip_eps``; DAPO's
    asymmetric bound otherwise) plus ``kl_coef`` x an estimate of the KL, Schulman's k3 with ``r = exp(logp_ref -
    logp)``: ``r - log(r + 1e-8) - 1`` for ``astrai`` (AstrAI's), ``(r - log r - 1) x ratio`` for the others (TRL's
    default ``use_bias_correction_kl``: the ratio makes its gradient the unbiased reverse-KL one, even where it is 1).
    The tokens are then averaged as ``kind`` says:

    - ``astrai`` and ``bnpo``: over every response token of the micro-batch;
    - ``grpo``: over each response's tokens, then over the responses (TRL's ``grpo``, the paper's);
    - ``dr_grpo``: summed and divided by ``N x max_response_tokens`` (Dr. GRPO's constant, TRL's
      ``max_completion_length``), so no response's length weights its tokens;
    - ``dapo``: summed and divided by ``tokens_per_micro_batch``, the mean response tokens of a micro-batch over
      the whole batch of rollouts and every rank (``train.grpo.Rollouts``). Divided by ``grad_accum_steps`` by the
      loop and averaged over the ranks, the step's gradient is that of one token mean over every response token of
      the step (TRL's ``dapo``: its ``num_items_in_batch`` per accumulation window).

    ``shape`` (TRL's losses only): GSPO's sequence-level ratio (Zheng et al. 2025: ``exp`` of the response's mean
    token log-ratio, clipped as one; its KL correction weighted by it), two-sided clipping (``min(ratio, delta)`` in
    the unclipped term), and ``sapo`` (Gao et al. 2025): the clip replaced by a soft gate, each token's objective
    ``sigmoid(tau (ratio - 1)) x 4 / tau x A`` with ``tau`` the positive or negative advantage's temperature, whose
    gradient at ratio 1 is the plain policy gradient's and fades as the ratio leaves 1; averaged as ``grpo``.
    ``policy_tokens`` ``[N, T]`` (``high_entropy_mask``): the tokens whose policy term counts (the KL term and the
    averaging still take every response token, as TRL's ``top_entropy_quantile``); None: all.

    A micro-batch without response tokens gives 0.
    """
    if kind not in GRPO_LOSSES:
        raise ValueError(f"unknown grpo loss {kind!r}; expected one of {GRPO_LOSSES}")
    if kind == "dapo" and tokens_per_micro_batch is None:
        raise ValueError("grpo loss dapo needs tokens_per_micro_batch, which online rollouts attach")
    mask = mask.float()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    if shape.sequence_level:  # [N, 1]: broadcast over the response's tokens below
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)
    if kind == "sapo":
        positive = torch.tensor(shape.sapo_temperature_pos, device=adv.device)
        temperature = torch.where(adv > 0, positive, shape.sapo_temperature_neg)
        surrogate = torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * adv
    else:
        unclipped = ratio if shape.delta is None else ratio.clamp(max=shape.delta)
        surrogate = torch.minimum(unclipped * adv, ratio.clamp(1 - clip_eps, 1 + high) * adv)
    log_ref_ratio = ref_logprobs - logprobs
    ref_ratio = torch.exp(log_ref_ratio)
    if kind == "astrai":
        kl = ref_ratio - torch.log(ref_ratio + 1e-8) - 1
    else:  # TRL 1.16's default use_bias_correction_kl: weighted by the ratio (the unbiased reverse-KL gradient)
        kl = (ref_ratio - log_ref_ratio - 1) * ratio

    def aggregate(per_token: Tensor) -> Tensor:
        if kind in ("grpo", "sapo"):
            return ((mask * per_token).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        if kind == "dr_grpo":
            return (mask * per_token).sum() / (per_token.shape[0] * max_response_tokens)
        if kind == "dapo":
            return (mask * per_token).sum() / tokens_per_micro_batch
        return (mask * per_token).sum() / mask.sum().clamp(min=1.0)

    policy_loss = aggregate(-surrogate if policy_tokens is None else -surrogate * policy_tokens)
    kl_loss = kl_coef * aggregate(kl)
    metrics = {"policy_loss": policy_loss.detach(), "kl_loss": kl_loss.detach()}
    if kind != "sapo":  # its gate clips nothing
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + high)).float()
        metrics["clip_fraction"] = (mask * clipped).sum() / mask.sum().clamp(min=1.0)
    return policy_loss + kl_loss, metrics


def rloo_advantages(rewards: Tensor, normalize: bool = False) -> Tensor:
    """RLOO's advantages (Ahmadian et al. 2024; TRL 1.16's RLOOTrainer) from the rewards of each group ``[..., G]``:
    each response's reward less the mean reward of the other ``G - 1`` (its leave-one-out baseline); with
    ``normalize``, then centred and divided by their Bessel-corrected std + 1e-4 over every group given (TRL's
    ``normalize_advantages``, over its generation batch). A group of one has no baseline: advantage 0."""
    size = rewards.shape[-1]
    if size == 1:
        return torch.zeros_like(rewards)
    advantages = rewards - (rewards.sum(dim=-1, keepdim=True) - rewards) / (size - 1)
    if normalize:
        std = advantages.std() if advantages.numel() > 1 else torch.full((), math.nan, device=rewards.device)
        advantages = torch.nan_to_num((advantages - advantages.mean()) / (std + 1e-4), nan=0.0)
    return advantages


def rloo_penalised_rewards(
    rewards: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    clip_range: tuple[float, float] | None,
) -> tuple[Tensor, Tensor]:
    """RLOO's rewards ``[N]``: clipped to ``clip_range`` (``(low, high)`` or None) and less ``kl_coef`` x each
    response's summed first-order KL estimate ``logp_old - logp_ref`` over its tokens, as TRL's RLOOTrainer puts
    the KL into the reward rather than the loss (the estimate can be negative per token); and the mean per-token
    estimate, for the log."""
    if clip_range is not None:
        rewards = rewards.clamp(min=clip_range[0], max=clip_range[1])
    mask = mask.float()
    per_token = (old_logprobs - ref_logprobs) * mask
    return rewards - kl_coef * per_token.sum(-1), per_token.sum() / mask.sum().clamp(min=1.0)


def rloo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO's objective as TRL 1.16's RLOOTrainer has it: one ratio per response, ``exp`` of its *summed* token
    log-ratio against the sampling policy, PPO-clipped (``1 - clip_eps``, ``1 + clip_eps_high``) with the response's
    advantage ``[N]``, the mean over responses."""
    mask = mask.float()
    ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(-1))
    high = clip_eps if clip_eps_high is None else clip_eps_high
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + high) * advantages).mean()
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + high)).float().mean()
    return loss, {"policy_loss": loss.detach(), "clip_fraction": clipped}


def high_entropy_mask(entropies: Tensor, mask: Tensor, threshold: Tensor) -> Tensor:
    """GRPO's top-entropy tokens (Wang et al. 2025, "the 80/20 rule"; TRL's ``get_high_entropy_mask``): the masked
    tokens whose entropy is at least ``threshold`` (the quantile of every masked token's entropy, all data-parallel
    ranks together), float."""
    return ((entropies * mask >= threshold) & mask.bool()).float()
