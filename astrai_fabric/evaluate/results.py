"""Evaluation results on disk: ``CHECKPOINT/eval/KIND-DIGEST.json``, one file per kind of evaluation (perplexity,
tasks) and set of settings (``DIGEST``: the first 12 hex digits of the settings' SHA-256), so a checkpoint evaluated
again with the same settings is found done, and other settings sit beside it. Written atomically (a temporary file
renamed), so an interrupted evaluation leaves no half file. Light (json only): ``astrai-fabric plot`` reads them.

A file holds ``{"format": 1, "kind", "settings", "source", "step", "versions", "metrics", "samples"?}``;
``metrics`` maps a name (``perplexity``, ``loss``, or ``TASK/METRIC``) to a number, with ``*_stderr`` or
``*_ci95`` beside it where one was computed.

A file read back is checked field by field (``result_problem``: kinds, ranges, finite numbers, the settings its name's
digest stands for) before anything prints, draws or writes it again: one that fails is not a result of ours, and its
reader says so in one warning naming the file and goes on without it (``evaluate`` evaluates again and stores the
new result over it; ``plot`` leaves it out).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import reprlib
import warnings
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


def read_result(path: Path, unusable: str) -> dict[str, Any] | None:
    """The result in ``path``, or None when there is none or it is not one of ours (``result_problem``): then one
    warning names the file, what is wrong and what the caller does instead (``unusable``: "evaluated again")."""
    if not path.is_file():
        return None
    try:
        result = read_json_object(path, "evaluation result", within=path.parent)  # found by a scan: no link out
    except UserError as err:
        problem = str(err).removeprefix(f"{path}: ")
    else:
        problem = result_problem(result, path.name)
    if problem is not None:
        warnings.warn(f"{path}: not a stored result of ours ({problem}); {unusable}", stacklevel=2)
        return None
    return result


def write_result(path: Path, result: dict[str, Any]) -> None:
    """``result`` as ``path``, whole or not at all."""
    path.parent.mkdir(exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    staging.replace(path)


def checkpoint_results(checkpoint: Path, unusable: str) -> list[dict[str, Any]]:
    """Every result stored in ``checkpoint/eval``, by file name; those that are not ours left out with a warning
    (``read_result``)."""
    folder = checkpoint / EVAL_DIR
    if not folder.is_dir():
        return []
    found = (read_result(path, unusable) for path in sorted(folder.iterdir()) if RESULT_NAME.fullmatch(path.name))
    return [result for result in found if result is not None]


LARGEST_LOSS = 700.0
"""Nats per token past which ``exp`` leaves float64 (a uniform guess over a 151,936-token vocabulary is 11.9):
perplexity refuses to report a larger mean loss, so a stored one is not ours."""
MAX_TEXT_CHARS = 4096
"""A stored path or Hub id (``source``, the data's ``data_root_path``): longer is not one we wrote."""
MAX_METRIC_NAME_CHARS = 256
"""A metric's name, ``TASK/METRIC[FILTER]`` (lm-eval's are tens of characters)."""
MAX_NESTING = 64
"""Levels of lists and objects in a result (lm-eval's logged samples go a few deep)."""
COUNTS = ("tokens", "units")
"""Perplexity's counts: positive integers."""
MEASURES = {"loss": (0.0, LARGEST_LOSS), "perplexity": (1.0, math.exp(LARGEST_LOSS))}
"""Perplexity's measures and the range each lies in (each with its 95% interval, ``NAME_ci95``, where computed)."""


def result_problem(result: dict[str, Any], file_name: str) -> str | None:
    """What makes ``result``, read from a file named ``file_name`` (``KIND-DIGEST.json``), not a result this module
    wrote, or None: the format; the kind and settings its name stands for; the source and step; each metric's kind
    and range (perplexity's by name: a loss in [0, 700], a perplexity >= 1, counts positive integers, an interval a
    pair low <= high; a task's a finite number, a standard error >= 0); and nothing anywhere that is not finite
    (``--output`` writes strict JSON) or nested past ``MAX_NESTING``. Bounded however large the file: values are
    shown through ``reprlib``."""
    kind, _, digest = file_name.removesuffix(".json").partition("-")
    if (value := _non_finite_or_too_deep(result)) is not None:
        return value
    if type(result.get("format")) is not int or result["format"] != RESULT_FORMAT:
        return f"format {_shown(result.get('format'))}, expected {RESULT_FORMAT}"
    if result.get("kind") != kind:
        return f"kind {_shown(result.get('kind'))} where its name says {kind!r}"
    settings = result.get("settings")
    if not isinstance(settings, dict) or settings_digest(settings) != digest:
        return f"settings that are not those its name's digest {digest} stands for"
    if kind == "perplexity" and not _is_text(settings.get("data_root_path")):
        return f"settings' data_root_path {_shown(settings.get('data_root_path'))}, expected a path"
    if not _is_text(result.get("source")):
        return f"source {_shown(result.get('source'))}, expected a path or Hub id"
    step = result.get("step")
    if step is not None and not (type(step) is int and step >= 0):
        return f"step {_shown(step)}, expected a non-negative integer or null"
    metrics = result.get("metrics")
    if not isinstance(metrics, dict) or not metrics:
        return f"metrics {_shown(metrics)}, expected an object of numbers by name"
    return _perplexity_problem(metrics) if kind == "perplexity" else _task_metrics_problem(metrics)


def _perplexity_problem(metrics: dict[str, Any]) -> str | None:
    known = {*COUNTS, *MEASURES, *(f"{name}_ci95" for name in MEASURES)}
    if missing := [name for name in (*MEASURES, *COUNTS) if name not in metrics]:
        return f"metrics without {', '.join(missing)}"
    if unknown := sorted(name for name in metrics if name not in known):
        return f"metrics {_shown(unknown)} perplexity does not write"
    for name in COUNTS:
        if not (type(metrics[name]) is int and metrics[name] >= 1):
            return f"metric {name} {_shown(metrics[name])}, expected a positive integer"
    for name, (low, high) in MEASURES.items():
        if not (_is_number(metrics[name]) and low <= metrics[name] <= high):
            return f"metric {name} {_shown(metrics[name])}, expected a number in [{low:g}, {high:.4g}]"
        interval = metrics.get(f"{name}_ci95")
        if interval is not None and not (
            isinstance(interval, list)
            and len(interval) == 2
            and all(_is_number(end) and low <= end <= high for end in interval)
            and interval[0] <= interval[1]
        ):
            expected = f"a pair [low, high] of numbers in [{low:g}, {high:.4g}]"
            return f"metric {name}_ci95 {_shown(interval)}, expected {expected}"
    return None


def _task_metrics_problem(metrics: dict[str, Any]) -> str | None:
    for name, value in metrics.items():
        if not (len(name) <= MAX_METRIC_NAME_CHARS and name.isprintable() and "/" in name):
            return f"metric name {_shown(name)}, expected TASK/METRIC"
        if not _is_number(value) or ("_stderr" in name and value < 0):
            return f"metric {_shown(name)} {_shown(value)}, expected a finite number" + (
                " >= 0" if "_stderr" in name else ""
            )
    return None


def _non_finite_or_too_deep(result: Any) -> str | None:
    """Where ``result`` holds a number that is not finite (NaN, Infinity, 1e400), or nests past ``MAX_NESTING``;
    walked without recursion (a file may nest as deep as the JSON parser allows)."""
    pending = [(result, 0)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_NESTING:
            return f"nested more than {MAX_NESTING} levels deep"
        if isinstance(value, float) and not math.isfinite(value):
            return f"a number that is not finite ({value})"
        if isinstance(value, dict | list):
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return None


def _is_number(value: Any) -> bool:
    """An int or a float (not a bool) that is finite as a float (an integer past float's range is not)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT_CHARS


def _shown(value: Any) -> str:
    """``value`` for a message, bounded however large it is."""
    return reprlib.repr(value)


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
