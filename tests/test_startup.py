"""Commands that train nothing start without what only training uses: ``--help`` (top level and each command's,
``evaluate``'s and ``serve``'s too), ``generate``, ``chat``, ``export`` and ``prepare`` import no Lightning, none of
torch.distributed beyond what ``import torch`` loads itself (no FSDP, DTensor, distributed checkpoint), no
torch._dynamo, transformers, matplotlib or sympy. Each of those costs 0.5-5 s of CPU before any work
(docs/performance.md, Start-up)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from astrai_fabric.assets import SFT_DATA_DIR, TINY_MODEL_DIR
from astrai_fabric.checkpoint import save_checkpoint
from astrai_fabric.config import ModelConfig
from astrai_fabric.model import AutoRegressiveLM

FORBIDDEN = (
    "lightning",
    "torch._dynamo",
    "torch._inductor",
    "transformers",
    "matplotlib",
    "sympy",
    "datasets",
    "pyarrow",
    "pandas",
    "trl",
)
"""Module name prefixes (``lightning`` covers lightning_fabric and lightning_utilities too)."""

CHILD = """
import contextlib, io, json, sys
import torch
own = {m for m in sys.modules if m.startswith("torch.distributed.")}
from astrai_fabric.cli import main
forbidden, steps, seen = tuple(json.loads(sys.argv[1])), json.loads(sys.argv[2]), set()
report = {}
for argv in steps:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # a command's --help
            code = exit_.code
    if argv[0] == "chat" and code == 2 and "unknown command" in err.getvalue():
        continue  # chat is being added beside this test; its absence is not what this checks
    assert code == 0, (argv, err.getvalue())
    new = {m for m in sys.modules if m.startswith(forbidden) or m.startswith("torch.distributed.") and m not in own}
    step = " ".join(a.rpartition("/")[2] for a in argv)  # paths by their last part
    report[step] = sorted(new - seen)  # the first step that imported each
    seen |= new
print(json.dumps(report))
"""


def child_report(script: str, *arguments: object) -> Any:
    """What ``script``, run in a fresh interpreter with ``arguments`` as JSON, printed as JSON on its last line."""
    result = subprocess.run(
        [sys.executable, "-c", script, *map(json.dumps, arguments)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_commands_that_train_nothing_import_nothing_only_training_uses(tmp_path):
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    ckpt = save_checkpoint(
        tmp_path / "ckpt", model.state_dict(), model.config.to_dict(), files=files, meta={"train_type": "seq"}
    )
    records = (SFT_DATA_DIR / "tasks.jsonl").read_text(encoding="utf-8").splitlines()[:4]
    (tmp_path / "chats.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    (tmp_path / "chat.json").write_text(
        '{"input": {"sections": [{"field": "messages", "action": "$role", '
        '"template": true}]}, "mask": {"assistant": "train"}}'
    )
    helps = [["--help"]] + [
        [command, "--help"] for command in ("evaluate", "generate", "chat", "serve", "export", "prepare", "plot")
    ]
    work = [
        ["generate", "--param_path", str(ckpt), "--chat", "false", "--prompt", "In the", "--max_new_tokens", "2"],
        ["export", str(ckpt)],  # complete already: said, nothing written (it used to import Lightning to say so)
        ["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")],
        [
            "prepare",
            str(tmp_path / "chats.jsonl"),
            "-o",
            str(tmp_path / "shards"),
            "-c",
            str(tmp_path / "chat.json"),
            "--tokenizer_path",
            "bundled:tiny",
        ],
    ]
    report = child_report(CHILD, FORBIDDEN, helps + work)
    assert {step: modules[:6] for step, modules in report.items() if modules} == {}
    assert (tmp_path / "hf" / "model.safetensors").is_file() and any((tmp_path / "shards").iterdir())
    assert not (Path(f"{ckpt}_full")).exists()


def test_plot_spells_the_metric_file_as_the_run_writes_it():
    """plot.py names metric.jsonl itself rather than import astrai_fabric.metrics (torch.distributed.tensor)."""
    from astrai_fabric import metrics, plot

    assert plot.METRIC_FILE == metrics.METRIC_FILE


def test_evaluation_results_spell_checkpoint_names_as_runs_write_them():
    """evaluate/results.py (read by plot) names checkpoints itself rather than import astrai_fabric.checkpoint."""
    from astrai_fabric.checkpoint import directory
    from astrai_fabric.evaluate import results

    assert results.CHECKPOINT_NAME.pattern == directory.CHECKPOINT_NAME.pattern


MISTAKES_CHILD = """
import contextlib, io, json, sys
from astrai_fabric.cli import main
report = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    report.append([code, err.getvalue().strip(), "torch" in sys.modules])
print(json.dumps(report))
"""


def test_a_flag_or_recipe_mistake_is_refused_before_torch_is_imported(tmp_path):
    """A mistake in the flags or a recipe (an unknown flag, another project's name given with ours, a value out of
    range, a recipe's unknown key) exits 2 in a process that never imported torch: refused in a fraction of a second
    rather than after torch's import (bench/startup.py's table)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  param_path: m\ntraining:\n  learnig_rate: 1.0e-3\n")
    mistakes = [
        ["sft", "--learning_rat", "1e-3"],
        ["sft", "--logging_dir", "x"],
        ["sft", "--lr", "1e-3", "--max_lr", "2e-4"],
        ["seq", "--param_path", "m", "--data_root_path", "d", "--warmup_ratio", "2"],
        ["dpo", "-c", str(recipe)],
    ]
    report = child_report(MISTAKES_CHILD, mistakes)
    assert [(code, torch_imported) for code, _, torch_imported in report] == [(2, False)] * len(mistakes), report
    assert "warmup_ratio must be in [0, 1], got 2.0" in report[3][1] and "learnig_rate" in report[4][1]


def test_what_the_flags_spell_out_to_stay_light_equals_its_source():
    """config/ spells out two values rather than import their modules (data/ and torch) when flags are read."""
    from astrai_fabric.config.train import DATA_FORMATS
    from astrai_fabric.config.train_checks import FLOAT32_MAX
    from astrai_fabric.data.shapes import DATA_FORMATS as SHAPES_DATA_FORMATS

    assert DATA_FORMATS == SHAPES_DATA_FORMATS
    assert FLOAT32_MAX == torch.finfo(torch.float32).max
