"""The model's seam for expert parallelism: an ``ExpertGroup`` that ``parallel.expert`` fills from outside (each MoE
layer holds it as ``expert_parallel``, its routed experts then this rank's block of them; the model imports no
``torch.distributed``), and what reads a model laid out so: its MoE layers, its group, the experts other ranks hold.

How the tokens reach their experts and come back (the all-to-alls, dropless): ``parallel.expert``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor, nn


class ExpertGroup:
    """The ranks that share every MoE layer's routed experts, and this rank's place among them: what an MoE layer
    asks of expert parallelism (``parallel.expert.AllToAllExperts`` answers it with collectives)."""

    size: int
    rank: int

    def owned(self, num_experts: int) -> range:
        """The indices of the experts this rank holds (a contiguous block of ``num_experts / size``)."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def exchange_and_run(self, run: Callable[[Tensor, list[int]], Tensor], inputs: Tensor, counts: Tensor) -> Tensor:
        """Every rank's expert outputs for ``inputs [N, H]`` (this rank's (token, slot) pairs sorted by expert,
        ``counts[e]`` of them for expert ``e`` of all), in the same order: each pair computed by
        ``run(inputs sorted by local expert, rows per local expert)`` on the rank holding its expert."""
        raise NotImplementedError


def moe_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every MoE layer of ``model`` (a module with routed experts)."""
    return (module for module in model.modules() if hasattr(module, "routed_experts"))


def expert_group(model: nn.Module) -> ExpertGroup | None:
    """The expert group ``model``'s MoE layers share; None without expert parallelism."""
    return next((layer.expert_parallel for layer in moe_layers(model) if layer.expert_parallel is not None), None)


def held_elsewhere(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names (and whole shapes) of the routed experts the other ranks of each expert group hold:
    what a file of the whole model has that this rank's model lacks (empty without expert parallelism)."""
    names = {}
    for prefix, layer in model.named_modules():
        if getattr(layer, "expert_parallel", None) is None:
            continue
        own = dict(layer.routed_experts.items())
        one = {name: tuple(tensor.shape) for name, tensor in next(iter(own.values())).state_dict().items()}
        for j in range(layer.n_routed):
            if str(j) not in own:
                names |= {f"{prefix}.routed_experts.{j}.{name}": shape for name, shape in one.items()}
    return names
