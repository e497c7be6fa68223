"""``--device_memory``: an accelerator's memory, by amount or by name, for planning (``footprint``); and amounts of
bytes given as text (``parse_bytes``: ``--kv_cache_memory`` too)."""

from __future__ import annotations

import math

from astrai_fabric.errors import ConfigError

DEVICES = {"h100": 80 * 2**30, "h200": 141 * 10**9, "a100-40gb": 40 * 2**30, "a100": 80 * 2**30, "l40s": 48 * 2**30,
           "b200": 180 * 10**9, "mi300x": 192 * 2**30}  # fmt: skip
"""``--device_memory`` by name: each device's memory as its vendor states it (GB or GiB, as they state it)."""

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}  # fmt: skip
MAX_DEVICE_MEMORY = 64 * 2**40
"""Larger is taken for a unit mistake: no accelerator has 64 TiB."""


def parse_device_memory(value: str) -> int:
    """``--device_memory``: ``141GiB``, ``80GB`` (a GB is 10^9 bytes, a GiB 2^30: the plan says which it read) or a
    device's name (``DEVICES``), in bytes; anything else one line naming what is accepted."""
    text = value.strip().lower().replace(" ", "")
    if text in DEVICES:
        return DEVICES[text]
    size = parse_bytes(value, "device_memory", f" or a device name: {', '.join(DEVICES)}")
    if not 2**30 <= size <= MAX_DEVICE_MEMORY:
        raise ConfigError(f"device_memory {value!r}: {size:,} bytes is not a device's memory (1 GiB to 64 TiB)")
    return size


def parse_bytes(value: str, field: str, alternatives: str = "") -> int:
    """``80GB``, ``141GiB``, ``512MiB`` (a GB is 10^9 bytes, a GiB 2^30) in bytes; anything else one line naming
    ``field`` and what is accepted (``alternatives`` added to it)."""
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = math.nan
    if unit not in UNITS or not math.isfinite(amount):
        raise ConfigError(
            f"{field} {value!r}: expected an amount with a unit (e.g. 80GB, 141GiB; GB = 10^9 bytes, "
            f"GiB = 2^30){alternatives}"
        )
    return int(amount * UNITS[unit])
