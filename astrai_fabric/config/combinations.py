"""What combines: the one table of the parallel dimensions, which need FSDP, which pairs are refused and which train
types each trains, and the one-line reason for every refusal. Every check of a combination reads it (the flags'
checks, ``config.train_checks``, and the mesh's, ``mesh.mesh_layout``, the dry run through both), and
docs/distributed.md's table is ``composition_table()`` (tests/test_docs.py holds them equal). Imports nothing heavy:
the flags are checked before torch is.

A new dimension is one ``Dimension`` here, its pairs in ``REFUSED_PAIRS``, what else it refuses in
``REFUSED_WITH``, and its place on the mesh (``mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass

from astrai_fabric.config.train_types import TRAIN_TYPES


@dataclass(frozen=True)
class Dimension:
    """A parallel dimension beyond FSDP's data sharding."""

    flag: str
    """Its size's flag (``tp_size``)."""
    name: str
    """What the docs call it."""
    why_fsdp: str
    """Why it needs ``--parallel_mode fsdp``, as the refusal says it."""
    train_types: tuple[str, ...] = TRAIN_TYPES
    """The train types it trains."""
    why_not_others: str = ""
    """Why the other train types are refused."""


DIMENSIONS = {
    "tp": Dimension("tp_size", "tensor", "the 2-D mesh"),
    "cp": Dimension("cp_size", "context", "FSDP shards over the context ranks"),
    "ep": Dimension("ep_size", "expert", "FSDP shards the experts over the data ranks an expert group leaves"),
    "pp": Dimension(
        "pp_size", "pipeline", "each stage is sharded as a model is", ("seq", "sft"),
        "the other losses need a reference model or sampling the schedule does not run",
    ),
}  # fmt: skip
"""Outer to inner as the mesh orders them, pipeline first in the refusals that name pairs."""

PIPELINE_PAIRS = "pipeline stages compose with FSDP, HSDP and tensor parallelism here"
EXPERT_PAIRS = "expert parallelism takes its ranks from the data shards alone here"
REFUSED_PAIRS = {
    ("pp", "cp"): PIPELINE_PAIRS,
    ("pp", "ep"): PIPELINE_PAIRS,
    ("ep", "tp"): EXPERT_PAIRS,
    ("ep", "cp"): EXPERT_PAIRS,
}
"""The pairs of dimensions refused, the first naming the refusal (every other pair, and each with FSDP or HSDP,
combines)."""


NOT_YET_IN_STAGES = "not supported with pipeline stages yet"
REFUSED_WITH = {
    ("cp", "neftune_alpha"): (
        "NEFTune scales its noise by the sequence length, and each rank would see its positions' length only"
    ),
    ("pp", "--packing false"): "stages exchange micro-batches of one shape, and records vary in length; pack them",
    ("pp", "neftune_alpha"): NOT_YET_IN_STAGES,
    ("pp", "quantize"): NOT_YET_IN_STAGES,
    ("pp", "compile"): NOT_YET_IN_STAGES,
    ("pp", "fsdp_sync_each_micro_batch"): NOT_YET_IN_STAGES,  # the schedule reduces once a window
    ("pp", "an MoE model"): (
        "the load-balancing loss of each stage's MoE layers cannot reach the last stage's loss here; train it with "
        "fsdp, tp, cp or ep"
    ),
    ("pp", "a reward model (score_head)"): "stages train language models here",
}
"""What else a dimension is refused with (a flag, or a kind of model), and why: the flags' checks
(``config.train_checks``) and the model's (``parallel.context``, ``model.pipeline``) both say ``knob_problem``."""


def knob_problem(key: str, size: int, knob: str) -> str:
    """The one line refusing dimension ``key`` at ``size`` with ``knob`` (a key of ``REFUSED_WITH``)."""
    return f"{DIMENSIONS[key].flag} {size} with {knob}: {REFUSED_WITH[key, knob]}"


def pair_problem(sizes: dict[str, int]) -> str | None:
    """The first refused pair among ``sizes`` (``{"tp": 2, ...}``; absent or 1: off), in one line naming the
    sizes; None when every pair combines."""
    on = {key: size for key, size in sizes.items() if (size or 1) > 1}
    for first in ("pp", "ep"):
        partners = [second for (one, second) in REFUSED_PAIRS if one == first and first in on and second in on]
        if partners:
            named = " and ".join(f"{DIMENSIONS[p].flag} {on[p]}" for p in DIMENSIONS if p in partners)
            why = REFUSED_PAIRS[first, partners[0]]
            return f"{DIMENSIONS[first].flag} {on[first]} with {named}: {why}; drop one of them"
    return None


def dimension_problem(key: str, size: int, parallel_mode: str, train_type: str | None) -> str | None:
    """Why dimension ``key`` at ``size`` cannot run under ``parallel_mode`` for ``train_type`` (None: unknown yet),
    in one line; None where it can."""
    dimension = DIMENSIONS[key]
    if size <= 1:
        return None
    if parallel_mode != "fsdp":
        hint = "" if key == "tp" else ": use --parallel_mode fsdp"
        return f"{dimension.flag} {size} needs parallel_mode fsdp ({dimension.why_fsdp}), got {parallel_mode}{hint}"
    if train_type is not None and train_type not in dimension.train_types:
        trained = " and ".join(dimension.train_types)
        return (
            f"{dimension.flag} {size} with train_type {train_type}: {dimension.name} parallelism trains {trained} "
            f"here ({dimension.why_not_others})"
        )
    return None


def composition_table() -> str:
    """docs/distributed.md's table: each pair of dimensions, and the train types each trains."""
    columns = ["FSDP / HSDP", *(f"{d.name} (`--{d.flag}`)" for d in DIMENSIONS.values())]
    rows = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    keys = ["fsdp", *DIMENSIONS]
    for row, key in zip(columns, keys, strict=True):
        cells = []
        for other in keys:
            refused = REFUSED_PAIRS.get((key, other)) or REFUSED_PAIRS.get((other, key))
            cells.append("—" if other == key else "refused" if refused else "yes")
        rows.append(f"| {row} | " + " | ".join(cells) + " |")
    rows += ["", "Refused: " + "; ".join(dict.fromkeys(REFUSED_PAIRS.values())) + "."]
    rows += ["", "| dimension | train types | refused with |", "|---|---|---|"]
    for key, dimension in DIMENSIONS.items():
        trained = "all" if dimension.train_types == TRAIN_TYPES else ", ".join(dimension.train_types)
        reason = f" ({dimension.why_not_others})" if dimension.why_not_others else ""
        knobs = "; ".join(f"{knob}: {why}" for (one, knob), why in REFUSED_WITH.items() if one == key) or "—"
        rows.append(f"| {dimension.name} | {trained}{reason} | {knobs} |")
    return "\n".join(rows)
