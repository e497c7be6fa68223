"""The seams of the checkpoint package, read from the source: its public names import without Lightning, one module
imports safetensors, and it sits in no import cycle (module-level imports, as Python runs them)."""

import ast
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
