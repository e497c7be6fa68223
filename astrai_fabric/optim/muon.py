"""``muon_adamw``, AstrAI's default: ``torch.optim.Muon`` for matrices, AdamW for the rest.

The split is by name (``composite.is_matrix_param``): matrices go to Muon (weight decay ``--weight_decay``),
everything else to AdamW (betas 0.9/0.95, no decay). ``optimizer.pt`` is ``{"muon": ..., "adamw": ...}``.

Muon's Newton-Schulz iteration: torch runs it in bfloat16, which on CPUs without bf16 matrix units is ~37x
slower than float32. ``MuonNS`` is ``torch.optim.Muon`` with the iteration's dtype as a per-instance setting; in
bfloat16 it *is* torch's step, and torch's Muon is untouched for any other code in the process.

Across ranks (``optim.muon_owners``) each matrix is orthogonalised whole by one owner rank, on the same matrix one
process would see, so the update equals the single-process one: for sharded matrices (FSDP, HSDP, FSDP over
tensor parallelism) the owner gathers only its matrices' pieces and sends each rank its piece of the result; under
DDP, when asked (``spread_replicated``; the CLI's default on CPU), owners send every rank their results. Matrices
no owner can take (DDP's otherwise, a mesh over part of the ranks) are orthogonalised whole on every rank (the
shards gathered first). ``MuonNS.describe_layout`` says which. One process runs the step it always did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import AdamW, Muon

from astrai_fabric.optim.composite import CompositeOptimizer, evaluate_closure, fused_if_possible, is_matrix_param
from astrai_fabric.optim.muon_owners import OwnerPlan, exchange, local_block, matrix_layout
from astrai_fabric.torch_private import muon_init_group

OWNER_ROUND_BYTES = 256 * 2**20
"""The most bytes of whole matrices an owner rank assembles at once (``muon_owners.OwnerPlan.rounds``): one
round (two all-to-alls) per step for models whose matrices fit, a few more rounds for larger ones, instead of each
rank holding its whole share (~1/W of every matrix) at once. The old path held one matrix at a time."""

STACK_MAX_NUMEL = 2**13
"""The largest matrix (elements) an owner stacks with others of its shape for one batched Newton-Schulz
(``newton_schulz`` on a stack); larger ones run alone. Measured on CPU, one thread (``bench/muon_distributed.py
--stack``, docs/performance.md): stacks of 64 x 128 matrices ran 1.1-1.5x faster, from 128 x 256 up (MoE experts'
sizes included) 0.8-0.9x, results bit-identical either way. Not measured on a GPU, where batched products should
win at larger sizes too."""

ADAMW_BETAS = (0.9, 0.95)
"""AdamW's betas in ``muon_adamw`` and ``mano_adamw`` (torch's default second beta is 0.999)."""


def resolve_ns_dtype(ns_dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 elsewhere (torch's and AstrAI's choice)."""
    if ns_dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[ns_dtype]


def newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation (Muon), torch's algorithm with the working ``dtype`` a parameter.

    ``matrix`` may also be a stack of same-shape matrices (``[count, rows, cols]``), each orthogonalised alone with
    batched products: an owner's many small matrices (MoE experts) then cost one kernel and one Python pass per
    product instead of one per matrix. A single matrix takes torch's own operations."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    stacked = matrix.dim() == 3
    transposed = matrix.size(-2) > matrix.size(-1)
    if transposed:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True) if stacked else x.norm()
    x = x / norm.clamp(min=eps)  # spectral norm at most 1
    product = torch.baddbmm if stacked else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT
        x = product(x, product(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if transposed else x


class MuonNS(Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype`` (state and groups unchanged), once
    per matrix across the ranks where the layout allows (see the module docstring).

    ``spread_replicated`` (default False): under DDP (plain tensors on several ranks, every rank holding the same
    matrices and gradients) each rank orthogonalises only the matrices it owns and sends them to every other rank
    (one all-to-all per step: an all-gather's bytes). It trades each rank's share ``(W - 1) / W`` of the
    iteration's FLOPs (``muon_owners.newton_schulz_flops``, ~``30 n^3`` for an ``n x n`` matrix at 5 steps) for
    receiving the same share of the matrices' bytes (``4 n^2`` in float32): ~``7.5 n`` FLOPs saved per byte
    received, which pays where a rank's matrix throughput over its link bandwidth is below that (fast
    interconnects, large matrices) and not over slow links; the CLI turns it on for CPU processes, where it
    measured faster (``muon_owners.resolve_spread_replicated``). It also applies to HSDP with one shard per
    replica (a replicated DTensor). Sharded matrices are always spread: where they split evenly that costs no more
    communication than the gather it replaces.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        spread_replicated: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        # Attributes, not group keys: optimizer.pt stays exactly torch's layout.
        self.ns_dtype = ns_dtype
        self.spread_replicated = spread_replicated
        self.owner_round_bytes: int | None = OWNER_ROUND_BYTES
        self._owner_plan: tuple[tuple, OwnerPlan, dict[int, int]] | None = None

    def owner_plan(self) -> OwnerPlan | None:
        """Who orthogonalises which matrix (``muon_owners.OwnerPlan``, matrices in ``param_groups`` order), made
        from the parameters' shapes and layouts once and kept while they stay; None in one process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        params = [p for group in self.param_groups for p in group["params"]]
        steps = [group["ns_steps"] for group in self.param_groups for _ in group["params"]]
        world_size = dist.get_world_size()
        key = (tuple(map(id, params)), tuple(steps), self.spread_replicated, world_size)
        if self._owner_plan is None or self._owner_plan[0] != key:
            layouts = [matrix_layout(p, world_size) for p in params]
            plan = OwnerPlan.build(layouts, steps, world_size, dist.get_rank(), self.spread_replicated)
            self._owner_plan = key, plan, {id(p): index for index, p in enumerate(params)}
        return self._owner_plan[1]

    def describe_layout(self) -> str:
        """How the iteration is shared among the ranks, in one line for the plan (``OwnerPlan.describe``)."""
        plan = self.owner_plan()
        return "one process: it orthogonalises every matrix" if plan is None else plan.describe()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        plan = self.owner_plan()
        if plan is not None and plan.spreads_any:
            loss = evaluate_closure(closure)
            self._step_with_owners(plan)
            return loss
        has_dtensor = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])
        if self.ns_dtype == torch.bfloat16 and not has_dtensor:
            return super().step(closure)  # exactly torch's (and AstrAI's) update
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            muon_init_group(self, group, params, grads, buffers)  # torch's: creates momentum buffers as torch does
            momentum = group["momentum"]
            for param, grad, buf in zip(params, grads, buffers, strict=True):
                # Torch's Muon step, with the orthogonalisation below as the only change.
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                self._apply(param, self._orthogonalise(update, group), group)
        return loss

    def _step_with_owners(self, plan: OwnerPlan) -> None:
        """Torch's step, the iteration run by each matrix's owner (``muon_owners.exchange``); matrices the plan
        does not spread take ``_orthogonalise``'s path, after the exchange, in the same order on every rank."""
        index_of = self._owner_plan[2]
        work, group_of = [], {}
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            muon_init_group(self, group, params, grads, buffers)
            momentum = group["momentum"]
            for param, grad, buf in zip(params, grads, buffers, strict=True):
                buf.lerp_(grad, 1 - momentum)  # momentum stays as torch keeps it: sharded or replicated
                index = index_of[id(param)]
                group_of[index] = group
                update = None
                if plan.needs_update(index):  # a replicated matrix another rank owns needs none here
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                work.append((index, param, update))
        if not work:
            return
        spread = [(index, param, update) for index, param, update in work if plan.owners[index] is not None]

        def orthogonalise(wholes: dict[int, Tensor]) -> dict[int, Tensor]:
            """The matrices this rank owns, orthogonalised: small ones of one shape and settings stacked
            (``newton_schulz`` on a stack), any other alone as one process does it."""
            batches: dict[tuple, list[int]] = {}
            for index, whole in wholes.items():
                group = group_of[index]
                settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], self.ns_dtype)
                stackable = whole.numel() <= STACK_MAX_NUMEL
                batches.setdefault((tuple(whole.shape), whole.dtype, settings, stackable), []).append(index)
            done = {}
            for (_, dtype, settings, stackable), indices in batches.items():
                if stackable and len(indices) > 1:
                    stacked = newton_schulz(torch.stack([wholes[i] for i in indices]), *settings).to(dtype)
                    done |= dict(zip(indices, stacked.unbind(), strict=True))
                else:
                    done |= {i: newton_schulz(wholes[i], *settings).to(dtype) for i in indices}
            return done

        results = exchange(
            plan,
            [index for index, _, _ in spread],
            {index: update for index, _, update in spread if update is not None},
            {index: param for index, param, _ in spread},
            orthogonalise,
            local_block(work[0][1]).device,
            self.owner_round_bytes,
        )
        # The rate torch's step would have used where one process hands the step to torch (plain, bfloat16).
        torch_rate = self.ns_dtype == torch.bfloat16 and not any(isinstance(p, DTensor) for _, p, _ in work)
        for index, param, update in work:
            group = group_of[index]
            update = results[index] if index in results else self._orthogonalise(update, group)
            self._apply(param, update, group, torch_rate)

    def _apply(self, param: Tensor, update: Tensor, group: dict[str, Any], torch_rate: bool = False) -> None:
        """Weight decay, then the orthogonalised update at Muon's adjusted learning rate (``torch_rate``: in
        torch's arithmetic, for the steps ``step`` hands to torch in one process)."""
        lr = group["lr"]
        rows, cols = param.shape[:2]
        if torch_rate:
            # torch.optim.Muon's own expression (its ``_adjust_lr``), which may round one bit apart from ours below.
            ratios = {"match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)), "original": math.sqrt(max(1, rows / cols))}
            adjusted_lr = lr * ratios.get(group["adjust_lr_fn"] or "original", 1.0)
        elif group["adjust_lr_fn"] == "match_rms_adamw":
            adjusted_lr = lr * 0.2 * max(rows, cols) ** 0.5
        else:
            adjusted_lr = lr * max(1.0, rows / cols) ** 0.5
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(update, alpha=-adjusted_lr)

    def _orthogonalise(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        args = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        if not isinstance(update, DTensor):
            return newton_schulz(update, *args).to(update.dtype)
        # The iteration needs the whole matrix: gather it, orthogonalise it on every rank, keep the local shard.
        full = newton_schulz(update.full_tensor(), *args).to(update.dtype)
        return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


class MuonAdamW(CompositeOptimizer):
    """Muon for matrices plus AdamW for the rest, stepped together (AstrAI's ``muon_adamw``)."""

    name = "muon_adamw"

    def __init__(
        self,
        named_params: Iterable[tuple[str, Tensor]],
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: torch.dtype = torch.bfloat16,
        spread_replicated: bool = False,
    ) -> None:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        matrices = [p for n, p in named if is_matrix_param(n, p)]
        others = [p for n, p in named if not is_matrix_param(n, p)]
        muon = MuonNS(
            matrices,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            spread_replicated=spread_replicated,
        )
        adamw = AdamW([{"params": others, "weight_decay": 0.0}], lr=lr, betas=ADAMW_BETAS, **fused_if_possible(others))
        super().__init__({"muon": muon, "adamw": adamw})

    @property
    def muon(self) -> MuonNS:
        return self.parts["muon"]

    def describe_layout(self) -> str:
        """How Muon's iteration is shared among the ranks (``MuonNS.describe_layout``)."""
        return self.muon.describe_layout()

    @property
    def adamw(self) -> AdamW:
        return self.parts["adamw"]
