"""Expert parallelism: each rank of an expert group holds 1/N of every MoE layer's routed experts, and the tokens go
to the ranks that hold their chosen experts (GShard, arXiv:2006.16668; torchtitan and Megatron lay it out the same
way).

A rank routes its own tokens (router, top-k and weights, the balance loss and routing statistics exactly as
without expert parallelism: each rank's own), sorts its (token, slot) pairs by expert, and, experts being dealt
out in contiguous blocks (rank r holds experts ``[r E/N, (r+1) E/N)``), that order is also by destination rank.
One all-to-all sends the per-expert counts, one host read of them sizes the uneven exchange, a second all-to-all
sends the pairs' hidden states; each rank computes what it received, grouped by its experts
(``ffn.run_experts``), and a third sends the results back, where they are weighted and summed into their tokens as
before. Dropless: no capacity factor, every pair is computed. The all-to-alls' adjoints are the reverse exchanges,
so an expert's gradient sums every rank's tokens routed to it.

The parameters stay one 2-D tensor per expert projection, named as in the whole model (``routed_experts.{j}``,
``j`` the expert's index among all of them, ``ffn.RoutedExperts``): a rank's layer keeps its own under those names,
so its ``state_dict`` names are the whole model's, those of the other ranks' experts left out
(``checkpoint.gather`` brings them together and deals them out).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError
from astrai_fabric.model.expert_parallel import ExpertGroup, moe_layers
from astrai_fabric.parallel.group import RanksOf


class AllToAllExperts(RanksOf, ExpertGroup):
    """An expert group of process-group ranks: the pairs sent to their experts' ranks by all-to-all and back."""

    def exchange_and_run(self, run: Callable[[Tensor, list[int]], Tensor], inputs: Tensor, counts: Tensor) -> Tensor:
        return _exchange_and_run(self, run, inputs, counts)


def check_expert_parallel(config: ModelConfig, ep_size: int) -> None:
    """Refuse, in one line, a model ``ep_size`` cannot deal out: no MoE layer, or routed experts it does not
    divide."""
    if not config.num_moe_layers:
        layers = "every layer is in mlp_only_layers" if config.ffn_type == "moe" else "the model is dense"
        raise ConfigError(f"ep_size {ep_size} deals out MoE experts, but {layers}: train it without --ep_size")
    if config.n_routed_experts % ep_size:
        raise ConfigError(
            f"ep_size {ep_size} must divide n_routed_experts ({config.n_routed_experts}): each rank holds as many"
        )


def describe_expert_parallel(config: ModelConfig, ep_size: int) -> str:
    """The plan's words on how the experts are dealt out."""
    return (
        f"expert parallel over {ep_size} ranks: each holds {config.n_routed_experts // ep_size} of the "
        f"{config.n_routed_experts} routed experts of each MoE layer; tokens reach them by all-to-all"
    )


def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Keep only this rank's routed experts in each of ``model``'s MoE layers (the others' parameters are freed)
    and give the layers the group."""
    experts = AllToAllExperts.of(group)
    for layer in moe_layers(model):
        owned = experts.owned(layer.n_routed)
        layer.routed_experts = layer.routed_experts.keep(owned)
        layer.expert_parallel = experts


def expert_meshes(model: nn.Module) -> dict[DeviceMesh | None, dist.ProcessGroup]:
    """The device meshes of the routed experts' parameters under expert parallelism, each with its expert group:
    a norm over a rank's experts is its share only, to be summed over the group (``norms.global_norm``). Empty
    without expert parallelism."""
    meshes = {}
    for layer in moe_layers(model):
        if layer.expert_parallel is not None:
            for param in layer.routed_experts.parameters():
                meshes[getattr(param, "device_mesh", None)] = layer.expert_parallel.group
    return meshes


def _exchange_and_run(
    experts: AllToAllExperts, run: Callable[[Tensor, list[int]], Tensor], inputs: Tensor, counts: Tensor
) -> Tensor:
    """Every rank's expert outputs for ``inputs [N, H]`` (this rank's (token, slot) pairs sorted by expert,
    ``counts[e]`` of them for expert ``e`` of all), in the same order: the pairs sent to the ranks holding their
    experts, computed there by ``run(received inputs sorted by local expert, rows per local expert)``, and sent
    back. One host read (the counts each rank sends and receives)."""
    local = counts.numel() // experts.size
    received_counts = torch.empty_like(counts)  # [source rank, local expert], flattened
    dist.all_to_all_single(received_counts, counts, group=experts.group)
    sizes = torch.cat([counts, received_counts]).tolist()
    sent, received = sizes[: counts.numel()], sizes[counts.numel() :]
    send_splits = [sum(sent[r * local : (r + 1) * local]) for r in range(experts.size)]
    receive_splits = [sum(received[r * local : (r + 1) * local]) for r in range(experts.size)]
    arrived = _Exchange.apply(inputs, experts.group, receive_splits, send_splits)
    # Arrived by source rank, then expert; regrouped by expert (stable: each expert's rows keep the source order).
    expert_of_row = torch.arange(local, device=inputs.device).repeat(experts.size)
    expert_of_row = expert_of_row.repeat_interleave(received_counts, output_size=arrived.size(0))
    order = torch.argsort(expert_of_row, stable=True)
    rows_per_expert = [sum(received[e::local]) for e in range(local)]
    outputs = run(arrived[order], rows_per_expert)[torch.argsort(order)]
    return _Exchange.apply(outputs, experts.group, send_splits, receive_splits)


class _Exchange(torch.autograd.Function):
    """Rows of ``x`` to the ranks of the group, ``send_splits[r]`` to rank ``r`` in order; what arrives, in rank
    order (``receive_splits[r]`` from rank ``r``). Backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, receive_splits: list[int], send_splits: list[int]) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.splits = group, (receive_splits, send_splits)
        return _exchange(x, group, receive_splits, send_splits)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        receive_splits, send_splits = ctx.splits
        return _exchange(grad, ctx.group, send_splits, receive_splits), None, None, None


def _exchange(x: Tensor, group: dist.ProcessGroup, receive_splits: list[int], send_splits: list[int]) -> Tensor:
    received = x.new_empty(sum(receive_splits), *x.shape[1:])
    dist.all_to_all_single(received, x.contiguous(), receive_splits, send_splits, group=group)
    return received
