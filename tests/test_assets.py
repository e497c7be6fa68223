"""The bundled tiny assets are present, consistent and reproducible by their build script."""

from astrai_fabric.assets import SEQ_DATA_DIR, SFT_DATA_DIR, TINY_MODEL_DIR, build
from astrai_fabric.config import ModelConfig
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer


def test_tiny_model_config_builds_and_fits_its_tokenizer():
    config = ModelConfig.from_file(TINY_MODEL_DIR / "config.json")
    model = AutoRegressiveLM(config)
    assert config.vocab_size == Tokenizer.from_dir(TINY_MODEL_DIR).vocab_size
    # Tensor parallelism splits heads in two: both head counts must be even.
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0
    assert 0.5e6 < model.num_parameters() < 2e6


def test_corpora_parse_and_have_the_documented_shape():
    seq = build.read_jsonl(SEQ_DATA_DIR / "kjv.jsonl")
    sft = build.read_jsonl(SFT_DATA_DIR / "tasks.jsonl")
    assert len(seq) == 247 and all(set(r) == {"text"} and r["text"] for r in seq)
    assert len(sft) == 2400
    for record in sft:
        roles = [m["role"] for m in record["messages"]]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])


def test_build_reproduces_the_committed_files(tmp_path):
    build.build(tmp_path, build.read_jsonl(build.SEQ_CORPUS))
    committed = (
        "data/sft/tasks.jsonl",
        "data/kto/unpaired.jsonl",
        "tiny/tokenizer.json",
        "tiny/tokenizer_config.json",
        "tiny/config.json",
    )
    for relative in committed:
        assert (tmp_path / relative).read_bytes() == (build.ASSETS / relative).read_bytes(), relative


def test_every_arithmetic_answer_is_correct():
    checked = 0
    for record in build.read_jsonl(SFT_DATA_DIR / "tasks.jsonl"):
        question, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
        if question.startswith("What is "):
            a, op, b = question.removeprefix("What is ").removesuffix("?").split()
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert answer == f"{a} {op} {b} = {value}."
            checked += 1
    assert checked > 300
