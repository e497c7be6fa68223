"""Training losses as pure tensor functions (no Fabric, no model import). Logits are cast to float32 first.

Each returns the loss of one micro-batch; the loop divides by ``grad_accum_steps`` (AstrAI's scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def causal_lm_loss(
    logits: Tensor, targets: Tensor, loss_mask: Tensor | None = None, label_smoothing: float = 0.0
) -> Tensor:
    """Next-token cross-entropy, the mean over the trained tokens of the micro-batch.

    ``seq``: no mask, every token counts (AstrAI's mean over ``B * S``). ``sft``: ``loss_mask`` (aligned with
    ``targets``) selects the tokens; a micro-batch without any trainable token gives a loss of exactly 0 with
    zero gradients, where AstrAI's ``cross_entropy`` returns NaN and poisons the step (B8).
    """
    logits = logits.flatten(0, 1).float()
    targets = targets.flatten()
    if loss_mask is None:
        return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
    mask = loss_mask.flatten().bool()
    masked = targets.masked_fill(~mask, IGNORE_INDEX)
    loss = F.cross_entropy(logits, masked, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)
    # Chosen on the device (an ``if`` would wait for it every micro-batch): with no trained token the mean above is
    # 0/0, and zero times the logits' sum keeps the graph (and DDP/FSDP hooks) intact with a zero gradient; the
    # untaken branch gets no gradient, and cross-entropy's backward divides by nothing when every target is ignored.
    return torch.where(mask.any(), loss, logits.sum() * 0.0)


CHUNKED_LOSS_ELEMENTS = 1 << 26
"""Float32 logits of a micro-batch (positions x vocabulary) from which a loss whose backward recomputes the logits
(dpo, kto, grpo with a trained head) is fused and chunked by default, for its memory (256 MB; Qwen's 151,936-token
vocabulary reaches it at 442 positions): below it the recomputation makes it slower than the whole logits."""
CHUNK_ELEMENTS = 1 << 23
"""Float32 logits in one chunk of the fused loss (32 MB): ``CHUNK_ELEMENTS // vocab`` positions at a time (55 at
Qwen's vocabulary). Half of 64 MB took a trained head's fused head-plus-loss peak from 2.97x to 3.14x below the
unfused one, its steps staying faster than unfused ones (bench/qlora_memory.py, docs/performance.md)."""


def loss_chunk_positions(
    requested: int | None, vocab_size: int, positions_per_micro_batch: int, faster_fused: bool = False
) -> int:
    """Positions per chunk of the fused head and loss (``head_token_nll``), 0 for the model's whole logits:
    ``requested`` (``--loss_chunk_size``) where given; else, in chunks of ``CHUNK_ELEMENTS``, at any size where
    the fused head is the faster (``faster_fused``) and from ``CHUNKED_LOSS_ELEMENTS`` logits on otherwise, for
    the memory.

    Where it is the faster (``Start.fused_loss_is_faster``; bench/fused_loss.py, docs/performance.md): a loss whose
    per-token weights are known before the forward (seq's and sft's mean: ``head_nll_loss`` takes the gradients in
    the forward) on CPU, where it does the whole head's three matmuls and fewer passes over the logits, each chunk
    in cache, and was never the slower against the whole logits and ``F.cross_entropy`` at nine shapes from
    256 x 2,048 to 1,024 x 151,936 logits (1.00-1.38x as fast, medians of 15 turns). A loss whose backward
    recomputes the logits (dpo, kto, grpo with a trained head) does a fourth matmul and was the slower at every
    shape (0.68-0.98x): fused for its memory only. On CUDA, by count rather than measurement: the fused
    head takes the weight's gradient as a float32 matmul (``addmm_`` into a float32 buffer), where a bf16 head's
    plain backward runs it in bf16 at several times the FLOP/s, a third of the head's matmul work; the passes it
    saves are memory-bound and worth less than that at a large hidden size. So CUDA keeps the threshold, the
    choice for memory."""
    if requested is not None:
        return requested
    if not faster_fused and vocab_size * positions_per_micro_batch < CHUNKED_LOSS_ELEMENTS:
        return 0
    return max(1, CHUNK_ELEMENTS // vocab_size)


def loss_chunk_reason(requested: int | None, faster_fused: bool) -> str:
    """Why ``loss_chunk_positions`` fused the head and the loss, in the plan's words."""
    if requested is not None:
        return "--loss_chunk_size"
    if faster_fused:
        return "the default for a mean over tokens on CPU, where it was never the slower"
    return f"the default from {CHUNKED_LOSS_ELEMENTS * 4 // 2**20} MB of float32 logits per micro-batch, for memory"


def token_nll_loss(token_nll: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """``causal_lm_loss`` from per-token losses (the fused head's ``token_nll``): the mean over every token (seq) or
    over those ``loss_mask`` selects (sft), exactly 0 with zero gradients where it selects none (B8)."""
    if loss_mask is None:
        return token_nll.mean()
    mask = loss_mask.float()
    loss = (token_nll * mask).sum() / mask.sum().clamp(min=1.0)
    return torch.where(mask.any(), loss, token_nll.sum() * 0.0)  # chosen on the device, as causal_lm_loss does


def with_moe_aux_loss(
    task_loss: Tensor, aux_loss: Tensor | None, router_stats: list[dict[str, Tensor]] | None, coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """``task + coef * aux`` for MoE models (``aux_loss`` and ``router_stats`` are the model's output's), with
    AstrAI's metric names and routing diagnostics; the task loss alone otherwise."""
    metrics = {"task_loss": task_loss.detach()}
    if aux_loss is None:
        return task_loss, metrics
    metrics.update(moe_aux_loss=aux_loss.detach(), moe_aux_loss_weighted=(coef * aux_loss).detach())
    metrics.update(moe_diagnostics(router_stats or []))
    return task_loss + coef * aux_loss, metrics


def moe_diagnostics(router_stats: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """AstrAI's router entropy (averaged over MoE layers) and ``expert_tokens`` ``[num_moe_layers, num_experts]``:
    how many of the micro-batch's tokens chose each expert, which ``moe_load_metrics`` turns into the load."""
    if not router_stats:
        return {}
    entropy = torch.stack([stats["entropy"] for stats in router_stats]).mean()
    return {"router_entropy": entropy, EXPERT_TOKENS: torch.stack([stats[EXPERT_TOKENS] for stats in router_stats])}


EXPERT_TOKENS = "expert_tokens"
"""The metric holding each MoE layer's tokens per expert: not logged; ``moe_load_metrics`` replaces it."""


def moe_load_metrics(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """``metrics`` with ``expert_tokens`` replaced by AstrAI's load diagnostics, averaged over MoE layers: the
    fraction of experts given no token, and the mean and largest load relative to an even split.

    ``train_step`` passes the counts averaged over a window's micro-batches and every rank, so the load is the
    model's over the whole step (under expert parallelism, what each expert received from every rank); AstrAI's
    are one micro-batch's on one rank. The values are unchanged by the averaging: AstrAI's ratios of counts (with
    its mean clamped at 1 token, which the average keeps at one micro-batch's scale)."""
    if EXPERT_TOKENS not in metrics:
        return metrics
    metrics = dict(metrics)
    counts = metrics.pop(EXPERT_TOKENS)
    load = counts / counts.mean(dim=-1, keepdim=True).clamp(min=1.0)
    per_layer = torch.stack([(counts == 0).float().mean(-1), (load - 1).abs().mean(-1), load.amax(-1)], dim=-1)
    names = ("dead_expert_fraction", "load_imbalance_mean", "load_imbalance_max")
    return metrics | dict(zip(names, per_layer.mean(dim=0), strict=True))


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log p(target)`` at every position: ``logits [..., L, V]`` and ``targets [..., L]`` → ``[..., L]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO (Rafailov et al. 2023): ``-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))``, mean over pairs.

    Inputs are summed response log-probabilities per sequence ``[B]`` (AstrAI's ``reduction="sum"``). Metrics:
    the implicit rewards ``beta * (pi - ref)`` of chosen and rejected, their margin, and the fraction of pairs
    where the chosen reward is higher (reward accuracy). ``preference_loss`` with ``kind="sigmoid"``.
    """
    unused = torch.ones_like(policy_chosen)  # token counts and NLL: the sigmoid loss reads neither
    pairs = PairLogps(policy_chosen, policy_rejected, unused, unused, unused.sum(), ref_chosen, ref_rejected)
    return preference_loss("sigmoid", pairs, beta)


PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "cpo", "orpo")
"""``--dpo_loss``: DPO's sigmoid (AstrAI's, the default), its IPO / hinge / robust variants, and the reference-free
SimPO, CPO and ORPO, each as TRL 1.16 computes it (``preference_loss``)."""
REFERENCE_FREE = ("simpo", "cpo", "orpo")
"""Preference losses that compare the policy's chosen and rejected responses alone: no reference model is built."""
SMOOTHED = ("robust", "simpo", "cpo")
"""Preference losses with a label smoothing term (``--dpo_label_smoothing``)."""


@dataclass(frozen=True)
class PairLogps:
    """One micro-batch of preference pairs as a loss sees it: the summed response log-probabilities ``[B]`` of the
    policy and (None for reference-free losses) the reference, the responses' trained token counts ``[B]``, and the
    policy's mean negative log-likelihood of the chosen responses' tokens (CPO's and ORPO's sft term)."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    chosen_nll: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None


def preference_loss(
    kind: str,
    pairs: PairLogps,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    orpo_beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The preference loss ``kind`` (``PREFERENCE_LOSSES``), mean over pairs, and its metrics.

    With ``d = (pi_c - ref_c) - (pi_r - ref_r)`` (summed log-probabilities) and ``e = label_smoothing``:

    - sigmoid (DPO, Rafailov et al. 2023): ``-logsigmoid(beta d)``, exactly ``dpo_loss``;
    - hinge (SLiC): ``relu(1 - beta d)``;
    - ipo (Azar et al. 2023, eq. 17): ``(d' - 1 / (2 beta))^2`` with ``d'`` the log-ratios averaged per response
      token, as TRL computes it (its comment: the form the IPO authors confirmed);
    - robust (Chowdhury et al. 2024): ``(-(1 - e) logsigmoid(beta d) + e logsigmoid(-beta d)) / (1 - 2e)``;
    - simpo (Meng et al. 2024): ``z = mean_c - mean_r - gamma / beta`` on the policy's log-probabilities averaged
      per token, ``-(1 - e) logsigmoid(beta z) - e logsigmoid(-beta z)`` (TRL's CPOTrainer with ``loss_type
      simpo``, ``cpo_alpha 0``: the paper's loss, no sft term);
    - cpo (Xu et al. 2024): the same on ``z = pi_c - pi_r`` (summed), plus ``cpo_alpha`` x the chosen tokens' NLL;
    - orpo (Hong et al. 2024): the chosen tokens' NLL minus ``orpo_beta`` x ``logsigmoid(log odds ratio)``, the
      odds ``p / (1 - p)`` of the per-token mean log-probabilities.

    Metrics: the preference term (``dpo_loss``), the implicit rewards (``beta (pi - ref)``, or ``beta pi`` on the
    log-probabilities the loss uses where there is no reference), their margin and accuracy, and ``nll_loss`` for
    cpo and orpo.
    """
    chosen, rejected = pairs.chosen, pairs.rejected
    # A response without trained tokens (an online sample that ended at once) averages to 0, not 0/0.
    chosen_tokens, rejected_tokens = pairs.chosen_tokens.clamp(min=1), pairs.rejected_tokens.clamp(min=1)
    mean_chosen, mean_rejected = chosen / chosen_tokens, rejected / rejected_tokens
    nll = None
    if kind in REFERENCE_FREE:
        used_chosen, used_rejected = (chosen, rejected) if kind == "cpo" else (mean_chosen, mean_rejected)
        scale = orpo_beta if kind == "orpo" else beta  # TRL's logged rewards: its trainer's ``beta`` x log-probs
        chosen_reward, rejected_reward = scale * used_chosen, scale * used_rejected
        if kind == "orpo":
            log_odds = (used_chosen - used_rejected) - (_log1mexp(used_chosen) - _log1mexp(used_rejected))
            per_pair = -orpo_beta * F.logsigmoid(log_odds)
            nll = pairs.chosen_nll
        else:
            z = used_chosen - used_rejected - (simpo_gamma / beta if kind == "simpo" else 0.0)
            per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
            nll = pairs.chosen_nll * cpo_alpha if kind == "cpo" else None
    else:
        chosen_ratio, rejected_ratio = chosen - pairs.ref_chosen, rejected - pairs.ref_rejected
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        d = chosen_ratio - rejected_ratio
        if kind == "sigmoid":
            per_pair = -F.logsigmoid(beta * d)
        elif kind == "hinge":
            per_pair = torch.relu(1 - beta * d)
        elif kind == "ipo":
            per_token = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
            per_pair = (per_token - 1 / (2 * beta)) ** 2
        elif kind == "robust":
            e = label_smoothing
            per_pair = (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
        else:
            raise ValueError(f"unknown preference loss {kind!r}; expected one of {PREFERENCE_LOSSES}")
    preference = per_pair.mean()
    loss = preference + nll if nll is not None else preference
    margin = (chosen_reward - rejected_reward).detach()
    metrics = {
        "dpo_loss": preference.detach(),
        "chosen_reward": chosen_reward.detach().mean(),
        "rejected_reward": rejected_reward.detach().mean(),
        "reward_margin": margin.mean(),
        "reward_accuracy": (margin > 0).float().mean(),
    }
    if kind in ("cpo", "orpo"):
        metrics["nll_loss"] = pairs.chosen_nll.detach()
    return loss, metrics


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation: ``log(-expm1(x))`` near 0, ``log1p(-exp(x))``
    below ``-log 2`` (Maechler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def kto_loss(
    policy: Tensor,
    reference: Tensor,
    desirable: Tensor,
    kl: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO (Ethayarajh et al. 2024) as TRL 1.16's ``KTOTrainer`` computes it, mean over the samples:
    ``w_d (1 - sigmoid(beta (r - kl)))`` for a desirable sample, ``w_u (1 - sigmoid(beta (kl - r)))`` for an
    undesirable one, with ``r = pi - ref`` (summed response log-probabilities ``[B]``) and ``kl`` the detached
    baseline (``kto.kl_baseline``). Metrics: the loss, the baseline, and the implicit rewards ``beta r`` of the
    micro-batch's desirable and undesirable samples (0 where it has none)."""
    ratio = policy - reference
    loss = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    ).mean()
    rewards = beta * ratio.detach()

    def mean_where(mask: Tensor) -> Tensor:
        return (rewards * mask).sum() / mask.sum().clamp(min=1)

    metrics = {
        "kto_loss": loss.detach(),
        "kl": kl.detach(),
        "desirable_reward": mean_where(desirable),
        "undesirable_reward": mean_where(~desirable),
    }
    return loss, metrics


def reward_model_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """A reward model's Bradley-Terry loss on the scores of pairs ``[B]``: ``-log sigmoid(r_c - r_r - margin)``
    averaged over the pairs (``margin`` per pair, none by default; Touvron et al. 2023's margin), plus
    ``center_coef * mean((r_c + r_r)^2)``, which keeps the scores centred on 0 (Eisenstein et al. 2023), as TRL
    1.16's ``RewardTrainer`` computes them."""
    difference = chosen - rejected
    loss = -F.logsigmoid(difference - (margin if margin is not None else 0.0)).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    metrics = {
        "accuracy": (difference > 0).float().mean(),
        "reward_margin": difference.detach().mean(),
        "chosen_reward": chosen.detach().mean(),
        "rejected_reward": rejected.detach().mean(),
    }
    return loss, metrics


ENTROPY_CHUNK_ROWS = 128
"""Positions whose softmax ``logits_entropy`` holds at once (TRL's ``entropy_from_logits`` chunk)."""


@torch.no_grad()
def logits_entropy(logits: Tensor) -> Tensor:
    """The entropy (nats, float32) of the softmax over the last axis of ``logits [..., V]`` → ``[...]``, without a
    gradient, ``ENTROPY_CHUNK_ROWS`` positions at a time: ``-sum(p log p)`` from the float32 log-softmax, as TRL's
    ``entropy_from_logits`` computes it (GRPO's top-entropy tokens, ``high_entropy_mask``)."""
    flat = logits.reshape(-1, logits.size(-1))
    entropies = torch.empty(flat.size(0), dtype=torch.float32, device=logits.device)
    for begin in range(0, flat.size(0), ENTROPY_CHUNK_ROWS):
        logp = torch.log_softmax(flat[begin : begin + ENTROPY_CHUNK_ROWS].float(), dim=-1)
        entropies[begin : begin + ENTROPY_CHUNK_ROWS] = -(logp.exp() * logp).sum(-1)
    return entropies.view(logits.shape[:-1])


@torch.no_grad()
def head_token_entropy(hidden: Tensor, weight: Tensor, chunk_size: int) -> Tensor:
    """``logits_entropy`` of the fused head's logits ``hidden [..., H] @ weight.T``, ``chunk_size`` positions at a
    time (never the whole logits), without a gradient."""
    flat = hidden.reshape(-1, hidden.size(-1))
    chunks = [logits_entropy(flat[b : b + chunk_size] @ weight.T) for b in range(0, flat.size(0), chunk_size)]
    return torch.cat(chunks).view(hidden.shape[:-1])


def head_token_nll(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, label_smoothing: float = 0.0
) -> Tensor:
    """``-log p(target)`` at every position from the final hidden states ``[..., H]`` and the head's weight
    ``[V, H]`` (the head and the log-softmax fused), computed ``chunk_size`` positions at a time, forward and
    backward: at most ``[chunk_size, V]`` float32 logits exist at once, where the unfused head and
    ``F.cross_entropy`` hold ``[positions, V]`` (at Qwen's 151,936-token vocabulary, 0.6 GB per 1,024 positions) and
    keep them for the backward. With ``label_smoothing`` ε: ``(1 - ε) * nll + ε * (lse - mean(logits))``, as
    ``F.cross_entropy`` smooths. Returns ``[...]`` float32; its gradients equal the unfused computation's up to the
    order of float32 sums (tests/test_chunked_loss.py). The model calls it inside its forward (``nll_targets``).

    A frozen head (LoRA, QLoRA) takes the hidden states' gradient in the forward, so its backward recomputes no
    logits; a trained one recomputes them, unless the loss's per-token weights are known first (``head_nll_loss``).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    nll = _HeadNLL.apply(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        chunk_size,
        label_smoothing,
        torch.is_grad_enabled(),
    )
    return nll.reshape(shape)


def head_nll_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    token_weights: Tensor,
    chunk_size: int,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``sum(token_weights * nll)`` (a float32 scalar) and the per-token ``nll`` (detached, ``head_token_nll``'s
    values) of the fused head, for a loss whose per-token weights are known before the forward (seq's and sft's mean,
    ``token_nll_weights``). Its forward takes the gradients of the hidden states and of the head's weight as well (the
    weight's summed in one float32 ``[V, H]`` buffer, the size of the gradient the unfused head produces), so the
    backward only scales them by the upstream gradient: no logits are recomputed, whether the head trains or not.
    All-zero weights (no trained token, B8) give a loss of exactly 0 and zero gradients."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    loss, nll = _WeightedHeadNLL.apply(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        token_weights.reshape(-1).float(),
        chunk_size,
        label_smoothing,
        torch.is_grad_enabled(),
    )
    return loss, nll.reshape(targets.shape)


def token_nll_weights(targets: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Float32 weights ``w`` with ``sum(w * token_nll) == token_nll_loss(token_nll, loss_mask)``: ``1 / N`` at every
    position (seq), ``mask / mask.sum()`` (sft), and all 0 where the mask selects nothing (B8: ``head_nll_loss`` gives
    exactly 0 with zero gradients)."""
    if loss_mask is None:
        return torch.full(targets.shape, 1.0 / targets.numel(), device=targets.device)
    mask = loss_mask.float()
    return mask / mask.sum().clamp(min=1.0)


def _logits_buffer(hidden: Tensor, weight: Tensor, chunk_size: int) -> Tensor | None:
    """One chunk's float32 logits, written by every chunk in turn where the head is float32 (``torch.mm(out=)``): on
    CPU a fresh chunk-sized allocation per chunk is a fresh mapping, paid again in page faults each time."""
    if hidden.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    return torch.empty(min(chunk_size, hidden.size(0)), weight.size(0), dtype=torch.float32, device=hidden.device)


def _chunk_nll(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    smoothing: float,
    grad_scale: Tensor | None,
    buffer: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's ``nll`` ``[positions]``, and given ``grad_scale [positions]`` (each position's
    weight; None: no gradient) ``grad_scale * (softmax - (1 - ε) onehot - ε / V)`` ``[positions, V]`` float32, made
    in the chunk's logits: no second chunk-sized tensor, and each pass over them one element-wise step (the
    log-sum-exp taken by hand, ``torch.logsumexp`` allocating its own exponentials)."""
    if buffer is not None:
        logits = torch.mm(hidden, weight.T, out=buffer[: hidden.size(0)])
    else:
        logits = (hidden @ weight.T).float()
    target_logits = logits.gather(-1, targets[:, None]).squeeze(-1)
    mean_logits = logits.mean(dim=-1) if smoothing else None
    largest = logits.amax(dim=-1)
    exps = logits.sub_(largest[:, None]).exp_()
    sums = exps.sum(dim=-1)
    lse = largest + sums.log()
    nll = lse - target_logits
    if smoothing:
        nll = (1 - smoothing) * nll + smoothing * (lse - mean_logits)
    if grad_scale is None:
        return nll, None
    grad_logits = exps.mul_((grad_scale / sums)[:, None])  # the softmax, scaled
    grad_logits.scatter_add_(-1, targets[:, None], ((smoothing - 1) * grad_scale)[:, None])
    if smoothing:
        grad_logits -= (smoothing / weight.size(0) * grad_scale)[:, None]
    return nll, grad_logits


def _times_weight(grad_logits: Tensor, weight: Tensor) -> Tensor:
    """``grad_logits @ weight`` in the weight's dtype, as the unfused head's backward takes it: a float32 copy of a
    bf16 head would be a ``[V, H]`` buffer."""
    return grad_logits.to(weight.dtype) @ weight


class _HeadNLL(torch.autograd.Function):
    """``head_token_nll``'s autograd, one of three ways, from what needs a gradient (``ctx.needs_input_grad``, which
    torch fills in before the forward; it says True under ``no_grad`` too, hence ``grad_enabled``):

    - the hidden states alone (a frozen head: LoRA, QLoRA): the forward stores each position's ``d nll / d hidden``
      ``[positions, H]``, and the backward scales its rows by the upstream gradient. Exact for any loss upstream
      (dpo, grpo and kto take the log-probabilities through nonlinear functions): each token's gradient is linear in
      its own upstream scalar.
    - the head's weight (full fine-tuning, a loss whose per-token weights are not known here): the backward
      recomputes each chunk's logits and turns them into ``softmax - target`` there (``_chunk_nll``, as the forward),
      scaled by the upstream gradient, the weight's gradient summed in place (``addmm_``).
    - nothing (a reference model, evaluation, rollouts): the values alone.

    No step holds more than one chunk of logits. The gradients are those of ``F.cross_entropy(hidden @ weight.T)``:
    ``d nll / d logits = softmax - (1 - ε) onehot - ε / V``."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int, smoothing: float, grad_enabled: bool
    ) -> Tensor:
        needs_hidden, needs_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        store = needs_hidden and not needs_weight
        nll = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        # Float32 whatever the hidden states' dtype: the rows are scaled in the backward before the cast, as there.
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if store else None
        scale = torch.ones_like(nll) if store else None
        buffer = _logits_buffer(hidden, weight, chunk_size)
        for begin in range(0, hidden.size(0), chunk_size):
            rows = slice(begin, begin + chunk_size)
            nll[rows], grad_logits = _chunk_nll(
                hidden[rows], weight, targets[rows], smoothing, scale[rows] if store else None, buffer
            )
            if store:
                grad_hidden[rows] = _times_weight(grad_logits, weight)
        ctx.chunk_size, ctx.smoothing, ctx.stored, ctx.hidden_dtype = chunk_size, smoothing, store, hidden.dtype
        if store:
            ctx.save_for_backward(grad_hidden)
        elif needs_weight:
            ctx.save_for_backward(hidden, weight, targets)
        return nll

    @staticmethod
    def backward(ctx, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.stored:
            (grad_hidden,) = ctx.saved_tensors
            return (grad_nll[:, None] * grad_hidden).to(ctx.hidden_dtype), None, None, None, None, None
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # A trained head sums its chunks' gradients in place (addmm_), never holding a second weight-sized temporary.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        weight_float = weight.float()  # once, not per chunk (the weight itself where it is float32 already)
        buffer = _logits_buffer(hidden, weight, ctx.chunk_size)
        for begin in range(0, hidden.size(0), ctx.chunk_size):
            rows = slice(begin, begin + ctx.chunk_size)
            _, grad_logits = _chunk_nll(hidden[rows], weight, targets[rows], ctx.smoothing, grad_nll[rows], buffer)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight_float).to(hidden.dtype)
            grad_weight.addmm_(grad_logits.T, hidden[rows].float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


class _WeightedHeadNLL(torch.autograd.Function):
    """``head_nll_loss``'s autograd: the forward turns each chunk's logits into ``w * (softmax - target)`` and takes
    from it the hidden states' rows and the weight's summed gradient (``addmm_`` into one float32 ``[V, H]``, only
    where the head trains); the backward multiplies them by the upstream scalar (the loop's ``1 / grad_accum_steps``,
    a precision plugin's scale), in place. The per-token ``nll`` is an output without a gradient (metrics)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        token_weights: Tensor,
        chunk_size: int,
        smoothing: float,
        grad_enabled: bool,
    ) -> tuple[Tensor, Tensor]:
        needs_hidden, needs_weight = (grad_enabled and needed for needed in ctx.needs_input_grad[:2])
        with_grad = needs_hidden or needs_weight
        nll = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        buffer = _logits_buffer(hidden, weight, chunk_size)
        for begin in range(0, hidden.size(0), chunk_size):
            rows = slice(begin, begin + chunk_size)
            nll[rows], grad_logits = _chunk_nll(
                hidden[rows], weight, targets[rows], smoothing, token_weights[rows] if with_grad else None, buffer
            )
            if not with_grad:
                continue
            if needs_hidden:
                grad_hidden[rows] = _times_weight(grad_logits, weight)
            if needs_weight:
                grad_weight.addmm_(grad_logits.T, hidden[rows].float())
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(nll)
        return (nll * token_weights).sum(), nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: the weight's gradient is the one float32 [V, H] this loss holds (a second backward through the
        # same graph fails the saved tensors' version check rather than scaling twice).
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss).to(ctx.hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
