"""YAML read from outside (a dataset card's header), loaded with its aliases bounded.

An alias (``*name``) repeats the value its anchor (``&name``) names without repeating its text: ten lists of ten
aliases to the list before are 10^10 values from a few hundred bytes. YAML's safe loaders build them as shared
objects, so the cost comes later, wherever the value is walked (a repr, a comparison, JSON): the bound has to be
set when the YAML is read. ``load`` counts what the aliases expand to from the parser's events (before any object
is built) and refuses YAML whose values, expanded, outnumber a bound; one that never reaches it loads as YAML's safe
loader loads it (aliases as shared values: dataset cards written by ``yaml.dump`` use them for repeated values).
Recipes refuse aliases outright (``cli.py``'s loader).
"""

from __future__ import annotations

from typing import Any

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML has it (a large card parses in milliseconds), else the Python one."""


class AliasExpansionError(yaml.composer.ComposerError):
    """YAML whose aliases expand it past the bound, or an alias inside the value it names (a cycle)."""


def load(text: str, max_values: int) -> Any:
    """The plain data (mappings, lists, scalars) ``text`` holds, by YAML's safe loader, after its events are counted:
    every scalar, list and mapping one value, an alias the values its anchor's node holds. Past ``max_values`` (or
    an alias to a node it is inside of) raises ``AliasExpansionError`` at that alias; other malformed YAML raises
    what YAML raises (``yaml.YAMLError``)."""
    sizes: dict[str, int] = {}
    """Each anchor's node: the values it holds, expanded."""
    open_nodes: list[tuple[str | None, int]] = []
    """The lists and mappings being read: their anchors, and the count where each started."""
    expanded = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                if any(anchor == event.anchor for anchor, _ in open_nodes):
                    raise AliasExpansionError(
                        None, None, f"alias *{event.anchor} is inside the value it names", event.start_mark
                    )
                continue  # an alias to no anchor: the loader below raises YAML's own error for it
            expanded += sizes[event.anchor]
            if expanded > max_values:
                raise AliasExpansionError(
                    None, None, f"aliases (*name) expand it to more than {max_values:,} values", event.start_mark
                )
        elif isinstance(event, yaml.ScalarEvent):
            expanded += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append((event.anchor, expanded))
            expanded += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = expanded - start
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 — a safe loader (plain data only)
