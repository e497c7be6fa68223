"""Data where it lives, read through ``datasets`` (data/sources.py): parquet, arrow, CSV and JSON files, directories
of them, ``save_to_disk`` directories and a Hub dataset id (through tests/hub_stand_in.py), each giving the records
the JSONL source of the same rows gives; training and ``prepare`` on them (``--num_proc`` and ``--resume`` giving
the bytes of a JSONL input); and without the extra, one line naming it. Every file is written here by ``datasets``
or pyarrow; nothing is downloaded."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
import pyarrow as pa  # noqa: E402 (datasets brings it)

from astrai_fabric.cli import main  # noqa: E402
from astrai_fabric.data.prepare import PipelineConfig, prepare  # noqa: E402
from astrai_fabric.data.sources import open_source  # noqa: E402
from astrai_fabric.data.storage import detect_format, read_jsonl, read_records  # noqa: E402
from astrai_fabric.errors import UserError  # noqa: E402
from tests.test_prepare import BEFORE_STREAMING, STREAMED, TOKENIZER, digest, mixed_records  # noqa: E402

ROOT = Path(__file__).parents[1]

datasets.disable_progress_bars()
TEXTS = [{"text": f"In the beginning {i} " + "and the earth " * (i % 5)} for i in range(40)]
CHATS = [{"messages": [{"role": "user", "content": f"What is {i}?"}, {"role": "assistant", "content": f"It is {i}."}]}
         for i in range(40)]  # fmt: skip


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def arrow_file(path: Path, rows: list[dict]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def plain(records):
    return [record for _, record in records]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Each kind of source, holding TEXTS (and, where the format nests, CHATS)."""
    root = tmp_path_factory.mktemp("sources")
    for name, rows in (("texts", TEXTS), ("chats", CHATS)):
        jsonl(root / f"{name}.jsonl", rows)
        dataset = datasets.Dataset.from_list(rows)
        dataset.to_parquet(root / f"{name}.parquet")
        dataset.to_json(root / f"{name}.json")
        arrow_file(root / f"{name}.arrow", rows)
        dataset.save_to_disk(root / f"{name}-saved")
    datasets.Dataset.from_list(TEXTS).to_csv(root / "texts.csv", index=False)
    pairs = (ROOT / "astrai_fabric" / "assets" / "data" / "dpo" / "pairs.jsonl").read_text().splitlines()[:6]
    (root / "pairs.jsonl").write_text("".join(f"{line}\n" for line in pairs))
    datasets.Dataset.from_list([json.loads(line) for line in pairs]).to_parquet(root / "pairs.parquet")
    (root / "parquet-dir").mkdir()  # three files, read in name order
    for i in range(3):
        datasets.Dataset.from_list(TEXTS[i * 15 : (i + 1) * 15]).to_parquet(root / "parquet-dir" / f"part-{i}.parquet")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(TEXTS[:5]), "validation": datasets.Dataset.from_list(TEXTS[5:])}
    ).save_to_disk(root / "dict")
    return root


KINDS = [("texts.parquet", "parquet"), ("texts.arrow", "arrow"), ("texts.csv", "csv"), ("texts.json", "json"),
         ("texts-saved", "saved"), ("chats.parquet", "parquet"), ("chats.arrow", "arrow"), ("chats.json", "json"),
         ("chats-saved", "saved")]  # fmt: skip


@pytest.mark.parametrize("name, kind", KINDS)
def test_each_kind_gives_the_records_of_the_jsonl_source(sources, name, kind):
    assert detect_format(sources / name) == kind
    records = read_records(sources / name)
    expected = read_jsonl(sources / f"{name.split('.')[0].split('-')[0]}.jsonl")
    assert plain(records) == plain(expected)
    where = records[3][0]
    assert where == (f"{sources / name} (train) row 3" if kind == "saved" else f"{sources / name} row 3")


def test_parquet_arrow_and_saved_sources_state_their_column_kinds(sources):
    """What Shaper.check_schema is given, read from the footer, the stream's header or the saved table (no row);
    CSV and JSON state none (their rows say; the record checks name a wrong kind there)."""
    for name in ("texts.parquet", "texts.arrow", "texts-saved", "chats.arrow"):
        kinds = [part.schema() for part in open_source(sources / name, detect_format(sources / name)).parts]
        messages = ("list", "list<item: struct<role: string, content: string>>")
        assert kinds == [{"text": ("string", "string")} if name.startswith("texts") else {"messages": messages}]
    assert open_source(sources / "texts.csv", "csv").parts[0].schema() is None


def test_a_directory_of_parquet_files_and_a_split_of_a_saved_dict(sources):
    records = read_records(sources / "parquet-dir")
    assert plain(records) == TEXTS[:45]
    assert records[16][0] == f"{sources / 'parquet-dir' / 'part-1.parquet'} row 1"  # file and row within it
    assert plain(read_records(sources / "dict")) == TEXTS[:5]  # train, the default
    assert plain(read_records(sources / "dict", split="validation")) == TEXTS[5:]


def run(kind: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        kind,
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        str(data),
        "--window_size",
        "16",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--max_steps",
        "1",
        "--ckpt_dir",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize("kind, name", [("seq", "texts.parquet"), ("sft", "chats.parquet"), ("dpo", "pairs.parquet")])
def test_one_step_trained_on_a_parquet_source(sources, tmp_path, capsys, kind, name):
    window = ["--window_size", "64"] if kind == "dpo" else []  # pairs longer than 16 tokens
    assert main(run(kind, sources / name, tmp_path / "parquet", *window)) == 0
    from_parquet = capsys.readouterr().out
    assert main(run(kind, sources / name.replace(".parquet", ".jsonl"), tmp_path / "jsonl", *window)) == 0
    from_jsonl = capsys.readouterr().out
    loss = [line.split("| loss ")[1].split(" ")[0] for line in (from_parquet, from_jsonl)]
    assert loss[0] == loss[1]  # the same tokens trained on
    assert f"from {sources / name}" in from_parquet and (tmp_path / "parquet" / "epoch_0_step_1").is_dir()


PROMPT_ANSWER = {"input": {"sections": [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]},
                 "preprocessing": {"min_chars": 0}}  # fmt: skip
"""A dataset_config.json whose fields no record shape has: ignored, the records would be refused (no messages)."""


def test_a_dataset_config_beside_parquet_renders_its_records_as_beside_jsonl(tmp_path, capsys):
    rows = [{"prompt": f"Question {i}: why?", "answer": "because " * (i % 4 + 1)} for i in range(24)]
    losses = []
    for kind in ("parquet", "jsonl"):
        directory = tmp_path / kind
        directory.mkdir()
        (directory / "dataset_config.json").write_text(json.dumps(PROMPT_ANSWER))
        if kind == "parquet":
            datasets.Dataset.from_list(rows).to_parquet(directory / "train.parquet")
        else:
            jsonl(directory / "train.jsonl", rows)
        assert main(run("sft", directory, tmp_path / f"{kind}-run")) == 0
        out = capsys.readouterr().out
        assert f"records rendered by {directory / 'dataset_config.json'}" in out
        losses.append(out.split("| loss ")[1].split(" ")[0])
    assert losses[0] == losses[1]  # the same tokens and masks


def test_a_split_of_a_saved_dict_is_what_trains(sources, tmp_path, capsys):
    assert main(run("seq", sources / "dict", tmp_path / "validation", "--data_split", "validation", "--dry_run")) == 0
    assert main(run("seq", sources / "dict", tmp_path / "train", "--dry_run")) == 0
    validation, train = (
        re.search(r"^  data +([\d,]+) samples", out, re.M).group(1)
        for out in capsys.readouterr().out.split("plan for ")[1:]
    )
    assert validation != train  # 5 texts in train, the rest in validation


def mixed_rows(tmp_path: Path) -> list[dict]:
    """test_prepare's records as table rows: every column in each (a record without ``lang`` has it null)."""
    lines = mixed_records(tmp_path / "in.jsonl").read_text().splitlines()
    return [{"lang": None, **json.loads(line)} for line in lines]


def test_prepare_on_parquet_writes_the_bytes_of_jsonl_with_any_num_proc(tmp_path, monkeypatch):
    monkeypatch.setattr("astrai_fabric.data.prepare.CHUNK_BYTES", 300)  # several chunks: both workers busy
    rows = mixed_rows(tmp_path)
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "in.parquet")
    config = PipelineConfig.from_dict(STREAMED["bfd"], "cfg")
    for n in (1, 2):
        prepare([tmp_path / "in.parquet"], tmp_path / f"out{n}", config, TOKENIZER, num_proc=n)
    assert digest(tmp_path / "out1") == digest(tmp_path / "out2") == BEFORE_STREAMING["bfd"]


def test_a_killed_prepare_of_a_parquet_directory_resumes_to_the_same_bytes(tmp_path, capsys):
    rows = mixed_rows(tmp_path)
    (tmp_path / "in").mkdir()
    for i in range(3):  # the kill falls inside the second file: the resume starts at its row
        datasets.Dataset.from_list(rows[i * 20 : (i + 1) * 20]).to_parquet(tmp_path / "in" / f"{i}.parquet")
    (tmp_path / "p.json").write_text(json.dumps(STREAMED["bfd"]))
    argv = [
        "prepare",
        str(tmp_path / "in"),
        "-o",
        str(tmp_path / "out"),
        "-c",
        str(tmp_path / "p.json"),
        "--tokenizer_path",
        "bundled:tiny",
    ]
    env = {**os.environ, "ASTRAI_FABRIC_CRASH_AT": "prepare-shard@3", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", "astrai_fabric", *argv], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert main([*argv, "--resume"]) == 0
    assert digest(tmp_path / "out") == BEFORE_STREAMING["bfd"]
    assert capsys.readouterr().out.startswith("records: 60 read, ")  # each record counted once


def test_a_hub_dataset_id_is_downloaded_then_read_offline(tmp_path, monkeypatch, capsys):
    stand_in_module = pytest.importorskip("tests.hub_stand_in", reason="tests/hub_stand_in.py (HUB's) is missing")
    files = {}
    for split, rows in (("train", TEXTS[:30]), ("test", TEXTS[30:])):
        datasets.Dataset.from_list(rows).to_parquet(tmp_path / f"{split}.parquet")
        files[f"data/{split}-00000-of-00001.parquet"] = (tmp_path / f"{split}.parquet").read_bytes()
    files["README.md"] = b"# a dataset\n"
    files["dataset_config.json"] = json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}}).encode()
    files |= {"loader.py": b"print('a dataset script')\n", "images/cat.png": b"\x89PNG\r\n"}  # never fetched
    with stand_in_module.serving(monkeypatch, tmp_path / "home") as stand_in:
        stand_in.add("org/texts", files, repo_type="dataset")
        records = read_records(Path("org/texts"), split="test")
        assert plain(records) == TEXTS[30:] and records[0][0] == "org/texts: data/test-00000-of-00001.parquet row 0"
        assert not stand_in.unexpected
        fetched = {path.name for path in (tmp_path / "home").rglob("*") if path.is_file()}
        assert {"README.md", "test-00000-of-00001.parquet"} <= fetched and not {"loader.py", "cat.png"} & fetched
        stand_in_module.go_offline(monkeypatch, stand_in)
        assert plain(read_records(Path("org/texts"))) == TEXTS[:30]  # from the cache, the server gone
        # a run trains on it offline and records the commit it read, as it does a model's (hub.HUB_FLAGS)
        assert main(run("seq", Path("org/texts"), tmp_path / "run")) == 0
        snapshot = next((tmp_path / "home").rglob("datasets--org--texts/snapshots/*"))
        assert f"records rendered by {snapshot / 'dataset_config.json'}" in capsys.readouterr().out  # the repo's own
        recipe = (tmp_path / "run" / "recipe.yaml").read_text()
        assert re.search(r"^data_root_path: org/texts@[0-9a-f]{40}$", recipe, re.M), recipe


SUBSETS_CARD = b"""---
license: mit
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train-*.parquet
  - split: test
    path: en/test-*.parquet
- config_name: fr
  data_files: fr/*.parquet
---
# Two subsets, each in its own folder; en names its splits, fr is one list (its split: train)
"""


def fetched(stand_in) -> set[str]:
    """The repository files the stand-in was asked for (HEAD or GET)."""
    return {r.split("/resolve/", 1)[1].split("/", 1)[1] for r in stand_in.requests if "/resolve/" in r}


def test_a_hub_dataset_with_subsets_fetches_only_the_chosen_ones_files(tmp_path, monkeypatch, capsys):
    """The card first; then only the chosen subset's files (and split's, where the card names splits), as the
    stand-in's request log shows; a subset or split the card lacks is refused before any data file is asked for;
    prepare and a run read the same way, the run offline from the pinned commit."""
    stand_in_module = pytest.importorskip("tests.hub_stand_in", reason="tests/hub_stand_in.py (HUB's) is missing")
    rows = {
        "en/train-00000-of-00001.parquet": TEXTS[:10],
        "en/test-00000-of-00001.parquet": TEXTS[10:15],
        "fr/part-0.parquet": TEXTS[20:30],
        "fr/part-1.parquet": TEXTS[30:40],
    }
    files = {"README.md": SUBSETS_CARD}
    for name, part in rows.items():
        datasets.Dataset.from_list(part).to_parquet(tmp_path / "part.parquet")
        files[name] = (tmp_path / "part.parquet").read_bytes()
    (tmp_path / "p.json").write_text(json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}}))
    prepare_argv = [
        "prepare",
        "org/multi",
        "-o",
        str(tmp_path / "out"),
        "-c",
        str(tmp_path / "p.json"),
        "--tokenizer_path",
        "bundled:tiny",
    ]
    with stand_in_module.serving(monkeypatch, tmp_path / "home") as stand_in:
        commit = stand_in.add("org/multi", files, repo_type="dataset")
        refused = [
            ({"subset": "de"}, "--data_subset 'de': data_root_path org/multi has no such subset; it has 'en', 'fr'"),
            ({}, "data_root_path org/multi: has subsets 'en', 'fr'; choose one with --data_subset"),
            (
                {"subset": "en", "split": "validation"},
                "--data_split 'validation': subset 'en' of data_root_path "
                "org/multi has no such split; it has 'train', 'test'",
            ),
        ]
        for choice, message in refused:
            with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
                read_records(Path("org/multi"), **choice)
        assert fetched(stand_in) == {"README.md"}  # the card alone: no data file asked for
        assert main([*prepare_argv, "--data_subset", "fr"]) == 0  # prepare reads ids the same way
        assert capsys.readouterr().out.startswith("records: 20 read, ")
        assert fetched(stand_in) == {"README.md", "fr/part-0.parquet", "fr/part-1.parquet"}
        stand_in.requests.clear()
        records = read_records(Path("org/multi"), subset="en", split="test")
        assert plain(records) == TEXTS[10:15] and records[0][0] == "org/multi: en/test-00000-of-00001.parquet row 0"
        assert fetched(stand_in) - {"README.md"} == {"en/test-00000-of-00001.parquet"}  # not en's train split
        assert not stand_in.unexpected
        stand_in_module.go_offline(monkeypatch, stand_in)
        asked = len(stand_in.requests)
        assert plain(read_records(Path("org/multi"), subset="fr")) == TEXTS[20:40]  # from the cache
        assert plain(read_records(Path(f"org/multi@{commit}"), subset="en", split="test")) == TEXTS[10:15]
        with pytest.raises(
            UserError,
            match=re.escape(
                "HF_HUB_OFFLINE=1 with no cached copy of the Hub dataset org/multi (--data_subset 'en') in "
            ),
        ):
            read_records(Path("org/multi"), subset="en")  # its train split was never fetched
        assert main(run("seq", Path("org/multi"), tmp_path / "run", "--data_subset", "fr")) == 0
        assert len(stand_in.requests) == asked  # not one request offline
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert f"data_root_path: org/multi@{commit}\n" in recipe and "data_subset: fr\n" in recipe
    snapshot = tmp_path / "home" / "hub" / "datasets--org--multi" / "snapshots" / commit
    held = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert held == ["README.md", "en/test-00000-of-00001.parquet", "fr/part-0.parquet", "fr/part-1.parquet"]


BAD_CARDS = [
    ("configs: [{config_name: a, data_files: 3}]", "README.md: configs[0].data_files: is int 3, expected a string, "
     "a list of strings or a list of {split, path} mappings"),
    ("configs: [{config_name: a, data_files: ../../secrets/*.parquet}]",
     "README.md: configs[0].data_files: '../../secrets/*.parquet' is not a path inside the repository (absolute, "
     "or with ..)"),
    ("configs: [{config_name: a, data_files: [{split: train, path: /etc/*.parquet}]}]",
     "README.md: configs[0].data_files[0].path: '/etc/*.parquet' is not a path inside the repository (absolute, "
     "or with ..)"),
    ("configs: [{config_name: a, data_files: x.parquet}, {config_name: a, data_files: y.parquet}]",
     "README.md: configs names 'a' more than once"),
    ("configs: [unclosed", "README.md: its YAML header is not readable YAML ("),
    ("x: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(f"y{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n"
     for i in range(1, 20)) + "configs: *a19", "README.md: its YAML header's aliases (*name) expand it to more than "
     "4,194,304 values (line 8); not a dataset card"),
    ("configs: &a [*a]", "README.md: its YAML header's alias *a is inside the value it names (line 2); not a "
     "dataset card"),
    ("configs: [{config_name: a, data_files: elsewhere/*.parquet}]", "subset 'a' of its README.md names data files "
     "(elsewhere/*.parquet) that match no parquet, arrow, CSV or JSON file of the repository"),
]  # fmt: skip


def test_a_malformed_dataset_card_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    stand_in_module = pytest.importorskip("tests.hub_stand_in", reason="tests/hub_stand_in.py (HUB's) is missing")
    datasets.Dataset.from_list(TEXTS[:4]).to_parquet(tmp_path / "part.parquet")
    (tmp_path / "p.json").write_text(json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}}))
    with stand_in_module.serving(monkeypatch, tmp_path / "home") as stand_in:
        for index, (header, message) in enumerate(BAD_CARDS):
            card = f"---\n{header}\n---\n# a card\n".encode()
            stand_in.add(
                f"org/bad{index}",
                {"README.md": card, "x.parquet": (tmp_path / "part.parquet").read_bytes()},
                repo_type="dataset",
            )
            argv = [
                "prepare",
                f"org/bad{index}",
                "-o",
                str(tmp_path / "out"),
                "-c",
                str(tmp_path / "p.json"),
                "--tokenizer_path",
                "bundled:tiny",
                "--data_subset",
                "a",
            ]
            assert main(argv) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            expected = f"astrai-fabric: error: input org/bad{index}: {message}"
            assert len(lines) == 1 and lines[0].startswith(expected), lines
        assert fetched(stand_in) == {"README.md"} and not stand_in.unexpected  # no data file of any
    assert not (tmp_path / "out").exists()


BLOCKED = """import json, sys
sys.modules["datasets"] = None  # as if the extra were not installed: `import datasets` raises ImportError
from astrai_fabric.cli import main
print(json.dumps([main(argv) for argv in json.loads(sys.argv[1])]))
"""


def test_without_the_extra_jsonl_works_and_other_kinds_say_which_extra(sources, tmp_path):
    (tmp_path / "p.json").write_text('{"input": {"sections": [{"field": "text", "action": "train"}]}}')
    runs = [
        [
            "prepare",
            str(sources / name),
            "-o",
            str(tmp_path / name),
            "-c",
            str(tmp_path / "p.json"),
            "--tokenizer_path",
            "bundled:tiny",
        ]
        for name in ("texts.jsonl", "texts.parquet")
    ]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, json.dumps(runs)], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith("records: 40 read, ") and done.stdout.splitlines()[-1] == "[0, 2]", done.stderr
    assert done.stderr.splitlines() == [
        f"astrai-fabric: error: input {sources / 'texts.parquet'}: reading parquet data "
        "needs the datasets library: pip install 'astrai-fabric[datasets]'"
    ]
    assert (tmp_path / "texts.jsonl").is_dir() and not (tmp_path / "texts.parquet").exists()


def test_what_a_source_does_not_have_is_one_line(sources, tmp_path):
    """Each choice a source cannot honour, named with what it has (the CLI cases: tests/test_hostile_input.py)."""
    datasets.DatasetDict(
        {"a": datasets.Dataset.from_list(TEXTS[:1]), "b": datasets.Dataset.from_list(TEXTS[1:2])}
    ).save_to_disk(tmp_path / "ab")
    (tmp_path / "broken").mkdir()
    for name in ("state.json", "dataset_info.json"):
        (tmp_path / "broken" / name).write_text("{not json")
    (tmp_path / "shards").mkdir()
    for name in ("meta.json", "sequence.bin"):
        (tmp_path / "shards" / name).write_text("")
    cases = [
        (lambda: read_records(tmp_path / "ab"), "splits 'a', 'b' and none is 'train'; choose one with --data_split"),
        (lambda: read_records(tmp_path / "broken"), "broken: not readable by datasets ("),
        (lambda: read_records(sources / "texts.parquet", subset="en"), "is one parquet file, without subsets"),
        (lambda: read_records(sources / "texts.csv", split="test"), "is one csv file, whose only split is 'train'"),
        (lambda: read_records(sources / "dict", subset="en"), "is a save_to_disk directory, without subsets"),
        (lambda: read_records(sources / "texts-saved", split="test"), "holds one dataset, whose split is 'train'"),
        (lambda: read_records(sources / "texts.jsonl", split="train"), "is JSONL, which has no subsets or splits"),
        (lambda: read_records(tmp_path / "shards"), "shards: holds bin shards, not records"),
        (
            lambda: prepare(
                [tmp_path / "shards"], tmp_path / "o", PipelineConfig.from_dict(STREAMED["text"], "c"), TOKENIZER
            ),
            "holds bin shards, already prepared; inputs are records",
        ),
    ]
    for read, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab", "broken", "shards"]


MEASURE = """import json, os, resource, sys, types
from pathlib import Path
package = types.ModuleType("astrai_fabric.data")  # record_size alone, without the package's torch-importing __init__
package.__path__ = [str(Path(sys.argv[1]) / "astrai_fabric" / "data")]
sys.modules["astrai_fabric.data"] = package
import pyarrow.ipc, pyarrow.parquet
from astrai_fabric.data import record_size
from astrai_fabric.errors import UserError


def read(kind, file):
    if kind == "jsonl":
        with open(file, "rb") as handle:
            for _ in record_size.lines(handle, file):
                pass
    else:
        record_size.check_file(Path(file), kind, file)


found = {}
for kind, file in json.loads(sys.argv[3]).items():
    pipe, answer = os.pipe()
    if os.fork() == 0:  # a child's peak starts at what it holds: the read's own peak is the difference
        record_size.MAX_RECORD_BYTES = 0  # a first read of a small file loads what a read loads (code, kernels)
        try:
            read(kind, json.loads(sys.argv[4])[kind])
        except UserError:
            pass
        record_size.MAX_RECORD_BYTES = int(sys.argv[2])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            read(kind, file)
            message = "nothing refused"
        except UserError as err:
            message = str(err)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) << 10
        os.write(answer, json.dumps([message, grown]).encode())
        os._exit(0)
    os.close(answer)
    os.waitpid(-1, 0)
    found[kind] = json.loads(os.read(pipe, 1 << 16))
print(json.dumps(found))
"""


def test_a_record_past_the_limit_is_refused_having_held_a_small_multiple_of_the_limit(tmp_path):
    """The multiple (record_size's docstring): one record 12x the limit, refused, the reading process's peak memory
    growing by at most 3x the limit: about 2x for a JSONL line (read to the limit), 0.6x for CSV (a chunk at a time,
    whatever the limit), none for arrow (memory-mapped, measured from its offsets) and 0.5x for parquet (its footer
    alone). Read whole, it would be 12x or more."""
    limit = 4 << 20
    for name, text in (("d", "x" * (48 << 20)), ("small", "x")):  # small: each reader's first use, not measured
        jsonl(tmp_path / f"{name}.jsonl", [{"text": "hello"}, {"text": text}])
        jsonl(tmp_path / f"{name}.json", [{"text": "hello"}, {"text": text}])
        (tmp_path / f"{name}.csv").write_text(f'text\nhello\n"{text}"\n')
        arrow_file(tmp_path / f"{name}.arrow", [{"text": "hello"}, {"text": text}])
        pa.parquet.write_table(pa.table({"text": [text]}), tmp_path / f"{name}.parquet")
    del text
    kinds = ("jsonl", "json", "csv", "arrow", "parquet")
    files = {kind: str(tmp_path / f"d.{kind}") for kind in kinds}
    small = {kind: str(tmp_path / f"small.{kind}") for kind in kinds}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(ROOT), str(limit), json.dumps(files), json.dumps(small)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    expected = {
        "jsonl": f"{files['jsonl']}:2: a line longer than 4 MiB",
        "json": f"{files['json']}:2: a line longer than 4 MiB",
        "csv": f"{files['csv']} row 1: a row longer than 8 MiB as written",
        "arrow": f"{files['arrow']} row 1: a record of 50,331,648 bytes",
        "parquet": f"{files['parquet']} row 0: 48 MiB per record",
    }
    for kind, (message, grown) in found.items():
        assert message.startswith(expected[kind]), message
        assert grown <= 3 * limit, f"{kind}: {grown / limit:.1f}x the limit"


def test_a_row_group_larger_than_the_limit_is_read_a_batch_at_a_time(tmp_path, monkeypatch):
    """Small records in one row group 24x the limit: read, none refused, and never the whole row group decoded at once
    (what pyarrow holds while the records stream stays under a quarter of it; datasets' reader held all of it)."""
    from astrai_fabric.data import record_size

    monkeypatch.setattr(record_size, "MAX_RECORD_BYTES", 1 << 20)
    rows = [f"{i:08d}" + "y" * 192 for i in range(120_000)]  # 200 bytes each: one row group of 24 MB
    pa.parquet.write_table(pa.table({"text": rows}), tmp_path / "d.parquet", row_group_size=len(rows))
    held = []
    source = open_source(tmp_path / "d.parquet", "parquet")
    read = [record["text"] for _, _, _, record in source.records() if held.append(pa.total_allocated_bytes()) is None]
    assert read == rows
    assert max(held) < len(rows) * 200 // 4, f"{max(held):,} bytes held"


def test_a_message_shows_a_value_in_brief_however_large_it_is():
    """A value read from outside, shown in an error: cut from its first items (errors.brief), never made whole
    first; a card's field of the wrong kind, expanded by aliases to a million values, named in one short line."""
    from astrai_fabric import dataset_card
    from astrai_fabric.errors import brief

    shared: list = ["x"]
    for _ in range(7):  # 10^7 values, as YAML aliases build them (shared): a whole repr would be 50 MB
        shared = [shared] * 10
    assert len(brief(shared)) <= 63 and len(brief("x" * (10 << 20))) <= 63
    header = "x: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"y{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 6)
    )
    with pytest.raises(UserError) as refused:
        dataset_card.subsets(f"---\n{header}configs: [*a5]\n---\n", "README.md")
    message = str(refused.value)
    assert message.startswith("README.md: configs[0]: is list [[[...], [...]") and len(message) < 200, message
