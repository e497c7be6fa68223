"""The key a stored evaluation result is found by (``CHECKPOINT/eval/KIND-DIGEST.json``, ``DIGEST`` from
``evaluate.run.job_settings``): every setting that changes a result changes the key, so that evaluating again with
it changed computes the result rather than read the first one back; every other flag is named here, with why it
does not (a new flag fails the first test until it is put in one table or the other)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.config.evaluate import EvaluateArgs
from astrai_fabric.evaluate import perplexity, run
from astrai_fabric.evaluate.perplexity import Scores
from astrai_fabric.evaluate.results import result_path

HARNESS = SimpleNamespace(LM_EVAL_VERSION="0.4.9")
CPU = torch.device("cpu")

CHANGES_RESULT = {  # flag: (another value, the kinds of result it changes); "{a}"/"{b}": two local files or folders
    "tokenizer_path": ("{b}/tokenizer", {"perplexity", "tasks"}),
    "data_root_path": ("{b}/data.jsonl", {"perplexity"}),
    "train_type": ("sft", {"perplexity"}),
    "perplexity_unit": ("records", {"perplexity"}),
    "window_size": (64, {"perplexity"}),
    "stride": (16, {"perplexity"}),
    "data_subset": ("other", {"perplexity"}),
    "data_split": ("test", {"perplexity"}),
    "data_format": ("alpaca", {"perplexity"}),
    "data_columns": ("text=body", {"perplexity"}),
    "bootstrap_iters": (10, {"perplexity"}),
    "tasks": (["hellaswag"], {"tasks"}),
    "num_fewshot": (5, {"tasks"}),
    "limit": (10, {"tasks"}),
    "apply_chat_template": (True, {"tasks"}),
    "max_gen_toks": (16, {"tasks"}),
    "log_samples": (True, {"tasks"}),
    "include_path": ("{b}/tasks", {"tasks"}),
    "precision": ("bf16-true", {"perplexity", "tasks"}),
    "seed": (7, {"perplexity", "tasks"}),
}
CHANGES_NOTHING = {  # flag: (another value, why the result does not depend on it)
    "param_path": ("elsewhere", "the key is kept inside the checkpoint it names"),
    "trust_code": (False, "it allows --include_path, whose files are keyed"),
    "batch_size": (3, "each row is scored alone (right-padded under a causal mask): docs/evaluation.md"),
    "device_type": ("cuda", "through the precision ``auto`` resolves to, which the key holds (tested below)"),
    "output": ("results.json", "a copy of the results elsewhere"),
    "nprocs": (2, "the ranks' scores are gathered into one process's"),
    "num_nodes": (2, "the ranks' scores are gathered into one process's"),
}


@pytest.fixture
def base(tmp_path) -> EvaluateArgs:
    """Both kinds asked for, each local file twice over (``a`` used, ``b`` another one)."""
    for side in "ab":
        shutil.copytree(TINY_MODEL_DIR, tmp_path / side / "tokenizer")
        (tmp_path / side / "data.jsonl").write_text('{"text": "held out"}\n')
        (tmp_path / side / "tasks").mkdir()
        (tmp_path / side / "tasks" / "task.yaml").write_text("task: mine\n")
    a = tmp_path / "a"
    paths = {"tokenizer_path": a / "tokenizer", "data_root_path": a / "data.jsonl", "include_path": a / "tasks"}
    return EvaluateArgs(param_path="ckpt", tasks=["arc_easy"], trust_code=True, **{k: str(v) for k, v in paths.items()})


def keys(args: EvaluateArgs, device: torch.device = CPU, harness=HARNESS) -> dict[str, str]:
    """The file each kind's result is stored as."""
    jobs = run.job_settings(args, harness, device)
    return {kind: result_path(Path("ckpt"), kind, settings).name for kind, settings in jobs}


def changed(args: EvaluateArgs, name: str, value, tmp_path: Path) -> EvaluateArgs:
    if isinstance(value, str):
        value = value.format(a=tmp_path / "a", b=tmp_path / "b")
    return dataclasses.replace(args, **{name: value})


def test_every_flag_is_named_once():
    flags = {field.name for field in dataclasses.fields(EvaluateArgs)}
    assert set(CHANGES_RESULT) | set(CHANGES_NOTHING) == flags
    assert not set(CHANGES_RESULT) & set(CHANGES_NOTHING)


@pytest.mark.parametrize("name", CHANGES_RESULT)
def test_a_setting_that_changes_a_result_changes_its_key(base, tmp_path, name):
    value, kinds = CHANGES_RESULT[name]
    before, after = keys(base), keys(changed(base, name, value, tmp_path))
    assert {kind for kind in before if before[kind] != after[kind]} == kinds


@pytest.mark.parametrize("name", CHANGES_NOTHING)
def test_a_flag_that_changes_no_result_leaves_the_key(base, tmp_path, name):
    assert keys(changed(base, name, CHANGES_NOTHING[name][0], tmp_path)) == keys(base)


FILES = {
    "tokenizer/tokenizer_config.json": {"perplexity", "tasks"},
    "data.jsonl": {"perplexity"},
    "tasks/task.yaml": {"tasks"},
}
"""A file of each local path the key fingerprints, and the kinds of result reading it."""


@pytest.mark.parametrize("path", FILES)
def test_a_file_changed_in_place_changes_the_key(base, tmp_path, path):
    kinds = FILES[path]
    before = keys(base)
    file = tmp_path / "a" / path
    file.write_text(file.read_text() + "\n")
    after = keys(base)
    assert {kind for kind in before if before[kind] != after[kind]} == kinds


def test_the_precision_is_keyed_as_it_resolves_and_lm_evals_version():
    """``auto`` is float32 on CPU and bf16 on CUDA: a CPU result is not read back on CUDA, and an explicit
    ``32-true`` finds the CPU's ``auto`` result. lm-eval's tasks change with its version."""
    args = EvaluateArgs(param_path="ckpt", data_root_path="data.jsonl", tasks=["arc_easy"])
    cuda = torch.device("cuda")
    assert keys(args, CPU) == keys(dataclasses.replace(args, precision="32-true"), CPU)
    assert keys(args, cuda) == keys(dataclasses.replace(args, precision="bf16-true"), CPU)
    assert keys(args, CPU)["perplexity"] != keys(args, cuda)["perplexity"]
    assert keys(args, CPU)["tasks"] != keys(args, cuda)["tasks"]
    newer = SimpleNamespace(LM_EVAL_VERSION="0.5.0")
    assert keys(args, harness=newer) == {**keys(args), "tasks": keys(args, harness=newer)["tasks"]}
    assert keys(args, harness=newer)["tasks"] != keys(args)["tasks"]


def test_another_tokenizer_is_evaluated_again_not_read_back(base, tmp_path, monkeypatch):
    """Through ``evaluate_models``, the model and the scoring stubbed: the same settings read the stored result back;
    another ``--tokenizer_path`` scores again and stores beside it."""
    checkpoint = tmp_path / "run" / "epoch_0_step_1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "meta.json").write_text("{}")
    scored = []

    def score(model, tokenizer, args, progress):
        scored.append(tokenizer.directory)
        return Scores(np.array([2.0]), np.array([1]), "one window")

    monkeypatch.setattr(run, "load_language_model", lambda *args, **kwargs: torch.nn.Linear(1, 1))
    monkeypatch.setattr(perplexity, "score_data", score)
    args = dataclasses.replace(base, param_path=str(checkpoint), tasks=[], bootstrap_iters=0)
    run.evaluate_models(args, CPU)
    run.evaluate_models(args, CPU)
    assert len(scored) == 1, "the same settings scored again: the stored result was not found"
    other = tmp_path / "b" / "tokenizer"
    run.evaluate_models(dataclasses.replace(args, tokenizer_path=str(other)), CPU)
    assert [Path(directory).resolve() for directory in scored[1:]] == [other.resolve()]
    assert len(list((checkpoint / "eval").glob("perplexity-*.json"))) == 2
