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
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from astrai_fabric.errors import CheckpointError
from astrai_fabric.model.expert_parallel import ExpertGroup, moe_layers
from astrai_fabric.model.transformer import LM_HEAD_KEY

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
    stage = _stage_of(model)
    if stage is not None:
        parts = _from_every_stage(stage, lambda keep_here: gather_full(state, keep_here), keep)
        if not keep:
            return dict.fromkeys(state)
        whole = {name: value for part in parts for name, value in part.items()}  # buffers: the first stage's
        if model.config.tied:  # the last stage's copy of the embedding
            whole.pop(LM_HEAD_KEY, None)
        return whole
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
    stage = _stage_of(model)
    if stage is not None:
        return _gather_stages_optimizer(optimizer, parts, model, stage, keep)
    experts = _experts_of(model)
    if experts is None:
        return gather_full(optimizer.state_dict(), keep)
    names = {id(p): name for name, p in model.named_parameters()}
    whole = {
        part_name: None if part is None else _gather_part(part, names, experts, keep)
        for part_name, part in parts.items()
    }
    return whole[None] if None in whole else whole


def _stage_of(model: nn.Module) -> Any:
    """The pipeline stage ``model`` is (``model.pipeline.Stage``), or None without pipeline parallelism."""
    stage = getattr(model, "stage", None)
    return stage if stage is not None and stage.group is not None else None


def _from_every_stage(stage: Any, gather: Any, keep: bool) -> list[Any] | None:
    """``gather(keep_here)`` (collective over a stage's ranks, kept on the ranks of rank 0's place in every stage)
    from every stage, in stage order, on rank 0 (``keep``); None elsewhere. The pipeline holding rank 0 sends its
    stages' parts to it."""
    first_pipeline = dist.get_process_group_ranks(stage.group)[0] == 0
    part = gather(first_pipeline)
    if not first_pipeline:
        return None
    parts = [None] * stage.num_stages if keep else None
    dist.gather_object(part, parts, group=stage.group, group_dst=0)
    return parts


def _gather_stages_optimizer(
    optimizer: Optimizer, parts: dict[str | None, Optimizer | None], model: nn.Module, stage: Any, keep: bool
) -> dict[str, Any] | None:
    """The whole optimizer state from every pipeline stage's (``gather_optimizer_state``): each stage's entries and
    groups by parameter name, joined in stage order (a stage holds the whole model's parameters in the whole
    model's order, a slice of them), then numbered as one process numbers them. A tied head's copy on the last
    stage is the first stage's embedding: left out."""
    names = {id(p): name for name, p in model.named_parameters()}
    tied_copy = "lm_head.weight" if model.config.tied and stage.is_last else None

    def by_name(keep_here: bool) -> dict:
        named = {}
        for part_name, part in parts.items():
            if part is None:
                named[part_name] = None
                continue
            saved = gather_full(part.state_dict(), keep_here)
            local = [names[id(p)] for group in part.param_groups for p in group["params"]]
            entries = {local[i]: entry for i, entry in (saved["state"] or {}).items() if local[i] != tied_copy}
            groups = [
                [names[id(p)] for p in group["params"] if names[id(p)] != tied_copy] for group in part.param_groups
            ]
            named[part_name] = (entries, groups, saved["param_groups"])
        return named

    stages = _from_every_stage(stage, by_name, keep)
    if not keep:
        return None
    whole = {}
    for part_name in parts:
        if stages[0][part_name] is None:
            whole[part_name] = None
            continue
        entries, groups, start = {}, [], 0
        for index, saved_group in enumerate(stages[0][part_name][2]):
            order = [name for named in stages for name in named[part_name][1][index]]
            for named in stages:
                entries |= {
                    start + k: named[part_name][0][name] for k, name in enumerate(order) if name in named[part_name][0]
                }
            groups.append({**saved_group, "params": list(range(start, start + len(order)))})
            start += len(order)
        whole[part_name] = {"state": entries, "param_groups": groups}
    return whole[None] if None in whole else whole


def numbered_as_whole(optimizer: Optimizer, parts: dict[str | None, Optimizer | None], model: nn.Module) -> Any:
    """``optimizer.state_dict()`` with this rank's entries numbered as the whole model's parameters and each group
    listing all of them, nothing gathered: what each rank writes into a sharded checkpoint, so that ranks holding
    different experts write different entries, and the files read whole are one process's state
    (``local_optimizer_state`` takes it back). As it is without expert parallelism."""
    experts = _experts_of(model)
    if experts is None:
        return optimizer.state_dict()
    names = {id(p): name for name, p in model.named_parameters()}
    whole = {}
    for part_name, part in parts.items():
        if part is not None:
            saved = part.state_dict()
            local = [names[id(p)] for group in part.param_groups for p in group["params"]]
            part = _renumbered(part, saved, {local[i]: entry for i, entry in saved["state"].items()}, names, experts)
        whole[part_name] = part
    return whole[None] if None in whole else whole


def local_optimizer_state(state: Any, parts: dict[str | None, Optimizer | None], model: nn.Module, source: Any) -> Any:
    """A whole optimizer state (``optimizer.pt``) cut to this rank's parameters and numbered as its optimizer
    numbers them (as it is without expert parallelism). ``source`` names the file in errors; what else does not
    fit is left for ``state.load_optimizer_state`` to name."""
    experts = _experts_of(model)
    if experts is None:
        return state
    names = {id(p): name for name, p in model.named_parameters()}
    if None in parts:
        return _local_part(parts[None], state, names, experts, source)
    if not (isinstance(state, dict) and set(state) == set(parts)):
        return state
    return {
        name: state[name] if part is None else _local_part(part, state[name], names, experts, source)
        for name, part in parts.items()
    }


def _gather_part(part: Optimizer, names: dict, experts: _Experts, keep: bool) -> dict | None:
    """One torch optimizer's state, whole (see ``gather_optimizer_state``)."""
    saved = part.state_dict()
    local = [names[id(p)] for group in part.param_groups for p in group["params"]]
    mine = [i for i in sorted(saved["state"]) if EXPERT.match(local[i])]
    dense = gather_full({i: entry for i, entry in saved["state"].items() if i not in mine}, keep)
    tensors = [((i, k), v) for i in mine for k, v in saved["state"][i].items() if isinstance(v, Tensor)]
    gathered = experts.gather(tensors, keep)
    if not keep:
        return None
    entries = {local[i]: entry for i, entry in dense.items()}
    for i in mine:
        for rank in range(experts.group.size):
            entry = {k: gathered[(i, k)][rank] if isinstance(v, Tensor) else v for k, v in saved["state"][i].items()}
            entries[experts.rename(local[i], rank)] = entry
    return _renumbered(part, saved, entries, names, experts)


def _renumbered(part: Optimizer, saved: dict, entries: dict[str, Any], names: dict, experts: _Experts) -> dict:
    """``entries`` (optimizer state by parameter name) numbered as the whole model's parameters, in ``saved``'s
    groups each listing the whole model's parameters."""
    groups, state, start = [], {}, 0
    for group, saved_group in zip(part.param_groups, saved["param_groups"], strict=True):
        order = experts.whole_order([names[id(p)] for p in group["params"]])
        state |= {start + k: entries[name] for k, name in enumerate(order) if name in entries}
        groups.append({**saved_group, "params": list(range(start, start + len(order)))})
        start += len(order)
    return {"state": state, "param_groups": groups}


def _local_part(part: Optimizer, whole: Any, names: dict, experts: _Experts, source: Any) -> Any:
    """One torch optimizer's whole state cut to this rank's parameters (see ``local_optimizer_state``)."""
    saved_groups = whole.get("param_groups") if isinstance(whole, dict) else None
    if not (isinstance(saved_groups, list) and isinstance(whole.get("state"), dict)):
        return whole
    if len(saved_groups) != len(part.param_groups) or not all(isinstance(g, dict) for g in saved_groups):
        return whole
    index_of, start = {}, 0
    for group, saved_group in zip(part.param_groups, saved_groups, strict=True):
        order = experts.whole_order([names[id(p)] for p in group["params"]])
        if len(saved_group.get("params", ())) != len(order):
            raise CheckpointError(
                f"{source}: optimizer state has a group of {len(saved_group.get('params', ()))} parameters where "
                f"the whole model has {len(order)}: the checkpoint was trained with another model or optimizer"
            )
        index_of |= {name: start + k for k, name in enumerate(order)}
        start += len(order)
    local = [names[id(p)] for group in part.param_groups for p in group["params"]]
    state = {i: whole["state"][index_of[name]] for i, name in enumerate(local) if index_of[name] in whole["state"]}
    groups, start = [], 0
    for group, saved_group in zip(part.param_groups, saved_groups, strict=True):
        groups.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": groups}
