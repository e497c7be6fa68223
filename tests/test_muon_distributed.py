"""Muon's Newton-Schulz once per matrix across ranks (issue 42, ``optim.muon_owners``): the owner table, the layouts
and routes simulated over meshes no spawn here could afford (HSDP 2 x 4, FSDP x TP, 8 ranks for 3 matrices), and
one spawn of 2 gloo ranks stepping FSDP, HSDP, DDP and tensor-parallel layouts against one process, bit for bit,
counting each rank's iterations; Mano and Nora in the same spawn, their sharded sums all-reduced, against one
process to float32 rounding. The 4-rank layouts (FSDP, HSDP 2 x 2, DDP, FSDP x TP on a real tensor-parallel model)
run inside tests/test_training_distributed.py's 4-rank spawn, which pays for its processes already."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from spawn import run_ranks
from torch.distributed.tensor import Replicate, Shard

from astrai_fabric.optim import MuonNS
from astrai_fabric.optim.muon_owners import (
    REPLICATED_OFF,
    SUB_MESH,
    MatrixLayout,
    OwnerPlan,
    assemble,
    assign_owners,
    block_slices,
    layout_from_mesh,
    matrix_layout,
    newton_schulz_flops,
    pack,
    unpack,
)

NS_STEPS = 5
SHAPES = [(48, 16), (16, 48), (33, 20), (7, 5), (40, 24), (24, 40), (3, 40), (1, 6), (29, 17), *[(12, 8)] * 4]
"""Uneven row counts on 2 ranks (33, 7, 3, 29, and 1: one rank's block empty), and four small matrices of one shape
(experts: an owner orthogonalises those it has as one stack); 2 ranks split the FLOPs 50/50."""
STEPS = 3
SETTINGS = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


# --- the owner table ---------------------------------------------------------------------------------------------


def test_owners_balance_flops_not_counts():
    # 2 large matrices and 20 of a tenth their side (1/1000th the FLOPs): by count, 4 ranks would take 5-6 each and
    # two of them a large one; by FLOPs the large ones go to two ranks and the small ones fill the other two.
    shapes = [(1024, 1024)] * 2 + [(102, 102)] * 20 + [(1024, 4096), (256, 1024)]
    costs = [newton_schulz_flops(*shape, NS_STEPS) for shape in shapes]
    owners = assign_owners(costs, 4)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == rank) for rank in range(4)]
    assert max(loads) - min(loads) <= max(costs)
    assert owners == assign_owners(list(costs), 4)  # a function of the shapes: every rank computes the same
    assert newton_schulz_flops(8, 4, 1) == newton_schulz_flops(4, 8, 1) == 4 * 16 * 8 + 2 * 64


def test_owners_are_the_least_loaded_rank_each_time_as_a_scan_of_every_rank_finds_it():
    """The heap's choice (O(matrices log ranks)) is the definition's: largest cost first, to the rank of least load,
    lowest index on ties (zero costs and equal costs included), against a scan of every rank."""

    def scanned(costs: list[float], world_size: int) -> tuple[int, ...]:
        loads, owners = [0.0] * world_size, [0] * len(costs)
        for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
            owners[index] = min(range(world_size), key=lambda r: (loads[r], r))
            loads[owners[index]] += costs[index]
        return tuple(owners)

    generator = random.Random(0)
    for _ in range(500):
        costs = [generator.choice([0.0, 1.0, 2.0, generator.random()]) for _ in range(generator.randint(0, 30))]
        world_size = generator.randint(1, 40)
        assert assign_owners(costs, world_size) == scanned(costs, world_size), (costs, world_size)


def test_more_ranks_than_matrices_leaves_ranks_idle():
    costs = [newton_schulz_flops(*shape, NS_STEPS) for shape in ((5, 3), (2, 7), (4, 4))]
    owners = assign_owners(costs, 8)
    assert len(set(owners)) == 3  # five ranks own nothing
    simulate([(5, 3), (2, 7), (4, 4)], "fsdp8")  # rows < ranks: most blocks empty


def test_rounds_bound_what_an_owner_holds_at_once():
    world, cap = 2, 4 * 40 * 24  # bytes: one (40, 24) float32 matrix
    layouts = [grid_layout(shape, ((0, 1),)) for shape in [*SHAPES, (64, 64)]]
    plan = OwnerPlan.build(layouts, [NS_STEPS] * len(layouts), world, 0, replicated=False)
    active = list(range(len(layouts)))
    rounds = plan.rounds(active, cap)
    assert sorted(m for batch in rounds for m in batch) == active and all(batch == sorted(batch) for batch in rounds)
    for batch in rounds:
        for rank in range(world):
            owned = [m for m in batch if plan.owners[m] == rank]
            held = sum(4 * layouts[m].shape[0] * layouts[m].shape[1] for m in owned)
            assert held <= cap or len(owned) == 1  # a matrix larger than the cap has a round of its own
    assert plan.rounds(active, None) == [active]


# --- layouts and routes, simulated -------------------------------------------------------------------------------

MESHES = {
    # name: (the mesh's global ranks by coordinate, placements per mesh dimension)
    "fsdp2": ([0, 1], [Shard(0)]),
    "fsdp4": ([0, 1, 2, 3], [Shard(0)]),
    "fsdp8": (list(range(8)), [Shard(0)]),
    "hsdp2x2": ([[0, 1], [2, 3]], [Replicate(), Shard(0)]),
    "hsdp2x2_strided": ([[0, 2], [1, 3]], [Replicate(), Shard(0)]),  # a replica's ranks not consecutive
    "hsdp2x4": ([[0, 1, 2, 3], [4, 5, 6, 7]], [Replicate(), Shard(0)]),
    "fsdp2_x_tp2_rowwise": ([[0, 1], [2, 3]], [Shard(0), Shard(1)]),  # FSDP over a row-wise split: 2 x 2 tiles
    "fsdp2_x_tp2_colwise": ([[0, 1], [2, 3]], [Shard(0), Shard(0)]),  # both split rows: 4 row blocks
    "hsdp2x2_x_tp2": ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [Replicate(), Shard(0), Shard(1)]),
    "tp2_columns": ([0, 1], [Shard(1)]),  # tensor parallelism's row-wise layers alone
    "ddp3": ([0, 1, 2], [Replicate()]),  # every rank whole: a replicated DTensor, as DDP's plain tensors
}


def mesh_layout(shape: tuple[int, int], name: str) -> MatrixLayout:
    ranks, placements = MESHES[name]
    layout = layout_from_mesh(shape, torch.float32, torch.tensor(ranks), placements)
    assert isinstance(layout, MatrixLayout), layout
    return layout


def grid_layout(shape: tuple[int, int], grid: tuple[tuple[int, ...], ...]) -> MatrixLayout:
    """``grid[replica][shard]``: the rank holding that shard's rows (FSDP: one replica)."""
    return layout_from_mesh(shape, torch.float32, torch.tensor(grid), [Replicate(), Shard(0)])


def orthogonalised(whole: torch.Tensor, index: int) -> torch.Tensor:
    """A stand-in for the iteration: any function of the whole matrix, different per matrix."""
    return whole * 2 + index


def test_rectangles_are_where_torch_puts_each_rank_s_part():
    # torch's own split (distribute_tensor's chunks, computed here without a process group) against the layout.
    whole = torch.arange(33 * 20, dtype=torch.float32).view(33, 20)
    for name, (ranks, placements) in MESHES.items():
        ranks = torch.tensor(ranks)
        layout = mesh_layout((33, 20), name)
        for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
            local = whole
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Shard):  # torch.chunk's pieces; past the last one, empty
                    chunks = local.chunk(ranks.shape[mesh_dim], placement.dim) + (local.narrow(placement.dim, 0, 0),)
                    local = chunks[min(coordinate[mesh_dim], len(chunks) - 1)]
            r0, r1, c0, c1 = layout.blocks[int(ranks[coordinate])]
            if local.numel():
                assert torch.equal(local, whole[r0:r1, c0:c1]), (name, coordinate)
            else:
                assert (r1 - r0) * (c1 - c0) == 0, (name, coordinate)


def test_rectangles_that_interleave_are_refused():
    # A strided shard whose rows interleave (torch's own example: S(0) then a strided S(0) with split factor 2 on a
    # 2 x 2 mesh gives rows [0, 2] and [1, 3] per rank): no rectangle describes a rank's part, so no owner is chosen.
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = [Shard(0), _StridedShard(0, split_factor=2)]
    refused = layout_from_mesh((8, 4), torch.float32, torch.tensor([[0, 1], [2, 3]]), placements)
    assert isinstance(refused, str) and "not a grid of rectangles" in refused, refused
    assert not OwnerPlan.build([refused], [NS_STEPS], 4, 0, replicated=True).spreads_any


def simulate(shapes: list[tuple[int, int]], name: str) -> list[int]:
    """Both all-to-alls of a step over every rank of mesh ``name``, in one process: each owner must hold exactly
    its matrices whole, and every rank its rectangle of each result. Returns the elements each rank received."""
    layouts = [mesh_layout(shape, name) for shape in shapes]
    world = len(layouts[0].blocks)
    plans = [OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, rank, replicated=True) for rank in range(world)]
    wholes = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    active = list(range(len(shapes)))
    received = [0] * world
    assert len({plan.moves_rectangles(active) for plan in plans}) == 1  # every rank calls the gather, or none does

    def own(rank, m):
        r0, r1, c0, c1 = layouts[m].blocks[rank]
        return wholes[m][r0:r1, c0:c1]

    def all_to_all(pieces, source):
        """Each rank's sends, delivered: rank r's receive buffer is every peer's segment for r, in peer order."""
        sends = [getattr(plans[r], pieces)(active)[0] for r in range(world)]
        segments = []
        for rank in range(world):
            flat = pack(sends[rank], lambda piece, rank=rank: source(rank, piece), torch.float32, torch.device("cpu"))
            segments.append(flat.split(plans[rank].split_sizes(sends[rank])))
        out = []
        for rank in range(world):
            recvs = getattr(plans[rank], pieces)(active)[1]
            sizes = plans[rank].split_sizes(recvs)
            assert sizes == [segments[peer][rank].numel() for peer in range(world)]
            assert sizes[rank] == 0  # nothing to itself: its own rectangle stays where it is
            received[rank] += sum(sizes)
            out.append(unpack(recvs, torch.cat([segments[peer][rank] for peer in range(world)])))
        return out

    gathered = all_to_all("gather_pieces", lambda rank, piece: own(rank, piece.matrix))
    results = {}
    for rank in range(world):
        owned = [m for m in active if plans[rank].owners[m] == rank]
        recvs = plans[rank].gather_pieces(active)[1]
        assert {piece.matrix for piece in recvs} <= set(owned)  # its own matrices only
        held = assemble(plans[rank], owned, recvs, gathered[rank], lambda m, rank=rank: own(rank, m))
        for m, whole in held.items():
            assert torch.equal(whole, wholes[m])
            results[m] = orthogonalised(whole, m)
    returned = all_to_all("scatter_pieces", lambda rank, piece: results[piece.matrix][block_slices(piece.block)])
    for rank in range(world):
        recvs = plans[rank].scatter_pieces(active)[1]
        assert sorted(piece.matrix for piece in recvs) == [m for m in active if plans[rank].owners[m] != rank]
        for piece, block in zip(recvs, returned[rank], strict=True):
            assert piece.block == layouts[piece.matrix].blocks[rank]
            assert torch.equal(block, orthogonalised(wholes[piece.matrix], piece.matrix)[block_slices(piece.block)])
    return received


def gathered_today(shapes: list[tuple[int, int]], name: str) -> list[int]:
    """Elements each rank receives when every rank gathers every matrix whole (the old path)."""
    layouts = [mesh_layout(shape, name) for shape in shapes]
    return [
        sum(
            lay.shape[0] * lay.shape[1] - (r1 - r0) * (c1 - c0)
            for lay in layouts
            for r0, r1, c0, c1 in [lay.blocks[rank]]
        )
        for rank in range(len(layouts[0].blocks))
    ]


@pytest.mark.parametrize("name", [name for name in MESHES if name != "ddp3"])
def test_owners_get_their_matrices_whole_and_every_rank_its_part(name):
    shapes = [*SHAPES, (96, 64), (64, 96)]
    received = simulate(shapes, name)
    # The communication this replaces: every rank gathering every matrix whole. Where blocks split evenly it is
    # never less over the world (equal at 2 ranks); uneven blocks can cost an owner holding a short block one row
    # (or column) more per matrix, each way, per replica.
    world = len(mesh_layout(shapes[0], name).blocks)
    slack = sum(2 * world * max(shape) for shape in shapes)
    assert sum(received) <= sum(gathered_today(shapes, name)) + slack
    even = [(64, 48), (32, 96), (128, 128), (8, 16), (16, 8)]
    assert sum(simulate(even, name)) <= sum(gathered_today(even, name))


def test_every_rank_joins_every_collective_even_owning_nothing(monkeypatch):
    # HSDP 2 x 2 with one matrix: the other replica owns nothing, sends nothing, and still must join both
    # all-to-alls (it receives its rows of the result), or the owner's replica waits forever.
    import astrai_fabric.optim.muon_owners as owners

    calls = []

    def all_to_all_single(output, input, output_split_sizes, input_split_sizes):
        calls.append(rank)
        output.zero_()

    monkeypatch.setattr(owners.dist, "all_to_all_single", all_to_all_single)
    layouts = [mesh_layout((6, 4), "hsdp2x2")]
    for rank in range(4):
        plan = OwnerPlan.build(layouts, [NS_STEPS], 4, rank, replicated=False)
        r0, r1, c0, c1 = layouts[0].blocks[rank]
        update = torch.zeros(r1 - r0, c1 - c0)
        out = owners.exchange(plan, [0], {0: update}, {0: update}, lambda wholes: wholes, torch.device("cpu"))
        assert tuple(out[0].shape) == (r1 - r0, 4)
    assert calls == [0, 0, 1, 1, 2, 2, 3, 3]


def test_replicated_results_go_to_every_rank_once():
    # DDP: every rank holds every matrix whole, so owners need nothing (no gather on any rank) and each result goes
    # to every other rank: an all-gather's bytes, (W - 1) / W of the matrices per rank.
    shapes, world = SHAPES, 3
    received = simulate(shapes, "ddp3")
    total = sum(rows * cols for rows, cols in shapes)
    layouts = [mesh_layout(shape, "ddp3") for shape in shapes]
    plans = [OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, rank, replicated=True) for rank in range(world)]
    assert not plans[0].moves_rectangles(range(len(shapes))) and plans[0].gather_pieces(range(len(shapes))) == ([], [])
    for rank, plan in enumerate(plans):
        owned = sum(rows * cols for m, (rows, cols) in enumerate(shapes) if plan.owners[m] == rank)
        assert received[rank] == total - owned
    for m in range(len(shapes)):
        assert sum(plan.orthogonalised_here(m) for plan in plans) == 1
        assert [plan.needs_update(m) for plan in plans] == [plan.orthogonalised_here(m) for plan in plans]
    off = OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, 0, replicated=False)
    assert not off.spreads_any and off.describe() == f"every rank orthogonalises every matrix ({REPLICATED_OFF})"


def test_plan_says_which_path_each_matrix_takes():
    spread = grid_layout((8, 4), ((0, 1),))
    assert OwnerPlan.build([spread] * 3, [5] * 3, 2, 0, False).describe() == (
        "each matrix orthogonalised once, by one of 2 ranks"
    )
    mixed = OwnerPlan.build([spread, SUB_MESH, spread], [5] * 3, 2, 0, False)
    assert mixed.describe() == (
        f"2 of 3 matrices orthogonalised once, by one of 2 ranks; the other 1 by every rank ({SUB_MESH})"
    )
    assert OwnerPlan.build([SUB_MESH], [5], 2, 0, False).describe() == (
        f"every rank orthogonalises every matrix ({SUB_MESH})"
    )
    assert MuonNS([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1).describe_layout() == (
        "one process: it orthogonalises every matrix"
    )


# --- 2 real gloo ranks -------------------------------------------------------------------------------------------


def initial(index: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + index))


def gradient(step: int, index: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + index))


def take_steps(optimizer: torch.optim.Optimizer, params: list, place) -> None:
    """``STEPS`` steps on the fixed gradients, each ``place``d as its parameter."""
    for step in range(STEPS):
        for i, param in enumerate(params):
            param.grad = place(gradient(step, i, SHAPES[i]))
        optimizer.step()


LAYOUTS = {
    # name: (mesh shape, mesh dim names, placements or None for plain tensors, spread_replicated, ns dtype)
    "fsdp": ((2,), None, "S", False, torch.float32),
    "hsdp_1x2": ((1, 2), ("replicate", "shard"), "RS", False, torch.float32),
    "hsdp_2x1": ((2, 1), ("replicate", "shard"), "RS", True, torch.float32),  # replicas, one shard each
    "ddp": (None, None, None, True, torch.float32),
    "ddp_bfloat16": (None, None, None, True, torch.bfloat16),  # against torch's own Muon
    "ddp_default": (None, None, None, False, torch.float32),
    "columns": ((2,), ("tensor_parallel",), "C", False, torch.float32),  # tensor parallelism's row-wise split
    "refused": ((2,), None, "S", False, torch.float32),  # no layout accepted: every rank gathers every matrix
    "fsdp_rounds": ((2,), None, "S", False, torch.float32),
    "ddp_rounds": (None, None, None, True, torch.float32),
}
FOUR_RANK_LAYOUTS = {
    "fsdp4": ((4,), None, "S", False, torch.float32),
    "hsdp_2x2": ((2, 2), ("replicate", "shard"), "RS", False, torch.float32),  # owners in both replicas
    "ddp4": (None, None, None, True, torch.float32),
}
"""Stepped in tests/test_training_distributed.py's 4-rank spawn (``fsdp_tp_worker``), with FSDP x TP."""
ROUND_BYTES = {"fsdp_rounds": 2048, "ddp_rounds": 2048}
"""Layouts stepped in rounds of at most this many bytes of whole matrices per owner (one round by default)."""


def step_layout(name: str) -> dict:
    """``STEPS`` Muon steps of ``SHAPES`` held as ``LAYOUTS[name]``, the gradients fixed; Newton-Schulz calls and
    FLOPs counted on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import astrai_fabric.optim.muon as muon

    mesh_shape, names, placements, spread, ns_dtype = (LAYOUTS | FOUR_RANK_LAYOUTS)[name]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names) if mesh_shape else None
    chosen = {"S": [Shard(0)], "RS": [Replicate(), Shard(0)], "C": [Shard(1)]}.get(placements)

    def place(tensor):
        return distribute_tensor(tensor, mesh, chosen) if mesh else tensor

    params = [torch.nn.Parameter(place(initial(i, shape))) for i, shape in enumerate(SHAPES)]
    optimizer = MuonNS(params, ns_dtype=ns_dtype, spread_replicated=spread, **SETTINGS)
    if name == "refused":  # the path for layouts no owner can take (a mesh over part of the ranks, ...)
        muon.matrix_layout = lambda param, world_size: SUB_MESH
    if name in ROUND_BYTES:
        optimizer.owner_round_bytes = ROUND_BYTES[name]
        assert len(optimizer.owner_plan().rounds(range(len(SHAPES)), ROUND_BYTES[name])) > 2
    calls, flops, stacked = [], [], []
    plain = muon.newton_schulz

    def counted(matrix, *args):
        count = len(matrix) if matrix.dim() == 3 else 1  # a stack of matrices, or one
        stacked.append(count if matrix.dim() == 3 else 0)
        calls.extend([tuple(matrix.shape[-2:])] * count)
        flops.extend([newton_schulz_flops(*matrix.shape[-2:], NS_STEPS)] * count)
        return plain(matrix, *args)

    muon.newton_schulz = counted
    try:
        take_steps(optimizer, params, place)
    finally:
        muon.newton_schulz, muon.matrix_layout = plain, matrix_layout
    state = optimizer.state_dict()["state"]
    assert all(set(entry) == {"momentum_buffer"} for entry in state.values())  # torch's layout
    buffers = [entry["momentum_buffer"] for entry in state.values()]
    if mesh:  # momentum stays sharded as the parameter is
        assert [tuple(b.to_local().shape) for b in buffers] == [tuple(p.to_local().shape) for p in params]
    return {
        "params": [(p.full_tensor() if mesh else p).detach().clone() for p in params],
        "calls": len(calls),
        "flops": sum(flops),
        "stacked": sum(stacked),
        "describe": optimizer.describe_layout(),
    }


def real_fsdp_model(steps: int, sharded: bool):
    """Two bias-free Linear layers, trained ``steps`` Muon steps on a fixed batch (the same on every rank, so FSDP's
    averaged gradient is one process's exactly), under FSDP2's ``fully_shard`` when ``sharded``."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 10, bias=False))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    optimizer = MuonNS(list(model.parameters()), ns_dtype=torch.float32, **SETTINGS)
    batch = torch.randn(6, 16, generator=torch.Generator().manual_seed(6))
    for _ in range(steps):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, [(p.full_tensor() if sharded else p).detach() for p in model.parameters()]


ROW_OPTIMIZERS = {"mano": dict(lr=0.02, weight_decay=0.1), "nora": dict(lr=0.02, weight_decay=0.1)}
"""AstrAI's other matrix optimizers: Mano normalises columns and rows in turn, Nora rows (``composite.AlongDim``)."""
ROW_LAYOUTS = {"fsdp": "S", "columns": "C", "hsdp_1x2": "RS"}
"""Layouts that split Mano's columns (``S``: FSDP's rows) or Nora's and Mano's rows (``C``: tensor parallelism's)."""


def row_optimizer(kind: str, params: list) -> torch.optim.Optimizer:
    from astrai_fabric.optim import Mano
    from astrai_fabric.optim.nora import Nora

    return {"mano": Mano, "nora": Nora}[kind](params, **ROW_OPTIMIZERS[kind])


def step_row_optimizer(kind: str, layout: str | None) -> dict:
    """``STEPS`` steps of ``kind`` over ``SHAPES`` held as ``ROW_LAYOUTS[layout]`` (None: one process), the
    gradients fixed; on a mesh, counts the whole matrices gathered and the all-reduces of partial sums."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = (
        {"S": [Shard(0)], "C": [Shard(1)], "RS": [Replicate(), Shard(0)]}[ROW_LAYOUTS[layout]] if layout else None
    )
    mesh = init_device_mesh("cpu", (2,) if len(placements) == 1 else (1, 2)) if layout else None

    def place(tensor):
        return distribute_tensor(tensor, mesh, placements) if mesh else tensor

    params = [torch.nn.Parameter(place(initial(i, shape))) for i, shape in enumerate(SHAPES)]
    optimizer = row_optimizer(kind, params)
    counts = {"gathers": 0, "all_reduces": 0}
    full_tensor, all_reduce = DTensor.full_tensor, dist.all_reduce

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return counted

    DTensor.full_tensor, dist.all_reduce = counting("gathers", full_tensor), counting("all_reduces", all_reduce)
    try:
        take_steps(optimizer, params, place)
    finally:
        DTensor.full_tensor, dist.all_reduce = full_tensor, all_reduce
    return {"params": [(p.full_tensor() if mesh else p).detach().clone() for p in params], **counts}


def two_rank_worker(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {name: step_layout(name) for name in LAYOUTS}
    for kind in ROW_OPTIMIZERS:
        results |= {f"{kind}_{layout}": step_row_optimizer(kind, layout) for layout in ROW_LAYOUTS}
    optimizer, weights = real_fsdp_model(2, sharded=True)
    results["fully_shard"] = {"params": weights, "describe": optimizer.describe_layout()}
    save_with_counts(results, out)
    dist.destroy_process_group()


def save_with_counts(results: dict, out: str) -> None:
    """Rank 0 saves ``results`` with every rank's Newton-Schulz calls and FLOPs per entry."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    counts = {name: (r.get("calls"), r.get("flops"), r.get("stacked")) for name, r in results.items()}
    dist.all_gather_object(everyone, counts)
    if dist.get_rank() == 0:
        torch.save({"results": results, "counts": everyone}, out)


def check_layouts(layouts: dict, results: dict, counts: list[dict]) -> None:
    """Each layout's parameters equal one process's bit for bit (the same whole matrices reach the same iteration,
    not merely within reduction order), and each spread matrix is orthogonalised once per step, the FLOPs balanced
    over the ranks (greedily: no rank above an even share by more than the largest matrix)."""
    reference = one_process(torch.float32)
    costs = [newton_schulz_flops(*shape, NS_STEPS) for shape in SHAPES]
    world_size = len(counts)
    for name, (*_, ns_dtype) in layouts.items():
        expected = one_process(ns_dtype, torch_muon=True) if ns_dtype == torch.bfloat16 else reference
        for index, (ours, theirs) in enumerate(zip(results[name]["params"], expected, strict=True)):
            assert torch.equal(ours, theirs), (name, index, (ours - theirs).abs().max())
        calls = [counts[rank][name][0] for rank in range(world_size)]
        flops = [counts[rank][name][1] for rank in range(world_size)]
        if name in ("ddp_default", "refused"):  # not spread: every rank runs every iteration, as before
            assert calls == [STEPS * len(SHAPES)] * world_size, (name, calls)
            assert results[name]["describe"].startswith("every rank orthogonalises every matrix"), name
            continue
        assert sum(calls) == STEPS * len(SHAPES), (name, calls)  # each matrix exactly once per step
        assert sum(flops) == STEPS * sum(costs), (name, flops)
        assert max(flops) <= STEPS * (sum(costs) / world_size + max(costs)), (name, flops)
        assert results[name]["describe"] == f"each matrix orthogonalised once, by one of {world_size} ranks", name
        stacked = [counts[rank][name][2] for rank in range(world_size)]
        assert sum(stacked) > 0, (name, stacked)  # owners stack their small matrices of one shape
    if world_size == 2:  # SHAPES split 50/50 on 2 ranks
        assert all(0.45 <= counts[r][n][1] / (STEPS * sum(costs)) <= 0.55 for n in ("fsdp", "ddp") for r in range(2))


def one_process(ns_dtype: torch.dtype, torch_muon: bool = False) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(initial(i, shape)) for i, shape in enumerate(SHAPES)]
    kind = torch.optim.Muon if torch_muon else MuonNS
    optimizer = kind(params, **SETTINGS) if torch_muon else kind(params, ns_dtype=ns_dtype, **SETTINGS)
    take_steps(optimizer, params, lambda tensor: tensor)
    return [p.detach() for p in params]


@pytest.mark.slow
def test_two_ranks_orthogonalise_each_matrix_once_and_equal_one_process(tmp_path):
    run_ranks(two_rank_worker, 2, str(tmp_path / "out.pt"))
    saved = torch.load(tmp_path / "out.pt", weights_only=False)
    results, counts = saved["results"], saved["counts"]
    check_layouts(LAYOUTS, results, counts)
    assert SUB_MESH in results["refused"]["describe"]
    assert REPLICATED_OFF in results["ddp_default"]["describe"]
    # FSDP2's own layout (fully_shard), trained by backward passes: the same as one process.
    _, weights = real_fsdp_model(2, sharded=False)
    assert results["fully_shard"]["describe"] == "each matrix orthogonalised once, by one of 2 ranks"
    for ours, theirs in zip(results["fully_shard"]["params"], weights, strict=True):
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    # Mano and Nora: each rank reduces its block and the partial sums are all-reduced, never a matrix gathered. The
    # sums' order differs from one process's: the updates agree to 1e-6 of their largest entry, plus the rounding of
    # parameters ~3 in size that each of the steps adds (measured: at most 6.2e-6 of the largest entry in all).
    start = [initial(i, shape) for i, shape in enumerate(SHAPES)]
    for kind in ROW_OPTIMIZERS:
        reference = step_row_optimizer(kind, None)["params"]
        for layout in ROW_LAYOUTS:
            run = results[f"{kind}_{layout}"]
            assert run["gathers"] == 0, (kind, layout)
            splits = layout == "columns" or kind == "mano"  # Nora's rows stay whole on FSDP's row shards
            assert (run["all_reduces"] > 0) == splits, (kind, layout, run["all_reduces"])
            for index, (ours, theirs, before) in enumerate(zip(run["params"], reference, start, strict=True)):
                assert_updates_close(ours, theirs, before, f"{kind} {layout} {index}")


def assert_updates_close(ours: torch.Tensor, theirs: torch.Tensor, before: torch.Tensor, what: str) -> None:
    """``ours`` and ``theirs``, both stepped from ``before``, moved alike to 1e-6 of the largest entry of the
    reference's update, plus the float32 rounding of the parameters that each step adds."""
    update, expected = ours - before, theirs - before
    rounding = STEPS * torch.finfo(torch.float32).eps * theirs.abs().max().item()
    atol = 1e-6 * expected.abs().max().item() + rounding
    torch.testing.assert_close(update, expected, rtol=0, atol=atol, msg=what)


# --- FSDP over tensor parallelism: 4 real ranks, inside tests/test_training_distributed.py's 4-rank spawn -----------

FSDP_TP_OPTIMIZERS = ("muon", "mano", "nora")


def fsdp_tp_model(sharded: bool):
    """The tiny model with an MLP of 26 (13 rows per tensor-parallel rank, 7 and 6 per FSDP shard), laid out as
    ``--parallel_mode fsdp --tp_size 2`` on 4 ranks lays it out (``parallelize`` on a 2 x 2 mesh) when ``sharded``."""
    from conftest import tiny_config

    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.parallel.parallelize import parallelize

    torch.manual_seed(7)
    model = AutoRegressiveLM(tiny_config(intermediate_size=26))
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel")))
    return model


def step_fsdp_tp(kind: str, sharded: bool) -> dict:
    """``STEPS`` steps of ``kind`` over the model's matrices (Muon's split by name, Mano's and Nora's by role), each
    gradient a fixed function of its parameter computed elementwise (so it lies where the parameter does)."""
    from astrai_fabric.optim import Mano, Nora, is_matrix_param
    from astrai_fabric.optim.composite import split_by_role

    model = fsdp_tp_model(sharded)
    if kind == "muon":
        params = [p for n, p in model.named_parameters() if is_matrix_param(n, p)]
        optimizer = MuonNS(params, ns_dtype=torch.float32, **SETTINGS)
    else:
        params = split_by_role(model).matrices
        optimizer = {"mano": Mano, "nora": Nora}[kind](params, **ROW_OPTIMIZERS[kind])
    for step in range(STEPS):
        for index, param in enumerate(params):
            scale, shift = 1.3 + step, float(index)
            param.grad = on_each_block(lambda block, a=scale, b=shift: torch.sin(block * a + b), param.detach())
        optimizer.step()
    full = [(p.full_tensor() if sharded else p).detach().clone() for p in params]
    placements = sorted({type(p).__name__ for param in params for p in getattr(param, "placements", ())})
    describe = optimizer.describe_layout() if kind == "muon" else None
    position = {id(p): i for i, p in enumerate(model.parameters())}
    indices = [position[id(p)] for p in params]  # where each stepped matrix sits in model.parameters()
    return {"params": full, "placements": placements, "describe": describe, "indices": indices}


def on_each_block(function, tensor: torch.Tensor) -> torch.Tensor:
    """An elementwise ``function`` of ``tensor``, computed on each rank's block of a DTensor and placed as it was."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return function(tensor)
    mesh, placements = tensor.device_mesh, tensor.placements
    local = function(tensor.to_local())
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride())


def fsdp_tp_worker(out: str) -> None:
    """Each optimizer stepped on the 4-rank FSDP x TP layout, and Muon on ``FOUR_RANK_LAYOUTS``; rank 0 saves the
    results (the process group is the caller's)."""
    import torch.distributed as dist

    results = {kind: step_fsdp_tp(kind, sharded=True) for kind in FSDP_TP_OPTIMIZERS}
    results |= {name: step_layout(name) for name in FOUR_RANK_LAYOUTS}
    assert dist.get_world_size() == 4
    save_with_counts(results, out)


def check_fsdp_tp_optimizers(out: str) -> None:
    """Against one process: Muon bit for bit (each matrix orthogonalised whole by its owner) on FSDP x TP and
    ``FOUR_RANK_LAYOUTS``, Mano's and Nora's updates to 1e-6 (their sums all-reduced over both mesh dimensions
    where both split a dimension)."""
    saved = torch.load(out, weights_only=False)
    results = saved["results"]
    check_layouts(FOUR_RANK_LAYOUTS, results, saved["counts"])
    # FSDP2's strided shard over tensor parallelism's column split (rows split twice) is among the layouts.
    assert "_StridedShard" in results["muon"]["placements"], results["muon"]["placements"]
    assert results["muon"]["describe"] == "each matrix orthogonalised once, by one of 4 ranks"
    start = [p.detach() for p in fsdp_tp_model(sharded=False).parameters()]
    for kind in FSDP_TP_OPTIMIZERS:
        run = step_fsdp_tp(kind, sharded=False)
        starts = [start[i] for i in run["indices"]]
        for index, (ours, theirs, before) in enumerate(
            zip(results[kind]["params"], run["params"], starts, strict=True)
        ):
            if kind == "muon":
                assert torch.equal(ours, theirs), (index, (ours - theirs).abs().max())
            else:
                assert_updates_close(ours, theirs, before, f"{kind} {index}")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--parallel_mode", "fsdp"], "each matrix orthogonalised once, by one of 2 ranks (its owner gathers only"),
        (["--parallel_mode", "ddp"], "by one of 2 ranks (the results all-gathered)"),  # CPU's default: spread
        (["--parallel_mode", "ddp", "--muon_spread_replicated", "false"], "every rank orthogonalises every matrix (r"),
        (["--parallel_mode", "ddp", "--device_type", "cpu", "--muon_spread_replicated", "true"], "(the results all-"),
        (["--parallel_mode", "fsdp", "--tp_size", "2"], "by one of 2 ranks (its owner gathers only its shards)"),
    ],
)
def test_the_plan_says_how_muon_shares_its_work_among_the_ranks(tmp_path, capsys, flags, line):
    """The dry run's (and the run's: one renderer) ``muon`` line for each layout, from the flags alone."""
    from astrai_fabric.cli import main

    argv = ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "32"]
    assert main([*argv, "--nprocs", "2", *flags, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    (muon,) = [text for text in capsys.readouterr().out.splitlines() if text.startswith("  muon ")]
    assert line in muon, muon
