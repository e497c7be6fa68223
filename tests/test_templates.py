"""The one bounded renderer of templates read from files (``tokenizer.render_template``): it stops what runs or grows
without end in any thread, renders ordinary templates exactly as Jinja does, and is the only renderer there is."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_layout import module_imports

from astrai_fabric import tokenizer as tokenizer_module
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import save_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.errors import UserError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer, compile_template, render_template

ATTACKS = {
    "nested-ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "rendering took longer than 0.5 s"),
    "recursive-macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "maximum recursion depth exceeded"),
    "doubling-string": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "characters or items is above the template limit"),
    "doubling-literal": ("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(64) %}{% set ns.a = [ns.a, ns.a] %}"
                         "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}", "is above the template limit"),
}  # fmt: skip


def tokenizer_dir(directory: Path, template: str, layout: str) -> Path:
    """The tiny tokenizer with ``template``: inline in AstrAI's layout, in chat_template.jinja in Hugging Face's."""
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((TINY_MODEL_DIR / "tokenizer.json").read_bytes())
    if layout == "astrai":
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    else:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_sentence|>"}))
        (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.mark.parametrize("layout", ["astrai", "huggingface"])
@pytest.mark.parametrize("attack", ATTACKS, ids=str)
def test_a_render_in_a_worker_thread_is_stopped(tmp_path, monkeypatch, attack, layout):
    """No SIGALRM off the main thread: the sandbox's own meter stops the render, with the file named."""
    monkeypatch.setattr(tokenizer_module, "RENDER_SECONDS", 0.5)
    template, reason = ATTACKS[attack]
    tokenizer = Tokenizer.from_dir(tokenizer_dir(tmp_path / "t", template, layout))
    raised: list[BaseException] = []

    def render() -> None:
        try:
            tokenizer.render_chat([{"role": "user", "content": "hi"}], where="a.jsonl:1")
        except BaseException as err:  # noqa: BLE001 - whatever it is, the test reports it
            raised.append(err)

    worker = threading.Thread(target=render, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "the render was not stopped"
    assert len(raised) == 1 and isinstance(raised[0], UserError), raised
    message = str(raised[0])
    name = "tokenizer_config.json" if layout == "astrai" else "chat_template.jinja"
    assert f"t/{name}: chat_template failed on a.jsonl:1: " in message and reason in message, message
    assert "\n" not in message


ORDINARY = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.revindex }} "
    "{{ m['role'] ~ ':' ~ m.content }}|{% else %}none{% endfor %}",
    "{% for k, v in {'b': 1, 'a': [1, (2, 3)]} | dictsort %}{{ k }}={{ v }};{% endfor %}"
    "{% set a, b = (1, 2) %}{{ a + b }}",
    "{% for item in [1, [2, [3, 4]], 5] recursive %}{% if item is iterable %}({{ loop(item) }}){% else %}{{ item }}"
    "{% endif %}{% endfor %}",
    "{% macro box(x, w=3) %}[{{ x | center(w) }}{{ caller() if caller }}]{% endmacro %}{{ box('a') }}"
    "{% call box('b', 5) %}!{% endcall %}{% set block %}{{ messages | length }} {{ 'x' * 3 }}{% endset %}{{ block }}"
    "{% filter upper %}{{ messages[0].content }}{% endfilter %}",
    "{% set ns = namespace(n=0, s='') %}{% for m in messages if m.role != 'system' %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.s = ns.s + m.content[:2] %}{% endfor %}{{ ns.n }} {{ ns.s }} {{ '%s-%d' % ('a', 3) }} "
    "{{ [1, 2] + [3] }} {{ (messages | map(attribute='role') | list) }} {{ range(3) | sum }} {{ 2 ** 10 }}",
]


@pytest.mark.parametrize("huggingface", [False, True], ids=["jinja-defaults", "transformers"])
def test_ordinary_templates_render_as_jinja_renders_them(huggingface):
    """Loops (``loop.*``, ``else``, filters, recursion), unpacking, literals, macros, ``caller``, block ``set``,
    ``{% filter %}``, operators: what the meter routes through its hooks renders as Jinja's own sandbox renders."""
    settings = {"trim_blocks": True, "lstrip_blocks": True} if huggingface else {}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
    ]
    for template in ORDINARY:
        expected = ImmutableSandboxedEnvironment(**settings).from_string(template).render(messages=messages)
        ours = render_template(compile_template(template, "t", huggingface), {"messages": messages}, "t")
        assert ours == expected, template
        compiled, result = compile_template(template, "t", huggingface), []
        worker = threading.Thread(
            target=lambda t=compiled, out=result: out.append(render_template(t, {"messages": messages}, "t"))
        )
        worker.start()
        worker.join()
        assert result == [expected]


def test_only_the_tokenizer_module_imports_jinja():
    """One renderer: every other module renders through ``tokenizer.render_template`` (export's probe included)."""
    imports = module_imports(top_level=False).items()
    assert sorted(m for m, names in imports if any(n.split(".")[0] == "jinja2" for n in names)) == [
        "astrai_fabric.tokenizer"
    ]


def test_export_copies_a_hugging_face_tokenizer_config_as_it_is(tmp_path):
    """The loader's layout rule decides what export rewrites: a Hugging Face config naming only ``sep_token`` was
    rendered as Hugging Face's in training, so it is exported unchanged (not rewritten as AstrAI's)."""
    ckpt = tokenizer_dir(tmp_path / "tok", "{% for m in messages %}\n{{ m['content'] }}\n{% endfor %}", "astrai")
    config = {"sep_token": "<|im_end|>", "chat_template": "{% for m in messages %}\n{{ m['content'] }}\n{% endfor %}"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(ckpt).layout == "huggingface"
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
    files = {n: ckpt / n for n in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(tmp_path / "model", model.state_dict(), model.config.to_dict(), files=files)
    assert main(["export", str(tmp_path / "model"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == config
