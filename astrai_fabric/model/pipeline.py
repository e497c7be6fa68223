"""Pipeline parallelism's model side: the decoder blocks split into stages (``stage_layers``) and one stage of the
model kept on a rank (``keep_stage``), as the module torch's pipelining schedules run (``PipelineStageLM``).

A stage is the whole model with what it does not hold removed, as torchtitan splits its models: the first keeps the
embedding, the last the final norm and the head, each its own blocks under their whole-model names
(``layers.5.attention...``), so ``state_dict`` keys, optimizer groups and checkpoints read as the whole model's. A
tied head stays on the last stage as its own copy of the embedding (``lm_head.weight``, the same tensor as
``embed_tokens.weight`` on the first): the two copies' gradients are summed between the two stages before each
update (``loop.pipeline``), so they stay equal, as one tensor would.

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

from astrai_fabric.config.model import ModelConfig
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


def stage_layers(config: ModelConfig, num_stages: int) -> list[range]:
    """The blocks of each of ``num_stages`` stages, consecutive, at least one each, balanced by parameters: the
    split whose largest stage holds the fewest, counting the embedding on the first stage and the final norm and
    head (a tied one too: the last stage holds its copy) on the last. Uneven layer counts are balanced, not refused;
    more stages than blocks are a ``ConfigError``."""
    blocks = layer_parameters(config)
    if num_stages > len(blocks):
        raise ConfigError(
            f"pp_size {num_stages} exceeds the model's {len(blocks)} decoder layers (num_hidden_layers): each stage "
            "holds at least one"
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


def describe_stages(ranges: list[range]) -> str:
    """``stage 0: layers 0-3 (+ embedding); stage 1: layers 4-7 (+ norm, head)``, for the plan."""
    parts = []
    for index, layers in enumerate(ranges):
        span = f"layer {layers.start}" if len(layers) == 1 else f"layers {layers.start}-{layers.stop - 1}"
        extras = [name for name, held in (("embedding", index == 0), ("norm, head", index == len(ranges) - 1)) if held]
        parts.append(f"stage {index}: {span}" + (f" (+ {', '.join(extras)})" if extras else ""))
    return "; ".join(parts)


@dataclass(frozen=True)
class StageLoss:
    """How the last stage takes its token losses: ``chunk_size`` positions at a time through the fused head
    (``TokenLoss``), or, at 0, from the whole logits; ``label_smoothing`` as the run's loss."""

    chunk_size: int = 0
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class Stage:
    """Which stage a rank's model is."""

    index: int
    num_stages: int
    layers: range
    group: Any = None
    """The pipeline's process group (one rank per stage, in stage order), set by ``parallelize``."""
    ends_group: Any = None
    """The process group of this place's first- and last-stage ranks (a tied embedding's two copies); None on a
    middle stage."""

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


class PipelineStageLM(AutoRegressiveLM):
    """One stage of an ``AutoRegressiveLM`` (``keep_stage`` makes it; see the module docstring). Its forward takes
    and returns tensors only, as torch's pipelining sends them: ``(input_ids or hidden states, target_ids[,
    position_ids])``, and hands on the same with its hidden states, or, on the last stage, each position's
    cross-entropy ``[B, S]`` float32."""

    stage: Stage
    stage_loss: StageLoss

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The stage's tensors; the last stage's copy of a tied head included (it is its own tensor here: read from
        the embedding, ``checkpoint.weights``; left out again when the stages' states are joined, ``gather``)."""
        state = nn.Module.state_dict(self, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.config.tied and not self.stage.is_last:
            state.pop(prefix + LM_HEAD_KEY, None)
        return state

    def forward(self, x: Tensor, target_ids: Tensor, *position_ids: Tensor) -> Tensor | tuple[Tensor, ...]:  # type: ignore[override]
        positions = position_ids[0] if position_ids else None
        mask = None if positions is None else make_doc_boundary_mask(positions)
        hidden, _, _ = self.trunk(x, mask, positions)
        if not self.stage.is_last:  # sent as they are: the process group sends contiguous tensors only
            return tuple(t.contiguous() for t in (hidden, target_ids, *position_ids))
        loss = self.stage_loss
        if loss.chunk_size:
            return self.head(hidden, TokenLoss(target_ids, loss.chunk_size, loss.label_smoothing)).token_nll
        logits = self.head.logits(hidden).float()
        nll = F.cross_entropy(
            logits.flatten(0, 1), target_ids.flatten(), reduction="none", label_smoothing=loss.label_smoothing
        )
        return nll.view_as(target_ids)


def held_by_other_stages(
    model: nn.Module, given: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names (and shapes) that the other stages hold: the whole model's this stage lacks, and of
    ``given`` (names and shapes to be loaded: a LoRA run's adapters) those of the other stages' blocks; empty for a
    model that is no stage."""
    stage = getattr(model, "stage", None)
    if stage is None:
        return {}
    with torch.device("meta"):
        whole = {name: tuple(tensor.shape) for name, tensor in AutoRegressiveLM(model.config).state_dict().items()}
    own = model.state_dict(keep_vars=True)
    others = {
        name: shape
        for name, shape in (given or {}).items()
        if (block := BLOCK.match(name)) and int(block[1]) not in stage.layers
    }
    return {name: shape for name, shape in whole.items() if name not in own} | others


def check_pipeline(config: ModelConfig, num_stages: int) -> None:
    """Refuse, in one line, a model ``num_stages`` stages cannot train: more stages than layers, MoE layers (their
    load-balancing loss would have to reach the last stage's loss from every stage), a reward model's score head."""
    if config.num_moe_layers:
        raise ConfigError(
            f"pp_size {num_stages} with an MoE model: the load-balancing loss of each stage's MoE layers cannot reach "
            "the last stage's loss here; train it with fsdp, tp, cp or ep"
        )
    if config.score_head:
        raise ConfigError(f"pp_size {num_stages} with a reward model (score_head): stages train language models here")
    stage_layers(config, num_stages)


def describe_pipeline(config: ModelConfig, num_stages: int, schedule: str, num_micro_batches: int) -> str:
    """The plan's line: the schedule, the micro-batches and each stage's blocks."""
    stages = describe_stages(stage_layers(config, num_stages))
    head = f"{num_stages} stages, {schedule} over {num_micro_batches} micro-batches per step"
    return f"{head} (blocks balanced by parameters): {stages}"


def keep_stage(model: AutoRegressiveLM, index: int, num_stages: int) -> PipelineStageLM:
    """``model`` cut to stage ``index`` of ``num_stages`` (``stage_layers``), in place: the other stages' blocks,
    and the embedding, final norm and head where this stage holds none, removed. MoE models are refused: their
    balance loss would have to reach the last stage's loss from every stage."""
    config = model.config
    check_pipeline(config, num_stages)
    layers = stage_layers(config, num_stages)[index]
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
    stage = Stage(index, num_stages, layers)
    if not stage.is_first:
        model.embed_tokens = None
    if not stage.is_last:
        model.norm = model.lm_head = None
    # A class of the same layout with the stage's forward, as fully_shard retypes the modules it wraps.
    model.__class__ = PipelineStageLM
    model.stage, model.stage_loss = stage, StageLoss()
    return model
