"""Torch's private APIs stay in ``astrai_fabric/torch_private.py``: no other module of the package touches a private
torch name (read from the source), each API it wraps still exists and takes what we pass, and the installed torch is
one of the versions they were checked against; each failure names the torch version and the API."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader

from astrai_fabric import torch_private
from astrai_fabric.torch_private import CHECKED_TORCH, PRIVATE_APIS

PACKAGE = Path(__file__).parents[1] / "astrai_fabric"
HOME = PACKAGE / "torch_private.py"
TORCH_PATH = re.compile(r"torch(\.\w+)+")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


DECLARED = {segment for path in PRIVATE_APIS for segment in path.split(".") if is_private(segment)}
"""Every private segment of the wrapped APIs: ``_init_group`` or ``_orig_mod`` is torch's wherever it is read."""


def torch_version() -> str:
    """The installed torch's minor version: ``2.13`` of ``2.13.0+cpu``."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, private name)`` for each place ``source`` touches a private torch name: a private segment in an
    import from torch or in a ``torch.…`` path (through any name bound by ``import torch…``/``from torch… import``),
    a wrapped API's private attribute on any object (``self._init_group``), or a string naming either (a
    ``getattr`` argument, a logger's or module's dotted path). Comments and docstrings are not code."""
    tree = ast.parse(source)
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    bound.add(alias.asname or "torch")
                    found += [(node.lineno, s) for s in alias.name.split(".") if is_private(s)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            bound.update(alias.asname or alias.name for alias in node.names)
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            found += [(node.lineno, s) for s in names if is_private(s)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr in DECLARED or (isinstance(root, ast.Name) and root.id in bound):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in DECLARED:
                found.append((node.lineno, node.value))
            elif TORCH_PATH.fullmatch(node.value):
                found += [(node.lineno, s) for s in node.value.split(".") if is_private(s)]
    return sorted(set(found))


def test_no_module_but_torch_private_touches_torch_private_names():
    uses = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for line, name in private_uses(path.read_text())
    ]
    assert not uses, (
        "private torch names outside astrai_fabric/torch_private.py (wrap each there, with why and the torch "
        "versions it was checked against, and add it to PRIVATE_APIS):\n  " + "\n  ".join(uses)
    )


def test_torch_private_lists_every_private_name_it_touches():
    touched = {name for _, name in private_uses(HOME.read_text())}
    assert touched - DECLARED == set(), f"torch_private.py touches {sorted(touched - DECLARED)}: add to PRIVATE_APIS"


SCANNED = '''
"""Docstrings may name torch._foreach_norm and DeviceMesh._unflatten."""
import torch
import torch.cuda.memory as memory
import torch.utils._pytree
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.cuda.memory import _dump_snapshot
torch._foreach_norm(x)
memory._record_memory_history(enabled=None)
self._init_group(group, params, grads, buffers)
getattr(model, "_orig_mod", model)
logging.getLogger("torch.utils._pytree")
torch.ops.aten._grouped_mm(a, b)
self._marker, weight.__tensor_flatten__(), getattr(x, "_dataloader", x), "torchao.quantize_.nf4", "torch.distributed"
'''


def test_the_scan_finds_each_way_of_touching_a_private_name():
    names = [
        "_pytree",
        "_utils",
        "_dump_snapshot",
        "_foreach_norm",
        "_record_memory_history",
        "_init_group",
        "_orig_mod",
        "_pytree",
        "_grouped_mm",
    ]
    assert private_uses(SCANNED) == list(enumerate(names, start=5))


def test_installed_torch_is_one_the_private_apis_were_checked_against():
    assert torch_version() in CHECKED_TORCH, (
        f"torch {torch.__version__} is not among the versions astrai_fabric/torch_private.py was checked against "
        f"({', '.join(CHECKED_TORCH)}): read each of its PRIVATE_APIS in torch {torch_version()}'s source "
        f"({', '.join(PRIVATE_APIS)}), run these tests and those of their callers, then add "
        f"{torch_version()!r} to CHECKED_TORCH"
    )


def check_foreach() -> None:
    a, b = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])], [torch.tensor([1.0, 2.0]), torch.tensor([2.0])]
    assert [n.item() for n in torch_private.foreach_norm(a)] == [5.0, 1.0]
    assert [t.tolist() for t in torch_private.foreach_sub(a, b)] == [[2.0, 2.0], [-1.0]]
    torch_private.foreach_add_(a, b, alpha=0.5)
    assert [t.tolist() for t in a] == [[3.5, 5.0], [2.0]]
    torch_private.foreach_mul_(a, 2.0)
    assert [t.tolist() for t in a] == [[7.0, 10.0], [4.0]]


def check_record_memory_history() -> None:
    """No CUDA here to record on: the arguments we pass, down to the function that takes them."""
    memory = torch.cuda.memory
    inspect.signature(memory._record_memory_history).bind(enabled=None)
    inspect.signature(memory._record_memory_history).bind(max_entries=1)
    assert "max_entries" in inspect.signature(memory._record_memory_history_impl).parameters


def check_dump_snapshot() -> None:
    inspect.signature(torch.cuda.memory._dump_snapshot).bind("rank0.memory.pickle")


def check_local_shape() -> None:
    module = importlib.import_module("torch.distributed.tensor._utils")
    parameters = list(inspect.signature(module.compute_local_shape_and_global_offset).parameters)
    assert parameters[:3] == ["global_shape", "mesh", "placements"], parameters


def check_mesh_block() -> None:
    # Where rank (1, 0) of a 2 x 2 mesh holds its part of a 4 x 6 matrix split by rows, then by columns.
    size, offset = torch_private.mesh_block((4, 6), (2, 2), (1, 0), [Shard(0), Shard(1)])
    assert (tuple(size), tuple(offset)) == ((2, 3), (2, 0))
    size, offset = torch_private.mesh_block((4, 6), (2, 2), (0, 1), [Replicate(), Shard(0)])
    assert (tuple(size), tuple(offset)) == ((2, 6), (2, 0))


def check_muon_init_group() -> None:
    param = nn.Parameter(torch.ones(2, 2))
    param.grad = torch.full((2, 2), 2.0)
    optimizer = torch.optim.Muon([param])
    params, grads, bufs = [], [], []
    torch_private.muon_init_group(optimizer, optimizer.param_groups[0], params, grads, bufs)
    assert params == [param] and grads[0] is param.grad and bufs[0] is optimizer.state[param]["momentum_buffer"]
    assert bufs[0].eq(0).all()


def check_ddp_ignore() -> None:
    model = nn.Linear(2, 2)
    torch_private.hide_from_ddp(model, ["weight"])
    assert model._ddp_params_and_buffers_to_ignore == ["weight"]


def check_loader_workers() -> None:
    loader = DataLoader(range(2), num_workers=1, persistent_workers=True)
    assert loader._iterator is None
    next(iter(loader))
    workers = list(loader._iterator._workers)
    torch_private.shut_down_loader_workers(loader)
    assert not any(worker.is_alive() for worker in workers)
    torch_private.shut_down_loader_workers(None)  # no-ops
    torch_private.shut_down_loader_workers(DataLoader(range(2)))


def check_uncompiled() -> None:
    model = nn.Linear(1, 1)
    assert torch_private.uncompiled(torch.compile(model)) is model and torch_private.uncompiled(model) is model


def check_pytree_logger() -> None:
    module = importlib.import_module(torch_private.PYTREE_LOGGER)
    assert module.log.name == torch_private.PYTREE_LOGGER


def check_grouped_mm() -> None:
    # Rows 0-1 times the first matrix, row 2 the second, none the third; the backward with an expanded gradient.
    inputs = torch.arange(12.0).view(3, 4).requires_grad_()
    weights = torch.stack([torch.eye(4), 2 * torch.eye(4), torch.eye(4)])
    outputs = torch_private.grouped_mm(inputs, weights, torch.tensor([2, 3, 3], dtype=torch.int32))
    assert outputs.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [16.0, 18.0, 20.0, 22.0]]
    outputs.sum().backward()
    assert inputs.grad.tolist() == [[1.0] * 4, [1.0] * 4, [2.0] * 4]
    assert torch_private.grouped_mm_fits(torch.float32, 4, 8) and not torch_private.grouped_mm_fits(torch.float32, 6)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch_private.grouped_mm(torch.ones(2, 6), torch.ones(1, 6, 4), torch.tensor([2], dtype=torch.int32))


def check_checkpoint_metadata_globals() -> None:
    """The index torch's distributed checkpoint writes for an optimizer-like state, read back through the restricted
    reader that admits only these names (no other name is needed)."""
    import tempfile
    import warnings
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    from astrai_fabric.checkpoint.sharded_state import check_sharded_state

    state = {"optimizer": {"state": {"0": {"exp_avg": torch.ones(2, 3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=Path(scratch), no_dist=True)
        metadata = check_sharded_state(Path(scratch))
    assert metadata.state_dict_metadata["optimizer.state.0.exp_avg"].size == torch.Size([2, 3])


CHECKS = {
    "torch._foreach_norm": check_foreach,
    "torch._foreach_sub": check_foreach,
    "torch._foreach_add_": check_foreach,
    "torch._foreach_mul_": check_foreach,
    "torch.cuda.memory._record_memory_history": check_record_memory_history,
    "torch.cuda.memory._dump_snapshot": check_dump_snapshot,
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": check_local_shape,
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset": check_mesh_block,
    "torch.optim.Muon._init_group": check_muon_init_group,
    "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model": check_ddp_ignore,
    "torch.utils.data.DataLoader._iterator": check_loader_workers,
    "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers": check_loader_workers,
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": check_uncompiled,
    "torch.utils._pytree": check_pytree_logger,
    "torch._grouped_mm": check_grouped_mm,
    "torch.distributed.checkpoint.filesystem._StorageInfo": check_checkpoint_metadata_globals,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": check_checkpoint_metadata_globals,
    "torch.serialization._get_layout": check_checkpoint_metadata_globals,
}
"""One check per wrapped API: it exists in the installed torch, takes our arguments and does what we use it for."""


def test_every_wrapped_api_has_a_check():
    assert sorted(CHECKS) == sorted(PRIVATE_APIS)


@pytest.mark.parametrize("path", sorted(set(PRIVATE_APIS)))
def test_each_wrapped_private_api_is_as_checked(path):
    try:
        CHECKS[path]()
    except Exception as err:  # noqa: BLE001 - any failure is the same news: torch changed it
        pytest.fail(
            f"torch {torch.__version__}: {path} is missing or changed ({type(err).__name__}: {err}); "
            f"astrai_fabric/torch_private.py was checked against torch {', '.join(CHECKED_TORCH)}: read the API in "
            f"this version's source and adapt its wrapper",
            pytrace=False,
        )
