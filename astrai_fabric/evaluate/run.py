"""``astrai-fabric evaluate SRC``: what SRC names (one model, or every checkpoint of a run), each loaded once and
evaluated (perplexity on ``--data_root_path``, lm-eval ``--tasks``), the results printed as a table, stored in each
checkpoint's ``eval/`` (``results.py``; a checkpoint already evaluated with the same settings is read, not
evaluated again) and, with ``--output``, written as one JSON file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from astrai_fabric import __version__, assets, hub
from astrai_fabric.checkpoint import CONFIG_FILE, META_FILE, checkpoint_step, complete_checkpoints, load_language_model
from astrai_fabric.checkpoint.directory import CHECKPOINT_NAME
from astrai_fabric.config.evaluate import EvaluateArgs
from astrai_fabric.errors import ConfigError, UserError, raised_on_every_rank
from astrai_fabric.evaluate import perplexity
from astrai_fabric.evaluate.perplexity import evaluation_world
from astrai_fabric.evaluate.results import flat_metrics, read_result, result_path, write_result
from astrai_fabric.tokenizer import Tokenizer


@dataclasses.dataclass
class Target:
    """One model to evaluate."""

    directory: Path
    shown: str
    """How SRC named it (a Hub id as ``org/name@commit``)."""
    step: int | None
    """The optimizer step of a run's checkpoint (its name says), else None."""
    stores_results: bool
    """A checkpoint of ours or AstrAI's (meta.json) outside the Hub cache: results go into its ``eval/``."""


UNUSABLE = "evaluated again"
"""What ``evaluate`` does with a stored result that is not one of ours (``results.read_result``): a tampered or
damaged file is no reason to stop; evaluating again is what it would do without one, and a checkpoint of a run
stores the new result over it."""

LAUNCHER_VARIABLES = ("LT_CLI_USED", "LOCAL_WORLD_SIZE", "SLURM_NTASKS")
"""Set by ``fabric run``, torchrun and SLURM: the processes may exist already, and Lightning's environments say how
many (``strategy.resolve_topology``)."""


def run_evaluate(args: EvaluateArgs) -> list[dict[str, Any]]:
    """Evaluate every target of ``args.param_path``; return each one's results (``{"source", "step", "kind",
    "metrics", ...}``; on rank 0 where several processes evaluate together)."""
    args.validate()
    if args.nprocs == 1 and args.num_nodes == 1 and not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return evaluate_models(args, _device(args))  # one process: Lightning is not even imported
    _checked_output(args.output)  # the mistakes found before any rank starts (each rank checks again: _agreed)
    evaluation_targets(args.param_path)  # a Hub id fetched here, once, before the ranks read the cache
    if args.tasks:
        _harness()
    from astrai_fabric.strategy import evaluation_fabric  # Lightning (5-17 s): only for several processes

    fabric = evaluation_fabric(args.nprocs, args.num_nodes, args.device_type)
    if fabric.world_size == 1 or os.environ.get("LT_CLI_USED") == "1":  # under `fabric run` the group exists
        return evaluate_models(args, fabric.device)
    return fabric.launch(lambda fabric: evaluate_models(args, fabric.device))  # starts the local ranks, or joins


def evaluate_models(args: EvaluateArgs, device: torch.device) -> list[dict[str, Any]]:
    """The evaluation on this process (one of ``evaluation_world()``'s ranks, each scoring its share): rank 0 says
    what happens, decides what is done already, and stores and prints the results."""
    output, targets, harness = _agreed(
        lambda: (
            _checked_output(args.output),
            evaluation_targets(args.param_path),
            _harness() if args.tasks else None,  # a missing extra is said before any model loads
        ),
        device,
    )
    dtype = _dtype(args, device)
    rank, world_size = evaluation_world()
    say = print if rank == 0 else _silent
    jobs = job_settings(args, harness, device)
    what = " and ".join(
        f"perplexity ({args.train_type}, {args.perplexity_unit}) on {args.data_root_path}"
        if kind == "perplexity"
        else f"lm-eval {harness.LM_EVAL_VERSION} tasks {', '.join(args.tasks)}"
        for kind, _ in jobs
    )
    processes = f"{world_size} processes" if world_size > 1 else "1 process"
    say(
        f"evaluate: {len(targets)} model(s) from {args.param_path}: {what}; {processes}, {device.type}, {dtype}",
        flush=True,
    )
    collected = []
    for number, target in enumerate(targets, start=1):
        say(f"[{number}/{len(targets)}] {target.shown}" + (f" (step {target.step})" if target.step else ""), flush=True)
        found = _from_rank_zero(
            {kind: read_result(result_path(target.directory, kind, settings), UNUSABLE) for kind, settings in jobs}
            if rank == 0
            else None
        )
        if target.stores_results and all(found.values()):
            say("  evaluated already with these settings: read from eval/", flush=True)
            results = list(found.values())
        else:
            results = _evaluate_target(target, jobs, found, args, device, dtype, harness, say)
        for result in results:
            say(_table(result["kind"], result["metrics"]), flush=True)
        collected += results
    if output is not None and rank == 0:
        output.write_text(json.dumps({"results": collected}, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        say(f"results: {output}")
    return collected


def job_settings(args: EvaluateArgs, harness: Any, device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    """Each evaluation asked for, ``(kind, the settings its result depends on)``: the flags that change it, with the
    local files it reads named absolutely and fingerprinted (a file changed or another one at the same relative
    path is evaluated again), the precision ``auto`` resolves to on ``device`` (bf16 on CUDA, float32 on CPU), and
    lm-eval's version (its tasks change with it). tests/test_evaluate_key.py names every flag that does not."""
    jobs, common = [], {"tokenizer_path": source_identity(args.tokenizer_path), "precision": _precision(args, device)}
    if args.data_root_path is not None:
        data = {"data_root_path": source_identity(args.data_root_path)}
        jobs.append(("perplexity", {**args.perplexity_settings(), **common, **data}))
    if args.tasks:
        tasks = {"include_path": source_identity(args.include_path), "lm_eval": harness.LM_EVAL_VERSION}
        jobs.append(("tasks", {**args.task_settings(), **common, **tasks}))
    return jobs


MAX_FINGERPRINTED_FILES = 100_000


def source_identity(path_or_id: str | None) -> str | None:
    """A local path as its absolute form and a fingerprint of its files (names, sizes, modification times; at most
    ``MAX_FINGERPRINTED_FILES``), ``path#sha256:DIGEST``; a Hub id or nothing as given (pin ``@revision`` to have a
    newer commit evaluated again)."""
    if path_or_id is None or hub.is_hub_id(path_or_id):
        return path_or_id
    path = assets.resolve(path_or_id).resolve()
    if not path.exists():
        return str(path)  # the reader says what is missing
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files[:MAX_FINGERPRINTED_FILES]:
        stat = file.stat()
        digest.update(
            f"{file.relative_to(path) if file != path else file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
        )
    return f"{path}#sha256:{digest.hexdigest()[:16]}"


T = TypeVar("T")


def _agreed(read: Callable[[], T], device: torch.device) -> T:
    """``read()`` on every rank, one rank's refusal every rank's: the others would wait for it in the next collective
    (a checkpoint one machine cannot see, say). Shown once per machine where every rank refused alike."""
    rank, world_size = evaluation_world()
    if world_size == 1:
        return read()
    try:
        value, error = read(), None
    except UserError as err:
        value, error = None, err
    failed = torch.tensor(float(error is not None), device=device)
    torch.distributed.all_reduce(failed)
    if error is not None:
        raise raised_on_every_rank(error, int(os.environ.get("LOCAL_RANK", rank))) if failed == world_size else error
    if failed:
        raise UserError(f"{int(failed)} other rank(s) could not start the evaluation (their messages say why)")
    return value


def _silent(*_: Any, **__: Any) -> None:
    """``print`` on ranks other than 0: one voice."""


def _from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (what is stored already: every rank must take the same branch)."""
    if evaluation_world()[1] == 1:
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def evaluation_targets(source: str) -> list[Target]:
    """A model directory or Hub id is one target; a run's ckpt_dir each of its complete checkpoints, oldest first."""
    directory = hub.resolve_model(source, "SRC")
    if not directory.exists():
        raise UserError(f"SRC {source}: not found (expected a checkpoint, a model directory or a run's ckpt_dir)")
    pinned = hub.portable(directory)
    if (directory / CONFIG_FILE).is_file():
        step = checkpoint_step(directory) if CHECKPOINT_NAME.match(directory.name) else None
        stores = (directory / META_FILE).is_file() and pinned is None
        return [Target(directory, pinned or source, step, stores)]
    checkpoints = complete_checkpoints(directory) if directory.is_dir() else []
    if not checkpoints:
        raise UserError(
            f"SRC {source}: neither a model directory (no config.json) nor a run's ckpt_dir (no complete "
            "epoch_E_step_S checkpoint in it)"
        )
    return [Target(path, str(path), checkpoint_step(path), True) for path in checkpoints]


def _evaluate_target(
    target: Target,
    jobs: list,
    found: dict,
    args: EvaluateArgs,
    device: torch.device,
    dtype: torch.dtype,
    harness: Any,
    say: Callable[..., None],
) -> list[dict[str, Any]]:
    """Load ``target`` once and run the jobs not found done; store each result (rank 0) as soon as it is complete."""
    model = load_language_model(target.directory, dtype=dtype, command="evaluate").to(device).eval()
    tokenizer_dir = (
        hub.resolve_model(args.tokenizer_path, "tokenizer_path") if args.tokenizer_path else target.directory
    )
    tokenizer, _ = Tokenizer.from_dir_if_present(tokenizer_dir)
    if args.tokenizer_path and tokenizer is None:
        tokenizer = Tokenizer.from_dir(tokenizer_dir)  # its one-line reason
    progress = sys.stderr.isatty() and evaluation_world()[0] == 0
    results = []
    for kind, settings in jobs:
        path = result_path(target.directory, kind, settings)
        if target.stores_results and found[kind] is not None:
            results.append(found[kind])
            continue
        began = time.perf_counter()
        if kind == "perplexity":
            scores = perplexity.score_data(model, tokenizer, args, progress)
            output = perplexity.summarize(scores, args.bootstrap_iters, args.seed)
            extra = {"data": scores.description}
        else:
            if tokenizer is None:
                raise UserError(f"tasks: {target.shown} holds no tokenizer (pass --tokenizer_path)")
            lm = harness.AstraiFabricLM(
                model,
                tokenizer,
                batch_size=args.batch_size,
                max_gen_toks=args.max_gen_toks,
                seed=args.seed,
                progress=progress,
            )
            output = harness.run_tasks(lm, args.tasks, args.task_settings())
            extra = {"lm_eval": output}
        result = {
            "format": 1,
            "kind": kind,
            "source": target.shown,
            "step": target.step,
            "settings": settings,
            "metrics": flat_metrics(kind, output),
            "seconds": round(time.perf_counter() - began, 3),
            "versions": {
                "astrai_fabric": __version__,
                "torch": torch.__version__,
                **({"lm_eval": harness.LM_EVAL_VERSION} if kind == "tasks" else {}),
            },
            **extra,
        }
        if target.stores_results and evaluation_world()[0] == 0:
            write_result(path, result)
            say(f"  stored: {path}", flush=True)
        results.append(result)
    return results


def _harness() -> Any:
    """``evaluate.harness``, or the one line naming the extra that brings lm-eval."""
    try:
        from astrai_fabric.evaluate import harness
    except ModuleNotFoundError as err:
        if err.name is None or not err.name.startswith("lm_eval"):
            raise
        raise UserError("--tasks needs lm-evaluation-harness: pip install 'astrai-fabric[eval]'") from None
    return harness


def _device(args: EvaluateArgs) -> torch.device:
    if args.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("evaluate: --device_type cuda, but no CUDA device is available here")
    return torch.device(args.device_type or ("cuda" if torch.cuda.is_available() else "cpu"))


def _precision(args: EvaluateArgs, device: torch.device) -> str:
    """``--precision``: ``auto`` is bf16-true on CUDA (as training), 32-true on CPU."""
    return args.precision if args.precision != "auto" else ("bf16-true" if device.type == "cuda" else "32-true")


def _dtype(args: EvaluateArgs, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if _precision(args, device) == "bf16-true" else torch.float32


def _checked_output(output: str | None) -> Path | None:
    if output is None:
        return None
    path = Path(output)
    if path.is_dir():
        raise UserError(f"--output {path}: is a directory; name the JSON file to write")
    if not path.parent.is_dir():
        raise UserError(f"--output {path}: the directory {path.parent} does not exist")
    return path


HEADER = ("task", "metric", "value", "stderr or 95% interval")


def _table(kind: str, metrics: dict[str, Any]) -> str:
    """``task  metric  value  stderr`` rows: perplexity's loss and perplexity with their 95% interval, then each
    lm-eval metric with its standard error."""
    rows = []
    if kind == "perplexity":
        for name in ("loss", "perplexity"):
            interval = metrics.get(f"{name}_ci95")
            spread = f"95% [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else ""
            rows.append(("perplexity", name, f"{metrics[name]:.4f}", spread))
        rows.append(("perplexity", "tokens", f"{metrics['tokens']:,}", ""))
    else:
        for name, value in metrics.items():
            if name.endswith("_stderr") or "_stderr[" in name:
                continue
            task, _, metric = name.partition("/")
            stderr = metrics.get(name.replace(metric, _stderr_name(metric)))
            rows.append((task, metric, f"{value:.4f}", f"± {stderr:.4f}" if isinstance(stderr, float) else ""))
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(4)]
    lines = [HEADER, *rows]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _stderr_name(metric: str) -> str:
    """lm-eval's name for ``metric``'s standard error: ``acc_stderr``, ``acc_stderr[filter]``."""
    name, bracket, rest = metric.partition("[")
    return f"{name}_stderr{bracket}{rest}"
