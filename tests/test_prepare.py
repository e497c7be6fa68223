"""`astrai-fabric prepare`: JSONL -> AstrAI bin shards -> the training windows and masks, checked by hand."""

import faulthandler
import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import astrai_fabric.data.prepare as prepare_module
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.cli import main
from astrai_fabric.data import load_window_dataset
from astrai_fabric.data.prepare import PipelineConfig, prepare
from astrai_fabric.errors import TrainingError, UserError
from astrai_fabric.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)
PROMPT_ANSWER = {"input": {"sections": [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]},
                 "preprocessing": {"min_chars": 0}}  # fmt: skip


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def shard(out, key):
    (directory,) = out.glob("__default__/shard_*")
    meta = json.loads((directory / "meta.json").read_text())[key]
    return np.fromfile(directory / f"{key}.bin", dtype=meta["dtype"])


def test_masked_record_after_unmasked_ones_stays_aligned(tmp_path):
    # AstrAI's B9: a record without a masked part, then one with a masked prompt -> its loss_mask came out shorter
    # than its tokens and misaligned every mask after it.
    records = write(tmp_path / "in.jsonl", [{"answer": "Amen."}, {"prompt": "Pray", "answer": "Amen."}])
    prepare([records], tmp_path / "out", PipelineConfig.from_dict(PROMPT_ANSWER, "cfg"), TOKENIZER)
    answer = TOKENIZER.encode("Amen.")  # the first section of a record is encoded with special tokens (none here)
    prompt = TOKENIZER.encode("Pray")
    tail = TOKENIZER.encode("Amen.", add_special_tokens=False)
    assert shard(tmp_path / "out", "sequence").tolist() == answer + prompt + tail
    assert shard(tmp_path / "out", "loss_mask").tolist() == [1] * len(answer) + [0] * len(prompt) + [1] * len(tail)
    assert shard(tmp_path / "out", "position_ids").tolist() == list(range(len(answer))) + list(
        range(len(prompt + tail))
    )


def test_chat_round_trip_to_training_windows(tmp_path):
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}
    records = write(tmp_path / "chat.jsonl", [chat, chat])
    config = {
        "input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
        "mask": {"assistant": "train"},
    }
    prepare([records], tmp_path / "out", PipelineConfig.from_dict(config, "cfg"), TOKENIZER)
    user = TOKENIZER.encode(TOKENIZER.render_chat(chat["messages"][:1]))
    assistant = TOKENIZER.encode(TOKENIZER.render_chat(chat["messages"][1:]))
    one = [TOKENIZER.bos_token_id, *user, *assistant]
    mask = [0] * (1 + len(user)) + [1] * len(assistant)
    # The dataset reads the shards exactly as it reads the same JSONL (one window covering both records).
    dataset = load_window_dataset("sft", tmp_path / "out", window_size=2 * len(one) - 1, stride=None, tokenizer=None)
    sample = dataset[0]
    assert sample["input_ids"].tolist() == (one + one)[:-1]
    assert sample["target_ids"].tolist() == (one + one)[1:]
    assert sample["loss_mask"].tolist() == [bool(m) for m in (mask + mask)[1:]]  # shifted with the targets
    assert sample["position_ids"].tolist() == (list(range(len(one))) * 2)[:-1]
    from_jsonl = load_window_dataset("sft", records, 2 * len(one) - 1, None, TOKENIZER)[0]
    assert all((from_jsonl[k] == sample[k]).all() for k in sample)


def test_text_documents_end_with_eos_and_filters_count(tmp_path, capsys):
    records = write(tmp_path / "text.jsonl", [{"text": "In the beginning God created"}, {"text": "short"}, {}])
    config = tmp_path / "seq.json"
    config.write_text(
        json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 10}})
    )
    argv = ["prepare", str(records), "-o", str(tmp_path / "out"), "-c", str(config), "--tokenizer_path", "bundled:tiny"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert "records: 3 read, 1 kept, dropped: 2 shorter than min_chars" in summary
    assert shard(tmp_path / "out", "sequence").tolist() == [*TOKENIZER.encode("In the beginning God created"), 1]
    assert not list((tmp_path / "out").glob("*/*/loss_mask.bin"))  # plain text: every token trains
    assert main(argv) == 2  # the output exists now: never overwritten
    assert "exists and is not empty" in capsys.readouterr().err


def test_bfd_packing_and_domains(tmp_path):
    records = write(
        tmp_path / "in.jsonl",
        [
            {"text": "a " * 3, "lang": "en"},
            {"text": "b " * 9, "lang": "en"},
            {"text": "c " * 5, "lang": "xx"},
        ],
    )
    config = {
        "input": {"sections": [{"field": "text", "action": "train"}]},
        "preprocessing": {"min_chars": 0, "packing_strategy": "bfd", "max_packed_len": 64, "append_eos": False},
        "output": {"domain_key": "lang", "dtype": {"sequence": "int64"}},
    }
    prepare([records], tmp_path / "out", PipelineConfig.from_dict(config, "cfg"), TOKENIZER)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["en", "xx"]
    meta = json.loads((tmp_path / "out" / "en" / "shard_0000" / "meta.json").read_text())
    assert meta["sequence"]["dtype"] == "int64"
    sequence = np.fromfile(tmp_path / "out" / "en" / "shard_0000" / "sequence.bin", dtype="int64").tolist()
    assert sequence == TOKENIZER.encode("b " * 9) + TOKENIZER.encode("a " * 3)  # longest first


@pytest.mark.parametrize(
    "config, message",
    [
        ({"input": {"sections": [{"field": "t", "action": "train"}]}, "prepocessing": {}},
         r"unknown key\(s\) prepocessing"),
        ({"input": {"sources": {}}}, r"input.sources \(dpo/grpo outputs\) is not supported"),
        ({"input": {"sections": [{"field": "t", "action": "keep"}]}}, r"needs a 'field' and an 'action'"),
        ({"input": {"sections": [{"field": "t", "action": "train"}]}, "preprocessing": {"packing_strategy": "x"}},
         r"preprocessing.packing_strategy 'x'"),
    ],
)  # fmt: skip
def test_bad_pipeline_configs(config, message):
    with pytest.raises(UserError, match=message):
        PipelineConfig.from_dict(config, "pipeline.json")


# --- streaming, --num_proc, --resume ---------------------------------------------------------------------------------

SFT = [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]
STREAMED = {
    "simple": {"input": {"sections": SFT}, "preprocessing": {"min_chars": 0, "max_packed_len": 16, "max_seq_len": 64},
               "output": {"domain_key": "lang", "max_tokens_per_shard": 100}},
    "bfd": {"input": {"sections": SFT},
            "preprocessing": {"min_chars": 0, "packing_strategy": "bfd", "max_packed_len": 40},
            "output": {"domain_key": "lang", "max_tokens_per_shard": 100, "position_ids_mode": "continuous"}},
    "bfd_split": {"input": {"sections": SFT},
                  "preprocessing": {"min_chars": 0, "packing_strategy": "bfd_split", "max_packed_len": 24},
                  "output": {"domain_key": "lang", "max_tokens_per_shard": 100, "dtype": {"sequence": "int64"}}},
    "text": {"input": {"sections": [{"field": "answer", "action": "train"}]},
             "preprocessing": {"min_chars": 20, "max_seq_len": 20, "truncation_mode": "keep_end"},
             "output": {"max_tokens_per_shard": 150}},
}  # fmt: skip
BEFORE_STREAMING = {
    "simple": "4bc74503d571f6209098084b909c218322d556a90b4939d998eebe0be67b9ee8",
    "bfd": "2890433546dec1ecb9f870829642bb5a1adbf6607f4113c766d82e2ef497b238",
    "bfd_split": "20d67717aad10dcdfda7093a868e84de5d6e9ffd18ffe2e96e989c9db23cd356",
    "text": "bbe7e079c02eb370cf5ee63775dc508cbd06625525ec9930c37bb07ccd806506",
}
"""Digests of the output of `prepare` as it was before streaming (commit 287ea38, which held every record in memory
and packed each shard at the end) on `mixed_records()` with the bundled tiny tokenizer: 15 shards over four
domains (6 for "text"), shard sizes, cuts, bfd orders, continuous positions and an int64 sequence among them."""


def mixed_records(path):
    records = []
    for i in range(60):
        record = {"prompt": f"Question {i}: " + "why " * (i % 7), "answer": "because " * (i * 5 % 23 + 1)}
        if i % 5:
            record["lang"] = ["en", "xx", "yy"][i % 3]
        records.append(record)
    return write(path, records)


def digest(out):
    """One hash over every file's relative path and bytes."""
    h = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(out)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def pipeline(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(STREAMED[name]))
    return path


@pytest.mark.parametrize("name", list(STREAMED))
def test_streamed_shards_are_the_bytes_prepare_wrote_before_streaming(tmp_path, name):
    records = mixed_records(tmp_path / "in.jsonl")
    prepare([records], tmp_path / "out", PipelineConfig.from_dict(STREAMED[name], "cfg"), TOKENIZER)
    assert digest(tmp_path / "out") == BEFORE_STREAMING[name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]  # the staging folder is gone


def test_two_processes_write_the_bytes_of_one(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 300)  # a chunk of a few records: both workers busy, in turn
    records = mixed_records(tmp_path / "in.jsonl")
    config = PipelineConfig.from_dict(STREAMED["bfd"], "cfg")
    summaries = [prepare([records], tmp_path / f"out{n}", config, TOKENIZER, num_proc=n) for n in (1, 2)]
    assert digest(tmp_path / "out1") == digest(tmp_path / "out2") == BEFORE_STREAMING["bfd"]
    assert summaries[0].replace("out1", "out2") == summaries[1]


def test_a_killed_prepare_resumes_to_the_same_bytes(tmp_path, capsys):
    # A real prepare process, SIGKILLed (as a power cut would) right after its third shard is recorded.
    records = mixed_records(tmp_path / "in.jsonl")
    argv = [
        "prepare",
        str(records),
        "-o",
        str(tmp_path / "out"),
        "-c",
        str(pipeline(tmp_path, "bfd")),
        "--tokenizer_path",
        "bundled:tiny",
    ]
    env = {**os.environ, "ASTRAI_FABRIC_CRASH_AT": "prepare-shard@3", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", "astrai_fabric", *argv], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    staging = tmp_path / ".out.prepare-partial"
    assert not (tmp_path / "out").exists() and len(list(staging.glob("shards/*/shard_*/meta.json"))) == 3
    assert main(argv) == 2  # without --resume: refused, the finished shards kept
    assert f"an unfinished prepare of it is in {staging}; add --resume" in capsys.readouterr().err
    other = [*argv[:-4], "-c", str(pipeline(tmp_path, "simple")), *argv[-2:], "--resume"]
    assert main(other) == 2
    assert "holds a prepare of a different pipeline (-c);" in capsys.readouterr().err
    assert main([*argv, "--resume", "--num_proc", "2"]) == 0  # the process count is not part of the run
    assert digest(tmp_path / "out") == BEFORE_STREAMING["bfd"] and not staging.exists()
    resumed = capsys.readouterr().out.splitlines()
    whole = prepare([records], tmp_path / "whole", PipelineConfig.from_dict(STREAMED["bfd"], "cfg"), TOKENIZER)
    assert resumed[:2] == whole.splitlines()[:2]  # each record counted once: "records: 60 read, ..."


@pytest.mark.parametrize(
    "point",
    [
        "prepare-shard-open@3",  # the third shard's folder made, nothing in it
        "prepare-shard-data@2",  # the second shard's arrays synced, its meta.json not written
        "prepare-synced@4",  # the second shard's meta.json written beside its place, not renamed into it
        "prepare-synced@5",  # the state after it, likewise
        "prepare-shard-meta@2",  # the second shard whole, the state not yet saying so
        "prepare-output@1",  # the output renamed into place, the staging folder not yet removed
    ],
)
def test_a_prepare_killed_at_each_step_of_publishing_resumes_to_the_same_bytes(tmp_path, capsys, point):
    """SIGKILL (a power cut) at each step of publishing a shard and the output (``faults.crash_point``), then the
    same command with ``--resume``: the same bytes as a run never killed, the same summary, no staging folder left."""
    records = mixed_records(tmp_path / "in.jsonl")
    argv = ["prepare", str(records), "-o", str(tmp_path / "out"), "-c", str(pipeline(tmp_path, "bfd"))]
    argv += ["--tokenizer_path", "bundled:tiny"]
    env = {**os.environ, "ASTRAI_FABRIC_CRASH_AT": point, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", "astrai_fabric", *argv], env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err[-2000:]
    assert digest(tmp_path / "out") == BEFORE_STREAMING["bfd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bfd.json", "in.jsonl", "out"]  # no staging folder
    whole = prepare([records], tmp_path / "whole", PipelineConfig.from_dict(STREAMED["bfd"], "cfg"), TOKENIZER)
    assert capsys.readouterr().out.strip() == whole.replace(str(tmp_path / "whole"), str(tmp_path / "out"))


def test_a_dead_worker_stops_the_run_and_the_run_resumes(tmp_path, monkeypatch):
    faulthandler.dump_traceback_later(60, exit=True)  # a lost result must fail the run, never wait for it
    monkeypatch.setattr(prepare_module, "CHUNK_BYTES", 300)
    monkeypatch.setenv("ASTRAI_FABRIC_CRASH_AT", "prepare-worker@5")  # each worker SIGKILLs itself at its fifth chunk
    records = mixed_records(tmp_path / "in.jsonl")
    config = PipelineConfig.from_dict(STREAMED["simple"], "cfg")
    with pytest.raises(TrainingError, match="a tokenising worker died .* run the same command with --resume"):
        prepare([records], tmp_path / "out", config, TOKENIZER, num_proc=2)
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.prepare-partial").is_dir()
    monkeypatch.delenv("ASTRAI_FABRIC_CRASH_AT")
    prepare([records], tmp_path / "out", config, TOKENIZER, num_proc=2, resume=True)
    assert digest(tmp_path / "out") == BEFORE_STREAMING["simple"]
    faulthandler.cancel_dump_traceback_later()


def test_a_malformed_last_record_is_found_before_anything_is_written(tmp_path):
    records = mixed_records(tmp_path / "in.jsonl")
    with open(records, "a") as f:
        f.write('{"prompt": "no closing brace"\n')
    # Only 10 records are prepared, but every line is checked first (as before streaming).
    config = {**STREAMED["simple"], "preprocessing": {**STREAMED["simple"]["preprocessing"], "max_items": 10}}
    with pytest.raises(UserError, match=r"in.jsonl:61: not valid JSON"):
        prepare([records], tmp_path / "out", PipelineConfig.from_dict(config, "cfg"), TOKENIZER)
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
