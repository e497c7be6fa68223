"""The bundled tokenizer in AstrAI's layout, and the loader's errors (every field of tokenizer_config.json checked)."""

import json
import re

import pytest

from astrai_fabric import tokenizer as tokenizer_module
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.assets.build import render_chat
from astrai_fabric.errors import UserError
from astrai_fabric.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TINY_MODEL_DIR)


def test_special_tokens_and_vocabulary(tokenizer):
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.stop_ids == [0, 1, 2, 3, 4]


def test_encode_decode_round_trip(tokenizer):
    text = "Wisdom is the principal thing; 17 + 25 = 42."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_sample_cut_inside_a_character_decodes_to_whole_characters(tokenizer):
    text = "héllo ✓ 漢字"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the last character spans several byte tokens
    for end in range(len(ids) + 1):
        whole = tokenizer.decode_whole_chars(ids[:end])
        assert "\ufffd" not in whole and text.startswith(whole), (end, whole)
    assert tokenizer.decode_whole_chars([*ids, tokenizer.eos_token_id]) == tokenizer.decode(ids) == text


def test_chat_template_matches_the_python_rendering_used_to_train_the_tokenizer(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
    ]
    assert tokenizer.render_chat(messages) == render_chat(messages)
    prompt = tokenizer.render_chat(messages[:2], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages[:2])
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_files_are_the_two_astrai_files(tokenizer):
    assert sorted(tokenizer.files) == ["tokenizer.json", "tokenizer_config.json"]


def test_missing_and_broken_files_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match=r"tokenizer.json: file not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match=r"tokenizer.json: not a valid tokenizers file"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((TINY_MODEL_DIR / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"special_tokens": {"eos_token": "<|nope|>"}}))
    with pytest.raises(UserError, match=r"special tokens not in the vocabulary: \['<\|nope\|>'\]"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    with pytest.raises(UserError, match="no 'chat_template'"):
        Tokenizer.from_dir(tmp_path).render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("value", [[[1]], {"x": [1]}], ids=["list-of-lists", "map-of-lists"])
@pytest.mark.parametrize("field", list(tokenizer_module._FIELD_KINDS))
def test_every_field_of_the_config_has_its_kind_checked(tmp_path, field, value):
    """A list or map where a string (or a token) is expected is one error naming the file, the field and the kind
    expected, before the value is used as a key, compared or hashed."""
    (tmp_path / "tokenizer.json").write_bytes((TINY_MODEL_DIR / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({field: value}))
    kind = tokenizer_module._FIELD_KINDS[field][0]
    with pytest.raises(UserError, match=re.escape(f"tokenizer_config.json: {field!r} must {kind}, got ")):
        Tokenizer.from_dir(tmp_path)


def test_a_nested_list_of_extra_special_tokens_is_refused_by_name(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((TINY_MODEL_DIR / "tokenizer.json").read_bytes())
    config = {"eos_token": "<|end_of_sentence|>", "additional_special_tokens": [["<|im_start|>"]]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    message = "'additional_special_tokens' must be a list of token strings or AddedTokens, got [["
    with pytest.raises(UserError, match=re.escape(message)):
        Tokenizer.from_dir(tmp_path)
