"""What combines (``config.combinations``): the mesh and the flags' checks refuse exactly the table's pairs and train
types, each in one line carrying the table's reason (the one place that decides them)."""

from __future__ import annotations

import itertools

import pytest

from astrai_fabric.config.combinations import DIMENSIONS, REFUSED_PAIRS, dimension_problem
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
