"""The documentation stays true to the code: the options page is what the dataclass docstrings render, every
troubleshooting message is produced by a test, the data page covers every pipeline option, the README's code map
covers every module, and relative links resolve."""

import dataclasses
import re
from pathlib import Path

import pytest

from astrai_fabric.config import reference
from astrai_fabric.data.prepare import PipelineConfig

ROOT = Path(__file__).parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_options_page_is_generated_from_the_docstrings():
    assert (ROOT / "docs" / "recipes.md").read_text() == reference.render(), "run `make docs`"


def troubleshooting_messages() -> list[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    return re.findall(r"^\| `(.+?)` \|", text, flags=re.MULTILINE)


def test_every_troubleshooting_message_is_produced_by_a_test():
    messages = troubleshooting_messages()
    assert len(messages) > 40
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != "test_docs.py")
    tests = tests.replace("\\", "")  # regular expressions in pytest.raises(match=...) escape brackets
    for message in messages:
        pieces = [re.escape(piece) for piece in message.split("...") if piece.strip()]
        assert re.search(".*?".join(pieces), tests), f"no test checks for {message!r}"


def test_data_page_covers_every_pipeline_option():
    text = (ROOT / "docs" / "data.md").read_text()
    options = [f.name for f in dataclasses.fields(PipelineConfig) if f.name != "sections"]
    assert [name for name in options if not re.search(rf"`(\w+\.)?{name}`", text)] == []


def test_readme_maps_every_module():
    code_map = (ROOT / "README.md").read_text().split("## Map of the code")[1]
    package = ROOT / "astrai_fabric"
    modules = [p for p in package.iterdir() if (p.suffix == ".py" and p.name != "__main__.py") or p.is_dir()]
    named = [p.name + ("/" if p.is_dir() else "") for p in modules if p.name != "__pycache__"]
    assert [name for name in named if name not in code_map and name != "__init__.py"] == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def training_commands(page: Path) -> list[list[str]]:
    """The training command lines of a page's bash blocks, in order (``make train`` is tiny-seq.yaml's)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith("make train"):
            line = "astrai-fabric seq --config recipes/tiny-seq.yaml"
        words = line.removeprefix(".venv/bin/").split()
        if words[:1] == ["astrai-fabric"] and words[1] in ("seq", "sft", "dpo", "grpo"):
            commands.append(words[1:])
    return commands


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "quickstart.md"], ids=lambda p: p.name)
def test_each_documented_fresh_run_has_its_own_ckpt_dir(page):
    # Run in order, a fresh run into a ckpt_dir an earlier command filled would refuse ("already holds ...").
    fresh = [words for words in training_commands(page) if not {"--resume", "--dry_run"} & set(words)]
    assert len(fresh) >= 3
    ckpt_dirs = []
    for words in fresh:
        if "--ckpt_dir" in words:
            ckpt_dirs.append(words[words.index("--ckpt_dir") + 1])
        else:
            recipe = (ROOT / words[words.index("--config") + 1]).read_text()
            ckpt_dirs.append(re.search(r"^ckpt_dir: (\S+)", recipe, flags=re.M)[1])
    assert len(set(ckpt_dirs)) == len(ckpt_dirs), ckpt_dirs


def test_distributed_md_shows_the_composition_table_the_code_decides_by():
    """docs/distributed.md's "What combines" table is ``config.combinations.composition_table()``, as generated."""
    from astrai_fabric.config.combinations import composition_table

    page = (ROOT / "docs" / "distributed.md").read_text()
    begin = "<!-- composition table: astrai_fabric.config.combinations.composition_table() -->\n"
    shown = page[page.index(begin) + len(begin) : page.index("\n<!-- end of composition table -->")]
    assert shown == composition_table()
