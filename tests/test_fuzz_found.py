"""What the fuzz tier (tests/test_fuzz.py) found, one deterministic case per distinct failure: the shrunk example,
through the same fork server and promise check (all at once: a hang costs its deadline once). Each is marked
``xfail(strict=True)``: it fails today, and whoever fixes the package removes the mark (strict, so that a fix which
forgets to is noticed). tests/fuzz_inputs.py leaves each shape out of its strategies, naming the case here.
"""

from __future__ import annotations

import json

import pytest
from fuzz_inputs import TINY_CONFIG, Example, bundled_records, check_all, train

from astrai_fabric.assets import resolve

HANG_S = 10.0
"""A found hang's deadline: its valid neighbours finish in about a second."""


def found(reason: str):
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"fuzz-found: {reason}")


def config(**changes) -> bytes:
    return json.dumps({**TINY_CONFIG, **changes}).encode()


def hf_config(**changes) -> dict:
    """The tiny model's Hugging Face config.json (as ``export --format hf`` writes it) with ``changes``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        **changes,
    }


def sft_records(message: dict) -> bytes:
    """The workspace's sft records, the first message of the first replaced by ``message``."""
    records = bundled_records("sft")
    records[0]["messages"][0] = message
    return "".join(json.dumps(r) + "\n" for r in records).encode()


SFT_200 = "".join(
    line + "\n" for line in (resolve("bundled:data/sft") / "tasks.jsonl").read_text().splitlines()[:200]
).encode()
HF_TOKENIZER = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_sentence|>",
                "eos_token": "<|end_of_sentence|>", "pad_token": "<|_pad_|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}  # fmt: skip
CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATE = ["generate", "--prompt", "hi", "--max_new_tokens", "2", "--chat", "false", "--param_path"]
STEP = {"type": "step", "epoch": 0, "step": 1, "consumed_samples": 1, "loss": 7.7, "lr": 3e-06, "tokens_per_sec": 99.0}

WIDE_HF_CONFIG = {
    **{k: v for k, v in hf_config().items() if k not in ("model_type", "hidden_act")},
    "hidden_size": 2**31 - 1,
    "pad_token_id": 2,
}
"""The shrunk example as found: no ``model_type`` (read by its ``architectures``), a width past the weights'."""

CASES = {
    "sft-message-role-list": (
        Example("sft jsonl", train("sft", "--dry_run", data="{x}/data.jsonl"), {},
                {"data.jsonl": sft_records({"role": ["user"], "content": "hi"})}, culprits=("data.jsonl", "role")),
        (),  # fixed: roles are compared, never hashed (data/tokenize.py)
    ),
    "template-wide-tojson-prepare": (
        Example("tokenizer_config.json (hf)", ["prepare", "{x}/data.jsonl", "-o", "{x}/out", "-c",
                "{w}/sft_pipeline.json", "--tokenizer_path", "{x}/t"], {"t/tokenizer.json": "tiny/tokenizer.json"},
                {"t/tokenizer_config.json": json.dumps({**HF_TOKENIZER, "chat_template": "{{ messages | "
                 "tojson(indent=100000) }}" + CHAT}).encode(), "data.jsonl": SFT_200},
                culprits=("chat_template",), deadline_s=HANG_S),
        (),  # fixed: a conversation renders to at most 65,536 characters more than 16 per input character
    ),
    "generate-empty-prompt": (
        Example("tokenizer_config.json (astrai)", ["generate", "--param_path", "{w}/ck", "--tokenizer_path", "{x}/t",
                "--prompt", "hi", "--max_new_tokens", "2"], {"t/tokenizer.json": "tiny/tokenizer.json"},
                {"t/tokenizer_config.json": json.dumps({"chat_template": "{{ '' }}"}).encode()},
                culprits=("chat_template", "tokenizer_config.json")),
        (),  # fixed: generate names the prompt its template renders as no token
    ),
    "prepare-nothing-kept-unnamed": (
        Example("tokenizer_config.json (astrai)", ["prepare", "{w}/sft.jsonl", "-o", "{x}/out", "-c",
                "{w}/sft_pipeline.json", "--tokenizer_path", "{x}/t"], {"t/tokenizer.json": "tiny/tokenizer.json"},
                {"t/tokenizer_config.json": json.dumps({"chat_template": "{{ '' }}"}).encode()},
                culprits=("chat_template", "tokenizer_config.json", "sft.jsonl")),
        (),  # fixed: the message names the inputs and the tokenizer
    ),
    "plot-loss-past-axis-range": (
        Example("metric.jsonl", ["plot", "{x}/metric.jsonl", "-o", "{x}/out.png"], {},
                {"metric.jsonl": (json.dumps({**STEP, "loss": -1e308}) + "\n").encode()}, outputs=("out.png",),
                culprits=("metric.jsonl", "loss")),
        (),  # fixed: points past matplotlib's range are left out, and counted
    ),
    "recipe-null-alias-unnamed": (
        Example("seq recipe", ["seq", "--config", "{x}/r.yaml", "--ckpt_dir", "{x}/out", "--dry_run"], {},
                {"r.yaml": b"param_path: '{w}/tiny'\ndata_root_path: '{w}/seq.jsonl'\nwindow_size: 16\n"
                 b"parallel_mode: none\nnum_workers: 0\nloggers: []\nmax_steps: 1\ndevices: null\n"},
                culprits=("r.yaml", "devices")),
        (),  # fixed: a recipe value of the wrong kind is named with its file (cli._check_recipe_kinds)
    ),
    "recipe-zero-alias-unnamed": (
        Example("seq recipe", ["seq", "--config", "{x}/r.yaml", "--ckpt_dir", "{x}/out", "--dry_run"], {},
                {"r.yaml": b"param_path: '{w}/tiny'\ndata_root_path: '{w}/seq.jsonl'\ndevices: 0\n"},
                culprits=("r.yaml", "devices")),
        (),  # fixed: a range error names the field as users also spell it (config.train_checks.SPELLED)
    ),
    "reward-model-hf-config-wide-score-head": (
        Example("hf config.json", ["reward_model", "--param_path", "{x}/hf", "--data_root_path", "{w}/dpo.jsonl",
                "--window_size", "16", "--parallel_mode", "none", "--num_workers", "0", "--loggers", "[]",
                "--ckpt_dir", "{x}/out", "--dry_run"], {"hf": "hf"},
                {"hf/config.json": json.dumps(WIDE_HF_CONFIG).encode()},
                culprits=("config.json", "hidden_size", "hf")),
        (),  # fixed: the new score head is a view of one zero until loading copies it (reward_model_weights), so
        # the dry run reaches its memory count instead of allocating 8 GiB of zeros first (exit 1 under the cap)
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def problems() -> dict[str, str | None]:
    """Every case run at once: what each broke of the promise (None where it kept it)."""
    names = list(CASES)
    return dict(zip(names, check_all([CASES[n][0] for n in names], [f"found-{n}" for n in names]), strict=True))


@pytest.mark.parametrize("name", [pytest.param(name, marks=mark) for name, (_, mark) in CASES.items()])
def test_a_found_input_keeps_the_error_promise(name, problems):
    assert problems[name] is None, problems[name]
