"""The fuzz tier's parts (tests/test_fuzz.py, tests/test_fuzz_found.py): Hypothesis strategies of hostile inputs, the
fork server that runs each through the real CLI, and the error promise each outcome must keep.

Strategies start from a valid base (the bundled tiny model, tokenizer and data, and the checkpoints a 1-step run writes
from them: ``build_workspace``) and replace, delete or add fields with values of the wrong kind, size or sign;
structurally plausible input reaches far deeper than random JSON. Every drawn ``Example`` names the files it writes
into its own directory (``{x}``; ``{w}`` is the shared workspace), the command line that reads them and the outputs
that command declares.

Each example runs in a child forked from a server process that imported the CLI and the train modules once
(``ForkServer``): a fresh single-threaded process, whatever threads the test process has started, so that the
child inherits no lock held by a thread it lacks. The child caps its address space, runs ``astrai_fabric.cli.main``
and exits with its status; the server kills it at the deadline (a hang in native code is not interruptible in
process) after asking faulthandler for its stack.
"""

from __future__ import annotations

import atexit
import copy
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from astrai_fabric.assets import TINY_MODEL_DIR, resolve
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.train import TrainArgs

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CAP_BYTES = 6 << 30
"""The child's address space: the imports take under 1 GiB, so a model a value blew up fails to allocate instead
of swapping the machine."""
RENDER_SECONDS = 0.5
"""The template renderer's deadline in the child (the hostile suite's value): an endless template costs little."""
DEADLINE_S = 20.0
"""A command still running after this is a hang (the slowest valid example, a 1-step run, takes about 1 s)."""
ERROR = "astrai-fabric: error:"

# --- the workspace: valid bases every example mutates a copy of ------------------------------------------------------

COMMON = ["--window_size", "16", "--parallel_mode", "none", "--num_workers", "0", "--loggers", "[]"]
DATA = {kind: f"{{w}}/{kind}.jsonl" for kind in ("seq", "sft", "dpo", "kto", "grpo")}
DATA["reward_model"] = DATA["dpo"]  # the same pairs, a margin per pair optional
SFT_PIPELINE = {"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
                "mask": {"assistant": "train"}}  # fmt: skip
SEQ_PIPELINE = {"input": {"sections": [{"field": "text", "action": "train"}]}}


def train(command: str, *extra: str, model: str = "{w}/tiny", data: str | None = None) -> list[str]:
    window = ["--window_size", "64"] if command == "grpo" else []
    return [
        command,
        "--param_path",
        model,
        "--data_root_path",
        data or DATA[command],
        *COMMON,
        *window,
        "--ckpt_dir",
        "{x}/out",
        *extra,
    ]


RECORDS = {"seq": 6, "sft": 24, "dpo": 16, "kto": 16, "grpo": 12, "grpo_online": 8}
"""The workspace's JSONL files: the first records of each bundled corpus, few enough that a dry run is quick."""


def bundled_records(kind: str) -> list[dict]:
    """The first ``RECORDS[kind]`` records of the bundled corpus (``seq``, ``sft``, ..., ``grpo_online``)."""
    lines = next(resolve(f"bundled:data/{kind}").glob("*.jsonl")).read_text().splitlines()[: RECORDS[kind]]
    return [json.loads(line) for line in lines]


def build_workspace(root: Path, server: ForkServer) -> Path:
    """``root/w``: the tiny model, a few records of each bundled corpus, a 1-step seq checkpoint (``ck``), a LoRA
    sft checkpoint on it (``lck``), its Hugging Face export (``hf``) and prepared seq and sft shards."""
    w = root / "w"
    shutil.copytree(TINY_MODEL_DIR, w / "tiny")
    for kind in RECORDS:
        (w / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bundled_records(kind)))
    (w / "sft_pipeline.json").write_text(json.dumps(SFT_PIPELINE))
    (w / "seq_pipeline.json").write_text(json.dumps(SEQ_PIPELINE))
    prepare = [
        [
            "prepare",
            f"{{w}}/{kind}.jsonl",
            "-o",
            f"{{w}}/{kind}_shards",
            "-c",
            f"{{w}}/{kind}_pipeline.json",
            "--tokenizer_path",
            "{w}/tiny",
        ]
        for kind in ("seq", "sft")
    ]
    stages = [
        [
            [
                "seq",
                "--param_path",
                "{w}/tiny",
                "--data_root_path",
                "{w}/seq.jsonl",
                *COMMON,
                "--ckpt_dir",
                "{w}/seq_run",
                "--max_steps",
                "1",
            ],
            *prepare,
        ],
        [
            [
                "sft",
                "--param_path",
                "{w}/ck",
                "--data_root_path",
                "{w}/sft.jsonl",
                *COMMON,
                "--ckpt_dir",
                "{w}/lora_run",
                "--max_steps",
                "1",
                "--lora_r",
                "4",
            ],
            ["export", "{w}/ck", "--format", "hf", "--out", "{w}/hf"],
        ],
    ]
    for i, stage in enumerate(stages):  # the commands of a stage in parallel, one per core
        jobs = [([fill(a, w, w) for a in argv], w / f"stage{i}-{j}") for j, argv in enumerate(stage)]
        for outcome in server.run_all(jobs, cwd=w, deadline_s=120):
            assert outcome.code == 0, outcome.stderr[-3000:] + outcome.stdout[-2000:]
        run = w / ("seq_run" if i == 0 else "lora_run")
        (run / "epoch_0_step_1").rename(w / ("ck" if i == 0 else "lck"))
    return w


_SESSION: tuple[ForkServer, Path] | None = None


def session() -> tuple[ForkServer, Path]:
    """The fork server and workspace this test process shares (test_fuzz.py and test_fuzz_found.py): started on
    first use, shut down and removed at exit."""
    global _SESSION
    if _SESSION is None:
        root = Path(tempfile.mkdtemp(prefix="astrai-fuzz-"))
        server = ForkServer()
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        atexit.register(server.close)
        _SESSION = server, build_workspace(root, server)
    return _SESSION


def check_all(examples: list[Example], names: list[str]) -> list[str | None]:
    """Run the examples at once, each in its own directory; what each broke of the promise (or None), with its
    description."""
    server, workspace = session()
    directories = [workspace.parent / name for name in names]
    jobs = [(materialise(example, workspace, d), d) for example, d in zip(examples, directories, strict=True)]
    before = [snapshot(d) for d in directories]
    outcomes = server.run_all(jobs, deadline_s=max(example.deadline_s for example in examples))
    problems = []
    for example, directory, old, outcome in zip(examples, directories, before, outcomes, strict=True):
        problem = broken_promise(example, outcome, old, snapshot(directory), workspace, directory)
        shutil.rmtree(directory)
        problems.append(problem and f"{problem}\n{example.describe()}")
    return problems


def fill(text: str, workspace: Path, example: Path) -> str:
    return text.replace("{w}", str(workspace)).replace("{x}", str(example))


# --- values -------------------------------------------------------------------------------------------------------

DELETE = "<delete>"
"""An edit's value that deletes the field."""
HUGE_INTS = (2**31, 2**32 + 1, 2**53 + 1, 2**63, 10**30, -1, -(2**31), -(2**63))
SIZES = (0, 1, 2, 3, 7, 64, 1000, 65536, 2**20, 10**6, 10**9, 2**31 - 1)
"""Sizes within the int32 bound a config allows: the large ones describe models or loops no machine finishes."""
ODD_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 1e-320, 1e308, -1e308, 0.5, -0.5, 1e-9)
ODD_STRINGS = (
    "", " ", "\x00", "\u202e", "é", "..", "../x", "/nonexistent", "bundled:", "bundled:..", "bundled:nope", "{x}",
    "{x}/nope", "{w}/ck", "{w}/tiny", "{w}/hf", "{w}/lck", "int32", "float16", "O", "llama", "mixtral", "qwen3",
    "gemma", "autoregressive_lm", "mla", "moe", "ntk", "linear", "llama3", "sft", "none", "fsdp", "auto", "true",
    "null", "NaN", "1e400", "0x10", "1_000", "{{ 7 * 7 }}", "${HOME}", "x" * 300, "<|im_start|>",
    "<|end_of_sentence|>", "q_proj", "assistant", "system",
)  # fmt: skip
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-4, 70),
    st.sampled_from(HUGE_INTS + SIZES),
    st.sampled_from(ODD_FLOATS),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(ODD_STRINGS),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=5) | st.sampled_from(ODD_STRINGS), inner, max_size=3)
    ),
    max_leaves=6,
)


def confused(value: Any) -> st.SearchStrategy:
    """Values of the wrong kind, sign or size derived from a valid ``value``."""
    options = [st.just([value]), st.just({"value": value}), st.just(None)]
    if isinstance(value, bool):
        options += [st.sampled_from([int(value), "yes", str(value).lower()])]
    elif isinstance(value, int):
        options += [
            st.sampled_from(
                [str(value), -value, value + 1, value * 1000, value * 2**31, float(value), value + 0.5, True]
            ),
            st.sampled_from(SIZES),
            st.sampled_from(SIZES),
        ]
    elif isinstance(value, float):
        options += [st.sampled_from([str(value), -value, value * 1e30, 0.0, round(value), math.nan])]
    elif isinstance(value, str):
        options += [st.sampled_from([value * 2, value.upper(), value[:1], value + "\x00", " " + value, 7])]
    elif isinstance(value, list):
        options += [st.sampled_from([value * 50, [], value[::-1], {str(i): v for i, v in enumerate(value)}])]
    elif isinstance(value, dict):
        options += [st.sampled_from([[list(item) for item in value.items()], [value], {}])]
    return st.one_of(options)


def paths_of(doc: Any, depth: int = 3, prefix: tuple = ()) -> list[tuple]:
    """Every key path into ``doc`` (dicts and lists) down to ``depth``."""
    found = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in list(items)[:12]:
        found.append((*prefix, key))
        if depth > 1:
            found += paths_of(value, depth - 1, (*prefix, key))
    return found


def get_path(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def set_path(doc: Any, path: tuple, value: Any) -> None:
    """Set (or, with ``DELETE``, remove) ``path`` in ``doc``; a missing or scalar parent becomes a mapping."""
    node = doc
    for key in path[:-1]:
        if isinstance(node, list) and isinstance(key, int) and key < len(node):
            child = node[key]
        elif isinstance(node, dict):
            child = node.get(key)
        else:
            return
        if not isinstance(child, dict | list):
            child = {}
            if isinstance(node, dict):
                node[key] = child
            else:
                node[key] = child
        node = child
    last = path[-1]
    if isinstance(node, list):
        if isinstance(last, int) and last < len(node):
            if value == DELETE:
                del node[last]
            else:
                node[last] = value
        return
    if value == DELETE:
        node.pop(last, None)
    else:
        node[last] = value


@st.composite
def edited(draw, base: Any, keys: tuple = (), nested: dict[str, tuple] | None = None, max_edits: int = 3):
    """``base`` with 1 to ``max_edits`` edits: a field confused (wrong kind of its own value), replaced by a hostile
    value, deleted, or one of ``keys`` (the schema's fields, ``nested``: fields of a nested mapping) added.
    Returns ``(document, edits)``."""
    doc = copy.deepcopy(base)
    paths = paths_of(base)
    edits = []
    for _ in range(draw(st.integers(1, max_edits))):
        how = draw(st.sampled_from(("confuse", "replace", "delete", "add") if paths else ("add",)))
        if how == "add":
            choices = [(k,) for k in keys] + [(p, k) for p, ks in (nested or {}).items() for k in ks]
            path = draw(st.sampled_from(choices)) if choices else (draw(st.text(max_size=5)),)
            value = draw(values)
        else:
            path = draw(st.sampled_from(paths))
            try:
                current = get_path(doc, path)
            except (KeyError, IndexError, TypeError):
                current = None
            value = DELETE if how == "delete" else draw(confused(current) if how == "confuse" else values)
        set_path(doc, path, value)
        edits.append((path, value))
    return doc, edits


RAW_JSON = ("", "[]", "null", "42", '"text"', "{", '{"a": 1,}', "\ufeff{}", '{"a": 1, "a": 2}', "[" * 2000,
            '{"vocab_size": ' + "9" * 5000 + "}", "NaN")  # fmt: skip


@st.composite
def json_text(draw, doc: Any) -> bytes:
    """``doc`` as JSON (NaN and Infinity included, as Python writes them); now and then the file broken instead:
    cut short, a byte that is not UTF-8, a byte-order mark, or replaced by other JSON."""
    text = json.dumps(doc)
    how = draw(st.sampled_from(("json",) * 12 + ("cut", "not-utf8", "bom", "raw")))
    if how == "cut":
        return text[: draw(st.integers(0, max(len(text) - 1, 0)))].encode()
    if how == "not-utf8":
        at = draw(st.integers(0, len(text)))
        return text[:at].encode() + b"\xff\xfe" + text[at:].encode()
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    if how == "raw":
        return draw(st.sampled_from(RAW_JSON)).encode()
    return text.encode()


# --- examples -----------------------------------------------------------------------------------------------------


@dataclass
class Example:
    """One hostile input and the command that reads it."""

    kind: str
    argv: list[str]
    copies: dict[str, str] = field(default_factory=dict)
    """Example-relative destination -> workspace-relative source, copied first."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Example-relative path -> content, written over the copies."""
    outputs: tuple[str, ...] = ("out",)
    """What the command may write (example-relative); nothing else may change, nothing at all on a refusal."""
    culprits: tuple[str, ...] = ()
    """Names the one error line may name: the files written, the fields edited."""
    deadline_s: float = DEADLINE_S

    def describe(self) -> str:
        shown = {name: content[:1500].decode("utf-8", "replace") for name, content in self.files.items()}
        return f"{self.kind}: astrai-fabric {' '.join(self.argv)}\ncopies {self.copies}\nfiles {shown}"


def culprits_of(file: str, edits: list) -> tuple[str, ...]:
    keys = {str(part) for path, _ in edits for part in path if isinstance(part, str) and part}
    return (Path(file).name, str(Path(file).parent), *sorted(keys))


SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")  # fmt: skip


@st.composite
def sized(draw, doc: dict, keys: tuple[str, ...]) -> list:
    """Half the time, one size of ``doc`` set (in place) to a large one within the bounds: the edits made."""
    if draw(st.booleans()):
        return []
    key, value = draw(st.sampled_from(keys)), draw(st.sampled_from(SIZES[-6:]))
    doc[key] = value
    return [((key,), value)]


TINY_CONFIG = json.loads((TINY_MODEL_DIR / "config.json").read_text())
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig) if f.name != "extra") + ("architectures", "rope_parameters")
HF_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "torch_dtype", "dtype", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "num_local_experts", "num_experts_per_tok",
    "router_aux_loss_coef", "attention_bias", "mlp_bias", "partial_rotary_factor", "quantization_config",
    "final_logit_softcapping", "attn_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id",
    "id2label", "num_labels",
)  # fmt: skip
ROPE_KEYS = ("rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor")  # fmt: skip
HF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


@st.composite
def model_configs(draw) -> Example:
    """An AstrAI ``config.json`` with hostile fields: in a model directory (the dry run or a 1-step run builds it)
    or in a checkpoint (its weights no longer fit the config: generate, export, resume)."""
    doc, edits = draw(edited(TINY_CONFIG, MODEL_KEYS, {"rope_scaling": ROPE_KEYS, "rope_frequency_scaling": ROPE_KEYS}))
    edits += draw(sized(doc, SIZE_KEYS + ("n_routed_experts", "n_activated_experts", "kv_lora_rank", "head_dim")))
    text = draw(json_text(doc))
    where = draw(st.sampled_from(("model", "model", "checkpoint")))
    if where == "model":
        argv = draw(
            st.sampled_from(
                [
                    train("seq", "--dry_run", model="{x}/m"),
                    train("sft", "--dry_run", model="{x}/m"),
                    train("seq", "--max_steps", "1", model="{x}/m"),
                ]
            )
        )
        return Example(
            "model config.json",
            argv,
            {"m": "tiny"},
            {"m/config.json": text},
            culprits=culprits_of("m/config.json", edits),
        )
    argv = draw(
        st.sampled_from(
            [
                ["generate", "--param_path", "{x}/ck", "--prompt", "hi", "--max_new_tokens", "2", "--chat", "false"],
                ["export", "{x}/ck", "--format", "hf", "--out", "{x}/out"],
                train("seq", "--resume", "{x}/ck", "--max_steps", "2"),
            ]
        )
    )
    return Example(
        "checkpoint config.json",
        argv,
        {"ck": "ck"},
        {"ck/config.json": text},
        culprits=culprits_of("ck/config.json", edits),
    )


@st.composite
def hf_configs(draw, base: dict) -> Example:
    """A Hugging Face ``config.json`` (the tiny model exported as llama) retyped as one of the five architectures,
    now and then as its reward model (``*ForSequenceClassification``, one label), with hostile fields."""
    start = {**base, "model_type": draw(st.sampled_from(HF_TYPES))}
    if draw(st.integers(0, 3)) == 0:  # the weights lack its score head: a run says so, a dry run reads the config
        start.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"}, pad_token_id=2)
    doc, edits = draw(edited(start, HF_KEYS, {"rope_scaling": ROPE_KEYS, "rope_parameters": ROPE_KEYS}))
    edits += draw(sized(doc, SIZE_KEYS + ("num_local_experts", "num_experts_per_tok", "sliding_window", "head_dim")))
    argv = draw(
        st.sampled_from(
            [
                train("sft", "--dry_run", model="{x}/hf"),
                train("sft", "--max_steps", "1", model="{x}/hf"),
                ["export", "{x}/hf", "--out", "{x}/out"],
                ["export", "{x}/hf", "--format", "hf", "--out", "{x}/out"],
                ["generate", "--param_path", "{x}/hf", "--prompt", "hi", "--max_new_tokens", "2", "--chat", "false"],
                train("reward_model", "--dry_run", model="{x}/hf", data=DATA["dpo"]),
                train("grpo", "--dry_run", "--reward_model", "{x}/hf", data="{w}/grpo_online.jsonl"),
            ]
        )
    )
    return Example(
        "hf config.json",
        argv,
        {"hf": "hf"},
        {"hf/config.json": draw(json_text(doc))},
        culprits=culprits_of("hf/config.json", edits),
    )


TEMPLATE_PIECES = (
    "{{% for a in range({n}) %}}{{% for b in range({n}) %}}x{{% endfor %}}{{% endfor %}}",
    "{{% for a in 'x' * {n} %}}{{% for b in 'x' * {n} %}}{{% endfor %}}{{% endfor %}}",
    "{{% macro f(n) %}}{{{{ f(n + 1) }}}}{{% endmacro %}}{{{{ f({n}) }}}}",
    "{{% macro f() %}}{{% for m in messages %}}{{{{ f() }}}}{{% endfor %}}{{% endmacro %}}{{{{ f() }}}}",
    "{{{{ 'x' * {n} }}}}", "{{{{ messages[0]['content'] * {n} }}}}", "{{{{ [0] * {n} }}}}",
    "{{{{ range({n}) | list | length }}}}", "{{{{ range({n}) | join(',') }}}}", "{{{{ lipsum({n}) }}}}",
    "{{{{ 'x' | center({n}) }}}}", "{{{{ '%0{n}d' % 1 }}}}", "{{{{ messages | tojson(indent={n}) }}}}",
    "{{{{ 2 ** {n} }}}}", "{{{{ {n} ** {n} }}}}", "{{{{ messages[{n}] }}}}", "{{{{ 'x' | indent({n}) }}}}",
    "{{{{ 'ab' | wordwrap({n}) }}}}", "{{{{ 'x' | truncate({n}) }}}}", "{{{{ ''.join(['x'] * {n}) }}}}",
    "{{% set ns = namespace(x='') %}}{{% for i in range({n}) %}}{{% set ns.x = ns.x ~ ns.x ~ 'x' %}}{{% endfor %}}",
    "{{{{ nothing }}}}", "{{{{ nothing.attr }}}}", "{{{{ nothing() }}}}", "{{{{ messages.nothing.deeper }}}}",
    "{{{{ ''.__class__.__mro__[1].__subclasses__() }}}}", "{{{{ cycler.__init__.__globals__ }}}}",
    "{{{{ joiner.__init__.__globals__.os }}}}", "{{{{ self.__init__.__globals__ }}}}",
    "{{{{ namespace.__init__.__globals__ }}}}", "{{{{ (messages | first).__class__ }}}}",
    "{{{{ '{{0.__class__}}'.format(1) }}}}", "{{{{ messages | map(attribute='__class__') | list }}}}",
    "{{{{ messages.append(1) }}}}", "{{{{ messages.clear() }}}}", "{{{{ messages[0].update(role=1) }}}}",
    "{{% include 'x' %}}", "{{% import 'x' as y %}}", "{{% extends 'x' %}}", "{{{{ raise_exception('no') }}}}",
    "{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}", "{{% if messages %}}", "{{{{", "{{% raw %}}x",
    "{{% filter upper %}}{{{{ 'x' * {n} }}}}{{% endfilter %}}", "{{{{ messages | length }}}}",
    "{{% for m in messages %}}{{% if loop.index > {n} %}}{{% break %}}{{% endif %}}{{{{ m.content }}}}{{% endfor %}}",
    "{{{{ strftime_now('%Y' * {n}) }}}}", "{{{{ messages[0]['role'] | tojson }}}}", "{{% do messages.pop() %}}",
)  # fmt: skip
COSTLY_PIECES = 21
"""The first pieces do work that grows with ``n``: loops, recursion, repetition, padding."""
TEMPLATE_SIZES = (0, 1, 3, 40, 1000, 100_000, 100_000, 10**9, 10**9, -1)


@st.composite
def templates(draw, base: str) -> str:
    """A chat template: the valid one with hostile pieces before or after it, or the pieces alone."""
    costly = st.sampled_from(TEMPLATE_PIECES[:COSTLY_PIECES])  # drawn as often as all the others together
    pieces = [
        draw(costly | st.sampled_from(TEMPLATE_PIECES)).format(n=draw(st.sampled_from(TEMPLATE_SIZES)))
        for _ in range(draw(st.integers(1, 2)))
    ]
    how = draw(st.sampled_from(("before", "after", "alone")))
    return {"before": "".join(pieces) + base, "after": base + "".join(pieces), "alone": "".join(pieces)}[how]


TOKENS = ("<|begin_of_sentence|>", "<|end_of_sentence|>", "<|_pad_|>", "<|im_start|>", "<|im_end|>")
ASTRAI_SPECIAL = ("bos_token", "eos_token", "pad_token", "im_start", "im_end", "unk_token", "sep")
HF_TOKENIZER_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens",
                     "added_tokens_decoder", "chat_template", "model_max_length", "tokenizer_class",
                     "clean_up_tokenization_spaces", "special_tokens")  # fmt: skip


@st.composite
def tokenizer_configs(draw, astrai: dict, hf: dict) -> Example:
    """A ``tokenizer_config.json``, AstrAI's layout or Hugging Face's, with hostile fields and a hostile chat
    template (or a ``chat_template.jinja`` beside Hugging Face's)."""
    layout = draw(st.sampled_from(("astrai", "hf")))
    base = copy.deepcopy(astrai if layout == "astrai" else hf)
    if layout == "hf" and draw(st.booleans()):
        base["added_tokens_decoder"] = {str(i): {"content": t, "special": True} for i, t in enumerate(TOKENS)}
    doc, edits = draw(
        edited(
            base,
            ("chat_template", *HF_TOKENIZER_KEYS, "special_tokens"),
            {"special_tokens": ASTRAI_SPECIAL, "added_tokens_decoder": ("0", "7", "-1", "x")},
            max_edits=2,
        )
    )
    files = {}
    if draw(st.integers(0, 2)):
        template = draw(templates(base["chat_template"]))
        if layout == "hf" and draw(st.booleans()):
            files["t/chat_template.jinja"] = template.encode()
            doc.pop("chat_template", None)
        else:
            doc["chat_template"] = template
            edits.append((("chat_template",), template))
    files["t/tokenizer_config.json"] = draw(json_text(doc))
    culprits = (*culprits_of("t/tokenizer_config.json", edits), "chat_template", "special")
    argv = draw(
        st.sampled_from(
            [
                train("sft", "--dry_run", "--tokenizer_path", "{x}/t"),
                train("sft", "--max_steps", "1", "--tokenizer_path", "{x}/t"),
                train("dpo", "--dry_run", "--tokenizer_path", "{x}/t"),
                [
                    "prepare",
                    "{w}/sft.jsonl",
                    "-o",
                    "{x}/out",
                    "-c",
                    "{w}/sft_pipeline.json",
                    "--tokenizer_path",
                    "{x}/t",
                ],
                [
                    "generate",
                    "--param_path",
                    "{w}/ck",
                    "--tokenizer_path",
                    "{x}/t",
                    "--prompt",
                    "hi",
                    "--max_new_tokens",
                    "2",
                ],
                ["export", "{x}/t", "--format", "hf", "--out", "{x}/out"],
            ]
        )
    )
    copies = {"t": "ck"} if argv[0] == "export" else {"t/tokenizer.json": "tiny/tokenizer.json"}
    return Example(f"tokenizer_config.json ({layout})", argv, copies, files, culprits=culprits)


POSITION_KEYS = ("epoch", "sample_index", "world_size", "optimizer_step", "num_tokens", "consumed_samples",
                 "skipped_steps")  # fmt: skip
LORA_BASE_KEYS = ("path", "absolute", "sha256")
QUANTIZATION = {"method": "nf4", "block_size": 64, "scaler_block_size": 256, "dtype": "float32",
                "keys": ["layers.0.attention.q_proj.weight"]}  # fmt: skip
"""A valid ``meta.json`` ``quantization`` record for the tiny model (its q_proj, 128 x 128, fits NF4's blocks)."""


@st.composite
def checkpoint_metas(draw, meta: dict, lora_meta: dict) -> Example:
    """A checkpoint's ``meta.json`` (a full checkpoint's, or a LoRA checkpoint's with its base pointer) with
    hostile fields, read by resume, export and generate."""
    lora = draw(st.booleans())
    base = lora_meta if lora else meta
    quantized = lora and draw(st.booleans())  # a QLoRA checkpoint: its adapter merged into the base's NF4 round trip
    keys = tuple(f.name for f in fields(TrainArgs)) + ("resume_position", "reference", "lora_base", "astrai_fabric")
    if quantized:  # its record edited: among a hundred-odd keys, a random edit would rarely reach it
        base, keys = {**base, "quantization": QUANTIZATION}, ("quantization", "lora_base")
    doc, edits = draw(
        edited(
            base,
            keys,
            {
                "resume_position": POSITION_KEYS,
                "lora_base": LORA_BASE_KEYS,
                "astrai_fabric": ("format_version", "versions"),
                "reference": ("param_path", "random_seed"),
                "quantization": tuple(QUANTIZATION),
            },
        )
    )
    name = "lck" if lora else "ck"
    resume = (
        train("sft", "--resume", "{x}/lck", "--lora_r", "4", "--max_steps", "2", model="{w}/ck")
        if lora
        else train("seq", "--resume", "{x}/ck", "--max_steps", "2", data="{w}/seq.jsonl")
    )
    merged = [
        ["export", f"{{x}}/{name}", "--format", "hf", "--out", "{x}/out"],
        ["generate", "--param_path", f"{{x}}/{name}", "--prompt", "hi", "--max_new_tokens", "2"],
    ]
    others = [
        resume,
        [*resume, "--dry_run"],
        ["export", f"{{x}}/{name}", "--format", "peft" if lora else "astrai", "--out", "{x}/out"],
    ]
    argv = draw(st.sampled_from(merged if quantized else [*others, *merged]))  # the merged model reads the record
    return Example(
        f"{name} meta.json",
        argv,
        {name: name},
        {f"{name}/meta.json": draw(json_text(doc))},
        culprits=culprits_of(f"{name}/meta.json", edits),
    )


ADAPTER_KEYS = ("r", "alpha", "lora_alpha", "target_modules", "lora_dropout", "init", "peft_type", "task_type",
                "base_model_name_or_path", "bias", "fan_in_fan_out", "modules_to_save")  # fmt: skip


@st.composite
def adapter_configs(draw, base: dict) -> Example:
    """A LoRA checkpoint's ``adapter_config.json`` with hostile fields."""
    doc, edits = draw(edited(base, ADAPTER_KEYS))
    argv = draw(
        st.sampled_from(
            [
                ["export", "{x}/lck", "--format", "peft", "--out", "{x}/out"],
                ["export", "{x}/lck", "--format", "hf", "--out", "{x}/out"],
                ["generate", "--param_path", "{x}/lck", "--prompt", "hi", "--max_new_tokens", "2"],
                train("sft", "--resume", "{x}/lck", "--lora_r", "4", "--dry_run", model="{w}/ck"),
                train("sft", "--max_steps", "1", model="{x}/lck"),
            ]
        )
    )
    return Example(
        "adapter_config.json",
        argv,
        {"lck": "lck"},
        {"lck/adapter_config.json": draw(json_text(doc))},
        culprits=culprits_of("lck/adapter_config.json", edits),
    )


TRAIN_KEYS = tuple(f.name for f in fields(TrainArgs))
SECTIONS = ("model", "data", "parallel", "training", "ckpt", "log", "runtime")
RAW_YAML = (
    "max_lr: &a 0.001\nwarmup_ratio: *a\n", "x: !!python/name:os.system\n", "? [a]\n: 1\n",
    "max_steps: " + "9" * 5000 + "\n", "max_lr: 0.001\nmax_lr: 0.002\n", "\t- bad indent\n", "---\nmax_steps: 2\n",
    "max_steps: 0o777\n", "max_steps: 1_000\n", "max_lr: 1e-3\n", "max_steps: !!binary AAAA\n",
    "resume: 2001-12-14\n", "max_lr: !!float 1e400\n", "[1, 2]\n", "max_steps: !!int '12'\n", "model: [1]\n",
    "training: {training: {max_steps: 1}}\n", "lora_targets: q_proj\n", "metrics: {a: 1}\n", "\x00\n",
)  # fmt: skip


@st.composite
def recipes(draw) -> Example:
    """A YAML recipe of TrainArgs keys (flat, or in AstrAI's sections) with values of every wrong kind, read by
    the dry run of each train type."""
    command = draw(st.sampled_from(("seq", "sft", "dpo", "kto", "grpo", "reward_model")))
    base = {
        "param_path": "{w}/tiny",
        "data_root_path": DATA[command],
        "window_size": 64 if command == "grpo" else 16,
        "parallel_mode": "none",
        "num_workers": 0,
        "loggers": [],
        "max_steps": 1,
    }
    doc, edits = draw(
        edited(
            base,
            TRAIN_KEYS + SECTIONS + ("devices", "dry-run", "train_type", "config"),
            {s: TRAIN_KEYS[:40:3] for s in SECTIONS[:3]},
        )
    )
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    if draw(st.integers(0, 5)) == 0:
        text += draw(st.sampled_from(RAW_YAML))
    argv = [command, "--config", "{x}/r.yaml", "--ckpt_dir", "{x}/out", "--dry_run"]
    return Example(
        f"{command} recipe",
        argv,
        {},
        {"r.yaml": text.encode()},
        culprits=(*culprits_of("r.yaml", edits), "--config", "recipe"),
    )


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


RAW_LINES = ("{", "[]", "null", '"text"', '{"text": NaN}', "\ufeff{}", "{}", '{"messages": []}', "[" * 3000,
             '{"prompt": ' + "9" * 5000 + "}", "\x00")  # fmt: skip


@st.composite
def jsonl_records(draw, workspace: Path) -> Example:
    """A JSONL file of one train type's records (seq text, sft messages, dpo pairs, kto unpaired preferences, grpo
    groups, online prompts) with one record edited or one line broken; trained on for a step, dry-run, or prepared."""
    kind = draw(st.sampled_from(("seq", "sft", "dpo", "kto", "grpo", "grpo_online", "reward_model")))
    records = read_records(workspace / f"{'dpo' if kind == 'reward_model' else kind}.jsonl")
    index = draw(st.integers(0, len(records) - 1))
    extra = {
        "seq": ("text",),
        "sft": ("messages", "text"),
        "dpo": ("prompt", "chosen", "rejected"),
        "reward_model": ("prompt", "chosen", "rejected", "margin"),
        "kto": ("prompt", "completion", "label"),
        "grpo": ("prompt", "responses", "rewards"),
        "grpo_online": ("prompt", "answer"),
    }[kind]
    record, edits = draw(edited(records[index], extra, max_edits=2))
    lines = [json.dumps(r) for r in records]
    lines[index] = json.dumps(record)
    if draw(st.integers(0, 6)) == 0:
        lines[index] = draw(st.sampled_from(RAW_LINES))
    text = "\n".join(lines) + draw(st.sampled_from(("\n", "", "\r\n", "\n\n\n")))
    command = "grpo" if kind == "grpo_online" else kind
    online = ["--reward", "length", "--group_size", "2", "--rollout_max_tokens", "4"] if kind == "grpo_online" else []
    choices = [
        train(command, "--max_steps", "1", *online, data="{x}/data.jsonl"),
        train(command, "--dry_run", *online, data="{x}/data.jsonl"),
    ]
    if kind in ("seq", "sft"):
        choices.append(
            [
                "prepare",
                "{x}/data.jsonl",
                "-o",
                "{x}/out",
                "-c",
                f"{{w}}/{kind}_pipeline.json",
                "--tokenizer_path",
                "{w}/tiny",
            ]
        )
    return Example(
        f"{kind} jsonl",
        draw(st.sampled_from(choices)),
        {},
        {"data.jsonl": text.encode()},
        culprits=culprits_of("data.jsonl", edits),
    )


@st.composite
def shard_metas(draw, workspace: Path) -> Example:
    """A bin shard's ``meta.json`` (a prepared seq or sft shard) with hostile entries; now and then a ``.bin``
    cut short too."""
    kind = draw(st.sampled_from(("seq", "sft")))
    meta_path = next((workspace / f"{kind}_shards").rglob("meta.json"))
    relative = meta_path.relative_to(workspace / f"{kind}_shards")
    base = json.loads(meta_path.read_text())
    doc, edits = draw(
        edited(
            base,
            ("sequence", "loss_mask", "position_ids", "attention_mask", "../x", ".hidden"),
            {k: ("shape", "dtype", "offset") for k in base},
        )
    )
    files = {f"d/{relative}": draw(json_text(doc))}
    if draw(st.integers(0, 5)) == 0:
        key = draw(st.sampled_from(sorted(base)))
        whole = (meta_path.parent / f"{key}.bin").read_bytes()
        files[f"d/{relative.parent}/{key}.bin"] = whole[: draw(st.integers(0, len(whole)))]
    argv = draw(
        st.sampled_from([train(kind, "--max_steps", "1", data="{x}/d"), train(kind, "--dry_run", data="{x}/d")])
    )
    return Example(
        f"{kind} shard meta.json",
        argv,
        {"d": f"{kind}_shards"},
        files,
        culprits=(*culprits_of(f"d/{relative}", edits), ".bin"),
    )


@st.composite
def metric_histories(draw, workspace: Path) -> Example:
    """A run's ``metric.jsonl`` with one entry edited or one line broken, plotted."""
    records = read_records(workspace / "ck" / "metric.jsonl")
    index = draw(st.integers(0, len(records) - 1))
    record, edits = draw(edited(records[index], ("type", "step", "loss", "lr", "tokens_per_sec", "val_loss")))
    lines = [json.dumps(r) for r in records]
    lines[index] = json.dumps(record) if draw(st.integers(0, 6)) else draw(st.sampled_from(RAW_LINES))
    return Example(
        "metric.jsonl",
        ["plot", "{x}/metric.jsonl", "-o", "{x}/out.png"],
        {},
        {"metric.jsonl": ("\n".join(lines) + "\n").encode()},
        outputs=("out.png",),
        culprits=culprits_of("metric.jsonl", edits),
    )


# --- running an example and the promise it must keep --------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    """The exit status; None when a signal ended the child (``signal``) or the deadline did (``timed_out``)."""
    signal: int | None
    timed_out: bool
    seconds: float
    stdout: str
    stderr: str


class ForkServer:
    """A process that imported the CLI once and forks a child per command (``python fuzz_inputs.py serve``)."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            cwd=ROOT,
        )
        assert self.process.stdout.readline().strip() == "ready"

    def run_all(
        self, jobs: list[tuple[list[str], Path]], cwd: Path | None = None, deadline_s: float = DEADLINE_S
    ) -> list[Outcome]:
        """Each ``(argv, directory)`` run at once in its own child, in ``cwd`` (default ``directory/cwd``); its
        stdout and stderr go through ``directory.stdout`` and ``directory.stderr``."""
        requests = []
        for argv, directory in jobs:
            out, err = (directory.with_name(directory.name + suffix) for suffix in (".stdout", ".stderr"))
            requests.append(
                {
                    "argv": argv,
                    "cwd": str(cwd or directory / "cwd"),
                    "stdout": str(out),
                    "stderr": str(err),
                    "deadline_s": deadline_s,
                }
            )
        self.process.stdin.write(json.dumps(requests) + "\n")
        self.process.stdin.flush()
        outcomes = []
        for request, reply in zip(requests, json.loads(self.process.stdout.readline()), strict=True):
            texts = []
            for name in ("stdout", "stderr"):
                path = Path(request[name])
                texts.append(path.read_bytes()[-(1 << 20) :].decode("utf-8", "replace"))
                path.unlink()
            outcomes.append(Outcome(reply["code"], reply["signal"], reply["timed_out"], reply["seconds"], *texts))
        return outcomes

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def serve() -> None:
    """The server's loop: a JSON list of commands per line on stdin, run at once; their outcomes, one line."""
    import torch

    torch.set_num_threads(1)
    import astrai_fabric.checkpoint.state  # noqa: F401 - export --merge_lora
    import astrai_fabric.plot  # noqa: F401
    import astrai_fabric.train.dpo  # noqa: F401
    import astrai_fabric.train.grpo  # noqa: F401
    import astrai_fabric.train.kto  # noqa: F401
    import astrai_fabric.train.lm  # noqa: F401
    import astrai_fabric.train.reward_model  # noqa: F401
    from astrai_fabric import cli

    cli.build_train_parser("seq")  # warms what the first parse loads lazily, once for every child
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing the imports print may land in the protocol
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        started = [_start_child(cli.main, request) for request in json.loads(line)]
        print(json.dumps([_wait_child(*child) for child in started]), file=replies, flush=True)


def _start_child(main, request: dict) -> tuple[int, int, float, float]:  # noqa: ANN001 - astrai_fabric.cli.main
    """Fork the child running ``main(request["argv"])``; returns its pid, pidfd, start time and deadline."""
    import resource

    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setpgid(0, 0)
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))
            os.chdir(request["cwd"])
            out = open(request["stdout"], "w", buffering=1)  # noqa: SIM115 - lives until os._exit
            err = open(request["stderr"], "w", buffering=1)  # noqa: SIM115
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout, sys.stderr = out, err
            import faulthandler

            faulthandler.enable(err)
            faulthandler.register(signal.SIGUSR1, err, all_threads=True)
            from astrai_fabric import tokenizer

            tokenizer.RENDER_SECONDS = RENDER_SECONDS
            code = main(request["argv"])
        except BaseException as exc:  # noqa: BLE001 - main must not raise; if it does, that is the finding
            import traceback

            traceback.print_exception(exc)
            code = 70
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            os._exit(code if isinstance(code, int) else 71)
    return pid, os.pidfd_open(pid), start, start + request["deadline_s"]


def _wait_child(pid: int, handle: int, start: float, deadline: float) -> dict:
    """The child's exit, or its kill at the deadline (after faulthandler wrote where it hangs)."""
    timed_out = not select.select([handle], [], [], max(deadline - time.monotonic(), 0))[0]
    if timed_out:
        os.kill(pid, signal.SIGUSR1)
        select.select([handle], [], [], 1.0)
        _kill_group(pid)
    _, status = os.waitpid(pid, 0)
    os.close(handle)
    _kill_group(pid)  # anything it left running (loader workers, launched ranks)
    died = os.WIFSIGNALED(status) and not timed_out
    return {
        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if died else None,
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def materialise(example: Example, workspace: Path, directory: Path) -> list[str]:
    """Write ``example`` into ``directory`` (created) and return its command line, filled in."""
    directory.mkdir(parents=True)
    (directory / "cwd").mkdir()
    for target, source in example.copies.items():
        (directory / target).parent.mkdir(parents=True, exist_ok=True)
        if (workspace / source).is_dir():
            shutil.copytree(workspace / source, directory / target)
        else:
            shutil.copyfile(workspace / source, directory / target)
    for name, content in example.files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(
            fill(content.decode("utf-8", "surrogateescape"), workspace, directory).encode("utf-8", "surrogateescape")
        )
    return [fill(arg, workspace, directory) for arg in example.argv]


def broken_promise(
    example: Example, outcome: Outcome, before: dict, after: dict, workspace: Path, directory: Path
) -> str | None:
    """What ``outcome`` broke of the error promise, as ``"<class>: detail"``, or None when it kept it: exit 0, or
    exit 2 with one ``astrai-fabric: error:`` line naming a file or field (the dry run's list on stdout instead);
    no traceback, hang or native crash; nothing written but the declared outputs, nothing at all on a refusal."""
    tail = f"\n--- stderr ---\n{outcome.stderr[-4000:]}\n--- stdout ---\n{outcome.stdout[-1500:]}"
    if outcome.timed_out:
        return f"hang: still running after {example.deadline_s:.0f} s" + tail
    if outcome.signal is not None:
        return f"native crash: killed by signal {outcome.signal}" + tail
    if "Traceback (most recent call last)" in outcome.stderr or "internal error, a bug" in outcome.stderr:
        return f"traceback: exit {outcome.code}" + tail
    if outcome.code not in (0, 2):
        return f"wrong exit: {outcome.code}" + tail
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k, 0) != after.get(k, 0))
    if outcome.code == 2 and changed:
        return f"write on refusal: {changed[:5]}" + tail
    outside = [k for k in changed if not any(k == o or k.startswith(o + "/") for o in example.outputs)]
    if outside:
        return f"write outside outputs: {outside[:5]}" + tail
    if outcome.code == 0:
        return None
    lines = [line for line in outcome.stderr.splitlines() if line.startswith(ERROR)]
    if not lines and "cannot start:" in outcome.stdout:  # the dry run lists every problem on stdout
        lines = [outcome.stdout.split("cannot start:", 1)[1]]
    elif len(lines) != 1:
        return f"more than one line: {len(lines)} error lines" + tail
    names = [fill(c, workspace, directory) for c in example.culprits] + [str(directory)]
    if not any(name in lines[0] for name in names if name):
        return "unnamed: the error names no file or field" + tail
    return None


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
