"""Only the command line, ``train/`` and ``config/`` read ``TrainArgs`` (``config.train``): every part below takes the
values it reads (numbers, strings, or a small ``*Args`` of its own, built from the flags in ``train/``). Read from the
source, every import counted: top-level, deferred inside a function, under ``TYPE_CHECKING``, relative, by
``importlib``, and the name ``TrainArgs`` itself (in code or a string annotation; a docstring may mention it)."""

import ast
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "astrai_fabric"
CONFIG_TRAIN = "astrai_fabric.config.train"
ALLOWED = ("astrai_fabric.cli", "astrai_fabric.train", "astrai_fabric.config")
"""The modules that may read ``TrainArgs``: these and every module under them."""
EXCEPTIONS: dict[str, str] = {}
"""Any other module allowed to, with the reason (none: ``AstraiLM`` takes keyword arguments of its own, named like
the flags)."""


def package_sources() -> dict[str, tuple[str, bool]]:
    """``{module: (its source, whether it is a package's __init__)}`` for every module of the package."""
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        sources[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
    return sources


def allowed(module: str) -> bool:
    return module in EXCEPTIONS or any(module == name or module.startswith(f"{name}.") for name in ALLOWED)


def is_config_train(name: str) -> bool:
    return name == CONFIG_TRAIN or name.startswith(f"{CONFIG_TRAIN}.")


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` reads from, a relative one resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def names_train_args(text: str) -> bool:
    """Whether a string is an expression naming ``TrainArgs`` (a string annotation; prose does not parse)."""
    try:
        with warnings.catch_warnings():  # prose with backslashes
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return any(isinstance(n, ast.Name) and n.id == "TrainArgs" for n in ast.walk(tree))


def reaches_config_train(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each place ``source`` (of ``module``) imports ``config.train`` or names ``TrainArgs``, as ``line N: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):  # every node: inside functions and ``if TYPE_CHECKING:`` too
        line = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if is_config_train(a.name)]
        elif isinstance(node, ast.ImportFrom):
            origin = absolute(module, is_package, node)
            for alias in node.names:
                if is_config_train(origin) or is_config_train(f"{origin}.{alias.name}") or alias.name == "TrainArgs":
                    found.append(f"{line}: from {origin} import {alias.name}")
        elif isinstance(node, ast.Name) and node.id == "TrainArgs":
            found.append(f"{line}: names TrainArgs")
        elif isinstance(node, ast.Attribute) and node.attr == "TrainArgs":
            found.append(f"{line}: names .TrainArgs")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if is_config_train(node.value):  # importlib.import_module("astrai_fabric.config.train")
                found.append(f"{line}: the string {node.value!r}")
            elif names_train_args(node.value):
                found.append(f"{line}: the annotation {node.value!r}")
    return found


def offenders(sources: dict[str, tuple[str, bool]]) -> dict[str, list[str]]:
    """The modules outside ``ALLOWED`` and ``EXCEPTIONS`` that reach ``config.train``, with where."""
    found = {m: reaches_config_train(m, source, is_package) for m, (source, is_package) in sources.items()}
    return {m: where for m, where in found.items() if where and not allowed(m)}


def report(found: dict[str, list[str]]) -> str:
    lines = [f"  {module}: {'; '.join(where)}" for module, where in sorted(found.items())]
    return "\n".join(
        ["modules outside cli.py, train/ and config/ read TrainArgs (pass them the values they read):", *lines]
    )


def test_only_cli_train_and_config_read_train_args():
    found = offenders(package_sources())
    assert not found, report(found)


def test_the_exceptions_are_modules_with_reasons():
    sources = package_sources()
    assert all(m in sources and reason.strip() for m, reason in EXCEPTIONS.items())


WAYS_IN = {
    "top-level": "from astrai_fabric.config.train import TrainArgs\n",
    "deferred": "def f():\n    from astrai_fabric.config.train import RECIPE_FILE\n    return RECIPE_FILE\n",
    "type-only": "import typing\n\nif typing.TYPE_CHECKING:\n    from astrai_fabric.config.train import X\n",
    "module import": "def f():\n    import astrai_fabric.config.train as flags\n",
    "submodule by name": "from astrai_fabric.config import train\n",
    "relative": "from ..config.train import TrainArgs\n",
    "relative package": "from .. import config\nfrom ..config import train\n",
    "string annotation": "def f(args: 'TrainArgs | None') -> None: ...\n",
    "attribute": "from astrai_fabric import config\n\n\ndef f(args: config.train.TrainArgs) -> None: ...\n",
    "importlib": "import importlib\n\nflags = importlib.import_module('astrai_fabric.config.train')\n",
}


@pytest.mark.parametrize("way", WAYS_IN)
def test_an_import_injected_into_the_read_graph_fails(way):
    """Each way in, added to a module below train/ (``loop/step.py``), fails the test naming that module."""
    sources = package_sources()
    source, is_package = sources["astrai_fabric.loop.step"]
    sources["astrai_fabric.loop.step"] = (source + "\n" + WAYS_IN[way], is_package)
    found = offenders(sources)
    assert list(found) == ["astrai_fabric.loop.step"], found
    assert "\n  astrai_fabric.loop.step: line " in report(found)


def test_allowed_modules_and_mentions_in_prose_pass():
    snippet = WAYS_IN["top-level"]
    for module in ("astrai_fabric.cli", "astrai_fabric.train", "astrai_fabric.train.plan", "astrai_fabric.config"):
        assert offenders({module: (snippet, False)}) == {}
    # A name that only starts like an allowed one is not allowed.
    assert list(offenders({"astrai_fabric.trainer": (snippet, False)})) == ["astrai_fabric.trainer"]
    prose = '"""The flags it reads (``TrainArgs`` documents each)."""\n\nX = "see TrainArgs.validate"\n'
    assert reaches_config_train("astrai_fabric.schedule", prose) == []
