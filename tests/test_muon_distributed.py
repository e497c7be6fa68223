"""Muon's Newton-Schulz once per matrix across ranks (issue 42, ``optim.muon_owners``): the owner table, the routes
simulated over grids no spawn here could afford (HSDP 2 x 2, 8 ranks for 3 matrices), and one spawn of 2 gloo ranks
stepping FSDP, HSDP and DDP layouts against one process, bit for bit, counting each rank's iterations; Mano and
Nora in the same spawn, their sharded sums all-reduced, against one process to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from spawn import run_ranks

from astrai_fabric.optim import MuonNS
from astrai_fabric.optim.muon_owners import (
    REPLICATED_OFF,
    TENSOR_PARALLEL,
    MatrixLayout,
    OwnerPlan,
    assemble,
    assign_owners,
    newton_schulz_flops,
    pack,
    unpack,
)

NS_STEPS = 5
SHAPES = [(48, 16), (16, 48), (33, 20), (7, 5), (40, 24), (24, 40), (3, 40), (1, 6), (29, 17)]
"""Uneven row counts on 2 ranks (33, 7, 3, 29, and 1: one rank's block empty); 2 ranks split the FLOPs 50/50."""
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


def test_more_ranks_than_matrices_leaves_ranks_idle():
    costs = [newton_schulz_flops(*shape, NS_STEPS) for shape in ((5, 3), (2, 7), (4, 4))]
    owners = assign_owners(costs, 8)
    assert len(set(owners)) == 3  # five ranks own nothing
    simulate_sharded([(5, 3), (2, 7), (4, 4)], grid=(tuple(range(8)),))  # rows < ranks: most blocks empty


def test_rounds_bound_what_an_owner_holds_at_once():
    world, cap = 2, 4 * 40 * 24  # bytes: one (40, 24) float32 matrix
    layouts = [MatrixLayout(shape, torch.float32, (tuple(range(world)),)) for shape in [*SHAPES, (64, 64)]]
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


# --- the routes, simulated ---------------------------------------------------------------------------------------


def orthogonalised(whole: torch.Tensor, index: int) -> torch.Tensor:
    """A stand-in for the iteration: any function of the whole matrix, different per matrix."""
    return whole * 2 + index


def simulate_sharded(shapes: list[tuple[int, int]], grid: tuple[tuple[int, ...], ...]) -> list[int]:
    """Both all-to-alls of a step over every rank of ``grid``, in one process: each owner must hold exactly its
    matrices whole, and every rank its rows of each result. Returns the elements each rank received from others."""
    world = sum(len(row) for row in grid)
    layouts = [MatrixLayout(shape, torch.float32, grid) for shape in shapes]
    plans = [OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, rank, replicated=False) for rank in range(world)]
    wholes = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    active = list(range(len(shapes)))
    received = [0] * world

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
            received[rank] += sum(size for peer, size in enumerate(sizes) if peer != rank)
            out.append(unpack(plans[rank], recvs, torch.cat([segments[peer][rank] for peer in range(world)])))
        return out

    def local(rank, piece):
        start, stop = layouts[piece.matrix].rows_of(rank)
        return wholes[piece.matrix][start:stop]

    gathered = all_to_all("gather_pieces", local)
    results = {}
    for rank in range(world):
        recvs = plans[rank].gather_pieces(active)[1]
        held = assemble(plans[rank], recvs, gathered[rank])
        assert sorted(held) == [m for m in active if plans[rank].owners[m] == rank]  # its own matrices only
        for m, whole in held.items():
            assert torch.equal(whole, wholes[m])
            results[m] = orthogonalised(whole, m)
    returned = all_to_all("scatter_pieces", lambda rank, piece: results[piece.matrix][slice(*piece.rows)])
    for rank in range(world):
        recvs = plans[rank].scatter_pieces(active)[1]
        assert sorted(piece.matrix for piece in recvs) == active  # one block of every matrix
        for piece, rows in zip(recvs, returned[rank], strict=True):
            assert piece.rows == layouts[piece.matrix].rows_of(rank)
            assert torch.equal(rows, orthogonalised(wholes[piece.matrix], piece.matrix)[slice(*piece.rows)])
    return received


def gathered_today(shapes: list[tuple[int, int]], grid: tuple[tuple[int, ...], ...]) -> list[int]:
    """Elements each rank receives when every rank all-gathers every matrix over its replica (the old path)."""
    world = sum(len(row) for row in grid)
    layouts = [MatrixLayout(shape, torch.float32, grid) for shape in shapes]
    received = []
    for rank in range(world):
        received.append(sum(lay.shape[0] * lay.shape[1] - lay.numel(lay.rows_of(rank)) for lay in layouts))
    return received


@pytest.mark.parametrize(
    "grid",
    [((0, 1),), ((0, 1, 2, 3),), ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2, 3), (4, 5, 6, 7))],
    ids=["fsdp2", "fsdp4", "hsdp2x2", "hsdp2x2_strided", "hsdp2x4"],
)
def test_owners_get_their_matrices_whole_and_every_rank_its_rows(grid):
    shapes = [*SHAPES, (96, 64), (64, 96)]
    received = simulate_sharded(shapes, grid)
    # The communication this replaces: every rank gathering every matrix over its replica. Where rows split evenly
    # it is never less over the world (equal at 2 shards); uneven blocks can cost an owner holding the short block
    # one row more per matrix, each way, per replica.
    replicas = len(grid)
    slack = sum(2 * replicas * cols for _, cols in shapes)
    assert sum(received) <= sum(gathered_today(shapes, grid)) + slack
    even = [(64, 48), (32, 96), (128, 128), (8, 16), (16, 8)]
    assert sum(simulate_sharded(even, grid)) <= sum(gathered_today(even, grid))


def test_every_rank_joins_every_collective_even_owning_nothing(monkeypatch):
    # HSDP 2 x 2 with one matrix: the other replica owns nothing, sends nothing, and still must join both
    # all-to-alls (it receives its rows of the result), or the owner's replica waits forever.
    import astrai_fabric.optim.muon_owners as owners

    calls = []

    def all_to_all_single(output, input, output_split_sizes, input_split_sizes):
        calls.append(rank)
        output.zero_()

    monkeypatch.setattr(owners.dist, "all_to_all_single", all_to_all_single)
    grid = ((0, 1), (2, 3))
    layouts = [MatrixLayout((6, 4), torch.float32, grid)]
    for rank in range(4):
        plan = OwnerPlan.build(layouts, [NS_STEPS], 4, rank, replicated=False)
        start, stop = layouts[0].rows_of(rank)
        update = torch.zeros(stop - start, 4)
        out = owners.exchange(plan, [0], {0: update}, {0: update}, lambda m, w: w, torch.device("cpu"))
        assert tuple(out[0].shape) == (stop - start, 4)
    assert calls == [0, 0, 1, 1, 2, 2, 3, 3]


def test_replicated_results_are_all_gathered_once():
    world, shapes = 3, SHAPES
    grid = tuple((rank,) for rank in range(world))  # DDP: every rank a replica of one shard
    layouts = [MatrixLayout(shape, torch.float32, grid) for shape in shapes]
    plans = [OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, rank, replicated=True) for rank in range(world)]
    wholes = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    active = list(range(len(shapes)))
    segment, where = plans[0].replicated_segments(active)
    assert all(plan.replicated_segments(active) == (segment, where) for plan in plans)
    assert plans[0].gather_pieces(active) == ([], [])  # nothing to gather: every rank holds every matrix
    flat = torch.zeros(world, segment)
    for m, (owner, offset) in where.items():
        assert plans[owner].orthogonalised_here(m) and sum(p.orthogonalised_here(m) for p in plans) == 1
        flat[owner, offset : offset + wholes[m].numel()] = orthogonalised(wholes[m], m).reshape(-1)
    for m, (owner, offset) in where.items():
        start = owner * segment + offset
        assert torch.equal(
            flat.reshape(-1)[start : start + wholes[m].numel()].view(shapes[m]), orthogonalised(wholes[m], m)
        )
    off = OwnerPlan.build(layouts, [NS_STEPS] * len(shapes), world, 0, replicated=False)
    assert not off.spreads_any and off.describe() == f"every rank orthogonalises every matrix ({REPLICATED_OFF})"


def test_plan_says_which_path_each_matrix_takes():
    grid = ((0, 1),)
    spread = MatrixLayout((8, 4), torch.float32, grid)
    assert OwnerPlan.build([spread] * 3, [5] * 3, 2, 0, False).describe() == (
        "each matrix orthogonalised once, by one of 2 ranks"
    )
    mixed = OwnerPlan.build([spread, TENSOR_PARALLEL, spread], [5] * 3, 2, 0, False)
    assert mixed.describe() == (
        "2 of 3 matrices orthogonalised once, by one of 2 ranks; the other 1 by every rank (tensor parallel)"
    )
    assert OwnerPlan.build([TENSOR_PARALLEL], [5], 2, 0, False).describe() == (
        "every rank orthogonalises every matrix (tensor parallel)"
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
    "fsdp_rounds": ((2,), None, "S", False, torch.float32),
    "ddp_rounds": (None, None, None, True, torch.float32),
}
ROUND_BYTES = {"fsdp_rounds": 2048, "ddp_rounds": 2048}
"""Layouts stepped in rounds of at most this many bytes of whole matrices per owner (one round by default)."""


def step_layout(name: str) -> dict:
    """``STEPS`` Muon steps of ``SHAPES`` held as ``LAYOUTS[name]``, the gradients fixed; Newton-Schulz calls and
    FLOPs counted on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import astrai_fabric.optim.muon as muon

    mesh_shape, names, placements, spread, ns_dtype = LAYOUTS[name]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names) if mesh_shape else None
    chosen = {"S": [Shard(0)], "RS": [Replicate(), Shard(0)], "C": [Shard(1)]}.get(placements)

    def place(tensor):
        return distribute_tensor(tensor, mesh, chosen) if mesh else tensor

    params = [torch.nn.Parameter(place(initial(i, shape))) for i, shape in enumerate(SHAPES)]
    optimizer = MuonNS(params, ns_dtype=ns_dtype, spread_replicated=spread, **SETTINGS)
    if name in ROUND_BYTES:
        optimizer.owner_round_bytes = ROUND_BYTES[name]
        assert len(optimizer.owner_plan().rounds(range(len(SHAPES)), ROUND_BYTES[name])) > 2
    calls, flops = [], []
    plain = muon.newton_schulz

    def counted(matrix, *args):
        calls.append(tuple(matrix.shape))
        flops.append(newton_schulz_flops(*matrix.shape, NS_STEPS))
        return plain(matrix, *args)

    muon.newton_schulz = counted
    try:
        take_steps(optimizer, params, place)
    finally:
        muon.newton_schulz = plain
    state = optimizer.state_dict()["state"]
    assert all(set(entry) == {"momentum_buffer"} for entry in state.values())  # torch's layout
    buffers = [entry["momentum_buffer"] for entry in state.values()]
    if mesh and chosen[-1] == Shard(0):  # momentum stays sharded as the parameter is
        assert [tuple(b.to_local().shape) for b in buffers] == [tuple(p.to_local().shape) for p in params]
    return {
        "params": [(p.full_tensor() if mesh else p).detach().clone() for p in params],
        "calls": len(calls),
        "flops": sum(flops),
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
    everyone = [None] * 2
    dist.all_gather_object(everyone, {name: (r.get("calls"), r.get("flops")) for name, r in results.items()})
    if dist.get_rank() == 0:
        torch.save({"results": results, "counts": everyone}, out)
    dist.destroy_process_group()


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
    reference = one_process(torch.float32)
    total_flops = STEPS * sum(newton_schulz_flops(*shape, NS_STEPS) for shape in SHAPES)
    for name, (*_, ns_dtype) in LAYOUTS.items():
        expected = one_process(ns_dtype, torch_muon=True) if ns_dtype == torch.bfloat16 else reference
        for index, (ours, theirs) in enumerate(zip(results[name]["params"], expected, strict=True)):
            # The same whole matrices reach the same iteration: bit for bit, not merely within reduction order.
            assert torch.equal(ours, theirs), (name, index, (ours - theirs).abs().max())
        calls = [counts[rank][name][0] for rank in range(2)]
        flops = [counts[rank][name][1] for rank in range(2)]
        if name in ("ddp_default", "columns"):  # not spread: every rank runs every iteration, as before
            assert calls == [STEPS * len(SHAPES)] * 2, (name, calls)
            assert results[name]["describe"].startswith("every rank orthogonalises every matrix"), name
            continue
        assert sum(calls) == STEPS * len(SHAPES), (name, calls)  # each matrix exactly once per step
        assert sum(flops) == total_flops and all(0.45 <= f / total_flops <= 0.55 for f in flops), (name, flops)
        assert results[name]["describe"] == "each matrix orthogonalised once, by one of 2 ranks", name
    assert "tensor parallel" in results["columns"]["describe"]
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
                update, expected = ours - before, theirs - before
                rounding = STEPS * torch.finfo(torch.float32).eps * theirs.abs().max().item()
                atol = 1e-6 * expected.abs().max().item() + rounding
                torch.testing.assert_close(update, expected, rtol=0, atol=atol, msg=f"{kind} {layout} {index}")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--parallel_mode", "fsdp"], "each matrix orthogonalised once, by one of 2 ranks (its owner gathers only"),
        (["--parallel_mode", "ddp"], "by one of 2 ranks (the results all-gathered)"),  # CPU's default: spread
        (["--parallel_mode", "ddp", "--muon_spread_replicated", "false"], "every rank orthogonalises every matrix (r"),
        (["--parallel_mode", "ddp", "--device_type", "cpu", "--muon_spread_replicated", "true"], "(the results all-"),
        (["--parallel_mode", "fsdp", "--tp_size", "2"], "every rank orthogonalises every matrix (tensor parallel)"),
    ],
)
def test_the_plan_says_how_muon_shares_its_work_among_the_ranks(tmp_path, capsys, flags, line):
    """The dry run's (and the run's: one renderer) ``muon`` line for each layout, from the flags alone."""
    from astrai_fabric.cli import main

    argv = ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "32"]
    assert main([*argv, "--nprocs", "2", *flags, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    (muon,) = [text for text in capsys.readouterr().out.splitlines() if text.startswith("  muon ")]
    assert line in muon, muon
