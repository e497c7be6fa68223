"""``EvaluateArgs``: the flags of ``astrai-fabric evaluate`` (``evaluate.run_evaluate`` reads them), beside
``TrainArgs`` so that the options page (``config/reference.py``) and the CLI read them without importing the model.

Two kinds of evaluation share one command: perplexity on held-out data (``--data_root_path``) and
lm-evaluation-harness tasks (``--tasks``); either or both. The settings that change a result are
``perplexity_settings()`` and ``task_settings()`` (``evaluate.run.job_settings`` adds the files' fingerprints and
the precision ``auto`` resolves to): a checkpoint evaluated with the same ones is not evaluated again
(``evaluate/results.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from astrai_fabric.config.generate import DEVICE_TYPES
from astrai_fabric.config.train import DataFormat
from astrai_fabric.data.shapes import settings_problems
from astrai_fabric.errors import ConfigError

PerplexityUnit = Literal["windows", "records"]
EvalPrecision = Literal["auto", "32-true", "bf16-true"]
TASK_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]*")
"""A task or group name as lm-eval's registry spells them (letters, digits, ``_ . : -``)."""
MAX_BATCH_SIZE = 1 << 16
MAX_PROCESSES = 1 << 12
MAX_BOOTSTRAP_ITERS = 1_000_000


@dataclass
class EvaluateArgs:
    """``astrai-fabric evaluate SRC``: perplexity on held-out data and lm-evaluation-harness tasks, for one model or
    every checkpoint of a run."""

    # --- what to evaluate ----------------------------------------------------------------------------------------
    param_path: str | None = None
    """SRC: a checkpoint or model directory (ours, AstrAI's, a LoRA checkpoint with its adapter applied, a Hugging
    Face directory), a Hub id ``org/name[@revision]``, or a run's ``ckpt_dir``: each ``epoch_E_step_S`` checkpoint
    in it is evaluated (those already evaluated with the same settings are skipped)."""
    tokenizer_path: str | None = None
    """Tokenizer directory (or Hub id); default: the model's."""

    # --- perplexity ----------------------------------------------------------------------------------------------
    data_root_path: str | None = None
    """Held-out data for perplexity: every source training reads (JSONL, bin shards, and with the ``datasets``
    extra parquet, arrow, CSV, ``save_to_disk``, Hub dataset ids; any documented record shape)."""
    train_type: Literal["seq", "sft"] = "seq"
    """How the data is read and scored, as that train type trains on it: seq scores every token of plain text; sft
    scores the assistant turns of conversations, documents masked apart."""
    perplexity_unit: PerplexityUnit = "windows"
    """``windows``: the training windows exactly (window_size, stride, masks, document boundaries), so the mean
    loss is the run's validation loss weighted by tokens. ``records``: each seq record scored alone from its first
    token, longer ones in rolling windows with the most context (lm-eval's rolling log-likelihood; AstrAI's
    ``scripts/eval/evaluate_ppl.py`` where records fit the window)."""
    window_size: int | None = None
    """Tokens per scored window; default: the model's ``max_position_embeddings`` (as training)."""
    stride: int | None = None
    """``windows``: the first token of each window after the previous one's (default: window_size, each token
    scored once)."""
    data_subset: str | None = None
    """The subset of a ``datasets`` source that has several."""
    data_split: str | None = None
    """The split of a ``datasets`` source; default: ``train``, or its only split."""
    data_format: DataFormat = "auto"
    """The records' shape (``auto``: detected from their fields); see docs/data.md, "Record shapes"."""
    data_columns: str | None = None
    """Other column names mapped to the shape's fields, ``field=column,...``."""
    bootstrap_iters: int = 1000
    """Resamples of the scored units (windows or records) for the 95% interval of the mean loss and perplexity
    (0: no interval)."""

    # --- lm-evaluation-harness -----------------------------------------------------------------------------------
    tasks: list[str] = field(default_factory=list)
    """lm-eval task or group names, comma-separated or the flag repeated (the ``.[eval]`` extra)."""
    num_fewshot: int | None = None
    """Few-shot examples per request; default: each task's own."""
    limit: int | None = None
    """At most this many documents per task (for a quick look; the metrics are then not comparable)."""
    apply_chat_template: bool = False
    """Render each request with the tokenizer's chat template (an instruction-tuned model)."""
    max_gen_toks: int = 256
    """Most tokens generated per request of a generate-until task, unless the task sets its own."""
    log_samples: bool = False
    """Keep each request's inputs and outputs in the results (``eval/*.json``, ``--output``)."""
    include_path: str | None = None
    """A directory of your own task YAMLs. They can import Python (``!function``), so this needs ``--trust_code``
    and is taken from the command line only."""
    trust_code: bool = False
    """Allow ``--include_path`` (command line only)."""

    # --- how ---------------------------------------------------------------------------------------------------
    batch_size: int = 8
    """Windows, records or requests per forward pass (the results do not depend on it)."""
    precision: EvalPrecision = "auto"
    """``32-true``, ``bf16-true``, or ``auto``: bf16-true on CUDA, 32-true on CPU."""
    device_type: str | None = None
    """``cuda`` or ``cpu``; default: cuda when available."""
    seed: int = 1234
    """Seed of few-shot sampling, the bootstrap and any sampled generation (lm-eval's default)."""
    output: str | None = None
    """Also write the results of every model evaluated as one JSON file here."""
    nprocs: int = 1
    """Processes evaluating together on this machine, each with the whole model and its share of the windows,
    records or requests; the results are gathered (as one process computes them). Under torchrun, ``fabric run`` or
    SLURM the launcher decides."""
    num_nodes: int = 1
    """Machines, with ``nprocs`` processes each (torchrun or SLURM start them)."""

    def validate(self) -> None:
        """Every bad value in one ``ConfigError``."""
        problems = []
        if self.param_path is None:
            problems.append("evaluate needs a model: astrai-fabric evaluate SRC (a checkpoint, a run's ckpt_dir, ...)")
        if self.data_root_path is None and not self.tasks:
            problems.append("evaluate needs --data_root_path (perplexity) or --tasks (lm-evaluation-harness), or both")
        positive = {
            "window_size": self.window_size,
            "stride": self.stride,
            "max_gen_toks": self.max_gen_toks,
            "limit": self.limit,
            "batch_size": self.batch_size,
            "nprocs": self.nprocs,
            "num_nodes": self.num_nodes,
        }
        problems += [
            f"{name} must be >= 1, got {value}" for name, value in positive.items() if value is not None and value < 1
        ]
        if self.nprocs > MAX_PROCESSES or self.num_nodes > MAX_PROCESSES:
            problems.append(f"nprocs and num_nodes must be at most {MAX_PROCESSES:,}")
        if self.batch_size > MAX_BATCH_SIZE:
            problems.append(f"batch_size must be at most {MAX_BATCH_SIZE:,}, got {self.batch_size:,}")
        if self.num_fewshot is not None and not 0 <= self.num_fewshot <= 1024:
            problems.append(f"num_fewshot must be between 0 and 1024, got {self.num_fewshot}")
        if not 0 <= self.bootstrap_iters <= MAX_BOOTSTRAP_ITERS:
            problems.append(
                f"bootstrap_iters must be between 0 and {MAX_BOOTSTRAP_ITERS:,}, got {self.bootstrap_iters}"
            )
        if bad := [t for t in self.tasks if not TASK_NAME.fullmatch(t)]:
            problems.append(f"tasks: {bad[0]!r} is not a task name (letters, digits, _ . : -)")
        if self.perplexity_unit == "records" and self.train_type != "seq":
            problems.append("perplexity_unit records scores plain text (train_type seq); sft data is scored in windows")
        if self.include_path is not None and not self.trust_code:
            problems.append(
                "include_path: a task directory can run Python (!function); add --trust_code on the command line to "
                "allow it"
            )
        if self.device_type not in (None, *DEVICE_TYPES):
            problems.append(f"device_type must be cpu or cuda, got {self.device_type!r}")
        if not 0 <= self.seed < 2**32:
            problems.append(f"seed must be between 0 and 2**32 - 1, got {self.seed}")
        problems += settings_problems(self.train_type, self.data_format, self.data_columns)
        if problems:
            raise ConfigError("; ".join(problems))

    def perplexity_settings(self) -> dict[str, Any]:
        """What decides a perplexity result (the data, how it is read and scored, precision), recorded with it."""
        names = (
            "data_root_path",
            "train_type",
            "perplexity_unit",
            "window_size",
            "stride",
            "data_subset",
            "data_split",
            "data_format",
            "data_columns",
            "bootstrap_iters",
            "seed",
            "precision",
            "tokenizer_path",
        )
        return {name: getattr(self, name) for name in names}

    def task_settings(self) -> dict[str, Any]:
        """What decides an lm-eval result, recorded with it."""
        names = (
            "tasks",
            "num_fewshot",
            "limit",
            "apply_chat_template",
            "max_gen_toks",
            "log_samples",
            "include_path",
            "seed",
            "precision",
            "tokenizer_path",
        )
        return {name: getattr(self, name) for name in names}
