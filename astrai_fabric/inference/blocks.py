"""``BlockPool``: which of the KV cache's fixed-size blocks hold what, who holds them, and which full blocks can be
found again by their tokens. Bookkeeping only: no tensor here (the tensors are ``paged_cache.PagedKVCache``'s).

A block holds the keys and values of ``block_size`` consecutive positions of one sequence. A request's block table
lists its blocks in position order. A block is

- free: on the free list, holding nothing of use;
- held: by one or more sequences (``refs``); the completions of one prompt (``n``) hold its full blocks together;
- cached: full, its tokens known, held by no one, kept so that a later prompt beginning with the same tokens reuses
  it (prefix reuse), and evicted least recently used when a block is needed and none is free.

A full block is found by its key: a hash chain over the tokens of every block up to it (a block's content depends on
every position before it, so its key does), looked up in a dict and then compared token by token along the whole
chain: a hash is never trusted alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def chain_hash(key: tuple[int, tuple[int, ...]]) -> int:
    """A block key's hash (Python's, of the previous block's hash and the tokens): a dict's lookup, never a match."""
    return hash(key)


@dataclass
class Block:
    """One block's bookkeeping."""

    index: int
    """Its place in the pool (``PagedKVCache``'s rows ``index * block_size ..``)."""
    refs: int = 0
    """Sequences holding it."""
    key: tuple[int, tuple[int, ...]] | None = None
    """``(the previous block's key hash, its tokens)`` once it is full and registered; None until then."""
    parent: Block | None = None
    """The block before it in the sequence that filled it: a block matches only after exactly its parent, so a
    match compares the whole chain's tokens."""
    children: list[Block] | None = None
    """Registered blocks whose parent it is, forgotten with it."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions: allocation, sharing, prefix lookup and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks and positions in each, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.blocks = [Block(index) for index in range(num_blocks)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.cached: OrderedDict[int, None] = OrderedDict()
        """Full blocks held by no one, least recently used first."""
        self.by_key: dict[int, list[Block]] = {}
        """Registered full blocks by their key's hash (``chain_hash``); a list: different chains may collide."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_available(self) -> int:
        """Blocks a request may still be given: free, or cached and evictable."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A block for one sequence (``refs`` 1): a free one, else the least recently used cached one, forgotten."""
        if self.free:
            index = self.free.pop()
        elif self.cached:
            index, _ = self.cached.popitem(last=False)
            self._forget(self.blocks[index])  # registered: only full, registered blocks are cached
        else:
            raise RuntimeError("the KV cache pool has no block left (the engine's admission should have waited)")
        self.blocks[index].refs = 1
        return index

    def hold(self, index: int) -> None:
        """One more sequence holds block ``index`` (a prefix found, or a prompt's blocks shared by its completions)."""
        block = self.blocks[index]
        if block.refs == 0:
            self.cached.pop(index, None)
        block.refs += 1

    def release(self, indices: Sequence[int]) -> None:
        """The sequence holding ``indices`` lets them go: a block no one holds is cached where it is registered (most
        recently used last), else freed."""
        for index in reversed(indices):  # a chain's tail first: evicted before the blocks it depends on
            block = self.blocks[index]
            block.refs -= 1
            if block.refs > 0:
                continue
            if block.key is not None:
                self.cached[index] = None  # the most recently used, after the chain's later blocks
            else:
                self.free.append(index)

    def register(self, index: int, parent: int | None, tokens: Sequence[int]) -> None:
        """Block ``index``, now full of ``tokens`` after the block ``parent`` (None: the sequence's first), can be
        found by them. A chain already registered keeps its block (this one stays private to its sequence)."""
        block, before = self.blocks[index], None if parent is None else self.blocks[parent]
        if block.key is not None or (before is not None and before.key is None):
            return
        key = (chain_hash(before.key) if before is not None else 0, tuple(tokens))
        if self._find(key, before) is not None:
            return
        block.key, block.parent, block.children = key, before, []
        if before is not None:
            before.children.append(block)
        self.by_key.setdefault(chain_hash(key), []).append(block)

    def lookup(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """The cached or held blocks holding the first full blocks of ``tokens``, at most ``max_blocks`` (each
        compared token by token along its chain), held now for the caller (``hold``)."""
        found: list[int] = []
        before: Block | None = None
        size = self.block_size
        for start in range(0, min(len(tokens) // size, max_blocks) * size, size):
            key = (chain_hash(before.key) if before is not None else 0, tuple(tokens[start : start + size]))
            block = self._find(key, before)
            if block is None:
                break
            found.append(block.index)
            before = block
        for index in found:
            self.hold(index)
        return found

    def _find(self, key: tuple[int, tuple[int, ...]], parent: Block | None) -> Block | None:
        """The registered block with exactly ``key`` after exactly ``parent`` (the same object: its own chain
        compared already), or None."""
        for block in self.by_key.get(chain_hash(key), ()):
            if block.key == key and block.parent is parent:
                return block
        return None

    def _forget(self, block: Block) -> None:
        """An evicted block's registration gone, and its descendants' (their content depends on it): cached ones
        freed, held ones private to their holders from now on."""
        for child in list(block.children):
            self._forget(child)
            if child.index in self.cached:
                del self.cached[child.index]
                self.free.append(child.index)
        if block.parent is not None:
            block.parent.children.remove(block)
        same = self.by_key[chain_hash(block.key)]
        same.remove(block)
        if not same:
            del self.by_key[chain_hash(block.key)]
        block.key, block.parent, block.children = None, None, None
