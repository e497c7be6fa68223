"""Rebuild the bundled tiny assets: the SFT corpus, the tokenizer and the tiny model's ``config.json``.

    python -m astrai_fabric.assets.build            # sft corpus + tokenizer + config, from the committed seq corpus
    python -m astrai_fabric.assets.build --kjv      # also re-extract the seq corpus (needs Debian's bible-kjv)

Every step is deterministic, so a rebuild reproduces the committed files byte for byte. Provenance: README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).parent
SEQ_CORPUS = ASSETS / "data" / "seq" / "kjv.jsonl"
SFT_CORPUS = ASSETS / "data" / "sft" / "tasks.jsonl"
TINY = ASSETS / "tiny"

KJV_BOOKS = {"Genesis": 50, "Ruth": 4, "Psalms": 150, "Proverbs": 31, "Ecclesiastes": 12}
"""Books taken from the King James Version (public domain), with their chapter counts."""

SPECIAL_TOKENS = {
    "bos_token": "<|begin_of_sentence|>",
    "eos_token": "<|end_of_sentence|>",
    "pad_token": "<|_pad_|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
}
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 2048

TINY_CONFIG = {
    "model_type": "autoregressive_lm",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # both head counts even: tensor parallelism splits them in two
    "intermediate_size": 352,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def extract_kjv() -> list[dict[str, str]]:
    """One record per chapter, verse numbers and line breaks removed, from the ``bible`` program's output."""
    records = []
    for book, chapters in KJV_BOOKS.items():
        for chapter in range(1, chapters + 1):
            out = subprocess.run(["bible", f"{book}{chapter}:1-{book}{chapter}:200"], capture_output=True, text=True)
            # Verses start with an indented number; unindented lines continue the verse above.
            lines = [re.sub(r"^\s+\d+ ", "", ln) for ln in out.stdout.splitlines()[2:] if ln.strip()]
            records.append({"text": " ".join(ln.strip() for ln in lines)})
    return records


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def build_sft(seq_records: list[dict[str, str]], num_records: int = 2400, seed: int = 7) -> list[dict]:
    """Short chats written for the project: arithmetic, word tasks and verse completion, each checkable."""
    rng = random.Random(seed)
    words = sorted({w.lower() for r in seq_records for w in re.findall(r"[A-Za-z]{4,9}", r["text"])})
    verses = [v.strip() for r in seq_records[-43:] for v in re.split(r"(?<=[.;:?!])\s+", r["text"]) if len(v) > 40]

    def arithmetic() -> tuple[str, str]:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."

    def reverse() -> tuple[str, str]:
        w = rng.choice(words)
        return f"Reverse the word '{w}'.", w[::-1]

    def count() -> tuple[str, str]:
        w = rng.choice(words)
        return f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."

    def compare() -> tuple[str, str]:
        a, b = rng.sample(range(1, 1000), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger."

    def upper() -> tuple[str, str]:
        w = " ".join(rng.sample(words, 2))
        return f"Write '{w}' in capital letters.", w.upper()

    def verse() -> tuple[str, str]:
        v = rng.choice(verses).split()
        cut = len(v) // 2
        return f"Complete the verse: {' '.join(v[:cut])}", " ".join(v[cut:])

    tasks = [arithmetic, reverse, count, compare, upper, verse]
    systems = ["You are a concise assistant.", "Answer briefly and exactly."]
    records = []
    for _ in range(num_records):
        question, answer = rng.choice(tasks)()
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": rng.choice(systems)})
        records.append({"messages": messages})
    return records


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE (every byte is in the vocabulary, so no unknown token is needed)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def render_chat(messages: list[dict[str, str]]) -> str:
    """The chat template written out in Python (so this script needs no Jinja; a test checks they agree)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def build(out_dir: Path, seq_records: list[dict[str, str]]) -> None:
    """Write the SFT corpus, the tokenizer files and the tiny ``config.json`` under ``out_dir``."""
    sft_records = build_sft(seq_records)
    write_jsonl(out_dir / SFT_CORPUS.relative_to(ASSETS), sft_records)
    texts = [r["text"] for r in seq_records] + [render_chat(r["messages"]) for r in sft_records]
    tokenizer = build_tokenizer(texts)
    tiny = out_dir / TINY.relative_to(ASSETS)
    tiny.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tiny / "tokenizer.json"))
    tokenizer_config = {"special_tokens": SPECIAL_TOKENS, "chat_template": CHAT_TEMPLATE}
    (tiny / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    config = {**TINY_CONFIG, "vocab_size": tokenizer.get_vocab_size()}
    (tiny / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    num_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    print(f"seq: {len(seq_records)} records, sft: {len(sft_records)} records, {num_tokens} tokens")
    print(f"vocabulary: {tokenizer.get_vocab_size()} ids -> {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kjv", action="store_true", help="re-extract the seq corpus with the `bible` program")
    args = parser.parse_args()
    if args.kjv:
        write_jsonl(SEQ_CORPUS, extract_kjv())
    build(ASSETS, read_jsonl(SEQ_CORPUS))


if __name__ == "__main__":
    main()
