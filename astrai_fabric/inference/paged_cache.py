"""``PagedKVCache``: one pool of fixed-size blocks per layer for keys and values, and ``BatchView``, what one forward
of the engine hands the model as its ``kv_cache``.

The model's attention asks its cache for every key and value it attends over (``update(layer_id, keys, values)``,
the seam ``model.kv_cache.KVCache`` fills for one sequence). A ``BatchView`` answers for a batch of requests at
different lengths: it writes the new positions' keys and values into their blocks, and gathers each request's past
ones from its blocks into one padded tensor, then exact SDPA over it with a mask (gather, then attend: the issue's
"gather then SDPA"; a kernel that reads the blocks in place would save the gather).

Layout of one forward: ``P`` the longest past of the batch, ``S`` its most new positions. Row r's past (``p_r``
positions) sits right-aligned in ``[P - p_r, P)``, its new positions (``n_r``) left-aligned in ``[P, P + n_r)``, so each
request's keys are contiguous and a key's distance from a query is their positions' distance: causal and sliding-
window masks are the model's own, built over ``P`` cached keys (``kv_cache.length``). The padding after a row's new
positions attends to itself only (no row of a mask may be empty), and nothing reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LayerShape:
    """What one layer caches per position: ``heads`` key/value heads of ``key_dim`` and ``value_dim`` (MLA's values
    are narrower than its keys)."""

    heads: int
    key_dim: int
    value_dim: int

    def bytes_per_position(self, element_size: int) -> int:
        return self.heads * (self.key_dim + self.value_dim) * element_size


class PagedKVCache:
    """Keys ``[num_blocks * block_size, heads, key_dim]`` and values per layer, zeros (what padding reads stays
    finite), each layer's made at its first write, in the shape, dtype and device of what it is given (under tensor
    parallelism a rank's own heads)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def layer(self, layer_id: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``layer_id``'s pools, made for ``keys``/``values [.., heads, D]`` if they are not yet."""
        if layer_id not in self.keys:
            slots = self.num_blocks * self.block_size
            self.keys[layer_id] = keys.new_zeros(slots, *keys.shape[-2:])
            self.values[layer_id] = values.new_zeros(slots, *values.shape[-2:])
        return self.keys[layer_id], self.values[layer_id]

    def copy_block(self, source: int, target: int) -> None:
        """Block ``target`` made a copy of block ``source`` in every layer (a completion's own last prompt block)."""
        size = self.block_size
        for store in (*self.keys.values(), *self.values.values()):
            store[target * size : (target + 1) * size] = store[source * size : (source + 1) * size]


class BatchView:
    """The ``kv_cache`` of one forward over requests at different lengths (the module docstring's layout)."""

    def __init__(
        self,
        cache: PagedKVCache,
        tables: list[list[int]],
        num_past: list[int],
        num_new: list[int],
        device: torch.device,
    ) -> None:
        """Row r: block table ``tables[r]``, ``num_past[r]`` positions in the pool, ``num_new[r]`` new ones (their
        blocks in the table already)."""
        size = cache.block_size
        self.cache = cache
        self.length = max(num_past)
        """The cached keys before the new ones, ``P`` (the model builds its masks over them)."""
        width = max(num_new)
        widest = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.long)
        past, new = torch.tensor(num_past), torch.tensor(num_new)
        index = torch.arange(self.length + width)[None, :]
        in_past = index < self.length
        # Each buffer index's position in its row: the past right-aligned before ``P``, the new positions after it
        position = torch.where(in_past, index - (self.length - past[:, None]), past[:, None] + index - self.length)
        real = (position >= 0) & (in_past | (index - self.length < new[:, None]))
        position = position.clamp(min=0)
        slots = table.gather(1, (position // size).clamp(max=widest - 1)) * size + position % size
        slots = torch.where(real, slots, 0)  # padding reads row 0 of the pool (zeros or a key: finite, masked)
        new_real = real[:, self.length :]
        self.slots = slots.flatten().to(device)
        """Every buffer index's pool row, ``[B * (P + S)]``: what attention reads, the new positions included."""
        self.written = slots[:, self.length :][new_real].to(device)
        """The pool rows the new positions' keys and values go to."""
        self.new_positions = None if bool(new_real.all()) else new_real.flatten().nonzero()[:, 0].to(device)
        """Which of the ``B * S`` new positions are real (None: all of them, as in a decode step)."""
        self.shape = (len(tables), self.length + width)
        self.num_past, self.num_new = past.to(device), new.to(device)

    def update(self, layer_id: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """``keys``/``values [B, S, heads, D]`` of the new positions stored in their blocks; every key and value
        the batch attends over returned, ``[B, P + S, heads, D]``, read from the pool in one gather."""
        attended = []
        for pool, new in zip(self.cache.layer(layer_id, keys, values), (keys, values), strict=True):
            new = new.flatten(0, 1)
            pool.index_copy_(0, self.written, new if self.new_positions is None else new[self.new_positions])
            attended.append(pool.index_select(0, self.slots).unflatten(0, self.shape))
        return attended[0], attended[1]

    def check_positions(self, switch: int, seq_len: int) -> None:
        """The engine admits no request past a length-dependent RoPE's switch (``Engine``): nothing to check."""

    def mask_and_positions(self) -> tuple[Tensor, Tensor]:
        """The attention mask ``[B, 1, S, P + S]`` (True: attend) and the new positions' ids ``[B, S]``."""
        past, new = self.num_past, self.num_new
        rows, width = self.shape[0], self.shape[1] - self.length
        query = torch.arange(width, device=past.device)
        key = torch.arange(self.shape[1], device=past.device) - self.length  # new positions from 0, past below
        real = query[None, :] < new[:, None]  # [B, S]
        causal = (key[None, None, :] >= -past[:, None, None]) & (key[None, None, :] <= query[None, :, None])
        itself = key[None, None, :] == query[None, :, None]
        mask = torch.where(real[:, :, None], causal, itself.expand(rows, -1, -1))
        positions = past[:, None] + torch.minimum(query[None, :], (new - 1).clamp(min=0)[:, None])
        return mask[:, None], positions
