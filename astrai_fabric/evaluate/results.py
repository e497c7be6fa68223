"""Evaluation results on disk: ``CHECKPOINT/eval/KIND-DIGEST.json``, one file per kind of evaluation (perplexity,
tasks) and set of settings (``DIGEST``: the first 12 hex digits of the settings' SHA-256), so a checkpoint evaluated
again with the same settings is found done, and other settings sit beside it. Written atomically (a temporary file
renamed), so an interrupted evaluation leaves no half file. Light (json only): ``astrai-fabric plot`` reads them.

A file holds ``{"format": 1, "kind", "settings", "source", "step", "versions", "metrics", "samples"?}``;
``metrics`` maps a name (``perplexity``, ``loss``, or ``TASK/METRIC``) to a number, with ``*_stderr`` or
``*_ci95`` beside it where one was computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from astrai_fabric.errors import UserError
from astrai_fabric.json_files import read_json_object

EVAL_DIR = "eval"
RESULT_FORMAT = 1
RESULT_NAME = re.compile(r"(perplexity|tasks)-[0-9a-f]{12}\.json")
CHECKPOINT_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")
"""``checkpoint.directory.CHECKPOINT_NAME``, spelled here (tests/test_startup.py checks they agree): importing
``astrai_fabric.checkpoint`` loads torch and safetensors, which ``astrai-fabric plot`` has no use for."""


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def result_path(checkpoint: Path, kind: str, settings: dict[str, Any]) -> Path:
    return checkpoint / EVAL_DIR / f"{kind}-{settings_digest(settings)}.json"


def read_result(path: Path) -> dict[str, Any] | None:
    """The result in ``path``, or None when there is none or it is not one of ours (it is then evaluated again)."""
    if not path.is_file():
        return None
    try:
        result = read_json_object(path, "evaluation result")
    except UserError:
        return None
    if result.get("format") != RESULT_FORMAT or not isinstance(result.get("metrics"), dict):
        return None
    return result


def write_result(path: Path, result: dict[str, Any]) -> None:
    """``result`` as ``path``, whole or not at all."""
    path.parent.mkdir(exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    staging.replace(path)


def checkpoint_results(checkpoint: Path) -> list[dict[str, Any]]:
    """Every result stored in ``checkpoint/eval``, by file name."""
    folder = checkpoint / EVAL_DIR
    if not folder.is_dir():
        return []
    found = (read_result(path) for path in sorted(folder.iterdir()) if RESULT_NAME.fullmatch(path.name))
    return [result for result in found if result is not None]


def flat_metrics(kind: str, output: dict[str, Any]) -> dict[str, float]:
    """A result's numbers by one name each: perplexity's as they are; lm-eval's ``{task: {"acc,none": v}}`` as
    ``task/acc`` (the filter named where it is not ``none``), the standard errors as ``task/acc_stderr``."""
    if kind == "perplexity":
        return output
    flat: dict[str, float] = {}
    for task, metrics in output.get("results", {}).items():
        for key, value in metrics.items():
            name, _, filter_name = key.partition(",")
            if not isinstance(value, int | float) or isinstance(value, bool) or not filter_name:
                continue
            suffix = "" if filter_name == "none" else f"[{filter_name}]"
            flat[f"{task}/{name}{suffix}"] = value
    return flat
