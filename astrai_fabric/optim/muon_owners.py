"""Muon's Newton-Schulz done once per matrix across the ranks: which rank owns which matrix, and the collectives
that bring an owner its matrices' pieces and take the results back (``optim.muon.MuonNS`` uses it; issue 42).

Why: the iteration needs the whole matrix, so under FSDP every rank used to gather every matrix and orthogonalise
all of them, and under DDP and tensor parallelism every rank orthogonalised every matrix too: each rank did one
process's whole work. Here each matrix gets one owner among all the world's ranks (replicas included), chosen by a
greedy balance of the iteration's FLOPs (``assign_owners``), computed from shapes alone, so every rank derives the
same table.

How a matrix is held (``MatrixLayout``): each rank holds one rectangle of it, and the distinct rectangles tile it
as a grid. DDP's plain tensors are one rectangle, the whole, held by every rank; FSDP's ``Shard(0)`` a column of
row blocks; HSDP the same row blocks on each replica; FSDP over tensor parallelism (a 2-D mesh) row blocks within
the tensor-parallel split of rows or columns. Where torch places each rank's rectangle comes from the DTensor's
mesh and placements (``layout_from_mesh``). A step is then, per round:

- one ``all_to_all_single`` brings each owner one copy of every rectangle of its matrices that it does not hold
  itself, each from the holder nearest after it in rank order (so replicas share the sending); the owner
  orthogonalises each whole matrix. Under DDP every owner already holds its matrices whole and this collective is
  skipped;
- a second ``all_to_all_single`` sends every other rank its rectangle of each result (the whole matrix under DDP:
  an all-gather of the results, which DDP did not need before, so ``MuonNS`` does it only when asked,
  ``spread_replicated``).

Per rank and step, with blocks that split evenly and balanced owners, a sharded layout receives about
``2 (W - 1) / W**2`` of the matrices' bytes for FSDP against the ``(W - 1) / W`` of the all-gather it replaces
(equal at 2 ranks, less above), and no more for HSDP or FSDP x TP. Rounds cap the whole matrices an owner holds at
once (``OwnerPlan.rounds``: one round per step unless a rank's share is large).

Anything else (a mesh over part of the ranks, a ``Partial`` placement, rectangles that do not tile) is not spread:
its ``MatrixLayout`` is a reason string, and ``MuonNS`` runs the gather-everywhere path for it.

The pure parts (layouts from a mesh's ranks, assignment, what goes to whom) take no process group, so tests can
simulate any grid.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement

from astrai_fabric.torch_private import mesh_block

REPLICATED_OFF = "replicated on every rank: spread only with MuonNS(spread_replicated=True), at one all-gather's cost"
SUB_MESH = "a mesh over part of the ranks"


def planned_layout(
    world_size: int,
    parallel_mode: str,
    tp_size: int | None,
    shards_per_replica: int,
    spread_replicated: bool,
    pp_size: int | None = None,
) -> str | None:
    """What ``OwnerPlan.describe`` will say of a run, from its flags alone (the plan prints it before any process
    group exists, the dry run without one): None for one process. ``shards_per_replica``: FSDP's shard size (1
    under DDP); ``tp_size``: tensor parallelism's, whose split the same owners undo (its mesh is FSDP's, every
    rank's); ``pp_size``: pipeline ranks under FSDP, each of whose stages' matrices have owners among its own
    world_size / pp_size ranks."""
    if parallel_mode == "fsdp":
        world_size //= pp_size or 1
    if world_size == 1:
        return None
    once = f"each matrix orthogonalised once, by one of {world_size} ranks (its owner gathers only its shards)"
    if parallel_mode == "fsdp" and (tp_size or 1) > 1:
        # Matrices tensor parallelism keeps whole live on FSDP's mesh alone, a mesh over part of the ranks.
        return f"{once}; any that tensor parallelism keeps whole (MoE experts, MLA's latent projections) by every rank"
    if parallel_mode == "fsdp" and shards_per_replica > 1:
        return once
    if spread_replicated:
        return f"each matrix orthogonalised once, by one of {world_size} ranks (the results all-gathered)"
    return "every rank orthogonalises every matrix (replicated: --muon_spread_replicated true spreads it)"


def resolve_spread_replicated(spread_replicated: bool | None, device_type: str) -> bool:
    """``--muon_spread_replicated``: None → on for CPU processes, where ``bench/muon_distributed.py`` measured the
    spread DDP step faster (173 against 278 ms on 2 gloo ranks), off elsewhere until a benchmark there decides."""
    return device_type == "cpu" if spread_replicated is None else spread_replicated


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matrix-multiply FLOPs of ``steps`` quintic Newton-Schulz iterations on a ``rows x cols`` matrix: with
    ``m = min``, ``n = max``, each iteration is ``X X^T`` (2 m^2 n), ``G G`` (2 m^3) and ``(...) X`` (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: Sequence[float], world_size: int) -> tuple[int, ...]:
    """An owner rank per cost: largest first, each to the least-loaded rank (lowest index on ties), so the loads
    differ by at most the largest single cost. Depends on the costs only: every rank computes the same table.
    O(costs x log ranks): the ranks wait in a heap by (load, index), of which at most one per cost is ever touched
    (the untouched ones, all at load 0, are taken in index order from a counter)."""
    owners = [0] * len(costs)
    loaded: list[tuple[float, int]] = []  # (load, rank) of the ranks given something
    fresh = 0  # ranks from here on hold nothing yet
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        if fresh < world_size and (not loaded or (0.0, fresh) < loaded[0]):
            load, rank = 0.0, fresh
            fresh += 1
        else:
            load, rank = heapq.heappop(loaded)
        owners[index] = rank
        heapq.heappush(loaded, (load + costs[index], rank))
    return tuple(owners)


Block = tuple[int, int, int, int]
"""Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a matrix: what one rank holds of it."""


def block_numel(block: Block) -> int:
    return (block[1] - block[0]) * (block[3] - block[2])


@dataclass(frozen=True)
class MatrixLayout:
    """How the world holds one matrix: ``blocks[rank]``, the rectangle of it that rank holds. Ranks holding the
    same rectangle are replicas of it; the distinct non-empty rectangles tile the matrix (``layout_from_mesh``
    checks)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    blocks: tuple[Block, ...]
    holders: dict[Block, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    """Each distinct non-empty rectangle and the ranks holding it, rectangles in (row, column) order."""

    def __post_init__(self) -> None:
        holders: dict[Block, list[int]] = {}
        for rank, block in enumerate(self.blocks):
            if block_numel(block):
                holders.setdefault(block, []).append(rank)
        object.__setattr__(self, "holders", {block: tuple(holders[block]) for block in sorted(holders)})

    @property
    def replicated(self) -> bool:
        """Every rank holds the matrix whole (DDP's plain tensors, HSDP with one shard per replica)."""
        return tuple(self.holders) == (self.whole,) and len(self.holders[self.whole]) == len(self.blocks)

    @property
    def whole(self) -> Block:
        return 0, self.shape[0], 0, self.shape[1]

    def source(self, block: Block, owner: int) -> int:
        """The holder of ``block`` that sends it to ``owner``: the owner itself where it holds it, else the next
        holder after it in rank order (so a replicated block's sends spread over its replicas, one per owner)."""
        world_size = len(self.blocks)
        return min(self.holders[block], key=lambda rank: (rank - owner) % world_size)


def layout_from_mesh(
    shape: tuple[int, int], dtype: torch.dtype, mesh_ranks: Tensor, placements: Sequence[Placement]
) -> MatrixLayout | str:
    """The ``MatrixLayout`` of a ``shape`` DTensor with ``placements`` over a mesh whose global ranks, by
    coordinate, are ``mesh_ranks`` (covering every rank of the world), or why it has none: each rank's rectangle
    as torch's distributed checkpointing computes it (``torch_private.mesh_block``: ``Shard`` and FSDP2's strided
    shard over tensor parallelism alike), accepted only when the distinct rectangles form a grid that tiles the
    matrix (rows split one way, columns another; a strided shard whose rows interleave would not)."""
    if any(getattr(p, "dim", None) is None and not p.is_replicate() for p in placements):
        return f"placements {tuple(placements)}"
    blocks: list[Block | None] = [None] * mesh_ranks.numel()
    for coordinate in itertools.product(*(range(size) for size in mesh_ranks.shape)):
        size, offset = mesh_block(shape, tuple(mesh_ranks.shape), coordinate, placements)
        blocks[int(mesh_ranks[coordinate])] = (offset[0], offset[0] + size[0], offset[1], offset[1] + size[1])
    layout = MatrixLayout(shape, dtype, tuple(blocks))
    rows = sorted({(b[0], b[1]) for b in layout.holders})
    cols = sorted({(b[2], b[3]) for b in layout.holders})
    tiles = (
        len(layout.holders) == len(rows) * len(cols)
        and all(a[1] == b[0] for a, b in itertools.pairwise(rows))
        and all(a[1] == b[0] for a, b in itertools.pairwise(cols))
        and (rows[0][0], rows[-1][1], cols[0][0], cols[-1][1]) == layout.whole
    )
    return layout if tiles else f"placements {tuple(placements)}: not a grid of rectangles"


def matrix_layout(param: Tensor, world_size: int) -> MatrixLayout | str:
    """``param``'s ``MatrixLayout`` over ``world_size`` ranks, or why it cannot have one. Plain tensors are taken
    as replicated on every rank (DDP's promise); a DTensor qualifies when its mesh holds every rank
    (``layout_from_mesh``)."""
    shape, dtype = (int(param.shape[0]), int(param.shape[1])), param.dtype
    if not isinstance(param, DTensor):
        return MatrixLayout(shape, dtype, ((0, shape[0], 0, shape[1]),) * world_size)
    ranks = param.device_mesh.mesh
    if sorted(ranks.flatten().tolist()) != list(range(world_size)):
        return SUB_MESH  # the other ranks hold copies this mesh cannot reach
    return layout_from_mesh(shape, dtype, ranks, param.placements)


class Piece(NamedTuple):
    """A rectangle of one matrix travelling between this rank and ``peer``."""

    matrix: int
    block: Block
    peer: int


@dataclass(frozen=True)
class OwnerPlan:
    """Every matrix's layout (or why it has none) and owner (None: orthogonalised by every rank), for one rank."""

    layouts: tuple[MatrixLayout | str, ...]
    owners: tuple[int | None, ...]
    world_size: int
    rank: int
    routes: dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False, compare=False)
    """What ``gather_pieces``, ``scatter_pieces``, ``moves_rectangles`` and ``needs_update`` worked out, by their
    arguments: the same every step."""

    @classmethod
    def build(
        cls, layouts: Sequence[MatrixLayout | str], steps: Sequence[int], world_size: int, rank: int, replicated: bool
    ) -> OwnerPlan:
        """Owners for the layouts that can be spread (replicated ones only when ``replicated``), balanced by
        ``newton_schulz_flops`` with each matrix's ``steps``."""
        layouts = [
            REPLICATED_OFF if isinstance(lay, MatrixLayout) and lay.replicated and not replicated else lay
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
        """Whether this rank must compute matrix ``index``'s momentum update: it orthogonalises the matrix, or sends
        its owner a rectangle of it."""
        if self.orthogonalised_here(index):
            return True
        key = ("needs", index)
        if key not in self.routes:
            layout, owner = self.layouts[index], self.owners[index]
            self.routes[key] = any(layout.source(block, owner) == self.rank for block in layout.holders)
        return self.routes[key]

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
            size = block_numel(layout.whole) * layout.dtype.itemsize
            if owner not in batches or (batches[owner][-1] and used[owner] + size > round_bytes):
                batches.setdefault(owner, []).append([])
                used[owner] = 0
            batches[owner][-1].append(m)
            used[owner] += size
        count = max((len(b) for b in batches.values()), default=0)
        return [sorted(m for b in batches.values() if k < len(b) for m in b[k]) for k in range(count)]

    def gather_pieces(self, active: Sequence[int]) -> tuple[list[Piece], list[Piece]]:
        """What this rank sends and receives so each owner holds its matrices whole: one copy of every distinct
        rectangle the owner does not hold, from its ``MatrixLayout.source``. Both lists are ordered by peer, then
        matrix and rectangle, as ``all_to_all_single`` lays out its segments."""
        key = ("gather", tuple(active))
        if key not in self.routes:
            sends, recvs = [], []
            for m in active:
                layout, owner = self.layouts[m], self.owners[m]
                for block in layout.holders:
                    source = layout.source(block, owner)
                    if source == owner:
                        continue  # the owner's own rectangle: taken where it lies
                    if source == self.rank:
                        sends.append(Piece(m, block, owner))
                    if owner == self.rank:
                        recvs.append(Piece(m, block, source))
            self.routes[key] = by_peer(sends), by_peer(recvs)
        return self.routes[key]

    def scatter_pieces(self, active: Sequence[int]) -> tuple[list[Piece], list[Piece]]:
        """What this rank sends and receives so every other rank gets its rectangle of each result (the whole
        matrix, for a replicated one: the all-gather of DDP's results)."""
        key = ("scatter", tuple(active))
        if key not in self.routes:
            sends, recvs = [], []
            for m in active:
                layout, owner = self.layouts[m], self.owners[m]
                if owner == self.rank:
                    sends += [Piece(m, block, peer) for peer, block in enumerate(layout.blocks) if peer != owner]
                elif owner is not None:
                    recvs.append(Piece(m, layout.blocks[self.rank], owner))
            self.routes[key] = by_peer(sends), by_peer(recvs)
        return self.routes[key]

    def moves_rectangles(self, active: Sequence[int]) -> bool:
        """Whether any owner lacks a rectangle of the matrices it owns in ``active`` (every rank answers alike)."""
        key = ("moves", tuple(active))
        if key not in self.routes:
            self.routes[key] = any(
                self.layouts[m].source(block, self.owners[m]) != self.owners[m]
                for m in active
                for block in self.layouts[m].holders
            )
        return self.routes[key]

    def split_sizes(self, pieces: Sequence[Piece]) -> list[int]:
        """Elements per peer, for ``all_to_all_single``."""
        sizes = [0] * self.world_size
        for piece in pieces:
            sizes[piece.peer] += block_numel(piece.block)
        return sizes


def by_peer(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` grouped by peer, in order within each (a stable sort): ``all_to_all_single``'s segments."""
    return sorted(pieces, key=lambda piece: piece.peer)


def unpack(pieces: Sequence[Piece], flat: Tensor) -> list[Tensor]:
    """``flat`` cut into ``pieces`` (views), each shaped as its rectangle."""
    out, offset = [], 0
    for piece in pieces:
        r0, r1, c0, c1 = piece.block
        out.append(flat[offset : offset + block_numel(piece.block)].view(r1 - r0, c1 - c0))
        offset += block_numel(piece.block)
    return out


def pack(
    pieces: Sequence[Piece], source: Callable[[Piece], Tensor], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """The flat send buffer: each piece's rectangle (``source``) in order."""
    parts = [source(piece).reshape(-1).to(dtype) for piece in pieces]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def assemble(plan: OwnerPlan, owned: Sequence[int], recvs: Sequence[Piece], blocks: Sequence[Tensor], local) -> dict:
    """Each matrix of ``owned`` whole: this rank's own rectangle (``local(index)``) and the received ones. A matrix
    this rank holds whole (a replicated one) is its own update, not a copy."""
    received: dict[int, list[tuple[Block, Tensor]]] = {}
    for piece, block in zip(recvs, blocks, strict=True):
        received.setdefault(piece.matrix, []).append((piece.block, block))
    wholes = {}
    for m in owned:
        layout, own = plan.layouts[m], plan.layouts[m].blocks[plan.rank]
        if own == layout.whole:
            wholes[m] = local(m)
            continue
        whole = wholes[m] = local(m).new_empty(layout.shape)
        for rectangle, block in [(own, local(m)), *received.get(m, [])]:
            whole[block_slices(rectangle)] = block
    return wholes


def local_block(update: Tensor) -> Tensor:
    """This rank's rectangle of an update: a DTensor's local shard, or a plain tensor whole."""
    return update.to_local() if isinstance(update, DTensor) else update


def like(result: Tensor, param: Tensor) -> Tensor:
    """``result`` (this rank's rectangle) as ``param`` holds it: a DTensor with its mesh and placements, or plain."""
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
    orthogonalise: Callable[[dict[int, Tensor]], dict[int, Tensor]],
    device: torch.device,
    round_bytes: int | None = None,
) -> dict[int, Tensor]:
    """The spread matrices' orthogonalised updates, each shaped and placed as its parameter.

    ``active``: the spread matrices stepped now (every rank passes the same list); ``updates``: this rank's
    momentum updates of those it ``needs_update``; ``orthogonalise(wholes)``: the iteration over the matrices this
    rank owns in a round, by index; ``round_bytes``: the most bytes of whole matrices an owner holds at once
    (``OwnerPlan.rounds``). Collectives per dtype and round: an ``all_to_all_single`` bringing owners their
    rectangles (skipped, on every rank alike, where every owner holds its matrices whole: DDP) and one returning
    each rank its rectangles of the results."""
    results: dict[int, Tensor] = {}
    for dtype in sorted({plan.layouts[m].dtype for m in active}, key=str):  # one flat buffer per dtype
        chosen = [m for m in active if plan.layouts[m].dtype == dtype]
        for batch in plan.rounds(chosen, round_bytes):
            results |= _exchange_round(plan, batch, updates, params, orthogonalise, dtype, device)
    return results


def _all_to_all(plan: OwnerPlan, sends, recvs, source: Callable[[Piece], Tensor], dtype, device) -> list[Tensor]:
    """One ``all_to_all_single`` of ``sends`` (each piece's rectangle from ``source``) into ``recvs``' views."""
    flat_in = pack(sends, source, dtype, device)
    flat_out = torch.empty(sum(plan.split_sizes(recvs)), dtype=dtype, device=device)
    dist.all_to_all_single(flat_out, flat_in, plan.split_sizes(recvs), plan.split_sizes(sends))
    return unpack(recvs, flat_out)


def _exchange_round(plan, active, updates, params, orthogonalise, dtype, device) -> dict[int, Tensor]:
    def local(m: int) -> Tensor:
        block = local_block(updates[m])
        r0, r1, c0, c1 = plan.layouts[m].blocks[plan.rank]
        assert tuple(block.shape) == (r1 - r0, c1 - c0), (m, plan.layouts[m].blocks[plan.rank], tuple(block.shape))
        return block

    owned = [m for m in active if plan.owners[m] == plan.rank]
    sends, recvs = plan.gather_pieces(active)
    received = []
    if plan.moves_rectangles(active):  # the same answer on every rank: all call, or none
        received = _all_to_all(plan, sends, recvs, lambda piece: local(piece.matrix), dtype, device)
    wholes = assemble(plan, owned, recvs, received, local)
    del received  # views of the receive buffer: freed before the iterations run
    done = {m: result.to(dtype) for m, result in orthogonalise(wholes).items()}
    del wholes
    sends, recvs = plan.scatter_pieces(active)
    returned = _all_to_all(
        plan, sends, recvs, lambda piece: done[piece.matrix][block_slices(piece.block)], dtype, device
    )
    results = {piece.matrix: like(block, params[piece.matrix]) for piece, block in zip(recvs, returned, strict=True)}
    for m in owned:
        results[m] = like(done[m][block_slices(plan.layouts[m].blocks[plan.rank])], params[m])
    return results


def block_slices(block: Block) -> tuple[slice, slice]:
    return slice(block[0], block[1]), slice(block[2], block[3])
