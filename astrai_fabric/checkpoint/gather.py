"""A run's whole state from its ranks' parts: each sharded tensor made full (``gather_full``), and under expert
parallelism the experts of every rank brought together; and a whole optimizer state dealt back out.

Under ``--ep_size`` each rank's model holds its own routed experts only, named as in the whole model
(``model.expert_parallel``), and its optimizer numbers its own parameters. Saving gathers every expert's tensors,
weights and optimizer state alike, from the ranks of rank 0's expert group to rank 0, which writes AstrAI's files
exactly as one process would: the same names, the same order, the optimizer's entries numbered as the whole
model's parameters. Loading a whole optimizer state gives each rank the entries of its own parameters, numbered as
its optimizer numbers them. Without expert parallelism both are the plain gather (``gather_full``) and the state as
it is.

The whole model's order comes from a rank's own: its parameters of one MoE layer's routed experts are consecutive
(one module's), and the whole model has every rank's block of experts there, in rank order (rank r holds experts
``[r E/N, (r+1) E/N)``): each such run is repeated once per rank, renamed for that rank's experts.

Under ``--pp_size`` each pipeline rank holds some of the whole model's parameters (its stages' blocks), in its
order, under the whole model's names (``model.pipeline``): the whole order of each optimizer group is every rank's
share of it, gathered from the pipeline's ranks and put back in the whole model's order
(``model.pipeline.in_whole_order``: with several stages per rank the ranks' blocks interleave) (``_WholeNames``);
each rank's tensors are made full among the ranks that shard them and sent to rank 0 by the ranks of its place. A
tied head is the embedding there: its last stage's copy is not written, and reads the embedding's entry back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from astrai_fabric.errors import CheckpointError
from astrai_fabric.model.expert_parallel import ExpertGroup, moe_layers
from astrai_fabric.model.pipeline import in_whole_order
from astrai_fabric.model.transformer import EMBED_KEY, LM_HEAD_KEY
from astrai_fabric.torch_private import uncompiled

EXPERT = re.compile(r"^(?P<layer>.*\.routed_experts\.)(?P<index>\d+)(?P<rest>\..+)$")
"""A routed expert's tensor: ``<layer>.routed_experts.<index>.<rest>``."""


def gather_full(obj: Any, keep: bool) -> Any:
    """``obj`` with every tensor replaced by a full CPU copy (``keep``) or dropped (other ranks).

    Collective when ``obj`` holds DTensors: every rank must call it with the same structure.
    """
    if isinstance(obj, DTensor):
        full = obj.full_tensor()
        return full.cpu() if keep else None
    if isinstance(obj, Tensor):
        return obj.detach().cpu() if keep else None
    if isinstance(obj, dict):
        return {k: gather_full(v, keep) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(gather_full(v, keep) for v in obj)
    return obj


class _Experts:
    """An expert group and the names of its ranks' experts."""

    def __init__(self, group: ExpertGroup, num_experts: int) -> None:
        self.group, self.per_rank = group, num_experts // group.size

    def rename(self, name: str, rank: int) -> str:
        """``name`` (one of this rank's experts' tensors) for the same tensor of ``rank``'s expert in its place."""
        match = EXPERT.match(name)
        index = int(match["index"]) % self.per_rank + rank * self.per_rank
        return f"{match['layer']}{index}{match['rest']}"

    def whole_order(self, names: list[str]) -> list[str]:
        """This rank's ``names`` in order as the whole model orders them: each run of one layer's expert names
        followed by the same run for every other rank's experts, in rank order (see the module docstring)."""
        order, run, run_layer = [], [], None
        for name in [*names, None]:
            match = EXPERT.match(name) if name is not None else None
            layer = match["layer"] if match else None
            if run and layer != run_layer:
                order += [self.rename(n, rank) for rank in range(self.group.size) for n in run]
                run = []
            run_layer = layer
            if match:
                run.append(name)
            elif name is not None:
                order.append(name)
        return order

    def gather(self, items: list[tuple[Any, Tensor]], keep: bool) -> dict[Any, list[Tensor]]:
        """Each of ``items`` (the same keys and shapes, in the same order, on every rank of the group: this rank's
        experts' tensors) whole from every rank of the group, in rank order, on the CPU of the rank that ``keep``s
        them (rank 0 of its group); an empty dict elsewhere. Collective over the group and each tensor's mesh."""
        group, gathered = self.group, {}
        for key, tensor in items:
            whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().contiguous()
            parts = [torch.empty_like(whole) for _ in range(group.size)] if group.rank == 0 else None
            dist.gather(whole, parts, group=group.group, group_dst=0)
            if keep:
                gathered[key] = [part.cpu() for part in parts]
        return gathered


def _experts_of(model: nn.Module) -> _Experts | None:
    layer = next((layer for layer in moe_layers(model) if layer.expert_parallel is not None), None)
    return None if layer is None else _Experts(layer.expert_parallel, layer.n_routed)


def whole_names(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` (of ``model``'s tensors) as the whole model names them: under expert parallelism every rank's experts
    in place of this rank's, in the whole model's order (no communication: every rank's block has the same names
    but for the expert index); as they are otherwise."""
    experts = _experts_of(model)
    return names if experts is None else experts.whole_order(names)


def gather_state(model: nn.Module, state: dict[str, Any], keep: bool) -> dict[str, Any]:
    """``state`` (``model``'s ``state_dict``, or part of it: the adapters, the base) whole on the rank that
    ``keep``s it (rank 0; the others get None values), every tensor full on the CPU (collective) and every expert's
    and every pipeline stage's included, in the whole model's order."""
    place = _place_of(model)
    if place is not None:
        parts = _from_every_rank(place, lambda keep_here: gather_full(state, keep_here), keep)
        if not keep:
            return dict.fromkeys(state)
        whole = {name: value for part in parts for name, value in part.items()}  # buffers: the first rank's
        if model.config.tied:  # the last stage's copy of the embedding
            whole.pop(LM_HEAD_KEY, None)
        return {name: whole[name] for name in in_whole_order(list(whole))}
    experts = _experts_of(model)
    if experts is None:
        return gather_full(state, keep)
    own = [name for name in state if EXPERT.match(name)]
    whole = gather_full({name: value for name, value in state.items() if name not in own}, keep)
    gathered = experts.gather([(name, state[name]) for name in own], keep)
    if not keep:
        return whole
    for name, parts in gathered.items():
        whole |= {experts.rename(name, rank): tensor for rank, tensor in enumerate(parts)}
    return {name: whole[name] for name in experts.whole_order(list(state))}


def gather_optimizer_state(
    optimizer: Optimizer, parts: dict[str | None, Optimizer | None], model: nn.Module, keep: bool
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as one process over the whole model would save it, on the rank that ``keep``s
    it (``parts``: the torch optimizers inside, ``state.optimizer_parts``)."""
    whole_names = _WholeNames.of(model, parts)
    if whole_names is None:
        return gather_full(optimizer.state_dict(), keep)
    place, experts = _place_of(model), _experts_of(model)
    whole = {}
    for part_name, part in parts.items():
        if part is not None:
            saved = part.state_dict()
            gather = _stage_entries if place is not None else _expert_entries
            entries = gather(saved, whole_names, part_name, place or experts, keep)
            part = whole_names.renumbered(part_name, saved, entries) if keep else None
        whole[part_name] = part
    return whole[None] if None in whole else whole


def _place_of(model: nn.Module) -> Any:
    """The pipeline place of ``model`` (``model.pipeline.Place``), or None without pipeline parallelism."""
    place = getattr(model, "place", None)
    return place if place is not None and place.group is not None else None


def _from_every_rank(place: Any, gather: Any, keep: bool) -> list[Any] | None:
    """``gather(keep_here)`` (collective over a pipeline rank's shard group, kept on the ranks of rank 0's place)
    from every pipeline rank, in pipeline order, on rank 0 (``keep``); None elsewhere. The pipeline holding rank 0
    sends its ranks' parts to it."""
    first_pipeline = dist.get_process_group_ranks(place.group)[0] == 0
    part = gather(first_pipeline)
    if not first_pipeline:
        return None
    parts = [None] * place.num_ranks if keep else None
    dist.gather_object(part, parts, group=place.group, group_dst=0)
    return parts


def _stage_entries(saved: dict, whole_names: _WholeNames, part_name: str | None, place: Any, keep: bool) -> dict:
    """Every pipeline stage's entries of one optimizer part, whole and by parameter name, on the rank that ``keep``s
    them (see ``gather_optimizer_state``): a tied head's copy on the last stage is the first stage's embedding."""
    local = [n for group in whole_names.groups[part_name] for n in group]

    def by_name(keep_here: bool) -> dict:
        state = gather_full(saved["state"], keep_here)
        return {local[i]: entry for i, entry in state.items() if local[i] not in whole_names.copies}

    ranks = _from_every_rank(place, by_name, keep)
    return {name: entry for entries in ranks or () for name, entry in entries.items()}


def numbered_as_whole(optimizer: Optimizer, parts: dict[str | None, Optimizer | None], model: nn.Module) -> Any:
    """``optimizer.state_dict()`` with this rank's entries numbered as the whole model's parameters and each group
    listing all of them, nothing gathered: what each rank writes into a sharded checkpoint, so that ranks holding
    different experts or stages write different entries, and the files read whole are one process's state
    (``local_optimizer_state`` takes it back). As it is without expert or pipeline parallelism."""
    whole_names = _WholeNames.of(model, parts)
    if whole_names is None:
        return optimizer.state_dict()
    whole = {}
    for part_name, part in parts.items():
        if part is not None:
            saved = part.state_dict()
            local = [n for group in whole_names.groups[part_name] for n in group]
            entries = {local[i]: entry for i, entry in saved["state"].items() if local[i] not in whole_names.copies}
            part = whole_names.renumbered(part_name, saved, entries)
        whole[part_name] = part
    return whole[None] if None in whole else whole


def local_optimizer_state(state: Any, parts: dict[str | None, Optimizer | None], model: nn.Module, source: Any) -> Any:
    """A whole optimizer state (``optimizer.pt``) cut to this rank's parameters and numbered as its optimizer
    numbers them (as it is without expert or pipeline parallelism). ``source`` names the file in errors; what else
    does not fit is left for ``state.load_optimizer_state`` to name. Collective under pipeline parallelism."""
    whole = _WholeNames.of(model, parts)
    if whole is None:
        return state

    def cut(part_name: str | None, saved: Any) -> Any:
        local = [whole.alias.get(n, n) for group in whole.groups[part_name] for n in group]
        return _local_part(parts[part_name], saved, local, whole.orders[part_name], source)

    if None in parts:
        return cut(None, state)
    if not (isinstance(state, dict) and set(state) == set(parts)):
        return state
    return {name: state[name] if part is None else cut(name, state[name]) for name, part in parts.items()}


@dataclass(frozen=True)
class _WholeNames:
    """How a rank's optimizer parts name their parameters, and how the whole model's optimizer lists them, where a
    rank holds part of the model: some experts (expert parallelism) or some blocks (a pipeline stage)."""

    groups: dict[str | None, list[list[str]]]
    """Each part's groups, as this rank's names of its parameters."""
    orders: dict[str | None, list[list[str]]]
    """Each part's groups, as the whole model's names of all its parameters, in the whole model's order."""
    alias: dict[str, str]
    """This rank's names of a tensor the whole model names otherwise: the last stage's copy of a tied head is the
    embedding's entry."""
    copies: frozenset[str] = frozenset()
    """This rank's parameters whose entries another rank owns (the tied head's copy): never written from here."""

    @classmethod
    def of(cls, model: nn.Module, parts: dict[str | None, Optimizer | None]) -> _WholeNames | None:
        """None when the rank holds the whole model (collective under pipeline parallelism: every stage's names
        are gathered)."""
        experts, place = _experts_of(model), _place_of(model)
        if experts is None and place is None:
            return None
        raw = uncompiled(getattr(model, "module", model))  # Fabric's wrapper, torch.compile's: the file's names
        names = {id(p): name for name, p in raw.named_parameters()}
        groups = {
            part_name: [[names[id(p)] for p in group["params"]] for group in part.param_groups]
            for part_name, part in parts.items()
            if part is not None
        }
        if place is None:
            orders = {part: [experts.whole_order(group) for group in of_part] for part, of_part in groups.items()}
            return cls(groups, orders, {})
        # Each group's whole order: every pipeline rank's share of it, in the whole model's order (a rank's
        # parameters are some of the whole model's, in its order), the tied head's copy left out.
        copies = frozenset({LM_HEAD_KEY} if model.config.tied and place.holds_last else ())
        own = {part: [[n for n in group if n not in copies] for group in of_part] for part, of_part in groups.items()}
        every_rank = [None] * place.num_ranks
        dist.all_gather_object(every_rank, own, group=place.group)
        orders = {
            part: [in_whole_order([n for shares in every_rank for n in shares[part][g]]) for g in range(len(of_part))]
            for part, of_part in groups.items()
        }
        return cls(groups, orders, {name: EMBED_KEY for name in copies}, copies)

    def renumbered(self, part_name: str | None, saved: dict, entries: dict[str, Any]) -> dict:
        """``entries`` (optimizer state by parameter name) numbered as the whole model's parameters, in ``saved``'s
        groups each listing the whole model's parameters."""
        groups, state, start = [], {}, 0
        for order, saved_group in zip(self.orders[part_name], saved["param_groups"], strict=True):
            state |= {start + k: entries[name] for k, name in enumerate(order) if name in entries}
            groups.append({**saved_group, "params": list(range(start, start + len(order)))})
            start += len(order)
        return {"state": state, "param_groups": groups}


def _expert_entries(
    saved: dict, whole_names: _WholeNames, part_name: str | None, experts: _Experts, keep: bool
) -> dict:
    """One optimizer part's entries by parameter name, every expert's included, on the rank that ``keep``s them
    (see ``gather_optimizer_state``)."""
    local = [n for group in whole_names.groups[part_name] for n in group]
    mine = [i for i in sorted(saved["state"]) if EXPERT.match(local[i])]
    dense = gather_full({i: entry for i, entry in saved["state"].items() if i not in mine}, keep)
    tensors = [((i, k), v) for i in mine for k, v in saved["state"][i].items() if isinstance(v, Tensor)]
    gathered = experts.gather(tensors, keep)
    if not keep:
        return {}
    entries = {local[i]: entry for i, entry in dense.items()}
    for i in mine:
        for rank in range(experts.group.size):
            entry = {k: gathered[(i, k)][rank] if isinstance(v, Tensor) else v for k, v in saved["state"][i].items()}
            entries[experts.rename(local[i], rank)] = entry
    return entries


def _local_part(part: Optimizer, whole: Any, local: list[str], orders: list[list[str]], source: Any) -> Any:
    """One torch optimizer's whole state cut to this rank's parameters (see ``local_optimizer_state``): ``local``
    names the part's parameters in its order (as the whole model names them), ``orders`` each of its groups' whole
    list of names."""
    saved_groups = whole.get("param_groups") if isinstance(whole, dict) else None
    if not (isinstance(saved_groups, list) and isinstance(whole.get("state"), dict)):
        return whole
    if len(saved_groups) != len(part.param_groups) or not all(isinstance(g, dict) for g in saved_groups):
        return whole
    index_of, start = {}, 0
    for order, saved_group in zip(orders, saved_groups, strict=True):
        if len(saved_group.get("params", ())) != len(order):
            raise CheckpointError(
                f"{source}: optimizer state has a group of {len(saved_group.get('params', ()))} parameters where "
                f"the whole model has {len(order)}: the checkpoint was trained with another model or optimizer"
            )
        index_of |= {name: start + k for k, name in enumerate(order)}
        start += len(order)
    state = {i: whole["state"][index_of[name]] for i, name in enumerate(local) if index_of[name] in whole["state"]}
    groups, start = [], 0
    for group, saved_group in zip(part.param_groups, saved_groups, strict=True):
        groups.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": groups}
