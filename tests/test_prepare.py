"""`astrai-fabric prepare`: JSONL -> AstrAI bin shards -> the training windows and masks, checked by hand."""

import json

import numpy as np
import pytest

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.cli import main
from astrai_fabric.data import load_window_dataset
from astrai_fabric.data.prepare import PipelineConfig, prepare
from astrai_fabric.errors import UserError
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
    config = {"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
              "mask": {"assistant": "train"}}  # fmt: skip
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
    config.write_text(json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]},
                                  "preprocessing": {"min_chars": 10}}))  # fmt: skip
    argv = ["prepare", str(records), "-o", str(tmp_path / "out"), "-c", str(config), "--tokenizer_path", "bundled:tiny"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert "records: 3 read, 1 kept, dropped: 2 shorter than min_chars" in summary
    assert shard(tmp_path / "out", "sequence").tolist() == [*TOKENIZER.encode("In the beginning God created"), 1]
    assert not list((tmp_path / "out").glob("*/*/loss_mask.bin"))  # plain text: every token trains
    assert main(argv) == 2  # the output exists now: never overwritten
    assert "exists and is not empty" in capsys.readouterr().err


def test_bfd_packing_and_domains(tmp_path):
    records = write(tmp_path / "in.jsonl", [
        {"text": "a " * 3, "lang": "en"}, {"text": "b " * 9, "lang": "en"}, {"text": "c " * 5, "lang": "xx"},
    ])  # fmt: skip
    config = {"input": {"sections": [{"field": "text", "action": "train"}]},
              "preprocessing": {"min_chars": 0, "packing_strategy": "bfd", "max_packed_len": 64, "append_eos": False},
              "output": {"domain_key": "lang", "dtype": {"sequence": "int64"}}}  # fmt: skip
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
