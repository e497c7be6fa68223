"""Data: AstrAI's window arithmetic, bin shards, JSONL tokenisation with role masks, and clear errors."""

import json

import numpy as np
import pytest
import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.data import TokenStream, WindowDataset, load_window_dataset
from astrai_fabric.data.tokenize import tokenize_chats, tokenize_text
from astrai_fabric.errors import UserError
from astrai_fabric.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TINY_MODEL_DIR)


def stream(n: int) -> TokenStream:
    return TokenStream({"sequence": [np.arange(n, dtype=np.int32)]})


@pytest.mark.parametrize(
    "tokens, window, stride, expected_begins",
    [
        (200, 64, None, [0, 64, 128]),  # (200 - 1 - 64) // 64 + 1 = 3; the last reads targets up to 192
        (192, 64, None, [0, 64]),  # 127 // 64 + 1 = 2: a third window would need target 192
        (200, 64, 50, [0, 50, 100]),
        (64, 64, None, []),  # T <= W: no sample
        (65, 64, None, [0]),  # one window and its shifted target fit exactly
    ],
)
def test_window_count_and_positions(tokens, window, stride, expected_begins):
    dataset = WindowDataset(stream(tokens), "seq", window, stride)
    assert len(dataset) == len(expected_begins)
    for i, begin in enumerate(expected_begins):
        sample = dataset[i]
        assert sample["input_ids"].tolist() == list(range(begin, begin + window))
        assert sample["target_ids"].tolist() == list(range(begin + 1, begin + window + 1))


def test_stream_reads_across_shards():
    shards = TokenStream({"sequence": [np.arange(0, 5), np.arange(5, 7), np.arange(7, 12)]})
    assert shards.num_tokens == 12
    assert shards.read("sequence", 3, 9).tolist() == [3, 4, 5, 6, 7, 8]


def write_shard(directory, **arrays) -> None:
    directory.mkdir(parents=True)
    meta = {}
    for key, array in arrays.items():
        array.tofile(directory / f"{key}.bin")
        meta[key] = {"shape": list(array.shape), "dtype": str(array.dtype)}
    (directory / "meta.json").write_text(json.dumps(meta))


def test_bin_shards_are_read_in_sorted_order(tmp_path):
    # Created in reverse order: AstrAI's unsorted glob would follow the filesystem (B23).
    write_shard(tmp_path / "__default__" / "shard_0001", sequence=np.arange(10, 20, dtype=np.int32))
    write_shard(tmp_path / "__default__" / "shard_0000", sequence=np.arange(0, 10, dtype=np.int32))
    dataset = load_window_dataset("seq", tmp_path, window_size=15, stride=None, tokenizer=None)
    assert dataset[0]["input_ids"].tolist() == list(range(15))


def test_seq_ignores_shard_position_ids(tmp_path):
    """seq trains on positions 0..window-1 and never reads the shards' position ids (AstrAI's seq neither), so ids
    past max_position_embeddings (one long document from `prepare` or AstrAI's pipeline) are no reason to refuse."""
    for train_type in ("seq", "sft"):
        write_shard(
            tmp_path / train_type / "shard_0000",
            sequence=np.arange(40, dtype=np.int32),
            loss_mask=np.ones(40, np.int32),
            position_ids=np.arange(40, dtype=np.int32),
        )
    dataset = load_window_dataset("seq", tmp_path / "seq", 8, stride=None, tokenizer=None, max_positions=16)
    assert len(dataset) == 4
    with pytest.raises(UserError, match="position ids must be below the model's max_position_embeddings 16"):
        load_window_dataset("sft", tmp_path / "sft", 8, stride=None, tokenizer=None, max_positions=16)


def test_sft_bin_shards_with_astrai_int32_masks(tmp_path):
    write_shard(
        tmp_path / "shard_0000",
        sequence=np.arange(8, dtype=np.int32),
        loss_mask=np.array([0, 0, 1, 1, 0, 1, 1, 1], dtype=np.int32),  # AstrAI's default dtype for masks
        position_ids=np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int32),
    )
    sample = load_window_dataset("sft", tmp_path, window_size=4, stride=3, tokenizer=None)[1]
    assert sample["input_ids"].tolist() == [3, 4, 5, 6]
    assert sample["position_ids"].tolist() == [3, 0, 1, 2]
    assert sample["loss_mask"].tolist() == [False, True, True, True]  # aligned with targets [4, 5, 6, 7]
    assert sample["loss_mask"].dtype == torch.bool


def test_chat_tokenisation_masks_roles_and_resets_positions(tokenizer):
    record = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}
    out = tokenize_chats([("a:1", record), ("a:2", record)], tokenizer)
    user = tokenizer.encode(tokenizer.render_chat(record["messages"][:1]))
    assistant = tokenizer.encode(tokenizer.render_chat(record["messages"][1:]))
    one = [tokenizer.bos_token_id, *user, *assistant]
    assert out["sequence"].tolist() == one + one
    assert out["loss_mask"].tolist() == ([0] * (1 + len(user)) + [1] * len(assistant)) * 2
    assert out["position_ids"].tolist() == list(range(len(one))) * 2


def test_text_records_are_separated_by_eos(tokenizer):
    out = tokenize_text([("a:1", {"text": "In the beginning"}), ("a:2", {"text": "God"})], tokenizer)
    eos = tokenizer.eos_token_id
    assert out["sequence"].tolist() == [*tokenizer.encode("In the beginning"), eos, *tokenizer.encode("God"), eos]


def test_bad_data_gives_one_clear_error(tmp_path, tokenizer):
    with pytest.raises(UserError, match="data_root_path .*absent: not found"):
        load_window_dataset("seq", tmp_path / "absent", 8, None, tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="the dataset is empty"):
        load_window_dataset("seq", empty, 8, None, tokenizer)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "In the beginning"}) + "\n")
    with pytest.raises(UserError, match=r"tokens hold no window of window_size=64 .*lower window_size"):
        load_window_dataset("seq", short, 64, None, tokenizer)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match=r"wrong.jsonl:2: a seq record needs a string field 'text'"):
        load_window_dataset("seq", wrong, 8, None, tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [}\n')
    with pytest.raises(UserError, match=r"broken.jsonl:1: not valid JSON"):
        load_window_dataset("sft", broken, 8, None, tokenizer)
    write_shard(tmp_path / "bin" / "shard_0000", sequence=np.arange(10, dtype=np.int32))
    (tmp_path / "bin" / "shard_0000" / "sequence.bin").write_bytes(b"\x00" * 12)
    with pytest.raises(UserError, match=r"sequence.bin: expected 40 bytes"):
        load_window_dataset("seq", tmp_path / "bin", 4, None, None)
    write_shard(tmp_path / "seqonly" / "shard_0000", sequence=np.arange(10, dtype=np.int32))
    with pytest.raises(UserError, match=r"sft data needs keys \['loss_mask', 'position_ids'\]"):
        load_window_dataset("sft", tmp_path / "seqonly", 4, None, None)
