"""Rebuild the bundled tiny assets: the SFT corpus, the tokenizer and the tiny model's ``config.json``.

    python -m astrai_fabric.assets.build            # sft corpus + tokenizer + config, from the committed seq corpus
    python -m astrai_fabric.assets.build --kjv      # also re-extract the seq corpus (needs Debian's bible-kjv)

Every step is deterministic, so a rebuild reproduces the committed files byte for byte. Provenance: README.md.
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import subprocess
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).parent
SEQ_CORPUS = ASSETS / "data" / "seq" / "kjv.jsonl"
SFT_CORPUS = ASSETS / "data" / "sft" / "tasks.jsonl"
DPO_PAIRS = ASSETS / "data" / "dpo" / "pairs.jsonl"
KTO_RECORDS = ASSETS / "data" / "kto" / "unpaired.jsonl"
GRPO_GROUPS = ASSETS / "data" / "grpo" / "groups.jsonl"
GRPO_PROMPTS = ASSETS / "data" / "grpo_online" / "prompts.jsonl"
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


class Tasks:
    """Checkable question/answer tasks written for the project; every draw consumes ``rng`` the same way."""

    def __init__(self, seq_records: list[dict[str, str]], rng: random.Random) -> None:
        self.rng = rng
        self.words = sorted({w.lower() for r in seq_records for w in re.findall(r"[A-Za-z]{4,9}", r["text"])})
        self.verses = [
            v.strip() for r in seq_records[-43:] for v in re.split(r"(?<=[.;:?!])\s+", r["text"]) if len(v) > 40
        ]  # Proverbs and Ecclesiastes

    def arithmetic(self) -> tuple[str, str]:
        a, b = self.rng.randint(2, 99), self.rng.randint(2, 99)
        op = self.rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."

    def reverse(self) -> tuple[str, str]:
        w = self.rng.choice(self.words)
        return f"Reverse the word '{w}'.", w[::-1]

    def count(self) -> tuple[str, str]:
        w = self.rng.choice(self.words)
        return f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."

    def compare(self) -> tuple[str, str]:
        a, b = self.rng.sample(range(1, 1000), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger."

    def upper(self) -> tuple[str, str]:
        w = " ".join(self.rng.sample(self.words, 2))
        return f"Write '{w}' in capital letters.", w.upper()

    def verse(self) -> tuple[str, str]:
        v = self.rng.choice(self.verses).split()
        cut = len(v) // 2
        return f"Complete the verse: {' '.join(v[:cut])}", " ".join(v[cut:])

    def draw(self) -> tuple[str, str]:
        kinds = [self.arithmetic, self.reverse, self.count, self.compare, self.upper, self.verse]
        return self.rng.choice(kinds)()


def wrong_answer(question: str, answer: str, rng: random.Random) -> str:
    """A plausible but wrong answer to one of the ``Tasks`` questions."""
    if match := re.fullmatch(r"(.* = )(-?\d+)\.", answer):  # arithmetic: off by a little
        return f"{match[1]}{int(match[2]) + rng.choice([-3, -2, -1, 1, 2, 10])}."
    if match := re.fullmatch(r"('\w+' has )(\d+)( letters\.)", answer):
        return f"{match[1]}{int(match[2]) + rng.choice([-2, -1, 1, 2])}{match[3]}"
    if match := re.fullmatch(r"Which is larger, (\d+) or (\d+)\?", question):
        return f"{min(int(match[1]), int(match[2]))} is larger."
    if answer.isupper():
        return answer.title()
    if question.startswith("Reverse"):
        return answer[::-1]  # the word itself, not reversed
    return " ".join(rng.sample(answer.split(), len(answer.split())))  # a verse ending, words shuffled


def build_sft(seq_records: list[dict[str, str]], num_records: int = 2400, seed: int = 7) -> list[dict]:
    """Short chats: arithmetic, word tasks and verse completion, a quarter with a system prompt."""
    rng = random.Random(seed)
    tasks = Tasks(seq_records, rng)
    systems = ["You are a concise assistant.", "Answer briefly and exactly."]
    records = []
    for _ in range(num_records):
        question, answer = tasks.draw()
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": rng.choice(systems)})
        records.append({"messages": messages})
    return records


def build_dpo(seq_records: list[dict[str, str]], num_records: int = 600, seed: int = 11) -> list[dict]:
    """Preference pairs: the right answer chosen, a plausible wrong one rejected."""
    rng = random.Random(seed)
    tasks = Tasks(seq_records, rng)
    records = []
    for _ in range(num_records):
        question, answer = tasks.draw()
        records.append({"prompt": question, "chosen": answer, "rejected": wrong_answer(question, answer, rng)})
    return records


def build_kto(dpo_records: list[dict], seed: int = 19) -> list[dict]:
    """Unpaired preferences for kto (TRL's ``prompt``/``completion``/``label`` form): each dpo pair split into its
    chosen answer (desirable) and its rejected one (undesirable), shuffled so a pair's halves are rarely neighbours."""
    records = [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
        for r in dpo_records
        for side in ("chosen", "rejected")
    ]
    random.Random(seed).shuffle(records)
    return records


def build_grpo(seq_records: list[dict[str, str]], num_records: int = 300, seed: int = 13) -> list[dict]:
    """Groups of 4 scored responses: the right answer and 3 wrong ones, rewarded by their similarity to it."""
    rng = random.Random(seed)
    tasks = Tasks(seq_records, rng)
    records = []
    for _ in range(num_records):
        question, answer = tasks.draw()
        responses = [answer] + [wrong_answer(question, answer, rng) for _ in range(3)]
        rng.shuffle(responses)
        rewards = [round(difflib.SequenceMatcher(None, r, answer).ratio(), 4) for r in responses]
        records.append({"prompt": question, "responses": responses, "rewards": rewards})
    return records


def build_prompts(seq_records: list[dict[str, str]], num_records: int = 200, seed: int = 17) -> list[dict]:
    """Arithmetic prompts with their answer, for online GRPO (``ExactMatchReward`` reads ``answer``)."""
    tasks = Tasks(seq_records, random.Random(seed))
    return [dict(zip(("prompt", "answer"), tasks.arithmetic(), strict=True)) for _ in range(num_records)]


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
    """Write the SFT, DPO, KTO and GRPO data, the tokenizer files and the tiny ``config.json`` under ``out_dir``."""
    sft_records = build_sft(seq_records)
    write_jsonl(out_dir / SFT_CORPUS.relative_to(ASSETS), sft_records)
    dpo_records = build_dpo(seq_records)
    write_jsonl(out_dir / DPO_PAIRS.relative_to(ASSETS), dpo_records)
    write_jsonl(out_dir / KTO_RECORDS.relative_to(ASSETS), build_kto(dpo_records))
    write_jsonl(out_dir / GRPO_GROUPS.relative_to(ASSETS), build_grpo(seq_records))
    write_jsonl(out_dir / GRPO_PROMPTS.relative_to(ASSETS), build_prompts(seq_records))
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
