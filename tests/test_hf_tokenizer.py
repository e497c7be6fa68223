"""Hugging Face tokenizer directories (``tokenizer.json`` + transformers' ``tokenizer_config.json``, with or without
``chat_template.jinja``) against transformers itself: byte-level BPE tokenizers are trained here with ``tokenizers``,
wrapped in ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``; our rendered text and ids must equal
``apply_chat_template``'s on the same messages. The config forms transformers 5 does not write (inline template,
AddedToken dicts, ``added_tokens_decoder``, a named list) are written by hand and read alike by both. A model without
a pad token fine-tunes through the CLI from a Hugging Face directory with its tokenizer beside it.

transformers is a test-only dependency (the ``test`` extra).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as RawTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from astrai_fabric.assets import TINY_MODEL_DIR  # noqa: E402
from astrai_fabric.cli import main  # noqa: E402
from astrai_fabric.data.tokenize import tokenize_chats  # noqa: E402
from astrai_fabric.errors import UserError  # noqa: E402
from astrai_fabric.tokenizer import ASTRAI, HUGGING_FACE, Tokenizer, render_template  # noqa: E402

# Llama 3's shape: BOS from the template, a system header always, roles checked, trailing whitespace trimmed; every
# tag strips its own whitespace ("-"), as the Hub's template does.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "You are a helpful assistant." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant, got ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen's ChatML shape written with plain tags, so its output depends on trim_blocks and lstrip_blocks (the indented
# tags and the newline after each tag vanish only under them); loop controls skip empty messages and stop at a
# "stop" role; the assistant turn sits in a {% generation %} block; the tool list goes through tojson.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are Qwen, a helpful assistant.<|im_end|>
    {% endif %}
    {% if message['content'] == '' %}{% continue %}{% endif %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}

    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML}
SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}
NAMED = {  # Llama 3 Instruct has no pad token; Qwen's pad is <|endoftext|>, its eos <|im_end|>, no bos
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "chatml": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
}
CORPUS = [
    "You are a helpful assistant. What is two plus two? Two plus two is four.",
    "Tell me about the weather today. It is sunny and warm, with a light breeze.",
    "héllo wörld ✓ 漢字 — answers, questions, and more text for the merges.",
] * 20
CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "Answer briefly.  \n"}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "Four. "}],
    [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "漢字 <tag> & 'quotes'"},
     {"role": "user", "content": "And the weather?"}, {"role": "assistant", "content": "Sunny.\n\nWarm."}],
]  # fmt: skip


def build_tokenizer(kind: str, **named: str) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``CORPUS``, its special tokens first, wrapped as transformers does."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS[kind], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(CORPUS, trainer)
    if kind == "llama3":  # Llama 3's tokenizer.json adds BOS when encoding with special tokens; chat ids must not
        raw.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", raw.token_to_id("<|begin_of_text|>"))]
        )
    named = named or NAMED[kind]
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=TEMPLATES[kind], **named)


@pytest.fixture(scope="module", params=list(TEMPLATES))
def saved(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedTokenizerFast, Path]:
    theirs = build_tokenizer(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(directory)
    return request.param, transformers.AutoTokenizer.from_pretrained(directory), directory


def their_ids(theirs, messages, add_generation_prompt: bool) -> list[int]:
    return theirs.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_templates_render_and_encode_as_transformers(saved, add_generation_prompt):
    kind, theirs, directory = saved
    ours = Tokenizer.from_dir(directory)
    assert ours.layout == HUGGING_FACE and ours.special_tokens == NAMED[kind]
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.render_chat(messages, add_generation_prompt) == text
        expected = their_ids(theirs, messages, add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    if kind == "llama3":  # the template's BOS, once: nothing added by the encoding
        assert ours.apply_chat_template(CONVERSATIONS[0]).count(ours.bos_token_id) == 1


def test_whitespace_control_and_loop_controls_are_transformers(saved):
    """The ChatML template's output depends on trim_blocks/lstrip_blocks and uses continue/break: the same template
    in AstrAI's layout (Jinja's defaults, no loop controls) renders otherwise."""
    kind, theirs, directory = saved
    if kind != "chatml":
        pytest.skip("the Llama 3 template strips its own whitespace")
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    ours = Tokenizer.from_dir(directory)
    rendered = ours.render_chat(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False)
    assert "never rendered" not in rendered and "\n    " not in rendered
    with pytest.raises(UserError, match="unknown role tool"):
        ours.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="unknown role tool"):
        theirs.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    tools = [{"name": "f", "description": "<a> & 'b' ✓"}]
    expected = theirs.apply_chat_template(messages[:1], tools=tools, tokenize=False)
    ours_text = render_template(ours._template, {**ours._variables(messages[:1], False), "tools": tools}, "t")
    assert ours_text == expected and "<a> & 'b' ✓" in expected  # transformers' tojson: no HTML escaping
    astrai_layout = Tokenizer(ours._tokenizer, {}, CHATML, layout=ASTRAI)
    with pytest.raises(UserError, match="not valid Jinja"):  # no loop controls, no generation tag
        _ = astrai_layout._template


def test_llama3_bad_role_raises_as_transformers(saved):
    kind, theirs, directory = saved
    if kind != "llama3":
        pytest.skip("one template is enough")
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="roles must be user or assistant, got tool"):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(UserError, match="chat_template.jinja: chat_template failed on a.jsonl:3: .*got tool"):
        Tokenizer.from_dir(directory).render_chat(bad, where="a.jsonl:3")


# --- the config forms, written by hand ------------------------------------------------------------------------


def added_token(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def rewrite(directory: Path, target: Path, form: str) -> Path:
    """``directory`` (as transformers 5 saved it) rewritten in another form transformers reads."""
    shutil.copytree(directory, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    template = (target / "chat_template.jinja").read_text()
    if form in ("inline", "transformers4", "named_list"):
        (target / "chat_template.jinja").unlink()
        config["chat_template"] = [{"name": "default", "template": template}] if form == "named_list" else template
    if form == "transformers4":  # AddedToken dicts and added_tokens_decoder, as transformers 4 wrote them
        raw = json.loads((target / "tokenizer.json").read_text())
        config["added_tokens_decoder"] = {str(t["id"]): added_token(t["content"]) for t in raw["added_tokens"]}
        for name in ("bos_token", "eos_token", "pad_token"):
            if name in config:
                config[name] = {"__type": "AddedToken", **added_token(config[name])}
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return target


@pytest.mark.parametrize("form", ["inline", "transformers4", "named_list"])
def test_every_config_form_reads_alike(saved, tmp_path, form):
    kind, theirs, directory = saved
    target = rewrite(directory, tmp_path / form, form)
    assert not (target / "chat_template.jinja").exists()
    ours, again = Tokenizer.from_dir(target), transformers.AutoTokenizer.from_pretrained(target)
    assert (ours.special_tokens, ours.chat_template) == (NAMED[kind], TEMPLATES[kind])
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(messages, tokenize=False)
        assert again.apply_chat_template(messages, tokenize=False) == expected  # transformers reads the form too
        assert ours.render_chat(messages) == expected


def test_the_template_file_wins_over_an_inline_one_and_is_copied(saved, tmp_path):
    kind, _, directory = saved
    target = tmp_path / "both"
    shutil.copytree(directory, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "inline {{ messages }}"}))
    theirs = transformers.AutoTokenizer.from_pretrained(target)
    ours = Tokenizer.from_dir(target)
    messages = CONVERSATIONS[1]
    assert ours.render_chat(messages) == theirs.apply_chat_template(messages, tokenize=False)
    assert ours.chat_template == TEMPLATES[kind]
    assert sorted(ours.files) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_a_tokenizer_without_pad_pads_with_eos(saved):
    kind, _, directory = saved
    ours = Tokenizer.from_dir(directory)
    assert ours.pad_token_id == (None if kind == "llama3" else ours.token_id("pad_token"))
    assert ours.padding_id == (ours.eos_token_id if kind == "llama3" else ours.pad_token_id)
    bare = Tokenizer(ours._tokenizer, {}, layout=HUGGING_FACE)
    assert bare.padding_id == 0


def test_sft_messages_are_the_conversation_transformers_renders(saved):
    """The sft route's tokens of a conversation equal transformers' ids of it, each message's tokens masked by its
    role (the Llama 3 template's BOS and system header open the first message)."""
    _, theirs, directory = saved
    ours = Tokenizer.from_dir(directory)
    for messages in CONVERSATIONS[1:]:
        out = tokenize_chats([("chats.jsonl:1", {"messages": messages})], ours)
        assert out["sequence"].tolist() == their_ids(theirs, messages, False)
        trained = ours.decode(out["sequence"][out["loss_mask"]].tolist(), skip_special_tokens=False)
        assert all(m["content"].strip() in trained for m in messages if m["role"] == "assistant")
        assert not any(m["content"].strip() in trained for m in messages if m["role"] != "assistant")
        assert out["position_ids"].tolist() == list(range(len(out["sequence"])))


# --- end to end: sft from a Hugging Face directory, its tokenizer beside it, no pad token ---------------------


def test_sft_trains_from_a_huggingface_directory_without_a_pad_token(tmp_path, capsys):
    tokenizer = build_tokenizer("llama3")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model_dir = tmp_path / "llama"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS[1:] * 4))
    out = tmp_path / "out"
    argv = [
        "sft",
        "--param_path",
        str(model_dir),
        "--data_root_path",
        str(chats),
        "--window_size",
        "48",
        "--batch_per_device",
        "2",
        "--max_steps",
        "2",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(out),
    ]
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    (checkpoint,) = out.glob("epoch_*_step_2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (checkpoint / name).read_bytes() == (model_dir / name).read_bytes()
    steps = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if s["type"] == "step"]
    assert len(losses) == 2 and np.isfinite(losses).all() and abs(losses[0] - np.log(len(tokenizer))) < 0.5
    reloaded = Tokenizer.from_dir(checkpoint)  # the checkpoint's tokenizer renders as the source's
    assert reloaded.render_chat(CONVERSATIONS[2]) == tokenizer.apply_chat_template(CONVERSATIONS[2], tokenize=False)


def test_dpo_pads_a_no_pad_tokenizer_with_eos_masked(saved):
    """dpo's collation pads with ``padding_id`` and masks it: the padded positions carry EOS, attention_mask and
    loss_mask 0 there."""
    from astrai_fabric.data.records import collate_preferences, encode

    kind, _, directory = saved
    if kind != "llama3":
        pytest.skip("the no-pad tokenizer")
    ours = Tokenizer.from_dir(directory)
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    encoded = encode(ours, prompt, ["Four.", "It is four, of course, as everyone knows."], max_len=128)
    batch = collate_preferences([encoded], pad_id=ours.padding_id)
    chosen = batch["input_ids"][0, 0]
    length = len(encoded.prompt_ids) + len(encoded.response_ids[0])
    assert (chosen[length:] == ours.eos_token_id).all() and len(chosen) > length
    assert not batch["attention_mask"][0, 0, length:].any() and not batch["loss_mask"][0, 0, length:].any()


def test_the_astrai_layout_is_unchanged():
    ours = Tokenizer.from_dir(TINY_MODEL_DIR)
    assert ours.layout == ASTRAI and sorted(ours.files) == ["tokenizer.json", "tokenizer_config.json"]
