"""Record shapes (``data/shapes.py``): each shape's records give the token ids and loss masks of the canonical
records they stand for, through the real tokenisation (``tokenize_chats``, the dpo/grpo datasets) with the bundled
tiny tokenizer (AstrAI's layout) and two Hugging Face-layout tokenizers (Llama 3's and ChatML templates, trained in
``test_hf_tokenizer.py``'s way); detection, ``--data_format``, ``--data_columns``, one shape per source; and one
1-step CLI run per train type on a shaped JSONL.

TRL (the test extra) is the oracle where its conversion exists: the conversational prompt/completion shape against
the ids and completion mask TRL's SFT builds (``apply_chat_template`` of the prompt with the generation prompt and of
the whole conversation, the mask from their common prefix, as ``SFTTrainer`` tokenises), and the implicit-prompt
preference shape against ``trl.data_utils.extract_prompt``. Not compared: TRL's *standard* prompt/completion (strings),
which TRL trains as plain text without a chat template, where sft here renders every shape through the template (a
string prompt is one user turn, AstrAI's rule), and ShareGPT's human/gpt roles, which TRL's ``maybe_convert_to_chatml``
leaves unmapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.cli import main
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.records import PreferenceDataset, PromptDataset
from astrai_fabric.data.shapes import SHAPES, Shaper, shape_records
from astrai_fabric.data.storage import read_jsonl
from astrai_fabric.data.tokenize import tokenize_chats
from astrai_fabric.errors import ConfigError, UserError
from astrai_fabric.tokenizer import Tokenizer

U, A, S = (
    {"role": role, "content": text}
    for role, text in (("user", "What is 2 + 2?"), ("assistant", "Four."), ("system", "Answer briefly."))
)

SFT = [  # (shape, shaped record, the messages it stands for)
    ("sharegpt", {"conversations": [{"from": "system", "value": S["content"]}, {"from": "human", "value": U["content"]},
                                    {"from": "gpt", "value": A["content"]}]}, [S, U, A]),
    ("sharegpt", {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "hello"},
                                    {"from": "human", "value": "and?"}, {"from": "gpt", "value": "bye"}]},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
      {"role": "assistant", "content": "bye"}]),
    ("alpaca", {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
     [{"role": "user", "content": "Add the numbers.\n\n2 and 2"}, {"role": "assistant", "content": "4"}]),
    ("alpaca", {"instruction": "Say hi.", "input": "", "output": "hi", "text": "the whole prompt, unread"},
     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]),
    ("alpaca", {"instruction": "Say hi.", "input": None, "output": "hi", "system": S["content"]},
     [S, {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]),
    ("prompt_completion", {"prompt": U["content"], "completion": A["content"]}, [U, A]),
    ("prompt_completion", {"prompt": [S, U], "completion": [A]}, [S, U, A]),
    ("messages", {"messages": [S, U, A]}, [S, U, A]),
]  # fmt: skip


@pytest.fixture(scope="module", params=["tiny", "llama3", "chatml"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    """The bundled tokenizer, or a Hugging Face directory written by transformers (``save_pretrained``)."""
    if request.param == "tiny":
        return Tokenizer.from_dir(TINY_MODEL_DIR)
    pytest.importorskip("transformers")
    from test_hf_tokenizer import build_tokenizer

    directory = tmp_path_factory.mktemp(request.param)
    build_tokenizer(request.param).save_pretrained(directory)
    return Tokenizer.from_dir(directory)


def numbered(records: list[dict], file: str = "data.jsonl") -> list[tuple[str, dict]]:
    return [(f"{file}:{i}", record) for i, record in enumerate(records, start=1)]


def test_each_sft_shape_tokenises_as_its_messages(tokenizer):
    """Token ids, loss mask and position ids of each shape equal those of its ``messages`` records."""
    for shape, record, messages in SFT:
        shaped, shaper = shape_records(numbered([record, record]), "sft")
        assert [s.name for s, _ in shaper.sources.values()] == [shape]
        ours = tokenize_chats(shaped, tokenizer)
        theirs = tokenize_chats(numbered([{"messages": messages}] * 2), tokenizer)
        for key in ("sequence", "loss_mask", "position_ids"):
            assert np.array_equal(ours[key], theirs[key]), (shape, key)
        assert ours["loss_mask"].any()


def pairs(dataset: PreferenceDataset) -> list[tuple]:
    return [(e.prompt_ids, e.response_ids, e.masks()) for e in dataset.samples]


def test_dpo_shapes_give_the_pairs_of_prompt_chosen_rejected(tokenizer):
    chosen, rejected = [U, A], [U, {"role": "assistant", "content": "Five."}]
    implicit = {"chosen": [S, *chosen], "rejected": [S, *rejected]}
    explicit = {"prompt": [S, U], "chosen": "Four.", "rejected": "Five."}
    listed = {"prompt": [S, U], "chosen": [A], "rejected": [rejected[1]]}
    for record in (implicit, listed):
        shaped, _ = shape_records(numbered([record]), "dpo")
        assert pairs(PreferenceDataset(shaped, tokenizer, 64)) == pairs(
            PreferenceDataset(numbered([explicit]), tokenizer, 64)
        )
    multi_turn = {"chosen": [U, A, U, A], "rejected": [U, A, U, rejected[1]]}  # the first three turns are the prompt
    shaped, _ = shape_records(numbered([multi_turn]), "dpo")
    assert shaped[0][1]["prompt"] == [U, A, U]


def test_grpo_prompts_keep_their_other_columns_for_the_reward(tokenizer):
    records = [{"question": U["content"], "answer": "4", "level": 1}, {"question": "What is 3 + 3?", "answer": "6"}]
    shaped, shaper = shape_records(numbered(records), "grpo", data_columns="prompt=question")
    canonical = [{"prompt": r["question"]} for r in records]
    ours, theirs = PromptDataset(shaped, tokenizer, 64), PromptDataset(numbered(canonical), tokenizer, 64)
    assert [ids for ids, _ in ours.samples] == [ids for ids, _ in theirs.samples]
    assert [r for _, r in ours.samples] == [{**r, "prompt": r["question"]} for r in records]
    assert shaper.describe() == "prompt shape (2 records), columns prompt=question"
    messages, _ = shape_records(numbered([{"prompt": [S, U], "answer": "4"}]), "grpo")
    assert PromptDataset(messages, tokenizer, 64).samples[0][1] == {"prompt": [S, U], "answer": "4"}


# --- TRL's own conversions as the oracle --------------------------------------------------------------------------


def test_conversational_prompt_completion_matches_trls_sft_tokenisation(tmp_path):
    """TRL's SFT on ``{"prompt": [...], "completion": [...]}``: ids of the whole conversation, the completion mask
    from where the prompt's ids (with the generation prompt) end. Ours: the same ids; trained are TRL's completion
    tokens plus the generation prompt (the assistant header goes with its message here, as in every sft record)."""
    pytest.importorskip("transformers")
    data_utils = pytest.importorskip("trl.data_utils")
    from test_hf_tokenizer import build_tokenizer

    for kind in ("llama3", "chatml"):
        theirs = build_tokenizer(kind)
        theirs.save_pretrained(tmp_path / kind)
        ours = Tokenizer.from_dir(tmp_path / kind)
        example = {"prompt": [S, U], "completion": [A]}
        assert data_utils.is_conversational(example)
        texts = data_utils.maybe_apply_chat_template(example, theirs)
        prompt_ids = theirs.apply_chat_template(
            example["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        full_ids = theirs.apply_chat_template(
            example["prompt"] + example["completion"], tokenize=True, return_dict=True
        )["input_ids"]
        prompt_len = data_utils.common_prefix_length(prompt_ids, full_ids)
        trl_mask = [0] * prompt_len + [1] * (len(full_ids) - prompt_len)

        shaped, _ = shape_records(numbered([example]), "sft")
        out = tokenize_chats(shaped, ours)
        assert out["sequence"].tolist() == full_ids
        assert ours.decode(full_ids, skip_special_tokens=False) == texts["prompt"] + texts["completion"]
        mask = out["loss_mask"].tolist()
        assert all(m >= t for m, t in zip(mask, trl_mask, strict=True)), kind  # every TRL-trained token trains
        header = ours.render_chat([S, U], add_generation_prompt=True)[len(ours.render_chat([S, U])) :]
        extra = [i for i, (m, t) in enumerate(zip(mask, trl_mask, strict=True)) if m and not t]
        assert ours.decode([full_ids[i] for i in extra], skip_special_tokens=False) == header, kind


def test_implicit_prompt_matches_trls_extract_prompt():
    data_utils = pytest.importorskip("trl.data_utils")
    examples = [
        {"chosen": [U, A], "rejected": [U, {"role": "assistant", "content": "Five."}]},
        {"chosen": [S, U, A, U, A], "rejected": [S, U, A, U, {"role": "assistant", "content": "No."}]},
    ]
    shaped, _ = shape_records(numbered(examples), "dpo")
    for (_, ours), example in zip(shaped, examples, strict=True):
        theirs = data_utils.maybe_extract_prompt(json.loads(json.dumps(example)))
        assert {k: ours[k] for k in ("prompt", "chosen", "rejected")} == theirs


# --- detection, --data_format, --data_columns, one shape per source ---------------------------------------------


@pytest.mark.parametrize(
    "train_type, record, shape",
    [
        ("seq", {"text": "a", "instruction": "b", "output": "c"}, "text"),
        ("sft", {"text": "a", "instruction": "b", "input": "", "output": "c"}, "alpaca"),  # tatsu-lab/alpaca's columns
        ("sft", {"messages": [U, A], "conversations": None}, "messages"),
        ("sft", {"messages": None, "conversations": [{"from": "human", "value": "x"}]}, "sharegpt"),  # a table's nulls
        ("sft", {"prompt": "p", "completion": "c"}, "prompt_completion"),
        ("dpo", {"prompt": "p", "chosen": "a", "rejected": "b"}, "preference"),
        ("dpo", {"input": "p", "chosen": "a", "rejected": "b"}, "preference"),
        ("dpo", {"chosen": [U, A], "rejected": [U, S | {"role": "assistant"}]}, "implicit_preference"),
        ("grpo", {"prompt": "p", "responses": ["a"], "rewards": [1]}, "groups"),
        ("grpo", {"prompt": "p", "answer": "4"}, "prompt"),
    ],
)  # fmt: skip
def test_the_shape_is_detected_from_the_columns(train_type, record, shape):
    shaper = Shaper(train_type)
    shaper("data.jsonl:1", record)
    assert shaper.sources["data.jsonl"][0] is SHAPES[shape]


def test_data_format_reads_every_record_as_the_shape_it_names():
    record = {"messages": [U, A], "conversations": [{"from": "human", "value": "other"}]}
    ((_, auto),) = shape_records(numbered([record]), "sft")[0]
    ((_, forced),) = shape_records(numbered([record]), "sft", "sharegpt")[0]
    assert auto["messages"] == [U, A] and forced["messages"] == [{"role": "user", "content": "other"}]
    with pytest.raises(UserError, match=r"data.jsonl:1: an sft record needs \['instruction', 'output'\] \(alpaca"):
        shape_records(numbered([record]), "sft", "alpaca")


def test_data_columns_reads_fields_from_other_columns(tokenizer):
    records = [{"question": "Add 2 and 2.", "context": "", "answer": "4"}]
    shaped, shaper = shape_records(
        numbered(records), "sft", data_columns="instruction=question,input=context,output=answer"
    )
    expected = [{"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": "4"}]
    assert shaped[0][1]["messages"] == expected
    assert shaper.describe() == "alpaca shape (1 record), columns instruction=question,input=context,output=answer"
    with pytest.raises(UserError, match=r"data.jsonl:1: a seq record needs a string field 'body', got keys \['text'\]"):
        shape_records(numbered([{"text": "x"}]), "seq", data_columns="text=body")


@pytest.mark.parametrize(
    "train_type, data_format, data_columns, message",
    [
        ("sft", "auto", "instruktion=q", "data_columns: 'instruktion' is not a field of the sft shapes (did you mean "
                                         "'instruction'?)"),
        ("sft", "alpaca", "prompt=q", "data_columns: 'prompt' is not a field of the alpaca shape"),
        ("sft", "auto", "prompt", "data_columns entry 'prompt' must be field=column"),
        ("sft", "auto", "prompt=,completion=a", "data_columns entry 'prompt=' must be field=column"),
        ("sft", "auto", " ", "data_columns is empty: give field=column pairs"),
        ("sft", "auto", "prompt=a,prompt=b", "data_columns names the field 'prompt' twice"),
        ("sft", "auto", "prompt=a,completion=a", "data_columns reads the column 'a' for two fields"),
        ("seq", "alpaca", None, "data_format 'alpaca' is an sft shape; seq reads text (or auto)"),
        ("grpo", "preference", None, "data_format 'preference' is a dpo shape; grpo reads groups, prompt (or auto)"),
    ],
)  # fmt: skip
def test_shape_flags_are_checked_with_the_other_flags(train_type, data_format, data_columns, message):
    args = TrainArgs(
        data_root_path="d", param_path="m", train_type=train_type, data_format=data_format, data_columns=data_columns
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        args.validate()


def test_a_source_holds_one_shape_and_each_file_its_own(tmp_path):
    alpaca = {"instruction": "Say hi.", "output": "hi"}
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    with pytest.raises(
        UserError,
        match=r"data.jsonl:2: the record has the sharegpt shape \(conversations\), but "
        r"data.jsonl:1, the source's first record, has the alpaca shape",
    ):
        shape_records(numbered([alpaca, sharegpt]), "sft")
    with pytest.raises(UserError, match=r"d.parquet row 1: the record has the sharegpt shape"):  # data/sources.py's
        shape_records([("d.parquet row 0", alpaca), ("d.parquet row 1", sharegpt)], "sft")
    (tmp_path / "a.jsonl").write_text(json.dumps(alpaca) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(sharegpt) + "\n" + json.dumps(sharegpt) + "\n")
    shaped, shaper = shape_records(read_jsonl(tmp_path), "sft")
    assert len(shaped) == 3
    assert shaper.describe() == "alpaca shape (1 record in 1 source(s)), sharegpt shape (2 records in 1 source(s))"


# --- one real run per train type on a shaped JSONL ----------------------------------------------------------------

SEEN_RECORDS: list[dict] = []


def remember_records(prompts: list[str], responses: list[list[str]], records: list[dict]) -> list[list[float]]:
    """A reward that keeps the records it is handed (the run calls it in this process: no workers)."""
    SEEN_RECORDS.extend(records)
    return [[float(len(r) % 3) for r in group] for group in responses]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cli(tmp_path: Path, train_type: str, data: str, *extra: str) -> list[str]:
    return [
        train_type,
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        data,
        "--window_size",
        "64",
        "--max_steps",
        "1",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(tmp_path / "out"),
        *extra,
    ]


@pytest.mark.parametrize(
    "train_type, records, extra, plan",
    [
        ("sft", [SFT[2][1], SFT[4][1]] * 4, [], "alpaca shape (8 records), windows of 64 tokens"),
        ("sft", [SFT[0][1], SFT[1][1]] * 4, [], "sharegpt shape (8 records), windows of 64 tokens"),
        ("dpo", [{"chosen": [U, A], "rejected": [U, {"role": "assistant", "content": "Five."}]}] * 2, [],
         "implicit_preference shape (2 records), preference pairs"),
        ("grpo", [{"question": U["content"], "answer": "4"}, {"question": "What is 3 + 3?", "answer": "6"}],
         ["--data_columns", "prompt=question", "--reward", "test_data_shapes.remember_records", "--trust_code",
          "--group_size", "2", "--rollout_max_tokens", "4"],
         "prompt shape (2 records), columns prompt=question, prompts from"),
    ],
    ids=["sft-alpaca", "sft-sharegpt", "dpo-implicit", "grpo-prompts"],
)  # fmt: skip
def test_a_shaped_jsonl_trains(tmp_path, capsys, train_type, records, extra, plan):
    SEEN_RECORDS.clear()
    data = write_jsonl(tmp_path / "data.jsonl", records)
    assert main(cli(tmp_path, train_type, data, *extra)) == 0
    out = capsys.readouterr().out
    assert plan in out
    assert (tmp_path / "out" / "epoch_0_step_1" / "model.safetensors").is_file()
    if train_type == "grpo":  # the reward saw each record's other columns
        assert SEEN_RECORDS and all(set(r) >= {"question", "answer", "prompt"} for r in SEEN_RECORDS)


# --- prepare reads the shapes as training does ----------------------------------------------------------------------

CHAT_PIPELINE = {"input": {"sections": [{"field": "messages", "action": "$role", "template": True}]},
                 "mask": {"assistant": "train"}, "preprocessing": {"min_chars": 0},
                 "output": {"max_tokens_per_shard": 200}}  # fmt: skip
"""The quickstart's chat pipeline, in shards of a few records: a resume starts inside a file."""
TINY = Tokenizer.from_dir(TINY_MODEL_DIR)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_prepare_writes_for_each_sft_shape_the_bytes_of_its_messages_records(tmp_path, monkeypatch, capsys):
    """A directory with one file per shape (sharegpt, alpaca, prompt_completion) against the same records as
    ``messages``: the same shards, with one process, two, and two killed midway then resumed (the shape each file
    was found to have is kept in the staging state: the resumed part is converted as the rest)."""
    from astrai_fabric.data.prepare import PipelineConfig, prepare
    from astrai_fabric.errors import TrainingError

    monkeypatch.setattr("astrai_fabric.data.prepare.CHUNK_BYTES", 200)  # a few records a chunk: both workers busy
    shaped, canonical = tmp_path / "shaped", tmp_path / "canonical"
    shaped.mkdir(), canonical.mkdir()
    for shape in ("sharegpt", "alpaca", "prompt_completion"):
        entries = [(record, messages) for name, record, messages in SFT if name == shape] * 5
        write_jsonl(shaped / f"{shape}.jsonl", [record for record, _ in entries])
        write_jsonl(canonical / f"{shape}.jsonl", [{"messages": messages} for _, messages in entries])
    (tmp_path / "chat.json").write_text(json.dumps(CHAT_PIPELINE))
    argv = [
        "prepare",
        str(canonical),
        "-o",
        str(tmp_path / "canonical-out"),
        "-c",
        str(tmp_path / "chat.json"),
        "--tokenizer_path",
        "bundled:tiny",
    ]
    assert main(argv) == 0
    assert "records read as" not in capsys.readouterr().out  # messages records: read as they are
    expected = shard_bytes(tmp_path / "canonical-out")
    assert len([name for name in expected if name.endswith("meta.json")]) > 3
    config = PipelineConfig.from_dict(CHAT_PIPELINE, "chat.json")
    for n in (1, 2):
        summary = prepare([shaped], tmp_path / f"out{n}", config, TINY, num_proc=n)
        assert shard_bytes(tmp_path / f"out{n}") == expected, n
    assert "records read as alpaca shape (15 records in 1 source(s)), prompt_completion shape (10 records in 1 " in (
        summary
    )
    # Each worker SIGKILLs itself at its 7th chunk: that is the run's 7th chunk or later, submitted only once the
    # first 3 were written (at most 4 in flight), and the first shard closes after the 3rd (an earlier crash could
    # take the pool down before any result came back, and leave nothing to resume).
    monkeypatch.setenv("ASTRAI_FABRIC_CRASH_AT", "prepare-worker@7")
    with pytest.raises(TrainingError, match="a tokenising worker died"):
        prepare([shaped], tmp_path / "resumed", config, TINY, num_proc=2)
    monkeypatch.delenv("ASTRAI_FABRIC_CRASH_AT")
    state = json.loads((tmp_path / ".resumed.prepare-partial" / "prepare_state.json").read_text())
    assert state["next"]["record"] > 0 and state["shapes"] == {
        "0:0": "alpaca",
        "1:0": "prompt_completion",
        "2:0": "sharegpt",
    }
    prepare([shaped], tmp_path / "resumed", config, TINY, num_proc=2, resume=True)
    assert shard_bytes(tmp_path / "resumed") == expected


def test_prepare_reads_a_field_from_another_column(tmp_path, capsys):
    """``--data_columns`` (and ``--data_format``) on prepare, spelled as training's: seq ``text=body`` gives the
    shards of the ``text`` records, and a record that has no column of any shape is left for the pipeline to drop,
    as before shapes (AstrAI's reading)."""
    bodies = ["In the beginning God created", "the heaven and the earth"]
    write_jsonl(tmp_path / "texts.jsonl", [{"text": body} for body in bodies] + [{}])
    write_jsonl(tmp_path / "bodies.jsonl", [{"body": body} for body in bodies] + [{}])
    (tmp_path / "seq.json").write_text(
        json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 0}})
    )
    for name, extra in (("texts", []), ("bodies", ["--data_format", "text", "--data_columns", "text=body"])):
        argv = [
            "prepare",
            str(tmp_path / f"{name}.jsonl"),
            "-o",
            str(tmp_path / f"{name}-out"),
            "-c",
            str(tmp_path / "seq.json"),
            "--tokenizer_path",
            "bundled:tiny",
            *extra,
        ]
        assert main(argv) == 0
        assert "records: 3 read, 2 kept, dropped: 1 no tokens\n" in capsys.readouterr().out
    assert shard_bytes(tmp_path / "bodies-out") == shard_bytes(tmp_path / "texts-out")
