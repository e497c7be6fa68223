"""The package's seams, read from the source: no import circle between its files nor between its folders, at every
level (every import counted: top-level, deferred, ``TYPE_CHECKING``), no arrow running back up to the training side,
the checkpoint package's public names import without Lightning and one module imports safetensors, ``prepare`` loads
no model code and the loop no strategy."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "astrai_fabric"


def module_imports(top_level: bool = True) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module of the package: in its top-level statements (the imports
    inside functions run later, on use, and close no cycle at import time), or anywhere."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        tree = ast.parse(path.read_text())
        for node in tree.body if top_level else ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        found[name] = imported
    return found


def test_the_public_names_import_without_lightning():
    """A fresh process: what a user imports to load a model must not pay for Lightning (``state`` does)."""
    code = (
        "import sys; import astrai_fabric.checkpoint as c; c.load_model; from astrai_fabric.checkpoint import "
        "load_checkpoint, save_checkpoint; assert 'lightning' not in sys.modules, 'lightning imported'; "
        "assert 'astrai_fabric.checkpoint.state' not in sys.modules, 'state imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]


def test_only_the_files_module_imports_safetensors():
    imports = module_imports(top_level=False).items()
    importers = sorted(m for m, names in imports if any(n.split(".")[0] == "safetensors" for n in names))
    assert importers == ["astrai_fabric.checkpoint.files"]


def test_the_checkpoint_package_is_in_no_import_cycle():
    """Nothing the checkpoint package imports, directly or not, imports the package back."""
    graph = module_imports()
    inside = {m for m in graph if m == "astrai_fabric.checkpoint" or m.startswith("astrai_fabric.checkpoint.")}
    seen, todo = set(), [n for m in inside for n in graph[m]]
    while todo:
        name = todo.pop()
        if name in graph and name not in inside and name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    back = sorted(m for m in seen if any(n.startswith("astrai_fabric.checkpoint") for n in graph[m]))
    assert back == []


def load_reading_order():
    """tools/reading_order.py, whose import graph (every import, with its kind) these tests read."""
    tool = Path(__file__).parents[1] / "tools" / "reading_order.py"
    spec = importlib.util.spec_from_file_location("reading_order", tool)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reading_order"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def file_import_graph() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, every import counted: top-level, inside functions (deferred)
    and under ``if TYPE_CHECKING:``."""
    tool = load_reading_order()
    return tool.graph_of(tool.imports(), {tool.TOP, tool.DEFERRED, tool.TYPING})


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (each holds at least one circle)."""
    return [group for group in load_reading_order().components(graph) if len(group) > 1]


def test_no_import_circle_between_the_package_files():
    graph = file_import_graph()
    assert len(graph) > 60 and graph["astrai_fabric.loop.step"], "the graph was not read"
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_deferred_circle():
    """The check above can fail: a function-level import closing a circle is found."""
    graph = file_import_graph()
    graph["astrai_fabric.errors"] = graph["astrai_fabric.errors"] | {"astrai_fabric.cli"}
    circles = import_circles(graph)
    assert any({"astrai_fabric.errors", "astrai_fabric.cli"} <= set(circle) for circle in circles)


def folder_circles(graph: dict[str, set[str]]) -> list[tuple[str, list[str]]]:
    """``(package, its parts in a circle)``: a package's parts are its files and sub-folders (each with everything
    under it), its own ``__init__.py`` one of its own (``reading_order.folder_cycles``)."""
    return load_reading_order().folder_cycles(graph)


def test_no_import_circle_between_the_package_folders():
    """At every level: between ``train/``, ``evaluate/``, ``plot.py``, ... and inside each folder between its files
    and sub-folders; a package-level loop can be made of files in no loop."""
    graph = file_import_graph()
    assert "astrai_fabric.train" in load_reading_order().folder_graphs(graph)["astrai_fabric"], "no folders read"
    assert folder_circles(graph) == []


TRAINING_SIDE = {
    "astrai_fabric.train": {"astrai_fabric.cli", "astrai_fabric.lightning_module"},
    "astrai_fabric.loop": {"astrai_fabric.train"},
}
"""Who may import each folder of the training side (besides its own modules): the entry points import ``train/``,
``train/`` alone the loop. The tools beside training (evaluate, plot, chat, export, ...) read what it writes through
``checkpoint/`` and ``data/``: an arrow from anywhere else runs back up."""


def arrows_back_up(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """``{folder of the training side: the modules that import it but may not}``, the folders without any left out."""
    found = {}
    for folder, allowed in TRAINING_SIDE.items():
        inside = {m for m in graph if m == folder or m.startswith(f"{folder}.")}
        importers = {m for m, deps in graph.items() if deps & inside and m not in inside}
        if strays := sorted(m for m in importers if not any(m == a or m.startswith(f"{a}.") for a in allowed)):
            found[folder] = strays
    return found


def test_no_arrow_runs_back_up_to_the_training_side():
    assert arrows_back_up(file_import_graph()) == {}


def test_the_circle_finder_finds_a_folder_circle_of_files_in_none():
    """The two checks above can fail: evaluate reading training's windows through ``train/`` (a deferred
    import, as it once did) closes train -> plot -> evaluate -> train, though no file reaches itself."""
    graph = file_import_graph()
    graph["astrai_fabric.evaluate.perplexity"].add("astrai_fabric.train.start")
    assert import_circles(graph) == []
    circles = folder_circles(graph)
    assert ("astrai_fabric", ["astrai_fabric.evaluate", "astrai_fabric.plot", "astrai_fabric.train"]) in circles
    assert arrows_back_up(graph) == {"astrai_fabric.train": ["astrai_fabric.evaluate.perplexity"]}


def test_prepare_loads_no_model_code_and_the_loop_no_strategy():
    """A fresh process: ``prepare`` tokenises and writes shards; the loop trains whatever Fabric it is handed."""
    code = (
        "import sys\n"
        "import astrai_fabric.data.prepare\n"
        "heavy = ('astrai_fabric.model', 'astrai_fabric.lora', 'astrai_fabric.checkpoint', 'safetensors',"
        " 'lightning')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "assert not loaded, f'data.prepare loaded {loaded}'\n"
        "import astrai_fabric.loop\n"
        "strategies = ('astrai_fabric.strategy', 'astrai_fabric.parallelize', 'astrai_fabric.parallel.parallelize')\n"
        "loaded = sorted(m for m in sys.modules if m in strategies)\n"
        "assert not loaded, f'loop loaded {loaded}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]


def distributed_imports(path: Path) -> list[int]:
    """The lines of ``path`` that import ``torch.distributed`` (or anything under it), anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
            found.append(node.lineno)
    return found


def test_the_model_imports_no_torch_distributed():
    """model/ asks its seams (a ContextGroup, an ExpertGroup) and ``parallel/`` fills them: no file of it imports
    ``torch.distributed``, at any level."""
    found = {
        str(p.relative_to(PACKAGE)): lines
        for p in (PACKAGE / "model").rglob("*.py")
        if (lines := distributed_imports(p))
    }
    assert found == {}


def test_the_distributed_import_finder_finds_an_injected_import(tmp_path):
    path = tmp_path / "attention.py"
    path.write_text(
        "import torch\n\n\ndef f():\n    from torch.distributed import all_reduce\n    import torch.distributed as d\n"
    )
    assert distributed_imports(path) == [5, 6]


COLLECTIONS = ("dict", "frozenset", "set", "tuple", "list")
"""Calls that build a literal collection (``dict(a=1, ...)``): tables too."""


def _statements(body: list[ast.stmt], scope: str) -> list[tuple[ast.stmt, str]]:
    """Every statement with the kind of scope it stands in (module, class or function)."""
    found = []
    for node in body:
        found.append((node, scope))
        inner = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}
        for field in ("body", "orelse", "finalbody"):
            found += _statements(getattr(node, field, []), inner.get(type(node), scope))
    return found


def unformatted_non_tables(path: Path) -> list[int]:
    """The lines of ``path`` that keep ruff's formatter out (``# fmt: skip``) on something other than a table: a
    literal collection assigned at module or class level, or a decorator (``pytest.mark.parametrize``'s cases)."""
    text = path.read_text()
    statements = _statements(ast.parse(text).body, "module")
    tables = set()
    for node, scope in statements:
        value = getattr(node, "value", None)
        built = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in COLLECTIONS
        collection = built or isinstance(value, ast.Dict | ast.List | ast.Tuple | ast.Set | ast.ListComp | ast.DictComp)
        if isinstance(node, ast.Assign | ast.AnnAssign) and scope != "function" and collection:
            tables.add(node.end_lineno)
        tables.update(d.end_lineno for d in getattr(node, "decorator_list", []))
    marked = [i for i, line in enumerate(text.splitlines(), start=1) if line.rstrip().endswith("# fmt: skip")]
    return [i for i in marked if i not in tables]


def test_ruff_decides_the_layout_except_in_tables():
    roots = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "bench", PACKAGE.parent / "tools"]
    paths = [path for root in roots for path in root.rglob("*.py")]
    found = {str(path.relative_to(PACKAGE.parent)): unformatted_non_tables(path) for path in paths}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_the_table_rule_finds_a_call_kept_from_the_formatter(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('X = {"a": 1}  # fmt: skip\n\n\ndef f():\n    return max(1,\n               2)  # fmt: skip\n')
    assert unformatted_non_tables(path) == [6]
