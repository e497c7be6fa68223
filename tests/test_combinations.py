"""What combines (``config.combinations``): the mesh and the flags' checks refuse exactly the table's pairs and train
types, each in one line carrying the table's reason (the one place that decides them)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.config.combinations import DIMENSIONS, REFUSED_PAIRS, REFUSED_WITH, dimension_problem, knob_problem
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.config.train_types import TRAIN_TYPES
from astrai_fabric.errors import ConfigError
from astrai_fabric.parallel.mesh import mesh_layout


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(DIMENSIONS, 2)))
def test_the_mesh_refuses_exactly_the_tables_pairs(first, second):
    sizes = {DIMENSIONS[first].flag: 2, DIMENSIONS[second].flag: 2}
    reason = REFUSED_PAIRS.get((first, second)) or REFUSED_PAIRS.get((second, first))
    if reason is None:
        layout = mesh_layout(8, **sizes)
        assert (getattr(layout, first), getattr(layout, second)) == (2, 2)
    else:
        with pytest.raises(ConfigError, match=f"with .*: {reason}; drop one of them"):
            mesh_layout(8, **sizes)


def problems_of(**flags) -> str:
    """What ``TrainArgs.validate`` says of ``flags`` (every problem, one line), or ""."""
    try:
        TrainArgs(**flags).validate()
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.parametrize(("key", "train_type"), list(itertools.product(DIMENSIONS, TRAIN_TYPES)))
def test_the_flags_refuse_exactly_the_train_types_a_dimension_does_not_train(key, train_type):
    flag = DIMENSIONS[key].flag
    said = problems_of(train_type=train_type, parallel_mode="fsdp", nprocs=2, grad_accum_steps=2, **{flag: 2})
    refused = dimension_problem(key, 2, "fsdp", train_type)
    assert (train_type not in DIMENSIONS[key].train_types) == (refused is not None)
    assert refused in said if refused else f"with train_type {train_type}" not in said
    ddp = problems_of(train_type=train_type, parallel_mode="ddp", nprocs=2, **{flag: 2})
    assert f"{flag} 2 needs parallel_mode fsdp ({DIMENSIONS[key].why_fsdp}), got ddp" in ddp


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(cp_size=2), None),
        (dict(cp_size=None), "cp_size 1: .* decides context parallelism, and its LayoutStrategy applies cp_size 2"),
        (dict(cp_size=2, ep_size=2), "ep_size 2: .* decides expert parallelism"),
        (dict(cp_size=2, pp_size=2), "pp_size 2: .* decides pipeline parallelism"),
        (dict(cp_size=2, fsdp_shard_size=1), "fsdp_shard_size 1: .* does not shard over 1 rank"),
    ],
)
def test_a_fabric_built_elsewhere_decides_the_layout(flags, message):
    """``train(fabric, args)``: the layout flags must be what the Fabric's ``LayoutStrategy`` applies (known before
    launch); a plain ``ModelParallelStrategy`` applies no context, expert or pipeline parallelism, and a sharding
    only it knows."""
    from functools import partial

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from astrai_fabric.parallel.parallelize import parallelize
    from astrai_fabric.strategy import LayoutStrategy, check_layout_flags, layout_of

    fabric = Fabric(accelerator="cpu", devices=4, strategy=LayoutStrategy(mesh_layout(4, cp_size=2)))
    assert layout_of(fabric) == mesh_layout(4, cp_size=2)
    sizes = [flags.get(name) for name in ("fsdp_shard_size", "cp_size", "ep_size", "pp_size")]
    if message is None:
        check_layout_flags(fabric, *sizes)
    else:
        with pytest.raises(ConfigError, match=message):
            check_layout_flags(fabric, *sizes)

    plain = ModelParallelStrategy(partial(parallelize), data_parallel_size=4, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=plain)
    check_layout_flags(fabric, None, None, None, None)
    with pytest.raises(ConfigError, match="cp_size 2: .* ModelParallelStrategy applies cp_size 1; build it with "):
        check_layout_flags(fabric, None, 2, None, None)
    with pytest.raises(ConfigError, match="fsdp_shard_size 4: "):
        check_layout_flags(fabric, 4, None, None, None)


def test_a_pipeline_layout_strategy_says_its_stages_per_rank():
    from lightning.fabric import Fabric

    from astrai_fabric.strategy import LayoutStrategy, check_layout_flags

    layout = mesh_layout(4, pp_size=2)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=LayoutStrategy(layout, pp_stages_per_rank=2))
    check_layout_flags(fabric, None, None, None, 2, 2)
    with pytest.raises(ConfigError, match="pp_stages_per_rank 1: .* decides the stages per pipeline rank"):
        check_layout_flags(fabric, None, None, None, 2, 1)


FLAG_KNOBS = {
    "--packing false": dict(train_type="sft", packing=False),
    "neftune_alpha": dict(train_type="sft", neftune_alpha=5.0),
    "quantize": dict(quantize="nf4", lora_r=4),
    "compile": dict(compile="default"),
    "fsdp_sync_each_micro_batch": dict(fsdp_sync_each_micro_batch=True),
}


@pytest.mark.parametrize(("key", "knob"), list(REFUSED_WITH))
def test_every_refusal_with_a_knob_is_the_tables(key, knob):
    """Each ``REFUSED_WITH`` entry is what the check that meets it says: the flags' checks for a flag, the model's
    (``check_context_parallel``, ``check_pipeline``) for a kind of model."""
    from astrai_fabric.config.model import ModelConfig
    from astrai_fabric.model.pipeline import check_pipeline
    from astrai_fabric.parallel.context import check_context_parallel

    expected = knob_problem(key, 2, knob)
    if knob in FLAG_KNOBS:
        flags = dict(parallel_mode="fsdp", nprocs=4, grad_accum_steps=2, **{DIMENSIONS[key].flag: 2})
        assert expected in problems_of(**flags | FLAG_KNOBS[knob])
        assert f"with {knob}:" not in problems_of(**flags)
        return
    config = ModelConfig.from_file(TINY_MODEL_DIR / "config.json")
    changes = {
        "neftune_alpha": dict(neftune_alpha=5.0),
        "an MoE model": dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, moe_intermediate_size=16),
        "a reward model (score_head)": dict(score_head=True),
    }[knob]
    check = {"cp": check_context_parallel, "pp": check_pipeline}[key]
    with pytest.raises(ConfigError) as refused:
        check(dataclasses.replace(config, **changes), 2)
    assert str(refused.value) == expected
