"""Muon's Newton-Schulz done once per matrix across the ranks: which rank owns which matrix, and the collectives
that bring an owner its matrices' row blocks and take the results back (``optim.muon.MuonNS`` uses it; issue 42).

Why: the iteration needs the whole matrix, so under FSDP every rank used to gather every matrix and orthogonalise
all of them, and under DDP every rank orthogonalised every matrix too: each rank did one process's whole work.
Here each matrix gets one owner among all the world's ranks (replicas included), chosen by a greedy balance of the
iteration's FLOPs (``assign_owners``), computed from shapes alone, so every rank derives the same table.

How a matrix is held (``MatrixLayout``): the world's ranks as a grid of replicas x shards, each shard a block of
rows (DTensor's ``Shard(0)``, torch.chunk's sizes). FSDP is one replica of W shards, HSDP R replicas of S shards,
DDP (plain tensors) W replicas of one shard. A step is then:

- sharded matrices (S > 1): one ``all_to_all_single`` brings each owner the row blocks of its matrices from the
  ranks of its own replica; the owner orthogonalises each whole matrix; a second ``all_to_all_single`` sends each
  rank of every replica its rows of the result (in rounds that cap the whole matrices an owner holds at once,
  ``OwnerPlan.rounds``: one round per step unless a rank's share is large). Per rank and step, with rows that
  split evenly and balanced owners, that receives about ``2 (W - 1) / W**2`` of the matrices' bytes for FSDP (the
  all-gather it replaces received ``(W - 1) / W``: equal at 2 ranks, less above) and ``(W + S - 2) / (S W)`` for
  HSDP against ``(S - 1) / S`` (never more when S >= 2). Uneven row blocks can cost an owner holding a short block
  a row per matrix more;
- replicated matrices (S = 1; DDP): each owner orthogonalises its own, and one ``all_gather_single`` over a flat
  buffer (each rank's results padded to the largest rank's) hands every rank every result. That communication is
  new (DDP needed none), so ``MuonNS`` does it only when asked (``spread_replicated``).

Anything else (tensor-parallel placements, a mesh that is not the whole world, two sharded mesh dimensions) is not
spread: its ``MatrixLayout`` is a reason string, and ``MuonNS`` runs the gather-everywhere path for it.

The pure parts (assignment, row blocks, what goes to whom) take no process group, so tests can simulate any grid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

REPLICATED_OFF = "replicated on every rank: spread only with MuonNS(spread_replicated=True), at one all-gather's cost"
TENSOR_PARALLEL = "tensor parallel"


def planned_layout(
    world_size: int, parallel_mode: str, tp_size: int | None, shards_per_replica: int, spread_replicated: bool
) -> str | None:
    """What ``OwnerPlan.describe`` will say of a run, from its flags alone (the plan prints it before any process
    group exists, the dry run without one): None for one process. ``shards_per_replica``: FSDP's shard size (1
    under DDP)."""
    if world_size == 1:
        return None
    if (tp_size or 1) > 1:
        return f"every rank orthogonalises every matrix ({TENSOR_PARALLEL})"
    if parallel_mode == "fsdp" and shards_per_replica > 1:
        return f"each matrix orthogonalised once, by one of {world_size} ranks (its owner gathers only its shards)"
    if spread_replicated:
        return f"each matrix orthogonalised once, by one of {world_size} ranks (the results all-gathered)"
    return "every rank orthogonalises every matrix (replicated: --muon_spread_replicated true spreads it)"


def resolve_spread_replicated(spread_replicated: bool | None, device_type: str) -> bool:
    """``--muon_spread_replicated``: None → on for CPU processes, where ``bench/muon_distributed.py`` measured the
    spread DDP step faster (215 against 346 ms on 2 gloo ranks), off elsewhere until a benchmark there decides."""
    return device_type == "cpu" if spread_replicated is None else spread_replicated


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matrix-multiply FLOPs of ``steps`` quintic Newton-Schulz iterations on a ``rows x cols`` matrix: with
    ``m = min``, ``n = max``, each iteration is ``X X^T`` (2 m^2 n), ``G G`` (2 m^3) and ``(...) X`` (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: Sequence[float], world_size: int) -> tuple[int, ...]:
    """An owner rank per cost: largest first, each to the least-loaded rank (lowest index on ties), so the loads
    differ by at most the largest single cost. Depends on the costs only: every rank computes the same table."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return tuple(owners)


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``index`` of ``shards`` along dim 0, as DTensor's ``Shard(0)`` splits them
    (torch.chunk's sizes: ``ceil(rows / shards)`` each, the last ones short or empty)."""
    size = -(-rows // shards)
    start = min(index * size, rows)
    return start, min(start + size, rows)


@dataclass(frozen=True)
class MatrixLayout:
    """How the world holds one matrix: ``grid[replica][shard]`` is the global rank holding that shard's rows."""

    shape: tuple[int, int]
    dtype: torch.dtype
    grid: tuple[tuple[int, ...], ...]
    places: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        places = {rank: (r, s) for r, row in enumerate(self.grid) for s, rank in enumerate(row)}
        object.__setattr__(self, "places", places)

    @property
    def shards(self) -> int:
        return len(self.grid[0])

    def rows_of(self, rank: int) -> tuple[int, int]:
        """The rows ``rank`` holds."""
        return shard_rows(self.shape[0], self.shards, self.places[rank][1])

    def numel(self, rows: tuple[int, int]) -> int:
        return (rows[1] - rows[0]) * self.shape[1]


def matrix_layout(param: Tensor, world_size: int) -> MatrixLayout | str:
    """``param``'s ``MatrixLayout`` over ``world_size`` ranks, or why it cannot have one. Plain tensors are taken
    as replicated on every rank (DDP's promise); a DTensor qualifies when its mesh holds every rank and each
    placement is ``Replicate`` or ``Shard(0)``, at most one of them sharded."""
    shape, dtype = (int(param.shape[0]), int(param.shape[1])), param.dtype
    if not isinstance(param, DTensor):
        return MatrixLayout(shape, dtype, tuple((rank,) for rank in range(world_size)))
    mesh, placements = param.device_mesh, param.placements
    ranks = mesh.mesh
    if sorted(ranks.flatten().tolist()) != list(range(world_size)):
        return TENSOR_PARALLEL  # a sub-mesh: the other ranks (tensor parallelism's) hold copies it cannot see
    sharded = [d for d, p in enumerate(placements) if type(p) is Shard and p.dim == 0]
    replicated = [d for d, p in enumerate(placements) if type(p) is Replicate]
    if len(sharded) > 1 or len(sharded) + len(replicated) != len(placements):
        names = mesh.mesh_dim_names or ()
        return TENSOR_PARALLEL if "tensor_parallel" in names else f"placements {tuple(placements)}"
    grid = ranks.permute(*replicated, *sharded).reshape(-1, ranks.size(sharded[0]) if sharded else 1)
    return MatrixLayout(shape, dtype, tuple(tuple(row) for row in grid.tolist()))


class Piece(NamedTuple):
    """Rows of one matrix travelling between this rank and ``peer``."""

    matrix: int
    rows: tuple[int, int]
    peer: int


@dataclass(frozen=True)
class OwnerPlan:
    """Every matrix's layout (or why it has none) and owner (None: orthogonalised by every rank), for one rank."""

    layouts: tuple[MatrixLayout | str, ...]
    owners: tuple[int | None, ...]
    world_size: int
    rank: int
    routes: dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``gather_pieces``, ``scatter_pieces`` and ``replicated_segments`` by their arguments: the same every step."""

    @classmethod
    def build(
        cls, layouts: Sequence[MatrixLayout | str], steps: Sequence[int], world_size: int, rank: int, replicated: bool
    ) -> OwnerPlan:
        """Owners for the layouts that can be spread (replicated ones only when ``replicated``), balanced by
        ``newton_schulz_flops`` with each matrix's ``steps``."""
        layouts = [
            REPLICATED_OFF if isinstance(lay, MatrixLayout) and lay.shards == 1 and not replicated else lay
            for lay in layouts
        ]
        spread = [i for i, lay in enumerate(layouts) if isinstance(lay, MatrixLayout)]
        costs = [newton_schulz_flops(*layouts[i].shape, steps[i]) for i in spread]
        owners: list[int | None] = [None] * len(layouts)
        for index, owner in zip(spread, assign_owners(costs, world_size), strict=True):
            owners[index] = owner
        return cls(tuple(layouts), tuple(owners), world_size, rank)

    @property
    def spreads_any(self) -> bool:
        return any(owner is not None for owner in self.owners)

    def orthogonalised_here(self, index: int) -> bool:
        """Whether this rank runs matrix ``index``'s iteration."""
        return self.owners[index] in (None, self.rank)

    def needs_update(self, index: int) -> bool:
        """Whether this rank must compute matrix ``index``'s momentum update: it holds part of a sharded matrix
        (its owner needs it), or orthogonalises the matrix itself."""
        layout = self.layouts[index]
        return self.orthogonalised_here(index) or (isinstance(layout, MatrixLayout) and layout.shards > 1)

    def describe(self) -> str:
        """One line for the plan: which path each matrix takes."""
        spread = sum(owner is not None for owner in self.owners)
        reasons = sorted({lay for lay in self.layouts if isinstance(lay, str)})
        once = f"by one of {self.world_size} ranks"
        if spread == len(self.owners):
            return f"each matrix orthogonalised once, {once}"
        if spread == 0:
            return f"every rank orthogonalises every matrix ({'; '.join(reasons)})"
        rest = len(self.owners) - spread
        return (
            f"{spread} of {len(self.owners)} matrices orthogonalised once, {once}; the other {rest} by every rank "
            f"({'; '.join(reasons)})"
        )

    def rounds(self, active: Sequence[int], round_bytes: int | None) -> list[list[int]]:
        """``active`` cut into rounds in which no owner holds more than ``round_bytes`` of whole matrices (a
        matrix larger than that gets a round of its own): round k is every owner's k-th batch of its matrices, so
        every rank works in every round. None: one round. The same on every rank (shapes and owners only)."""
        if round_bytes is None:
            return [list(active)]
        batches: dict[int, list[list[int]]] = {}
        used: dict[int, int] = {}
        for m in active:
            layout, owner = self.layouts[m], self.owners[m]
            size = layout.numel((0, layout.shape[0])) * layout.dtype.itemsize
            if owner not in batches or (batches[owner][-1] and used[owner] + size > round_bytes):
                batches.setdefault(owner, []).append([])
                used[owner] = 0
            batches[owner][-1].append(m)
            used[owner] += size
        count = max((len(b) for b in batches.values()), default=0)
        return [sorted(m for b in batches.values() if k < len(b) for m in b[k]) for k in range(count)]

    def owned_flops(self, steps: Sequence[int]) -> list[int]:
        """Newton-Schulz FLOPs each rank runs per step under this plan."""
        flops = [0] * self.world_size
        for index, layout in enumerate(self.layouts):
            if isinstance(layout, MatrixLayout):
                flops[self.owners[index]] += newton_schulz_flops(*layout.shape, steps[index])
        return flops

    def gather_pieces(self, active: Sequence[int]) -> tuple[list[Piece], list[Piece]]:
        """What this rank sends and receives so each owner holds its sharded matrices whole: its row block of each
        matrix owned in its replica, and every row block of its own matrices from the ranks of its replica. Both
        lists are ordered by peer, then matrix, as ``all_to_all_single`` lays out its segments."""
        key = ("gather", tuple(active))
        if key not in self.routes:
            sends, recvs = [], []
            for peer, m, layout, owner in self._sharded_by_peer(active):
                if layout.places[owner][0] == layout.places[self.rank][0] == layout.places[peer][0]:  # one replica
                    if owner == peer:
                        sends.append(Piece(m, layout.rows_of(self.rank), peer))
                    if owner == self.rank:
                        recvs.append(Piece(m, layout.rows_of(peer), peer))
            self.routes[key] = sends, recvs
        return self.routes[key]

    def scatter_pieces(self, active: Sequence[int]) -> tuple[list[Piece], list[Piece]]:
        """What this rank sends and receives so every rank of every replica gets its rows of each result."""
        key = ("scatter", tuple(active))
        if key not in self.routes:
            sends, recvs = [], []
            for peer, m, layout, owner in self._sharded_by_peer(active):
                if owner == self.rank:
                    sends.append(Piece(m, layout.rows_of(peer), peer))
                if owner == peer:
                    recvs.append(Piece(m, layout.rows_of(self.rank), peer))
            self.routes[key] = sends, recvs
        return self.routes[key]

    def _sharded_by_peer(self, active: Sequence[int]) -> Iterator[tuple[int, int, MatrixLayout, int]]:
        """``(peer, matrix, layout, owner)`` for every peer and every sharded matrix of ``active``, peer first: the
        order ``all_to_all_single`` lays out its segments in."""
        for peer in range(self.world_size):
            for m in active:
                layout = self.layouts[m]
                if isinstance(layout, MatrixLayout) and layout.shards > 1:
                    yield peer, m, layout, self.owners[m]

    def replicated_segments(self, active: Sequence[int]) -> tuple[int, dict[int, tuple[int, int]]]:
        """The all-gather of replicated results: each rank's segment length (the largest rank's results) and, per
        matrix, its owner and offset inside the owner's segment."""
        key = ("replicated", tuple(active))
        if key in self.routes:
            return self.routes[key]
        used, where = [0] * self.world_size, {}
        for m in active:
            layout, owner = self.layouts[m], self.owners[m]
            if isinstance(layout, MatrixLayout) and layout.shards == 1:
                where[m] = (owner, used[owner])
                used[owner] += layout.numel((0, layout.shape[0]))
        self.routes[key] = max(used), where
        return max(used), where

    def split_sizes(self, pieces: Sequence[Piece]) -> list[int]:
        """Elements per peer, for ``all_to_all_single``."""
        sizes = [0] * self.world_size
        for piece in pieces:
            sizes[piece.peer] += self.layouts[piece.matrix].numel(piece.rows)
        return sizes


def unpack(plan: OwnerPlan, pieces: Sequence[Piece], flat: Tensor) -> list[Tensor]:
    """``flat`` cut into ``pieces`` (views), each shaped as its rows."""
    out, offset = [], 0
    for piece in pieces:
        layout = plan.layouts[piece.matrix]
        size = layout.numel(piece.rows)
        out.append(flat[offset : offset + size].view(piece.rows[1] - piece.rows[0], layout.shape[1]))
        offset += size
    return out


def pack(
    pieces: Sequence[Piece], source: Callable[[Piece], Tensor], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """The flat send buffer: each piece's rows (``source``) in order."""
    parts = [source(piece).reshape(-1).to(dtype) for piece in pieces]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def assemble(plan: OwnerPlan, recvs: Sequence[Piece], blocks: Sequence[Tensor]) -> dict[int, Tensor]:
    """Each owned matrix whole, from its received row blocks."""
    by_matrix: dict[int, list[tuple[int, Tensor]]] = {}
    for piece, block in zip(recvs, blocks, strict=True):
        by_matrix.setdefault(piece.matrix, []).append((piece.rows[0], block))
    return {m: torch.cat([block for _, block in sorted(parts, key=lambda p: p[0])]) for m, parts in by_matrix.items()}


def local_rows(update: Tensor) -> Tensor:
    """This rank's rows of an update: a DTensor's local shard, or a plain tensor whole."""
    return update.to_local() if isinstance(update, DTensor) else update


def like(result: Tensor, param: Tensor) -> Tensor:
    """``result`` (this rank's rows) as ``param`` holds it: a DTensor with its mesh and placements, or plain."""
    if not isinstance(param, DTensor):
        return result
    return DTensor.from_local(
        result, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def exchange(
    plan: OwnerPlan,
    active: Sequence[int],
    updates: dict[int, Tensor],
    params: dict[int, Tensor],
    orthogonalise: Callable[[int, Tensor], Tensor],
    device: torch.device,
    round_bytes: int | None = None,
) -> dict[int, Tensor]:
    """The spread matrices' orthogonalised updates, each shaped and placed as its parameter.

    ``active``: the spread matrices stepped now (every rank passes the same list); ``updates``: this rank's
    momentum updates of those it ``needs_update``; ``orthogonalise(index, whole)``: the iteration, run here on the
    matrices this rank owns; ``round_bytes``: the most bytes of whole matrices an owner holds at once
    (``OwnerPlan.rounds``). Collectives per dtype and round: two ``all_to_all_single`` for sharded matrices, one
    ``all_gather_single`` for replicated ones, each skipped (on every rank alike) when no matrix needs it."""
    results: dict[int, Tensor] = {}
    for dtype in sorted({plan.layouts[m].dtype for m in active}, key=str):  # one flat buffer per dtype
        chosen = [m for m in active if plan.layouts[m].dtype == dtype]
        for batch in plan.rounds(chosen, round_bytes):
            results |= _exchange_sharded(plan, batch, updates, params, orthogonalise, dtype, device)
            results |= _exchange_replicated(plan, batch, updates, params, orthogonalise, dtype, device)
    return results


def _exchange_sharded(plan, active, updates, params, orthogonalise, dtype, device) -> dict[int, Tensor]:
    if not any(plan.layouts[m].shards > 1 for m in active):  # decided alike on every rank: all call, or none
        return {}
    sends, recvs = plan.gather_pieces(active)
    for m in active:
        if m in updates and plan.layouts[m].shards > 1:
            rows = plan.layouts[m].rows_of(plan.rank)
            expected = (rows[1] - rows[0], plan.layouts[m].shape[1])
            assert tuple(local_rows(updates[m]).shape) == expected, (m, expected, tuple(updates[m].shape))
    flat_in = pack(sends, lambda piece: local_rows(updates[piece.matrix]), dtype, device)
    flat_out = torch.empty(sum(plan.split_sizes(recvs)), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, plan.split_sizes(recvs), plan.split_sizes(sends))
    del flat_in
    wholes = assemble(plan, recvs, unpack(plan, recvs, flat_out))
    del flat_out
    done = {m: orthogonalise(m, whole).to(dtype) for m, whole in wholes.items()}
    del wholes
    sends, recvs = plan.scatter_pieces(active)
    flat_in = pack(sends, lambda piece: done[piece.matrix][piece.rows[0] : piece.rows[1]], dtype, device)
    flat_out = torch.empty(sum(plan.split_sizes(recvs)), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, plan.split_sizes(recvs), plan.split_sizes(sends))
    blocks = unpack(plan, recvs, flat_out)
    return {piece.matrix: like(rows, params[piece.matrix]) for piece, rows in zip(recvs, blocks, strict=True)}


def _exchange_replicated(plan, active, updates, params, orthogonalise, dtype, device) -> dict[int, Tensor]:
    segment, where = plan.replicated_segments(active)
    if not where:
        return {}
    owned = [m for m in where if where[m][0] == plan.rank]
    flat_in = torch.zeros(segment, dtype=dtype, device=device)
    for m in owned:
        offset, size = where[m][1], plan.layouts[m].numel((0, plan.layouts[m].shape[0]))
        flat_in[offset : offset + size] = orthogonalise(m, local_rows(updates[m])).to(dtype).reshape(-1)
    flat_out = torch.empty(segment * plan.world_size, dtype=dtype, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    all_gather(flat_out, flat_in)
    results = {}
    for m, (owner, offset) in where.items():
        start = owner * segment + offset
        whole = flat_out[start : start + plan.layouts[m].numel((0, plan.layouts[m].shape[0]))]
        results[m] = like(whole.view(plan.layouts[m].shape), params[m])
    return results
