"""Commands that train nothing start without what only training uses: ``--help`` (top level and each command's,
``evaluate``'s too), ``generate``, ``chat``, ``export`` and ``prepare`` import no Lightning, none of torch.distributed
beyond what ``import torch`` loads itself (no FSDP, DTensor, distributed checkpoint), no torch._dynamo, transformers,
matplotlib or sympy. Each of those costs 0.5-5 s of CPU before any work (docs/performance.md, Start-up)."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
        [command, "--help"] for command in ("evaluate", "generate", "chat", "export", "prepare", "plot")
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
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(FORBIDDEN), json.dumps(helps + work)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
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
