"""tools/reading_order.py's static parts: import kinds, heights, cycles, the climb classification (no run)."""

import ast
import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "reading_order.py"
spec = importlib.util.spec_from_file_location("reading_order", TOOL)
ro = importlib.util.module_from_spec(spec)
sys.modules["reading_order"] = ro  # dataclasses look their module up
spec.loader.exec_module(ro)


def test_import_kinds():
    source = """
import a
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import b
else:
    import c
try:
    import d
except ImportError:
    pass
class K:
    import e
def f():
    import g
    importlib.import_module("h")
    if TYPE_CHECKING:
        import i
"""
    kinds = {}
    for node, kind in ro._import_nodes(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.args[0].value
        else:
            name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        kinds[name] = kind
    assert kinds == {
        "a": "top",
        "typing": "top",
        "b": "typing",
        "c": "top",
        "d": "top",
        "e": "top",
        "g": "deferred",
        "h": "deferred",
        "i": "typing",
    }


def test_heights_and_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    assert ro.heights(graph) == {"d": 0, "b": 1, "c": 1, "a": 2}
    assert [g for g in ro.components(graph) if len(g) > 1] == [["b", "c"]]
    assert ro.shortest_cycle(graph, ["b", "c"]) == ["b", "c", "b"]


def test_classify(monkeypatch):
    low, high = "astrai_fabric.low", "astrai_fabric.high"
    pair = ro.Pair("astrai_fabric/low.py:3", "method", vias={"torch/x.py:f"})
    deferred = ro.Import(low, high, "deferred", 7, frozenset({high}))
    typing = ro.Import(low, high, "typing", 2, frozenset({high}))
    other = ro.Import(low, "astrai_fabric.other", "top", 1, frozenset({"astrai_fabric.other"}))
    monkeypatch.setattr(ro, "_file", lambda module: module.replace(".", "/") + ".py")
    assert ro.classify(low, high, pair, [other, deferred]).startswith("direct: deferred import of astrai_fabric.high")
    assert ro.classify(low, high, pair, [typing]).startswith("injected, typed: a method of an object")
    assert ro.classify(low, high, pair, [other]) == (
        "injected: a method of an object it was given (its class is defined higher); called through torch/x.py:f"
    )


def test_the_package_graph():
    found = ro.imports()
    height = ro.heights(ro.graph_of(found, {"top"}))
    assert set(height) == set(ro.modules())
    assert all(height[imp.source] > height[imp.target] for imp in found if imp.kind == "top")


def test_folder_cycles():
    """A package's ``__init__`` re-exporting its sub-folder, whose file imports a sibling file, is no circle; a
    circle of folders is found at the level where its parts differ, with no file in a circle."""
    graph = {"p": {"p.sub"}, "p.sub": {"p.sub.x"}, "p.sub.x": {"p.files"}, "p.sub.y": {"p.sub.z.k"}}
    graph |= {"p.sub.z.j": {"p.sub.w"}, "p.files": set(), "p.sub.z.k": set(), "p.sub.w": set()}
    assert sorted(ro.folder_graphs(graph)) == ["p", "p.sub", "p.sub.z"]
    assert ro.folder_cycles(graph) == []
    graph["p.sub.w"] = {"p.sub.y"}  # z.j -> w -> y -> z.k
    assert [g for g in ro.components(graph) if len(g) > 1] == []
    assert ro.folder_cycles(graph) == [("p.sub", ["p.sub.w", "p.sub.y", "p.sub.z"])]
