"""``astrai-fabric``: the command line. The only module that imports jsonargparse.

    astrai-fabric seq|sft --config recipe.yaml [--flag value ...]

Flags are ``TrainArgs`` fields, flat and spelled as AstrAI spells them; a recipe is a flat YAML of the same keys,
and the command line overrides it. AstrAI's own command lines and configs are accepted unchanged:
``--train_type sft`` instead of the subcommand, ``-c``, bare booleans (``--resume``), ``--no-X`` negations,
``--dry-run``, repeated ``--metrics``, and YAML grouped in AstrAI's sections (``model``, ``data``, ``parallel``,
``training``, ``ckpt``, ``log``; a ``runtime`` section is ignored, as AstrAI's trainer ignores it). Mistakes a user
can fix (``UserError``) print one message and exit with status 2, never a traceback. Anything else is a bug: one line
says so and where its traceback went (a ``crash-*.log`` under ``ckpt_dir`` once that exists, else stderr), exit 1.

A recipe is data: it is read with YAML's safe loader, refusing duplicate keys, aliases and non-string keys, and it
can never name code to run: ``--trust_code``, which opts into import paths outside the package, is taken from the
command line only.

Every subcommand's parser and the exit policy, the project's one jsonargparse seam; the recipe reader and the
spellings made ours are ``config.command_line``'s, what each command does lives in the modules it calls.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ArgumentParser, set_parsing_settings

from astrai_fabric import __version__, hub
from astrai_fabric.config.aliases import ALIASES as OTHER_NAMES
from astrai_fabric.config.command_line import (
    ONE_OF,
    TRAIN_FLAGS,
    Flags,
    normalize,
    one_line,
    read_recipe,
)
from astrai_fabric.config.generate import ChatArgs, GenerateArgs
from astrai_fabric.config.kinds import kind_problem
from astrai_fabric.config.serve import ServeArgs
from astrai_fabric.config.train import COMMAND_LINE_ONLY, READ_BY, TrainArgs, resolved_recipe
from astrai_fabric.config.train_types import TRAIN_TYPES
from astrai_fabric.errors import TrainingError, UserError, keep_traceback

# What this module imports is what a mistaken flag costs before it is refused: nothing here imports torch (a
# second and a half of CPU, tests/test_startup.py); each command imports what it runs inside its function.

TRAIN_COMMANDS = TRAIN_TYPES
OTHER_COMMANDS = ("evaluate", "generate", "chat", "serve", "export", "prepare", "plot", "download")
"""The commands that train nothing (each dispatched by ``_dispatch``); the usage line lists both tuples."""
TRAIN_TYPE_ALIASES = {"online_grpo": "grpo", "online_dpo": "dpo"}
"""AstrAI's train types that are a mode of ours: grpo and dpo are online when their data holds prompts only."""

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def run() -> NoReturn:
    """The console script and ``python -m astrai_fabric``: the CLI as a process of its own, which ends with
    ``main``'s status."""
    sys.exit(main(own_process=True))


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """The CLI on ``argv`` (default: the command line): its exit status. ``own_process``: the process is the CLI's
    (``run``), to end as ``_leave_process_group`` says."""
    global _crash_log_dir
    argv = list(sys.argv[1:] if argv is None else argv)
    _crash_log_dir = None
    try:
        return _dispatch(argv)
    except UserError as err:
        _print_error(err)
        _leave_process_group(own_process)
        return 2
    except TrainingError as err:
        _print_error(err)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during training, or one before it started
        print("astrai-fabric: interrupted; the checkpoints written so far are complete", file=sys.stderr)
        return 130
    except Exception as err:  # anything else is a bug of ours: one line, the traceback kept, exit (never hang)
        if _out_of_memory(err):  # not a bug: the run needs more memory than the machine has
            print(f"astrai-fabric: error: {OUT_OF_MEMORY} ({type(err).__name__})", file=sys.stderr)
            return 1
        where = _keep_traceback(err)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if any("Traceback" in line for line in lines):  # a loader worker's error carries its traceback as text
            lines = [lines[0], lines[-1]]
        summary = " ".join(lines)[:300]
        print(
            f"astrai-fabric: error: internal error, a bug: {type(err).__name__}: {summary} ({where})", file=sys.stderr
        )
        return 1


OUT_OF_MEMORY = (
    "out of memory: the run needs more than this machine has (the plan's parameters line counts the model and its "
    "optimizer state); lower --batch_per_device or --window_size, turn on --gradient_checkpointing, shard with "
    "--parallel_mode fsdp, or train a smaller model"
)


def _out_of_memory(err: Exception) -> bool:
    """Whether ``err`` is an allocation that failed: Python's, torch's CPU allocator's or a device's."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":  # torch's, without importing it
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def _print_error(err: Exception) -> None:
    """One line on stderr; an error every rank raised together (``errors.raised_on_every_rank``) once per machine."""
    if not getattr(err, "quiet", False):
        print(f"astrai-fabric: error: {err}", file=sys.stderr)


def _leave_process_group(own_process: bool) -> None:
    """Leave the process group after a refusal every rank raised together. Tearing gloo down can abort the process
    (exiting with its threads running: ``terminate called without an active exception``) or deadlock it (the DDP
    reducer, freed with the refusal's traceback, destroys the group holding the GIL that gloo's loop thread waits
    for: seen with torch 2.13), so a process of its own ends here with status 2, its output flushed and nothing
    left to write; a caller's process gets the group destroyed."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not (distributed.is_available() and distributed.is_initialized()):
        return
    if own_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    distributed.destroy_process_group()


_crash_log_dir: Path | None = None
"""Where a bug's traceback goes: the run's ``ckpt_dir`` once it exists (set by ``train_command``)."""


def _keep_traceback(err: Exception) -> str:
    """Keep ``err``'s traceback in ``ckpt_dir/crash-HOST-PID.log`` (stderr when there is no ckpt_dir); say where."""
    text = "".join(traceback.format_exception(err))
    log = keep_traceback(text, _crash_log_dir, "crash", f"astrai-fabric {__version__}")
    return f"traceback in {log}; please report it" if log is not None else "traceback above; please report it"


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in TRAIN_COMMANDS:
        return train_command(argv[0], argv[1:])
    if argv and argv[0] == "evaluate":
        return evaluate_command(argv[1:])
    if argv and argv[0] == "generate":
        return generate_command(argv[1:])
    if argv and argv[0] == "chat":
        return chat_command(argv[1:])
    if argv and argv[0] == "serve":
        return serve_command(argv[1:])
    if argv and argv[0] == "export":
        return export_command(argv[1:])
    if argv and argv[0] == "prepare":
        return prepare_command(argv[1:])
    if argv and argv[0] == "plot":
        return plot_command(argv[1:])
    if argv and argv[0] == "download":
        return download_command(argv[1:])
    if argv and argv[0] in ("--version", "-V"):
        print(f"astrai-fabric {__version__}")
        return 0
    train_type = _astrai_train_type(argv)
    if train_type is not None:  # an AstrAI command line: `--train_type sft ...` names the command
        return train_command(TRAIN_TYPE_ALIASES.get(train_type, train_type), argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return 0
    raise UserError(
        f"unknown command {argv[0]!r}; choose one of {', '.join(TRAIN_COMMANDS + OTHER_COMMANDS)} "
        "(see astrai-fabric --help)"
    )


def _top_level_help() -> str:
    lines = [
        f"usage: astrai-fabric {{{','.join(TRAIN_COMMANDS)}}} --config RECIPE.yaml [--flag value ...]",
        f"       astrai-fabric {{{','.join(OTHER_COMMANDS)}}} ARGS [--flag value ...]",
        "",
        "Train AstrAI decoder-only language models on Lightning Fabric.",
        "",
        "commands:",
        "  seq       pretraining: next-token prediction over windows of plain text",
        "  sft       supervised fine-tuning on chat messages (assistant turns trained)",
        "  dpo       direct preference optimization on chosen/rejected pairs (--dpo_loss: ipo, simpo, orpo, ...)",
        "  kto       Kahneman-Tversky optimization on unpaired answers labelled desirable or not",
        "  grpo      group relative policy optimization: scored groups (offline) or sampled and rewarded (online)",
        "  reward_model  a reward model (a score head) on chosen/rejected pairs; scores online grpo/dpo rollouts",
        "  evaluate  perplexity on held-out data and lm-evaluation-harness tasks, of a model or every checkpoint",
        "  generate  sample continuations of prompts from a model or checkpoint",
        "  chat      talk with a model or checkpoint: multi-turn, replies streamed, /reset and /exit",
        "  serve     a model or checkpoint behind OpenAI's and Anthropic's HTTP APIs (the serve extra)",
        "  export    a checkpoint in AstrAI's layout (completing a sharded one) or Hugging Face's (--format hf)",
        "  prepare   tokenise records into AstrAI's bin shards (seq, sft)",
        "  plot      loss, learning rate and throughput of one or more runs, as a PNG",
        "  download  a Hugging Face Hub model (org/name[@revision]) into the cache, for offline runs",
        "",
        "`astrai-fabric COMMAND --help` lists its flags (a train type's: those it reads and the common ones, then the",
        "Hugging Face / TRL names taken for them); `--print_config` prints the resolved recipe.",
    ]
    return "\n".join(lines)


def _astrai_train_type(argv: list[str]) -> str | None:
    """The train type of an AstrAI-style command line, from ``--train_type`` or the ``--config`` file."""
    flags = normalize(argv, TRAIN_FLAGS, check_choices=False)
    for token in flags:
        if token.startswith("--train_type="):
            return token.split("=", 1)[1]
    named: list[tuple[str, str]] = []  # (recipe, its train_type) of each recipe naming one: they must agree
    for i, token in enumerate(flags[:-1]):
        if token != "--config" or flags[i + 1].startswith("--"):  # no path: parse_train_args says so
            continue
        recipe = read_recipe(Path(flags[i + 1]))
        if "train_type" not in recipe:
            continue
        if problem := kind_problem(recipe["train_type"], str):
            raise UserError(f"{flags[i + 1]}: train_type {problem}")
        if named and recipe["train_type"] != named[0][1]:
            raise UserError(f"{flags[i + 1]}: train_type {recipe['train_type']!r} contradicts {named[0][0]}'s")
        named.append((flags[i + 1], recipe["train_type"]))
    return named[0][1] if named else None


# --- training commands -------------------------------------------------------------------------------------------


def build_train_parser(train_type: str, for_help: bool = False) -> ArgumentParser:
    """The parser of ``train_type``'s flags (every flag: AstrAI's command line takes each for every train type);
    ``for_help``: the one ``--help`` prints, listing the flags ``train_type`` reads and the other names it takes."""
    hidden = {flag for flag, readers in READ_BY.items() if train_type not in readers} if for_help else set()
    parser = ArgumentParser(
        prog=f"astrai-fabric {train_type}",
        usage=f"astrai-fabric {train_type} [--config RECIPE.yaml ...] [--flag value ...]",  # not every flag again
        description=f"Train with train_type={train_type}. Every flag can also be a key of the --config recipe."
        + (" The flags only other train types read are accepted too (their --help lists them)." if hidden else ""),
        epilog=_aliases_help(hidden) if for_help else None,
        exit_on_error=False,
    )
    parser.add_argument(
        "--config",
        help="Recipe: a flat YAML of these flags (AstrAI's sectioned YAML works too). Repeat it to merge several in "
        "order, a later file's keys over an earlier's; the flags given here win over every recipe.",
    )
    # --print_config is taken out of the flags before parsing (jsonargparse reserves the name); listed for --help.
    parser.add_argument("--print_config", action="store_true", help="Print the resolved recipe and exit.")
    parser.add_class_arguments(TrainArgs, nested_key=None, as_group=False, skip={"train_type", "config", *hidden})
    return parser


def _aliases_help(hidden: set[str]) -> str:
    """``--help``'s closing paragraph: the other projects' names taken for the flags listed."""
    by_flag: dict[str, list[str]] = {}
    for name, alias in OTHER_NAMES.items():
        if alias.flag not in hidden:
            by_flag.setdefault(alias.flag, []).append(f"--{name}")
    names = "; ".join(f"{', '.join(others)} (--{flag})" for flag, others in by_flag.items())
    return (
        f"Other names taken, read as ours (docs/coming-from-trl.md says where meanings differ): {names}. A name "
        "given with its other (or twice with different values) is refused."
    )


def parse_train_args(
    train_type: str, argv: list[str], notes: list[str] | None = None, origins: dict[str, Path] | None = None
) -> tuple[TrainArgs, bool]:
    """``TrainArgs`` from the recipe and the flags (flags win), and whether ``--print_config`` was given; each other
    project's name read as ours is said in ``notes``; ``origins`` gets the recipe each value a recipe set came from."""
    parser = build_train_parser(train_type, for_help=any(token in ("--help", "-h") for token in argv))
    flags, print_config = [], False
    for token in normalize(argv, TRAIN_FLAGS, notes=notes):
        if token == "--print_config":
            print_config = True
            continue
        if token.startswith("--train_type="):  # AstrAI's way of naming the command
            named = token.removeprefix("--train_type=")
            if TRAIN_TYPE_ALIASES.get(named, named) != train_type:
                raise UserError(f"{token[2:]} contradicts the command {train_type!r}")
            continue
        flags.append(token)
    recipe_paths = _take_recipe_paths(flags)
    base, recipes = None, []
    for recipe_path in recipe_paths:  # each on the one before: a later file's keys win (jsonargparse's, LitGPT's rule)
        recipe = read_recipe(recipe_path, notes)
        if refused := [key for key in COMMAND_LINE_ONLY if key in recipe]:
            raise UserError(f"{recipe_path}: {refused[0]} can only be given on the command line (a recipe is data)")
        named = recipe.pop("train_type", train_type)
        if problem := kind_problem(named, str):
            raise UserError(f"{recipe_path}: train_type {problem}")
        if TRAIN_TYPE_ALIASES.get(named, named) != train_type:
            raise UserError(f"{recipe_path}: train_type is not {train_type!r}, the command given")
        _give_way(base, [key for key, value in recipe.items() if value is not None])
        base = _parse(parser, recipe, namespace=base, source=recipe_path)
        recipes.append((recipe_path, recipe))
    given = [token[2:].partition("=")[0] for token in flags if token.startswith("--") and not token.endswith("=null")]
    _give_way(base, given)
    namespace = _parse(parser, flags, namespace=base)  # the command line's flags over every recipe
    values = {k: v for k, v in namespace.as_dict().items() if k in TRAIN_FLAGS.names and k != "config"}
    if not print_config:  # --print_config prints what was given, to fill in
        for recipe_path, recipe in recipes:
            _check_recipe_kinds(recipe_path, recipe, values)
    if origins is not None:  # the last recipe that set a value the command line left alone
        origins.update({key: path for path, recipe in recipes for key in recipe if key in values and key not in given})
    return TrainArgs(**values, train_type=train_type, config=[str(path) for path in recipe_paths]), print_config


def _give_way(namespace: Any, given: Iterable[str]) -> None:
    """Where a recipe or the command line gives one flag of a ``ONE_OF`` pair and not the other, the other is unset
    in ``namespace`` (the earlier recipes'): ``--warmup_steps 5`` over a recipe's ``warmup_ratio`` replaces it."""
    given = set(given)
    for pair in ONE_OF.values():
        for one, other in (pair, pair[::-1]):
            if namespace is not None and one in given and other not in given:
                namespace[other] = None


def _take_recipe_paths(flags: list[str]) -> list[Path]:
    """Every ``--config PATH`` of ``flags`` (normalized: ``-c`` and ``--config=PATH`` are ``--config PATH``), in
    the order given, taken out of ``flags``."""
    paths = []
    while "--config" in flags:
        i = flags.index("--config")
        if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
            raise UserError("--config needs a recipe path")
        paths.append(Path(flags[i + 1]))
        del flags[i : i + 2]
    return paths


def _check_recipe_kinds(recipe_path: Path, recipe: dict[str, Any], values: dict[str, Any]) -> None:
    """A recipe value the parser let through with the wrong kind (a ``null`` where a number goes, say) named with
    its file: ``TrainArgs.validate`` would say the same without knowing where the value came from."""
    hints = typing.get_type_hints(TrainArgs)
    wrong = [
        f"{key} {problem}"
        for key, value in recipe.items()
        if key in values and values[key] == value and (problem := kind_problem(value, hints[key]))
    ]
    if wrong:
        raise UserError(f"{recipe_path}: {'; '.join(wrong)}")


def train_command(train_type: str, argv: list[str]) -> int:
    global _crash_log_dir
    notes: list[str] = []
    origins: dict[str, Path] = {}
    args, print_config = parse_train_args(train_type, argv, notes, origins)
    if print_config:  # what was given, to fill in: checked when it runs
        print(resolved_recipe(args), end="")
        return 0
    try:
        args.validate()  # at the boundary, once: execute takes validated arguments
    except UserError as err:  # a value a recipe gave is named with its file, as the parser's own refusals are
        files = sorted({str(path) for key, path in origins.items() if re.search(rf"\b{key}\b", str(err))})
        if not files:
            raise
        raise type(err)(f"{', '.join(files)}: {err}") from None
    if notes and os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":  # once per machine
        print(f"astrai-fabric: read as ours: {'; '.join(notes)} (the plan uses our names)", file=sys.stderr)
    _crash_log_dir = Path(args.ckpt_dir)
    if not args.dry_run and os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        # Hub ids fetched before any rank starts (a download outlasts --dist_timeout)
        values = {flag: getattr(args, flag) for flag in hub.HUB_FLAGS}
        for flag, value in hub.pin_hub_flags(values, args.data_subset, args.data_split).items():
            setattr(args, flag, value)
    from astrai_fabric.train import execute  # imports Lightning (5-17 s measured): only when training

    return execute(args, own_process=True, command=[train_type, *argv])[0]


def evaluate_command(argv: list[str]) -> int:
    from astrai_fabric.config.evaluate import EvaluateArgs  # reads data/ (torch): only when evaluating
    from astrai_fabric.evaluate.run import run_evaluate  # torch and the model code: only when evaluating

    values = _parse_with_src(
        "evaluate",
        EvaluateArgs,
        argv,
        "A checkpoint or model directory (a LoRA checkpoint: its "
        "adapter applied), a Hub id, or a run's ckpt_dir (each of its checkpoints).",
    )
    values["tasks"] = [name.strip() for given in values["tasks"] for name in given.split(",") if name.strip()]
    run_evaluate(EvaluateArgs(**values))
    return 0


def generate_command(argv: list[str]) -> int:
    parser = ArgumentParser(prog="astrai-fabric generate", description=GenerateArgs.__doc__, exit_on_error=False)
    parser.add_class_arguments(GenerateArgs, nested_key=None, as_group=False)
    namespace = _parse(parser, normalize(argv, Flags.of(GenerateArgs)))
    from astrai_fabric.generate import run_generate  # torch and the model code: once the flags are read

    run_generate(GenerateArgs(**namespace.as_dict()))
    return 0


def chat_command(argv: list[str]) -> int:
    values = _parse_with_src(
        "chat",
        ChatArgs,
        argv,
        "A checkpoint or model directory: ours or AstrAI's, a LoRA "
        "checkpoint (its adapter merged) or a Hugging Face directory.",
    )
    from astrai_fabric.chat import run_chat  # torch and the model code: once the flags are read

    return run_chat(ChatArgs(**values))


def serve_command(argv: list[str]) -> int:
    values = _parse_with_src(
        "serve",
        ServeArgs,
        argv,
        "A checkpoint or model directory: ours or AstrAI's, a LoRA checkpoint (its adapter merged), a Hugging Face "
        "directory or a Hub id.",
    )
    from astrai_fabric.serve import run_serve  # torch, the model code and the server: once the flags are read

    return run_serve(ServeArgs(**values))


def _parse_with_src(command: str, args_type: type, argv: list[str], src_help: str) -> dict[str, Any]:
    """The flags of a command whose first argument is the model, SRC (chat, evaluate): ``args_type``'s fields, with
    ``param_path`` given as SRC or, as generate takes it, as ``--param_path``."""
    parser = ArgumentParser(prog=f"astrai-fabric {command}", description=args_type.__doc__, exit_on_error=False)
    parser.add_argument("param_path", nargs="?", metavar="SRC", help=src_help)
    parser.add_class_arguments(args_type, nested_key=None, as_group=False, skip={"param_path"})
    flags = [token.removeprefix("--param_path=") for token in normalize(argv, Flags.of(args_type))]
    return _parse(parser, flags).as_dict()


def export_command(argv: list[str]) -> int:
    from astrai_fabric.export import DEFAULT_MAX_SHARD_SIZE, DTYPES, FORMATS, AlreadyComplete, export  # torch

    parser = ArgumentParser(
        prog="astrai-fabric export",
        description="Write a checkpoint or model directory in AstrAI's layout (default: a --sharded_checkpoint "
        "checkpoint completed with optimizer.pt, a Hugging Face directory converted) or in Hugging Face's "
        "(--format hf: what transformers' AutoModelForCausalLM and AutoTokenizer load), or a LoRA adapter in PEFT's "
        "(--format peft), in one process, no GPUs.",
        exit_on_error=False,
    )
    parser.add_argument("checkpoint", help="The checkpoint or model directory to export.")
    parser.add_argument(
        "--format",
        default="astrai",
        choices=list(FORMATS),
        help="astrai (default), hf, or peft (a LoRA checkpoint's adapter for its Hugging Face base).",
    )
    parser.add_argument(
        "--out",
        help="Where to write; default: CHECKPOINT_full (astrai), CHECKPOINT_hf (hf) or CHECKPOINT_peft next to it.",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), help="Cast the weights; default: the checkpoint's dtype.")
    parser.add_argument(
        "--max_shard_size",
        help=f"--format hf: split the weights into shards of at most this size (default {DEFAULT_MAX_SHARD_SIZE}; "
        "GB = 10^9 bytes, GiB = 2^30).",
    )
    parser.add_argument(
        "--merge_lora",
        action="store_true",
        help="A LoRA checkpoint: write the model with its adapter merged into the base (--format hf always does).",
    )
    namespace = _parse(parser, argv)
    source = namespace.checkpoint
    try:
        target = export(
            source,
            namespace.out,
            namespace.format,
            namespace.dtype,
            namespace.max_shard_size,
            merge_lora=namespace.merge_lora,
        )
    except AlreadyComplete as done:  # what was asked holds already: said, exit 0
        print(f"nothing to export: {done}")
        return 0
    print(f"exported {source} -> {target}")
    return 0


def _parse(
    parser: ArgumentParser, given: list[str] | dict[str, Any], *, namespace: Any = None, source: Path | None = None
) -> Any:
    """Flags (a list; onto ``namespace`` when given) or a recipe's mapping (read from ``source``) parsed: the one
    place a parse error becomes the user's one line (jsonargparse raises ArgumentError, and type errors of its
    own), and ``--help`` exits with its status."""
    try:
        if isinstance(given, dict):
            return parser.parse_object(given, namespace=namespace)
        return parser.parse_args(given, namespace=namespace)
    except SystemExit as exit_:  # --help
        raise SystemExit(exit_.code) from None
    except Exception as err:
        message = _suggest_flags(parser, one_line(err))
        raise UserError(f"{source}: {message}" if source is not None else message) from None


UNRECOGNIZED = "unrecognized arguments: "


def _suggest_flags(parser: ArgumentParser, message: str) -> str:
    """jsonargparse's ``unrecognized arguments: --fromat hf`` with the closest flag to each one, spelled as flags
    are (the commands whose flags ``normalize`` does not check: export, prepare, plot; a bare unknown flag)."""
    if not message.startswith(UNRECOGNIZED):
        return message
    known = [option for option in parser._option_string_actions if option.startswith("--")]  # argparse's table
    words = []
    for word in message.removeprefix(UNRECOGNIZED).split(" "):
        flag = word.partition("=")[0]
        close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
        words.append(f"{word} (did you mean {close[0]}?)" if close else word)
    return UNRECOGNIZED + " ".join(words)


def prepare_command(argv: list[str]) -> int:
    description = "Tokenise records into AstrAI's bin shards for seq or sft (AstrAI's pipeline config)."
    parser = ArgumentParser(prog="astrai-fabric prepare", description=description, exit_on_error=False)
    inputs_help = "JSONL, parquet, arrow, CSV or JSON files, directories of them, save_to_disk directories, Hub ids."
    parser.add_argument("inputs", nargs="+", help=inputs_help)
    parser.add_argument("-o", "--output_dir", required=True, help="A new directory for the shards.")
    parser.add_argument(
        "-c", "--config", required=True, action="append", help="Pipeline JSON (AstrAI's PipelineConfig); one only."
    )
    parser.add_argument("--tokenizer_path", help="Tokenizer directory; default: the config's tokenizer_path.")
    parser.add_argument("--batch_size", type=int, help="Accepted for AstrAI command lines; unused.")
    parser.add_argument("--num_proc", type=int, default=1, help="Tokenising processes (the output is the same).")
    parser.add_argument("--resume", action="store_true", help="Continue the killed prepare of this -o.")
    parser.add_argument("--data_subset", help="The subset (configuration) of a datasets source.")
    parser.add_argument("--data_split", help="The split of a datasets source; default: train, or its only split.")
    shapes_help = "The records' shape, as in training: auto, or a seq/sft shape (plain documents are seq)."
    parser.add_argument("--data_format", default="auto", help=shapes_help)
    parser.add_argument("--data_columns", help="field=column,...: a shape's field read from another column.")
    namespace = _parse(parser, argv)
    from astrai_fabric.data.prepare import PipelineConfig, check_shape_flags, prepare  # torch: once flags are read
    from astrai_fabric.tokenizer import Tokenizer

    if len(namespace.config) > 1:  # one pipeline per output directory: nothing to merge (argparse kept the last)
        raise UserError(f"prepare takes one -c/--config, got {len(namespace.config)}: {', '.join(namespace.config)}")
    config = PipelineConfig.from_file(Path(namespace.config[0]))
    check_shape_flags(config, namespace.data_format, namespace.data_columns)  # before a tokenizer is fetched
    tokenizer_path = namespace.tokenizer_path or config.tokenizer_path
    if tokenizer_path is None:
        raise UserError("prepare needs --tokenizer_path (the tokenizer of the model to train), or tokenizer_path in -c")
    tokenizer = Tokenizer.from_dir(hub.resolve_model(tokenizer_path, "--tokenizer_path"))
    inputs = [Path(p) for p in namespace.inputs]
    print(
        prepare(
            inputs,
            Path(namespace.output_dir),
            config,
            tokenizer,
            namespace.num_proc,
            namespace.resume,
            namespace.data_subset,
            namespace.data_split,
            namespace.data_format,
            namespace.data_columns,
        )
    )
    return 0


def download_command(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="astrai-fabric download",
        description="Fetch a Hugging Face Hub model into the cache (HF_HUB_CACHE, else HF_HOME/hub): only what a run "
        "reads (config, safetensors weights, tokenizer, chat template), never pickled weights; then --param_path "
        "org/name works offline (HF_HUB_OFFLINE=1). Gated and private repositories use HF_TOKEN.",
        exit_on_error=False,
    )
    parser.add_argument("repo_id", help="org/name, or org/name@revision (a branch, tag or commit).")
    parser.add_argument("--revision", help="A branch, tag or commit; default: main.")
    parser.add_argument("--local_dir", help="Copy the files into this directory instead of the cache.")
    namespace = _parse(parser, argv)
    folder, from_cache = hub.download(namespace.repo_id, namespace.revision, namespace.local_dir)
    source = hub.portable(folder) or namespace.repo_id
    if from_cache is not None:  # offline, say: nothing was asked of the Hub
        print(f"found in the cache, nothing fetched ({from_cache}): {source} -> {folder}")
    else:
        print(f"downloaded {source} -> {folder}")
    return 0


def plot_command(argv: list[str]) -> int:
    from astrai_fabric.plot import PLOT_FILE, check_output, plot_runs  # matplotlib (~0.7 s) inside: only when plotting

    description = "Loss (train, validation), learning rate and tokens/s against step; runs overlaid; a PNG."
    parser = ArgumentParser(prog="astrai-fabric plot", description=description, exit_on_error=False)
    parser.add_argument("runs", nargs="+", help="Run directories (ckpt_dir), checkpoints or metric.jsonl files.")
    parser.add_argument("-o", "--output", help="The PNG to write; default: plot.png in the first run's directory.")
    namespace = _parse(parser, argv)
    runs = [Path(r) for r in namespace.runs]
    for run in runs:
        if not run.exists():
            raise UserError(f"{run}: not found")
    default = (runs[0] if runs[0].is_dir() else runs[0].parent) / PLOT_FILE
    output = Path(namespace.output) if namespace.output else default
    check_output(output)
    print(f"plot: {plot_runs(runs, output)}")
    return 0


if __name__ == "__main__":
    run()
