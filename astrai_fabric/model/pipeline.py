"""Pipeline parallelism's model side: the decoder blocks split into stages (``stage_layers``), a rank's stages kept
(``keep_stages``), and each stage as the module torch's pipelining schedules run (``PipelineStageLM``).

A rank holds one stage, or, under the interleaved schedules (``--pp_stages_per_rank`` V), V of them, looped as
torch's multi-stage schedules place them: of P ranks' V x P stages, rank r holds stages r, r + P, r + 2P, ...
(Megatron's interleaving, arXiv:2104.04473). The rank's model (``PipelineRankLM``) is the whole model with what the
rank does not hold removed, as torchtitan splits its models: the first stage's rank keeps the embedding, the last
stage's the final norm and the head, each rank its blocks under their whole-model names (``layers.5.attention...``),
so ``state_dict`` keys, optimizer groups and checkpoints read as the whole model's (``in_whole_order`` orders every
rank's names back into the whole model's). Each stage is a module of its own over the rank's tensors
(``stage_modules``: the schedule runs them, FSDP makes each a root). A tied head stays on the last stage as its own
copy of the embedding (``lm_head.weight``, the same tensor as ``embed_tokens.weight`` on the first): the two
copies' gradients are summed between the two ranks before each update (``parallel.pipeline``), so they stay equal, as
one tensor would.

Between stages travel tensors only: the hidden states, the targets (the last stage's head takes its token losses
from them, fused or not, inside its forward, where FSDP has gathered it) and, for sft's packed documents, the
position ids every stage builds its masks and RoPE from. The last stage returns each position's cross-entropy; the
schedule's loss function weighs it (``losses.token_nll_weights``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai_fabric.config.combinations import knob_problem
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.pipeline import stages_of_rank
from astrai_fabric.errors import ConfigError
from astrai_fabric.model.head import TokenLoss
from astrai_fabric.model.transformer import LM_HEAD_KEY, AutoRegressiveLM, make_doc_boundary_mask, parameter_counts

BLOCK = re.compile(r"^layers\.(\d+)\.")
"""A decoder block's tensor, by the block's index."""


def layer_parameters(config: ModelConfig) -> list[int]:
    """Each decoder block's parameters, from the config (``parameter_counts``' shares per layer)."""
    counts = parameter_counts(config)
    layers, moe_layers = config.num_hidden_layers, config.num_moe_layers
    shared = (counts.attention + counts.norms - config.hidden_size) // layers  # the final norm is no block's
    dense = counts.dense_mlp // (layers - moe_layers) if layers > moe_layers else 0
    moe = (counts.routed_experts + counts.moe_other) // moe_layers if moe_layers else 0
    return [shared + (moe if config.ffn_type_of_layer(i) == "moe" else dense) for i in range(layers)]


def stage_layers(config: ModelConfig, num_ranks: int, stages_per_rank: int = 1) -> list[range]:
    """The blocks of each of the ``num_ranks`` x ``stages_per_rank`` stages, consecutive, at least one each,
    balanced by parameters: the split whose largest stage holds the fewest, counting the embedding on the first
    stage and the final norm and head (a tied one too: the last stage holds its copy) on the last. Uneven layer
    counts are balanced, not refused; more stages than blocks are a ``ConfigError``."""
    blocks, num_stages = layer_parameters(config), num_ranks * stages_per_rank
    if num_stages > len(blocks):
        named = f"pp_size {num_ranks}" + (f" x pp_stages_per_rank {stages_per_rank}" if stages_per_rank > 1 else "")
        verb = "exceeds" if stages_per_rank == 1 else f"= {num_stages} stages exceed"
        raise ConfigError(
            f"{named} {verb} the model's {len(blocks)} decoder layers (num_hidden_layers): each stage holds at least "
            "one"
        )
    embedding = config.vocab_size * config.hidden_size
    weights = list(blocks)
    weights[0] += embedding
    weights[-1] += embedding + config.hidden_size  # the head (or the tied copy) and the final norm
    # best[s][i]: the smallest largest stage over splits of the first i blocks into s stages (i >= s).
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    count = len(weights)
    best = [[float("inf")] * (count + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stages in range(1, num_stages + 1):
        for end in range(stages, count + 1):
            for start in range(stages - 1, end):
                largest = max(best[stages - 1][start], prefix[end] - prefix[start])
                if largest < best[stages][end]:
                    best[stages][end], cut[stages][end] = largest, start
    ranges, end = [], count
    for stages in range(num_stages, 0, -1):
        start = cut[stages][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def describe_stages(ranges: list[range], num_ranks: int | None = None) -> str:
    """``stage 0: layers 0-3 (+ embedding); stage 1: layers 4-7 (+ norm, head)``, for the plan; with ``num_ranks``
    fewer than the stages (several stages per rank), each stage's rank too: ``stage 2 (rank 0): layers 4-5``."""
    parts = []
    looped = num_ranks is not None and num_ranks < len(ranges)
    for index, layers in enumerate(ranges):
        span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"
        extras = [name for name, held in (("embedding", index == 0), ("norm, head", index == len(ranges) - 1)) if held]
        rank = f" (rank {index % num_ranks})" if looped else ""
        parts.append(f"stage {index}{rank}: {span}" + (f" (+ {', '.join(extras)})" if extras else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class StageLoss:
    """How the last stage takes its token losses: ``chunk_size`` positions at a time through the fused head
    (``TokenLoss``), or, at 0, from the whole logits; ``label_smoothing`` as the run's loss."""

    chunk_size: int = 0
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its index and blocks."""

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class Place:
    """A rank's place in the pipeline: its rank among the pipeline's ``num_ranks`` and the stages it holds
    (``stages``: rank, rank + num_ranks, ..., in stage order)."""

    rank: int
    num_ranks: int
    stages: tuple[Stage, ...]
    group: Any = None
    """The pipeline's process group (its ranks in pipeline order, one per place), set by ``parallelize``."""
    ends_group: Any = None
    """The process group of this place's first- and last-stage ranks (a tied embedding's two copies); None on a rank
    that holds neither."""

    @property
    def holds_first(self) -> bool:
        return self.stages[0].is_first

    @property
    def holds_last(self) -> bool:
        return self.stages[-1].is_last

    @property
    def layers(self) -> list[int]:
        """Every block the rank holds, in order."""
        return [i for stage in self.stages for i in stage.layers]


class PipelineRankLM(AutoRegressiveLM):
    """The part of an ``AutoRegressiveLM`` a pipeline rank holds (``keep_stages`` makes it; see the module
    docstring): it owns the tensors, its ``stage_modules`` run them. It has no forward of its own: the schedule runs
    the stages (``parallel.pipeline``)."""

    place: Place
    stage_modules: list[PipelineStageLM]
    """One module per stage held, in stage order, over this model's own submodules (not registered here: their
    tensors are this model's, under its names)."""

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The rank's tensors; the last stage's copy of a tied head included (it is its own tensor here: read from
        the embedding, ``checkpoint.weights``; left out again when the ranks' states are joined, ``gather``)."""
        state = nn.Module.state_dict(self, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.config.tied and not self.place.holds_last:
            state.pop(prefix + LM_HEAD_KEY, None)
        return state

    def train(self, mode: bool = True) -> PipelineRankLM:
        """Training or evaluation mode, the stage modules' too (they decide on recomputing blocks)."""
        super().train(mode)
        for module in self.stage_modules:
            module.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("a pipeline rank's model runs through its schedule (parallel.pipeline.Pipeline), not forward")


class PipelineStageLM(AutoRegressiveLM):
    """One stage of an ``AutoRegressiveLM``, over its rank's tensors (``PipelineRankLM.stage_modules``). Its forward
    takes and returns tensors only, as torch's pipelining sends them: ``(input_ids or hidden states, target_ids[,
    position_ids])``, and hands on the same with its hidden states, or, on the last stage, each position's
    cross-entropy ``[B, S]`` float32."""

    stage: Stage
    stage_loss: StageLoss

    def forward(self, x: Tensor, target_ids: Tensor, *position_ids: Tensor) -> Tensor | tuple[Tensor, ...]:  # type: ignore[override]
        positions = position_ids[0] if position_ids else None
        mask = None if positions is None else make_doc_boundary_mask(positions)
        hidden, _, _ = self.trunk(x, mask, positions)
        if not self.stage.is_last:  # sent as they are: the process group sends contiguous tensors only
            return tuple(t.contiguous() for t in (hidden, target_ids, *position_ids))
        # The last stage's losses leave as a copy, not a view of the flat ones: FSDP warns of a view (an in-place op
        # on it would drop its gradient hook; the schedule's loss does none), at every pipeline run. B x S values.
        loss = self.stage_loss
        if loss.chunk_size:
            return self.head(hidden, TokenLoss(target_ids, loss.chunk_size, loss.label_smoothing)).token_nll.clone()
        logits = self.head.logits(hidden).float()
        nll = F.cross_entropy(
            logits.flatten(0, 1), target_ids.flatten(), reduction="none", label_smoothing=loss.label_smoothing
        )
        return nll.view_as(target_ids).clone()


def held_by_other_stages(
    model: nn.Module, given: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names (and shapes) that the other stages hold: the whole model's this stage lacks, and of
    ``given`` (names and shapes to be loaded: a LoRA run's adapters) those of the other stages' blocks; empty for a
    model that is no stage."""
    place = getattr(model, "place", None)
    if place is None:
        return {}
    with torch.device("meta"):
        whole = {name: tuple(tensor.shape) for name, tensor in AutoRegressiveLM(model.config).state_dict().items()}
    own = model.state_dict(keep_vars=True)
    held = set(place.layers)
    given = given or {}
    others = {name: shape for name, shape in given.items() if (b := BLOCK.match(name)) and int(b[1]) not in held}
    return {name: shape for name, shape in whole.items() if name not in own} | others


def check_pipeline(config: ModelConfig, num_ranks: int, stages_per_rank: int = 1) -> None:
    """Refuse, in one line, a model ``num_ranks`` x ``stages_per_rank`` stages cannot train: more stages than
    layers, MoE layers (their load-balancing loss would have to reach the last stage's loss from every stage), a
    reward model's score head."""
    if config.num_moe_layers:
        raise ConfigError(knob_problem("pp", num_ranks, "an MoE model"))
    if config.score_head:
        raise ConfigError(knob_problem("pp", num_ranks, "a reward model (score_head)"))
    stage_layers(config, num_ranks, stages_per_rank)


def describe_pipeline(
    config: ModelConfig, num_ranks: int, stages_per_rank: int, schedule: str, num_micro_batches: int
) -> str:
    """The plan's line: the stages on their ranks, the schedule, the micro-batches and each stage's blocks."""
    num_stages = num_ranks * stages_per_rank
    stages = describe_stages(stage_layers(config, num_ranks, stages_per_rank), num_ranks)
    placed = f" on {num_ranks} ranks ({stages_per_rank} each, looped)" if stages_per_rank > 1 else ""
    head = f"{num_stages} stages{placed}, {schedule} over {num_micro_batches} micro-batches per step"
    return f"{head} (blocks balanced by parameters): {stages}"


def keep_stages(model: AutoRegressiveLM, rank: int, num_ranks: int, stages_per_rank: int = 1) -> PipelineRankLM:
    """``model`` cut, in place, to what pipeline rank ``rank`` of ``num_ranks`` holds: its ``stages_per_rank``
    stages (of ``num_ranks`` x ``stages_per_rank``, ``stage_layers``; rank r holds r, r + num_ranks, ...), the
    other blocks removed, and the embedding, final norm and head where its stages hold none; ``stage_modules`` one
    module per stage over what is kept. MoE models and reward models are refused (``check_pipeline``)."""
    config = model.config
    check_pipeline(config, num_ranks, stages_per_rank)
    num_stages = num_ranks * stages_per_rank
    ranges = stage_layers(config, num_ranks, stages_per_rank)
    held = stages_of_rank(rank, num_ranks, stages_per_rank)
    stages = tuple(Stage(index, num_stages, ranges[index]) for index in held)
    place = Place(rank, num_ranks, stages)
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in place.layers})
    if not place.holds_first:
        model.embed_tokens = None
    if not place.holds_last:
        model.norm = model.lm_head = None
    # A class of the same layout with the rank's behaviour, as fully_shard retypes the modules it wraps.
    model.__class__ = PipelineRankLM
    model.place = place
    model.stage_modules = [_stage_module(model, stage) for stage in stages]
    return model


def _stage_module(model: PipelineRankLM, stage: Stage) -> PipelineStageLM:
    """Stage ``stage`` of the rank's ``model``, sharing its submodules (RoPE's tables, the blocks, the ends)."""
    module = PipelineStageLM.__new__(PipelineStageLM)
    nn.Module.__init__(module)
    module.config = model.config
    module.rotary_embedding = model.rotary_embedding
    module.embed_tokens = model.embed_tokens if stage.is_first else None
    module.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in stage.layers})
    module.norm = model.norm if stage.is_last else None
    module.lm_head = model.lm_head if stage.is_last else None
    module.local_rotary_embedding = model.local_rotary_embedding
    module.gradient_checkpointing = model.gradient_checkpointing
    module.context_parallel = None
    module.stage, module.stage_loss = stage, StageLoss()
    return module


def in_whole_order(names: list[str]) -> list[str]:
    """``names`` (of tensors of the whole model, some ranks' each) in the whole model's order: the embedding, the
    blocks by index (each block's tensors in the order given), then the rest (the final norm, the head). Every rank
    lists its own in this order; with one stage per rank the ranks' lists, in rank order, are already in it, with
    several they interleave."""

    def key(name: str) -> tuple[int, int]:
        block = BLOCK.match(name)
        return (1, int(block[1])) if block else (0, 0) if name.startswith("embed_tokens.") else (2, 0)

    return sorted(names, key=key)
