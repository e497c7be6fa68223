"""Which calls of one training run climb back up the import order, and why each is allowed: a measure of whether
``astrai-fabric sft`` reads top-down, from ``cli.main`` to the optimizer step (issue 14's "Done when", issue 22).

    .venv/bin/python tools/reading_order.py            # the climbs, each classified; the figure: direct climbs
    .venv/bin/python tools/reading_order.py --verbose  # also every distinct pair, with its first call site
    .venv/bin/python tools/reading_order.py --cycles   # only: import cycles between files and between folders,
                                                       # every import counted (exit 1 if any)

What it does: runs one real ``astrai-fabric sft`` in this process (the bundled ``recipes/tiny-sft.yaml``, two
optimizer steps, a temporary ``ckpt_dir``) under ``sys.setprofile``, from the call of ``cli.main`` to its return,
and records every distinct pair *caller -> callee* of two functions of ``astrai_fabric``. Of those pairs it lists
the climbs (the callee's module higher in the import order than the caller's) and classifies each: *injected*
(the lower module was handed the callee as a value) or *direct* (the lower module imports the higher one and
calls up). The figure is the number of direct climbs. Exit status: 1 when the run failed, else 0.

Definitions, precisely:

* A function is a code object of a file of the ``astrai_fabric`` package that is a ``def`` or a ``lambda`` (not a
  module body, not a class body, not a comprehension or generator expression). It is named by its module and its
  ``__qualname__``: ``Class.method``, ``outer.<locals>.inner``, ``outer.<locals>.<lambda>`` (a lambda is a function of
  the module that defines it; its name shows the function or class around it). Code generated at run time (a
  dataclass's ``__init__``, file ``<string>``) is not in the package's files: it is not a function of the package.
* A call is a ``call`` event of the profiler entering a function. Left out: a generator's or coroutine's resumptions
  (only its first entry, at ``RESUME 0``, is a call); every call made while a module body is running (an import under
  way: ``cli.main`` imports the training modules when it needs them, and what an import runs is not the run's path);
  calls in other threads (counted and reported, not attributed) and in other processes.
* The caller of a call is the nearest frame below the callee's, in the same thread's stack, whose code is in a file of
  the package. Frames of other code in between are skipped over, not hidden: the callee was then called back by that
  code (Lightning's ``fabric.launch`` running our function, torch's ``DataLoader`` calling our ``collate`` or
  ``__getitem__``, an ``nn.Module.__call__`` running our ``forward``, a dataclass's generated ``__init__`` calling
  ``__post_init__``), and the pair keeps as its *via*s the frame of other code that made each such call. A caller
  frame of a comprehension or generator expression counts as the function that defines it (its ``__qualname__``
  without the trailing ``<locals>.<genexpr>``). A call with no package frame below it (``cli.main`` itself) has no
  caller: it is no pair.
* The import graph for heights has one node per module file of the package (a package's ``__init__.py`` is the
  package) and an edge ``A -> B`` when ``A`` imports ``B`` at its top level: an ``import``/``from ... import`` that
  runs when ``A`` is imported (at module level, also inside a module-level ``if``/``try``/``with`` or class body), not
  one inside a function (deferred) nor under ``if TYPE_CHECKING:``. ``from astrai_fabric.x import y`` is an edge to
  ``astrai_fabric.x.y`` when that is a module, else to ``astrai_fabric.x``; importing ``a.b.c`` also runs ``a.b``'s
  ``__init__``, but only the named module is an edge.
* A module's height is 0 when it imports no module of the package, else 1 + the largest height of the modules it
  imports (the longest import path below it), so a module is higher than every module it imports, transitively.
  Modules of one import cycle (none today) get one height. Equal heights are level; unrelated modules are compared by
  height alone.
* A climb is a distinct pair whose callee's module has a strictly greater height than the caller's module.
* A module *names* a module ``M`` when any ``import`` statement in its file, wherever it is (top level, in a function,
  under ``TYPE_CHECKING``), has ``M`` as its target (as for edges) or imports a name that resolves to ``M``:
  ``from P import n`` where ``P``'s file binds ``n`` by ``from Q import n`` resolves, through ``Q``, to the module that
  defines ``n`` (a package re-exporting a function). ``importlib.import_module("astrai_fabric.m")`` with a constant
  string is an import statement in a function.
* A climb is *direct* when the caller's module names the callee's module by an import that runs (top level or
  deferred): the lower module reached the higher module's code itself. It is *injected, typed* when the only imports
  naming it are under ``TYPE_CHECKING``, and *injected* when none does: either way the lower module holds no reference
  to the higher module at run time, so the only way it reached that code is through a value it was given (the rule
  does not see code reached as an attribute of a module object, ``P.sub.f()`` after ``import P`` when nothing names
  ``P.sub``: check a climb's call site). The kind of value is read from the callee's code and reported: a generator (a
  generator function's first entry is the caller's first ``next()``), a lambda, a method (``__qualname__``
  ``Class.name``: an object it was given whose class is defined higher, polymorphism) or else a function value (an
  argument, an attribute, a dataclass field, a closure), and the pair's *via*s when other code made the call. A climb
  between modules of one import cycle cannot occur (they are level). The figure is the number of direct climbs.

The run's own output is hidden (its last lines are printed when it fails); its exit status is printed.

``--cycles`` checks the import graph of *every* import: top level, deferred (in a function) and under
``TYPE_CHECKING``, one node per file as above. It lists each group of files that reach each other (a strongly
connected component), one shortest cycle of it, and every edge inside it with its kind and line (the edges one
would cut). It checks the same graph between folders too, at every level: for each package ``P`` (a folder with an
``__init__.py``), the graph of its parts, where a part is a file of ``P`` or a sub-folder of ``P`` with every module
under it (``astrai_fabric.train.start`` is the part ``astrai_fabric.train`` of ``astrai_fabric``, and the part
``astrai_fabric.train.start`` of ``astrai_fabric.train``), and ``P``'s own ``__init__.py`` is a part of its own (a
package re-exporting names of its sub-folders is not in a circle with them); it lists each group of parts that reach
each other, with one shortest cycle and the imports between its parts. Files in no circle can make folders that are
in one (``evaluate.perplexity`` importing ``train.start`` while ``train.common`` imports ``plot``, which imports
``evaluate.results``). Exit status 1 when either check finds one. The default run prints both summaries first.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dis
import io
import sys
import tempfile
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "astrai_fabric"
RECIPE = ROOT / "recipes" / "tiny-sft.yaml"

TOP, DEFERRED, TYPING = "top", "deferred", "typing"
EXPRESSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}
CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR, CO_OPTIMIZED = 0x20, 0x80, 0x200, 0x1
RESUME = dis.opmap["RESUME"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    """One import of a package module by another: ``names`` are the modules it names (see the docstring)."""

    source: str
    target: str
    kind: str  # TOP, DEFERRED or TYPING
    line: int
    names: frozenset[str]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, kind: str = TOP):
    """Every import statement under ``node`` (and constant ``import_module`` call), with the kind it has there."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.Call) and _is_import_module(child):
            yield child, DEFERRED if kind == TOP else kind
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), TYPING)
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), kind)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _import_nodes(child, DEFERRED if kind == TOP else kind)
        else:
            yield from _import_nodes(child, kind)


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return (
        name == "import_module"
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def imports() -> list[Import]:
    """Every import of a package module by another, anywhere in its file (see the module docstring)."""
    known = modules()
    trees = {name: ast.parse(path.read_text()) for name, path in known.items()}

    def base_of(name: str, node: ast.ImportFrom) -> str:
        base = node.module or ""
        if node.level:  # relative: from the package this module belongs to
            anchor = name.split(".") if known[name].name == "__init__.py" else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        return base

    rebinds: dict[str, dict[str, tuple[str, str]]] = {}  # module -> name it binds -> (module, name) it comes from
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                base = base_of(name, node)
                if base in known:
                    for alias in node.names:
                        rebinds.setdefault(name, {})[alias.asname or alias.name] = (base, alias.name)

    def origin(module: str, name: str, depth: int = 0) -> str:
        """The module that defines what ``from module import name`` binds."""
        if f"{module}.{name}" in known:
            return f"{module}.{name}"
        if depth < 10 and name in rebinds.get(module, {}):
            return origin(*rebinds[module][name], depth + 1)
        return module

    found: dict[tuple[str, str, str, int], set[str]] = {}  # (source, target, kind, line) -> the modules it names
    for name, tree in trees.items():
        for node, kind in _import_nodes(tree):
            if isinstance(node, ast.Call):
                pairs = [(node.args[0].value, {node.args[0].value})]
            elif isinstance(node, ast.Import):
                pairs = [(alias.name, {alias.name}) for alias in node.names]
            else:
                base = base_of(name, node)
                pairs = [
                    (f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, {base, origin(base, a.name)})
                    for a in node.names
                ]
            for target, names in pairs:
                if target in known and target != name:
                    found.setdefault((name, target, kind, node.lineno), set()).update(names & known.keys())
    return [Import(*key, frozenset(names)) for key, names in found.items()]


def graph_of(found: list[Import], kinds: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for imp in found:
        if imp.kind in kinds:
            graph[imp.source].add(imp.target)
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's), each sorted, dependencies first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    result: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            result.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def heights(graph: dict[str, set[str]]) -> dict[str, int]:
    """Longest import path below each module; the modules of one cycle share one height."""
    result: dict[str, int] = {}
    for group in components(graph):  # dependencies first: every edge out of the group has its height already
        outside = {dep for member in group for dep in graph[member]} - set(group)
        value = 1 + max((result[dep] for dep in outside), default=-1)
        result.update(dict.fromkeys(group, value))
    return result


def shortest_cycle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest cycle through ``group[0]`` inside ``group`` (breadth first)."""
    start, members = group[0], set(group)
    parent: dict[str, str] = {}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for dep in sorted(graph[node] & members):
            if dep == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if dep not in parent:
                parent[dep] = node
                todo.append(dep)
    return [start]


def part_of(package: str, module: str) -> str | None:
    """The part of ``package`` that ``module`` lies in (see ``--cycles``), or None when it lies outside."""
    if module == package:
        return package  # its __init__.py: a part of its own
    if not module.startswith(f"{package}."):
        return None
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def folder_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """For each package (a folder: the module names before a dot), the graph of its parts that ``graph``'s imports
    inside it give."""
    packages = {name.rsplit(".", depth)[0] for name in graph for depth in range(1, name.count(".") + 1)}
    result = {}
    for package in sorted(packages):
        parts: dict[str, set[str]] = {}
        for module, deps in graph.items():
            if (part := part_of(package, module)) is None:
                continue
            reached = {part_of(package, dep) for dep in deps} - {None, part}
            parts.setdefault(part, set()).update(reached)
            for other in reached:
                parts.setdefault(other, set())
        result[package] = parts
    return result


def folder_cycles(graph: dict[str, set[str]]) -> list[tuple[str, list[str]]]:
    """``(package, parts)``: each group of more than one part of a package that import each other, directly or
    through others (see ``--cycles``)."""
    return [
        (package, group)
        for package, parts in folder_graphs(graph).items()
        for group in components(parts)
        if len(group) > 1
    ]


def report_cycles(found: list[Import]) -> bool:
    """Print the file cycles and the folder cycles (every import counted); True when there is any."""
    graph = graph_of(found, {TOP, DEFERRED, TYPING})
    groups = [group for group in components(graph) if len(group) > 1]
    print(f"import cycles between files (top-level, deferred and TYPE_CHECKING imports): {len(groups) or 'none'}")
    for group in groups:
        print(f"  {len(group)} files: " + " -> ".join(shortest_cycle(graph, group)))
        for imp in sorted(found, key=lambda i: (i.source, i.line)):
            if imp.source in group and imp.target in group:
                print(f"    {imp.source} -> {imp.target}  ({imp.kind}, {_file(imp.source)}:{imp.line})")
    folders = folder_cycles(graph)
    print(f"import cycles between folders, at every level (the same imports): {len(folders) or 'none'}")
    parts = folder_graphs(graph)
    for package, group in folders:
        print(f"  {len(group)} parts of {package}: " + " -> ".join(shortest_cycle(parts[package], group)))
        for imp in sorted(found, key=lambda i: (i.source, i.line)):
            source, target = part_of(package, imp.source), part_of(package, imp.target)
            if source in group and target in group and source != target:
                print(f"    {imp.source} -> {imp.target}  ({imp.kind}, {_file(imp.source)}:{imp.line})")
    return bool(groups or folders)


def _file(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))


@dataclass
class Pair:
    """One distinct caller -> callee pair of the run: where it was first called, how often, through what."""

    site: str
    kind: str  # what the callee is: "generator", "lambda", "method" or "function"
    calls: int = 0
    vias: set[str] = field(default_factory=set)


@dataclass
class Recording:
    pairs: dict[tuple[str, str, str, str], Pair]  # (caller module, caller, callee module, callee) -> Pair
    calls: int  # calls recorded (every call of a function from cli.main on, cli.main included)
    rootless: set[tuple[str, str]]  # callees with no package frame below them
    other_threads: int  # calls of package functions in other threads: not attributed
    status: object
    output: str


def _qualname(code) -> str:  # noqa: ANN001 - a code object
    parts = code.co_qualname.split(".")
    while parts and parts[-1] in EXPRESSIONS:
        parts.pop()
        if parts and parts[-1] == "<locals>":
            parts.pop()
    return ".".join(parts) or "<module>"


def _kind(code) -> str:  # noqa: ANN001 - a code object
    parts = code.co_qualname.split(".")
    if code.co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR):
        return "generator"
    if parts[-1] == "<lambda>":
        return "lambda"
    return "method" if len(parts) > 1 and parts[-2] != "<locals>" else "function"


VALUES = {
    "generator": "a generator it was given (its body starts at the first next())",
    "lambda": "a lambda it was given",
    "method": "a method of an object it was given (its class is defined higher)",
    "function": "a function value it was given (argument, attribute or field)",
}


def _where(frame) -> str:  # noqa: ANN001 - a frame
    path = frame.f_code.co_filename
    for marker in ("site-packages/", "/lib/python"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        with contextlib.suppress(ValueError):
            path = str(Path(path).relative_to(ROOT))
    return f"{path}:{frame.f_code.co_name}"


def record_pairs(steps: int) -> Recording:
    """Every distinct caller -> callee pair of one tiny sft run (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from astrai_fabric import cli  # noqa: PLC0415 - imported before profiling starts, so imports are not calls

    files = {str(p): name for name, p in modules().items()}
    pairs: dict[tuple[str, str, str, str], Pair] = {}
    rootless: set[tuple[str, str]] = set()
    counts = {"calls": 0, "importing": 0, "other_threads": 0}

    def first_entry(frame, code) -> bool:  # noqa: ANN001
        if not code.co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR):
            return True
        at = frame.f_lasti
        return code.co_code[at] == RESUME and code.co_code[at + 1] == 0  # RESUME 0: the start, not after a yield

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        code = frame.f_code
        if code.co_name == "<module>":
            if event == "call":
                counts["importing"] += 1
            elif event == "return":
                counts["importing"] -= 1
            return
        if event != "call" or counts["importing"]:
            return
        module = files.get(code.co_filename)
        if module is None or code.co_name in EXPRESSIONS or not code.co_flags & CO_OPTIMIZED:
            return  # not ours, an expression's code, or a class body
        if not first_entry(frame, code):
            return
        counts["calls"] += 1
        callee = (module, code.co_qualname)
        below, via = frame.f_back, None
        while below is not None and below.f_code.co_filename not in files:
            via = via or _where(below)
            below = below.f_back
        if below is None:
            rootless.add(callee)
            return
        key = (files[below.f_code.co_filename], _qualname(below.f_code), *callee)
        pair = pairs.get(key)
        if pair is None:
            site = f"{Path(below.f_code.co_filename).relative_to(ROOT)}:{below.f_lineno}"
            pair = pairs[key] = Pair(site, _kind(code))
        pair.calls += 1
        if via:
            pair.vias.add(via)

    def other_thread(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename in files:
            counts["other_threads"] += 1

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["sft", "--config", str(RECIPE), "--ckpt_dir", f"{tmp}/ckpt", "--max_steps", str(steps)]
        sink = io.StringIO()
        threading.setprofile(other_thread)
        sys.setprofile(profile)
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                status = cli.main(argv)
        except SystemExit as exit_:
            status = exit_.code
        except Exception:  # noqa: BLE001 - a failed run is reported, with its traceback
            sys.setprofile(None)
            sink.write(traceback.format_exc())
            status = "exception"
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    return Recording(pairs, counts["calls"], rootless, counts["other_threads"], status, sink.getvalue())


def classify(caller: str, callee: str, pair: Pair, found: list[Import]) -> str:
    """``direct``, ``injected, typed`` or ``injected``, with the reason (see the module docstring)."""
    naming = [imp for imp in found if imp.source == caller and callee in imp.names]
    running = [imp for imp in naming if imp.kind != TYPING]
    through = f"; called through {', '.join(sorted(pair.vias))}" if pair.vias else ""
    if running:
        imports_ = ", ".join(f"{imp.kind} import of {imp.target} ({_file(caller)}:{imp.line})" for imp in running)
        return f"direct: {imports_}{through}"
    if naming:
        lines = ", ".join(f"{_file(caller)}:{imp.line}" for imp in naming)
        return f"injected, typed: {VALUES[pair.kind]}{through}; names {callee} only under TYPE_CHECKING ({lines})"
    return f"injected: {VALUES[pair.kind]}{through}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of the run (default 2)")
    parser.add_argument("--verbose", action="store_true", help="also print every distinct pair, first call site")
    parser.add_argument("--cycles", action="store_true", help="only check for import cycles, files and folders")
    options = parser.parse_args()
    found = imports()
    cyclic = report_cycles(found)
    if options.cycles:
        return 1 if cyclic else 0
    height = heights(graph_of(found, {TOP}))
    rec = record_pairs(options.steps)

    def label(module: str, function: str) -> str:
        return f"h{height[module]} {module}.{function}"

    climbs = {key: pair for key, pair in rec.pairs.items() if height[key[2]] > height[key[0]]}
    if options.verbose:
        print(f"every distinct pair ({len(rec.pairs)}), in order of first call; ^ marks a climb:")
        for (cmod, cfun, emod, efun), pair in rec.pairs.items():
            mark = "^" if (cmod, cfun, emod, efun) in climbs else " "
            via = f"  via {', '.join(sorted(pair.vias))}" if pair.vias else ""
            print(f"  {mark} {label(cmod, cfun)} -> {label(emod, efun)}  [{pair.site}, {pair.calls}x]{via}")
        for module, function in sorted(rec.rootless):
            print(f"    no package caller: {label(module, function)}")
    kinds = {"direct": 0, "injected, typed": 0, "injected": 0}
    print(f"climbs (distinct pairs whose callee's module is higher than the caller's): {len(climbs)}")
    for (cmod, cfun, emod, efun), pair in climbs.items():
        verdict = classify(cmod, emod, pair, found)
        kinds[verdict.split(":")[0]] += 1
        print(f"  {label(cmod, cfun)} -> {label(emod, efun)}  [{pair.site}, {pair.calls}x]\n      {verdict}")
    ok = rec.status in (0, None)
    if not ok:
        print("the run failed; its last lines:\n" + "\n".join(rec.output.rstrip().splitlines()[-25:]))
    print(
        f"run: sft {RECIPE.relative_to(ROOT)} --max_steps {options.steps}, exit status {rec.status}; "
        f"{rec.calls} calls, {len(rec.pairs)} distinct pairs, {len(rec.rootless)} callee(s) with no package caller, "
        f"{rec.other_threads} calls in other threads (not attributed)"
    )
    print(
        f"climbs: {len(climbs)} = {kinds['injected']} injected + {kinds['injected, typed']} injected, typed + "
        f"{kinds['direct']} direct"
    )
    print(f"reading-order figure (direct climbs: a lower module calling up through its own import): {kinds['direct']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
