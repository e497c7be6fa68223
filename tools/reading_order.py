"""How far one run's calls climb back up the import order: a measure of whether ``astrai-fabric sft`` reads
top-down, from ``cli.main`` to the optimizer step (issue 14's "Done when").

    .venv/bin/python tools/reading_order.py            # prints the count, the definition's numbers, the climbs
    .venv/bin/python tools/reading_order.py --calls 300 --verbose
    .venv/bin/python tools/reading_order.py --cycles     # only: import cycles between packages (exit 1 if any)

What it does: runs one real ``astrai-fabric sft`` in this process (the bundled ``recipes/tiny-sft.yaml``, two
optimizer steps, a temporary ``ckpt_dir``) under ``sys.setprofile`` and records, from the call of ``cli.main`` on,
the module of every call into a function of ``astrai_fabric``. Of the first ``--calls`` (200) it counts the calls
whose module is *higher* in the import order than the module of the call before.

Definitions, precisely:

* A call is a ``call`` event of the profiler whose code lives in a file of the ``astrai_fabric`` package and has a
  name (functions and methods). Left out: module bodies (imports running), comprehensions, generator expressions
  and lambdas (``<...>`` code names: parts of an expression, not a function a reader follows), class bodies, a
  generator's resumptions (only its first entry is a call), and every call made while a module is being imported
  (``cli.main`` imports the training modules when it needs them: what their import runs is not the run's path).
  Code generated at run time (a dataclass's ``__init__``, file ``<string>``) is not in the package's files.
* The import graph has one node per module file of the package (a package's ``__init__.py`` is the package) and
  an edge ``A -> B`` when ``A`` imports ``B`` at its top level: module-level ``import``/``from ... import``
  statements, including those inside a module-level ``if``/``try``, but not those inside functions (deferred
  imports) nor under ``if TYPE_CHECKING:``. ``from astrai_fabric.x import y`` is an edge to ``astrai_fabric.x.y``
  when that is a module, else to ``astrai_fabric.x``; importing ``a.b.c`` also runs ``a.b``'s ``__init__``, but only
  the named module is an edge.
* A module's height is 0 when it imports no module of the package, else 1 + the largest height of the modules it
  imports (the longest import path below it). So a module is higher than every module it imports, transitively.
  Modules of equal height are level (neither is higher); unrelated modules are compared by height alone. A cycle
  in the graph (none today) would be reported and its modules given one height.
* A climb is a call whose module's height is strictly greater than the height of the previous call's module.

The run's own output is hidden; its outcome (exit status) is printed.

``--cycles`` checks the same top-level graph one level up: each module counted as its top-level part of the
package (``astrai_fabric.train.start`` as ``astrai_fabric.train``, ``astrai_fabric.lora`` as itself), it lists
every pair of parts that import each other, directly or through others (a deferred import is no edge: that is
how a cycle is broken, with the reason beside it).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "astrai_fabric"
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at its top level (see the module docstring)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in _top_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package this module belongs to
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            edges.update(t for t in targets if t in known and t != name)
        graph[name] = edges
    return graph


def heights(graph: dict[str, set[str]]) -> dict[str, int]:
    """Longest import path below each module; raises on a cycle (there should be none)."""
    result: dict[str, int] = {}
    visiting: list[str] = []

    def height(name: str) -> int:
        if name in result:
            return result[name]
        if name in visiting:
            cycle = visiting[visiting.index(name) :] + [name]
            raise SystemExit("import cycle: " + " -> ".join(cycle))
        visiting.append(name)
        value = 1 + max((height(dep) for dep in graph[name]), default=-1)
        visiting.pop()
        result[name] = value
        return value

    for name in graph:
        height(name)
    return result


def package_cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs ``(a, b)``: part ``a`` imports part ``b`` and ``b`` reaches ``a`` back (see ``--cycles``)."""
    parts: dict[str, set[str]] = {}
    for name, deps in graph.items():
        part = ".".join(name.split(".")[:2])
        parts.setdefault(part, set()).update(".".join(d.split(".")[:2]) for d in deps)
    for part, deps in parts.items():
        deps.discard(part)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in parts.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    return sorted((a, b) for a, deps in parts.items() for b in deps if a in reachable(b))


def record_calls(limit: int, steps: int) -> tuple[list[tuple[str, str]], int]:
    """``(module, function)`` of the first ``limit`` calls of one tiny sft run, and the run's exit status."""
    sys.path.insert(0, str(ROOT))
    from astrai_fabric import cli  # noqa: PLC0415 - imported before profiling starts, so imports are not calls

    files = {str(p): name for name, p in modules().items()}
    calls: list[tuple[str, str]] = []
    entered: set[int] = set()
    keep_alive: list = []  # generator frames, so that their ids are not reused while recording

    importing = [0]  # module bodies running (any module's: an import under way)

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        code = frame.f_code
        if code.co_name == "<module>" and event in ("call", "return"):
            importing[0] += 1 if event == "call" else -1
            return
        if event != "call" or importing[0] or len(calls) >= limit:
            return
        module = files.get(code.co_filename)
        if module is None or code.co_name.startswith("<") or not code.co_flags & 0x1:  # 0x1: CO_OPTIMIZED
            return  # not ours, an expression's code, or a class body
        if code.co_flags & 0x20:  # CO_GENERATOR: only the first entry is a call
            if id(frame) in entered:
                return
            entered.add(id(frame))
            keep_alive.append(frame)
        if calls or (module == "astrai_fabric.cli" and code.co_name == "main"):
            calls.append((module, code.co_qualname))
            if len(calls) >= limit:
                sys.setprofile(None)

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["sft", "--config", str(RECIPE), "--ckpt_dir", f"{tmp}/ckpt", "--max_steps", str(steps)]
        sink = io.StringIO()
        sys.setprofile(profile)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                status = cli.main(argv)
        except SystemExit as exit_:
            status = exit_.code
        finally:
            sys.setprofile(None)
    return calls, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls counted from cli.main (default 200)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of the run (default 2)")
    parser.add_argument("--verbose", action="store_true", help="print every counted call")
    parser.add_argument("--cycles", action="store_true", help="only check for import cycles between packages")
    options = parser.parse_args()
    graph = import_graph()
    cycles = package_cycles(graph)
    print("import cycles between packages: " + (", ".join(f"{a} <-> {b}" for a, b in cycles) or "none"))
    if options.cycles:
        return 1 if cycles else 0
    height = heights(graph)
    calls, status = record_calls(options.calls, options.steps)
    climbs = 0
    for index, (module, function) in enumerate(calls):
        up = index > 0 and height[module] > height[calls[index - 1][0]]
        climbs += up
        if options.verbose or up:
            mark = "^" if up else " "
            print(f"{index:4d} {mark} h{height[module]:<2d} {module}.{function}")
    print(f"run exit status {status}; {len(calls)} calls recorded from cli.main")
    print(f"climbs (a call into a module higher than the previous call's): {climbs} of the first {len(calls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
