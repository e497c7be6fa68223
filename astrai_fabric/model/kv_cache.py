"""``KVCache``: keys and values of the positions already seen, so generation feeds one new token per step.

The model's attention reaches its cache through two calls, the seam a cache fills: ``update(layer_id, keys,
values)`` (store the new positions', return every key and value to attend over) and ``check_positions`` (refuse what
the cache cannot rotate), with ``length`` the cached positions before the new ones. ``KVCache`` holds one contiguous
sequence per row; the generation engine's ``inference.paged_cache.BatchView`` holds a batch of requests in blocks."""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """Per-layer key/value buffers ``[B, max_len, K, D]``, filled left to right.

    Attention layers call ``update`` with the new positions' keys and values and attend over everything cached so
    far; the model advances ``length`` once all layers have written. Buffers are allocated on first use, in the
    dtype and on the device of the keys.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}

    def update(self, layer_id: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``keys``/``values [B, S, K, D]`` after the cached ones; return all of them."""
        end = self.length + keys.size(1)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, {end} requested")
        if layer_id not in self._keys:
            # values may be narrower than keys (MLA's v_head_dim)
            for store, new in ((self._keys, keys), (self._values, values)):
                store[layer_id] = new.new_zeros((new.size(0), self.max_len, *new.shape[2:]))
        self._keys[layer_id][:, self.length : end] = keys
        self._values[layer_id][:, self.length : end] = values
        return self._keys[layer_id][:, :end], self._values[layer_id][:, :end]

    def check_positions(self, switch: int, seq_len: int) -> None:
        """Refuse ``seq_len`` new positions that cross a longrope model's ``switch`` (its original length): the
        cached keys were rotated with the short factors, the new ones would be with the long, a function of neither.
        transformers' Phi-3 drops its cache there and recomputes the whole sequence
        (``Phi3ForCausalLM.prepare_inputs_for_generation``), which is what a forward without a cache does here."""
        if 0 < self.length <= switch < self.length + seq_len:
            raise ValueError(
                f"longrope: this generation crosses original_max_position_embeddings {switch}, where the cached "
                "keys' frequencies (short factors) no longer apply; generate without a KV cache to go past it"
            )
