"""``astrai-fabric chat``: through the real CLI with stdin piped and in a pseudo-terminal; greedy replies equal
``generate`` without a cache on the same conversation (the cache kept across turns, or recomputed where the template
rewrites an earlier turn); checkpoints, LoRA checkpoints and Hugging Face directories; the errors' one line."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import signal
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from astrai_fabric import chat as chat_module
from astrai_fabric import lora
from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.chat import ChatSession
from astrai_fabric.checkpoint import load_model, save_checkpoint
from astrai_fabric.checkpoint.adapter import lora_base_entry, weight_digests
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.config.generate import ChatArgs
from astrai_fabric.export import export
from astrai_fabric.generate import generate
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer

ROOT = Path(__file__).parents[1]
TOKENIZER_CONFIG = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
REWRITE = (  # the bundled template, but an assistant turn before the last user message keeps no content
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] != 'assistant' or loop.index0 >= (messages | length) - 1 %}{{ message['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONE_QUESTION = "{% if messages | length > 2 %}{{ raise_exception('one question only') }}{% endif %}"
NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
TURNS = ["hello", "how are you", "tell me more"]
NEW_TOKENS = 10


def tokenizer_dir(path: Path, **config) -> Path:
    path.mkdir()
    shutil.copy(TINY_MODEL_DIR / "tokenizer.json", path)
    values = {k: v for k, v in {**TOKENIZER_CONFIG, **config}.items() if v is not None}
    (path / "tokenizer_config.json").write_text(json.dumps(values))
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """``model`` (the bundled tiny architecture, untied, random weights), ``hf`` (it exported to Hugging Face's
    layout), ``lora`` (an adapter-only checkpoint on it), and tokenizers: ``rewrite``, ``plain`` (no template),
    ``no_system``, ``two_turns`` (a template refusing a second question), ``empty`` (one rendering nothing)."""
    root = tmp_path_factory.mktemp("chat")
    config = ModelConfig.from_dict(
        {**json.loads((TINY_MODEL_DIR / "config.json").read_text()), "tie_word_embeddings": False}
    )
    torch.manual_seed(9)  # replies of varied tokens whose text encodes back to the ids sampled (the cache is kept)
    model = AutoRegressiveLM(config)
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(root / "model", model.state_dict(), config.to_dict(), files=files)
    export(root / "model", root / "hf", "hf")
    spec = lora.LoRASpec(r=4, alpha=8)
    lora.inject(model, spec, seed=0)
    torch.manual_seed(4)
    adapter = {k: torch.randn_like(v) * 0.5 for k, v in lora.adapter_state_dict(model.state_dict()).items()}
    meta = {"lora_base": lora_base_entry(root / "model", root / "lora", weight_digests(root / "model"))}
    save_checkpoint(
        root / "lora",
        None,
        config.to_dict(),
        meta=meta,
        files=files,
        adapter=adapter,
        adapter_config=spec.adapter_config(),
    )
    tokenizer_dir(root / "rewrite", chat_template=REWRITE)
    tokenizer_dir(root / "plain", chat_template=None)
    tokenizer_dir(root / "no_system", chat_template=NO_SYSTEM + TOKENIZER_CONFIG["chat_template"])
    tokenizer_dir(root / "two_turns", chat_template=ONE_QUESTION + TOKENIZER_CONFIG["chat_template"])
    tokenizer_dir(root / "empty", chat_template="{{ '' }}")
    return root


def reference(model, tokenizer: Tokenizer, turns: list[str], templated: bool = True, system: str | None = None):
    """Each turn's greedy reply by ``generate`` without a cache, the whole conversation rendered anew each turn."""
    messages, text, replies = ([{"role": "system", "content": system}] if system else []), system or "", []
    stop_ids = tokenizer.stop_ids if templated else [tokenizer.eos_token_id]
    for user in turns:
        if templated:
            ids = tokenizer.apply_chat_template([*messages, {"role": "user", "content": user}])
        else:
            text = f"{text}\n{user}" if text else user
            ids = tokenizer.encode(text)
        limit = min(NEW_TOKENS, model.config.max_position_embeddings - len(ids))
        out = generate(model, [ids], limit, temperature=0, stop_ids=stop_ids, use_cache=False)[0]
        replies.append(tokenizer.decode_whole_chars(out))
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": replies[-1]}]
        text += replies[-1]
    return replies


def piped(text: str | bytes) -> io.TextIOWrapper:
    """A stand-in for a piped stdin: bytes under a UTF-8 text layer, as Python opens a pipe."""
    return io.TextIOWrapper(io.BytesIO(text.encode() if isinstance(text, str) else text), encoding="utf-8")


def chat(argv: list[str], stdin: str | bytes, capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", piped(stdin))
    code = main(["chat", *argv, "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS)])
    out, err = capsys.readouterr()
    return code, out, err


def session(work: Path, tokenizer: str = "model", **options) -> ChatSession:
    model = load_model(work / "model").eval()
    chat_args = ChatArgs(param_path=str(work / "model"), temperature=0, max_new_tokens=NEW_TOKENS)
    return ChatSession(model, Tokenizer.from_dir(work / tokenizer), chat_args, **options)


def test_piped_turns_reset_exit_and_end_of_input(work, capsys, monkeypatch):
    model, tokenizer = load_model(work / "model").eval(), Tokenizer.from_dir(work / "model")
    first, second = reference(model, tokenizer, TURNS[:2])
    assert first and second and first != second
    stdin = "hello\n\n   \nhow are you\n/reset\nhello\n /exit \nnever read\n"
    assert chat([str(work / "model")], stdin, capsys, monkeypatch) == (0, f"{first}\n{second}\n{first}\n", "")
    assert chat([str(work / "model")], "hello\nhow are you", capsys, monkeypatch) == (0, f"{first}\n{second}\n", "")
    assert chat(["--param_path", str(work / "model")], "hello\n", capsys, monkeypatch)[1] == f"{first}\n"  # generate's
    system = reference(model, tokenizer, TURNS[:1], system="Be brief.")
    assert chat([str(work / "model"), "--system", "Be brief."], "hello\n", capsys, monkeypatch)[1] == f"{system[0]}\n"


def reused(session: ChatSession, ids: list[int], before: list[int]) -> int:
    """The prompt positions the engine should find cached: the full blocks of the ids ``before`` (what it computed
    of the previous turn) that ``ids`` starts with, short of ``ids``' last position."""
    common = next((i for i, (a, b) in enumerate(zip(ids, before, strict=False)) if a != b), min(len(ids), len(before)))
    size = session.engine.block_size
    return min(common, len(ids) - 1) // size * size


def test_greedy_replies_equal_generate_without_a_cache_and_the_blocks_are_kept_across_turns(work):
    chat_session, written, computed = session(work), [], []
    replies = []
    for user in TURNS:
        ids = chat_session.ids_with(user)
        replies.append(chat_session.reply(user, written.append))
        assert chat_session.cached_prompt_tokens == reused(chat_session, ids, computed)
        computed = chat_session.last_ids[:-1]  # the last token sampled is never fed
    assert replies == reference(chat_session.model, chat_session.tokenizer, TURNS)
    assert "".join(written) == "".join(f"{reply}\n" for reply in replies)
    assert chat_session.cached_prompt_tokens > 0  # later turns computed only what was new
    chat_session.reset()
    ids = chat_session.ids_with(TURNS[0])
    assert chat_session.reply(TURNS[0], written.append) == replies[0]
    assert chat_session.cached_prompt_tokens == reused(chat_session, ids, computed)


def test_a_template_that_rewrites_earlier_turns_reuses_only_what_it_kept(work):
    chat_session, computed = session(work, tokenizer="rewrite"), []
    replies = []
    for user in TURNS:
        ids = chat_session.ids_with(user)
        replies.append(chat_session.reply(user, lambda text: None))
        assert chat_session.cached_prompt_tokens <= reused(chat_session, ids, computed)
        computed = chat_session.last_ids[:-1]
    assert all(replies) and replies == reference(chat_session.model, chat_session.tokenizer, TURNS)


@pytest.mark.parametrize("where", ["between two tokens", "inside a forward pass"])
def test_a_reply_stopped_by_ctrl_c_stays_in_the_conversation_and_the_cache_stays_right(work, where):
    chat_session, pieces, forwards = session(work), [], []

    def write(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3 and where == "between two tokens":
            raise KeyboardInterrupt

    def second_layer(module, inputs) -> None:  # the first layer has written this position into the cache
        forwards.append(inputs)
        if len(forwards) == 4 and where == "inside a forward pass":  # the prefill and two tokens fed before it
            raise KeyboardInterrupt

    hook = chat_session.model.layers[1].register_forward_pre_hook(second_layer)
    partial = chat_session.reply(TURNS[0], write)
    hook.remove()
    assert partial and partial == "".join(pieces[:-1] if where == "inside a forward pass" else pieces[:2])
    assert pieces[-1] == "\n" and len(pieces) == 4  # the third piece, sampled, never showed in the first case
    messages = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": partial}]
    for user in TURNS[1:]:  # what the engine computed is known exactly: later turns find its full blocks
        computed = chat_session.last_ids[:-1]  # an interrupted forward computed nothing; the last token is unfed
        ids = chat_session.tokenizer.apply_chat_template([*messages, {"role": "user", "content": user}])
        out = generate(
            chat_session.model,
            [ids],
            NEW_TOKENS,
            temperature=0,
            stop_ids=chat_session.tokenizer.stop_ids,
            use_cache=False,
        )[0]
        messages += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": chat_session.tokenizer.decode_whole_chars(out)},
        ]
        assert chat_session.reply(user, lambda text: None) == messages[-1]["content"]
        assert chat_session.cached_prompt_tokens == reused(chat_session, ids, computed)
    assert all(block.refs == 0 for block in chat_session.engine.pool.blocks)  # the cancelled turn's freed


def test_a_template_failing_on_a_later_turn_is_one_line_and_the_chat_goes_on(work, capsys, monkeypatch):
    first = reference(load_model(work / "model").eval(), Tokenizer.from_dir(work / "model"), TURNS[:1])[0]
    argv = [str(work / "model"), "--tokenizer_path", str(work / "two_turns")]
    code, out, err = chat(argv, "hello\nhow are you\n/reset\nhello\n", capsys, monkeypatch)
    assert (code, out) == (0, f"{first}\n{first}\n")
    refused = "tokenizer_config.json: chat_template failed: raise_exception: one question only"
    assert err == f"astrai-fabric: error: {work}/two_turns/{refused}\n"


def test_a_terminal_that_cannot_show_a_character_gets_a_replacement(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    chat_module._write("héllo")
    assert sys.stdout.buffer.getvalue() == b"h?llo"


def test_stdin_bytes_that_are_not_utf8_read_as_replacements_said_once(work, capsys, monkeypatch):
    turns = ["caf\ufffd", "hello", "\ufffd\ufffd ok"]  # a cut character, then two bytes no character starts with
    expected = reference(load_model(work / "model").eval(), Tokenizer.from_dir(work / "model"), turns)
    code, out, err = chat([str(work / "model")], b"caf\xc3\nhello\n\xff\xfe ok\n", capsys, monkeypatch)
    assert (code, out) == (0, "".join(f"{reply}\n" for reply in expected))
    assert err == (
        "astrai-fabric: input line 1 is not utf-8 text (unexpected end of data at byte 3): bytes that do not decode "
        "are read as U+FFFD, here and in any later line\n"
    )


def test_a_line_over_max_input_bytes_is_refused_in_one_line_and_the_chat_goes_on(work, capsys, monkeypatch):
    turns = ["hello", "b" * 64]  # the 65-byte line between them is not in the conversation; 64 bytes are taken
    expected = reference(load_model(work / "model").eval(), Tokenizer.from_dir(work / "model"), turns)
    stdin = f"hello\n{'a' * 65}\n{'b' * 64}\n"
    code, out, err = chat([str(work / "model"), "--max_input_bytes", "64"], stdin, capsys, monkeypatch)
    assert (code, out) == (0, "".join(f"{reply}\n" for reply in expected))
    assert err == (
        "astrai-fabric: error: input line 2 is 65 bytes, over chat's 64 (--max_input_bytes): this message is skipped\n"
    )


@pytest.mark.parametrize(
    "stdin, lines",
    [
        (b"a" * 8 + b"\nnext\n", [b"a" * 8, b"next"]),
        (b"a" * 8, [b"a" * 8]),  # the last line, without a line end
        (b"a" * 9 + b"\nnext\n", [9, b"next"]),
        (b"a" * 9, [9]),
        (b"a" * 40 + b"\n\nnext", [40, b"", b"next"]),  # dropped over several pieces
    ],
)
def test_read_line_takes_at_most_max_bytes_and_drops_a_longer_line(stdin, lines):
    stream, read = io.BytesIO(stdin), []
    while True:
        try:
            line = chat_module.read_line(stream, 8)
        except chat_module.LineTooLong as err:
            line = err.size_bytes
        if line is None:
            break
        read.append(line)
    assert read == lines


def test_a_long_line_is_never_held_whole(tmp_path):
    """Peak memory reading past a line of 16 MiB with a 64 KiB cap stays under three times the cap."""
    max_bytes, path = 1 << 16, tmp_path / "stdin"
    with path.open("wb") as file:
        file.truncate(16 << 20)  # one line of 16 MiB of zero bytes, taking no disk space
        file.seek(16 << 20)
        file.write(b"\nnext\n")
    with path.open("rb") as stream:
        tracemalloc.start()
        try:
            with pytest.raises(chat_module.LineTooLong) as too_long:
                chat_module.read_line(stream, max_bytes)
            peak_bytes = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert too_long.value.size_bytes == 16 << 20 and chat_module.read_line(stream, max_bytes) == b"next"
    assert peak_bytes < 3 * max_bytes, peak_bytes  # about 2x: readline joins the pieces it read


def test_plain_continuation_without_a_chat_template(work, capsys, monkeypatch):
    model = load_model(work / "model").eval()
    expected = reference(model, Tokenizer.from_dir(work / "plain"), TURNS[:2], templated=False, system="Once")
    out = "".join(f"{reply}\n" for reply in expected)
    argv = [str(work / "model"), "--system", "Once"]
    assert chat([*argv, "--tokenizer_path", str(work / "plain")], "hello\nhow are you\n", capsys, monkeypatch)[1] == out
    assert chat([*argv, "--template", "false"], "hello\nhow are you\n", capsys, monkeypatch)[1] == out


def test_streamed_text_holds_back_the_bytes_of_an_unfinished_character():
    tokenizer = Tokenizer.from_dir(TINY_MODEL_DIR)
    text = "héllo 世界 ok"
    ids = [*tokenizer.encode(text), tokenizer.eos_token_id]
    text_of = tokenizer.decode_stream()  # what chat streams with
    pieces = [text_of(i) for i in ids]
    assert "".join(pieces) == text == tokenizer.decode_whole_chars(ids)
    assert "" in pieces[:-1] and all("\ufffd" not in piece for piece in pieces)  # bytes waited for their character


def test_a_conversation_past_the_models_positions_is_one_line_and_reset_starts_again(work, capsys, monkeypatch):
    tokenizer = Tokenizer.from_dir(work / "model")
    rendered = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}]))
    word = len(tokenizer.encode(" a", add_special_tokens=False))
    near = "a" + " a" * ((256 - rendered - 3) // word - 1)  # 3 positions left for the reply
    assert 256 - len(tokenizer.apply_chat_template([{"role": "user", "content": near}])) == 3
    stdin = f"{near}\nhello\n/reset\nhello\n"
    code, out, err = chat([str(work / "model")], stdin, capsys, monkeypatch)
    first = reference(load_model(work / "model").eval(), tokenizer, ["hello"])[0]
    assert code == 0 and out.endswith(f"\n{first}\n") and out.count("\n") == 2 and "Traceback" not in err
    cut, full = err.splitlines()
    assert cut == (
        "astrai-fabric: the reply stopped at the model's 256 positions (max_position_embeddings): type "
        "/reset to start a new conversation"
    )
    tokens = re.fullmatch(
        r"astrai-fabric: the conversation \((\d+) tokens with this message\) "
        r"no longer fits the model's 256 positions \(max_position_embeddings\): type /reset to start a new one",
        full,
    )
    assert tokens and int(tokens[1]) > 256


def test_lora_checkpoints_and_huggingface_directories(work, capsys, monkeypatch):
    tokenizer = Tokenizer.from_dir(work / "model")
    base = load_model(work / "model").eval()
    live = load_model(work / "model")  # the adapter applied in the forward pass, not merged into the weights
    lora.inject(live, lora.LoRASpec(r=4, alpha=8), seed=0)
    lora.load_adapter(live, load_file(work / "lora" / "adapter_model.safetensors"), "the test's adapter")
    with_adapter = reference(live.eval(), tokenizer, TURNS[:2])
    assert with_adapter != reference(base, tokenizer, TURNS[:2])
    expected = "".join(f"{reply}\n" for reply in with_adapter)
    assert chat([str(work / "lora")], "hello\nhow are you\n", capsys, monkeypatch) == (0, expected, "")
    expected = "".join(f"{reply}\n" for reply in reference(base, tokenizer, TURNS[:2]))
    assert chat([str(work / "hf")], "hello\nhow are you\n", capsys, monkeypatch) == (0, expected, "")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["chat", "bundled:tiny"], "assets/tiny: has no weights (no model.safetensors"),
        (["chat", "{w}/absent"], "absent: no such checkpoint or model directory"),
        (["chat"], "chat needs a model: astrai-fabric chat SRC"),
        (["chat", "{w}/model", "--temperature", "-1"], "chat: need a finite temperature >= 0, 0 < top_p <= 1"),
        (["chat", "{w}/model", "--top_p", "0"], "got temperature=0.7, top_p=0.0, top_k=0, max_new_tokens=128"),
        (["chat", "{w}/model", "--max_new_tokens", "0"], "max_new_tokens=0"),
        (["chat", "{w}/model", "--device_type", "gpu"], "chat: device_type must be cpu or cuda, got 'gpu'"),
        (["chat", "{w}/model", "--num_samples", "2"], "unknown flag --num_samples"),
        (["chat", "{w}/model", "--templat", "false"], "unknown flag --templat (did you mean"),
        (["chat", "{w}/model", "--system", "caf\udce9"],  # how Python hands over a command line's byte 0xe9
         "chat: system is not UTF-8 text (an undecodable byte at position 3)"),
        (["chat", "{w}/model", "--max_input_bytes", "0"], "chat: need max_input_bytes >= 1, got 0"),
        (["chat", "{w}/model", "--tokenizer_path", "{w}/no_system", "--system", "Be brief."],
         "no_system/tokenizer_config.json: chat_template failed: raise_exception: System role not supported"),
        (["chat", "{w}/model", "--tokenizer_path", "{w}/empty"], "the conversation renders as no token"),
        (["generate", "--param_path", "{w}/model", "--prompt", "x", "--num_samples", "0"],
         "generate: need 1 <= num_samples <= 256, got 0"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_exit_2_before_a_reply(work, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(sys, "stdin", piped("hello\n"))
    assert main([part.replace("{w}", str(work)) for part in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("astrai-fabric: error: "), err
    assert message in err.replace(str(work) + "/", ""), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_asked_for_where_there_is_none(work, capsys):
    assert main(["chat", str(work / "model"), "--device_type", "cuda"]) == 2
    assert "chat: --device_type cuda, but no CUDA device is available here" in capsys.readouterr().err


def read_until(fd: int, wanted: bytes, seconds: float = 60) -> bytes:
    seen, deadline = b"", time.monotonic() + seconds
    while wanted not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"no {wanted!r} within {seconds} s; the terminal shows {seen!r}")
        try:
            seen += os.read(fd, 4096)
        except OSError:  # the terminal closed: the process ended
            raise AssertionError(f"no {wanted!r}; the terminal showed {seen!r}") from None
    return seen


def test_in_a_terminal_the_prompt_shows_and_the_reply_streams(work):
    """Also what stdin's checks say in a terminal (through the line editor): a byte that is not UTF-8, then a line
    over ``--max_input_bytes``; the session goes on after each. A reply cut at ``--max_new_tokens`` says so, and
    ``/reset`` says it started a new conversation (piped input stays the replies alone)."""
    model, tokenizer = load_model(work / "model").eval(), Tokenizer.from_dir(work / "model")
    first, second = reference(model, tokenizer, ["hello", "\ufffd"])
    in_process, cut = session(work), []
    for user in ("hello", "\ufffd"):  # whether each reply ended at the 10 tokens, not at a stop token
        assert in_process.reply(user, lambda text: None) in (first, second)
        cut.append(in_process.cut_at_max_new_tokens)
    assert cut[0], "the test needs a first reply that the token budget cuts (seed 9's model: no stop token)"
    note = f"astrai-fabric: (cut at --max_new_tokens {NEW_TOKENS}; the model had not finished this reply)\n"
    argv = [
        sys.executable,
        "-m",
        "astrai_fabric.cli",
        "chat",
        str(work / "model"),
        "--temperature",
        "0",
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--max_input_bytes",
        "64",
    ]
    pid, terminal = pty.fork()  # the child's controlling terminal: Ctrl-C there is its SIGINT
    if pid == 0:
        try:
            os.chdir(ROOT)
            # A terminal user's Ctrl-C: a shell without job control starts background jobs (pytest here) with SIGINT
            # ignored, which exec keeps and which would keep Python from raising KeyboardInterrupt at all.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # stdin as a desktop's UTF-8 locale opens it (strict; Python keeps undecodable bytes only under C.UTF-8)
            os.environ["PYTHONIOENCODING"] = "utf-8:strict"
            os.execv(sys.executable, argv)
        finally:
            os._exit(127)
    status = (0, 0)
    try:
        banner = read_until(terminal, b">>> ")
        assert b"/reset clears the conversation, /exit or Ctrl-D leaves" in banner
        os.write(terminal, b"hello\n")
        shown = read_until(terminal, b">>> ").decode().replace("\r\n", "\n")
        assert shown == f"hello\n{first}\n{note}>>> "  # the echoed input, the reply, what cut it, the next prompt
        os.write(terminal, b"\xff\n")  # a byte that starts no UTF-8 character: said, and read as U+FFFD
        shown = read_until(terminal, b">>> ").decode(errors="replace").replace("\r\n", "\n")
        notice = "astrai-fabric: input line 2 is not utf-8 text (invalid start byte at byte 0): bytes that do not "
        said = f"{notice}decode are read as U+FFFD, here and in any later line\n"
        assert shown == f"\ufffd\n{said}{second}\n{note if cut[1] else ''}>>> "
        os.write(terminal, b"a" * 65 + b"\n")
        shown = read_until(terminal, b">>> ").decode().replace("\r\n", "\n")
        refusal = "astrai-fabric: error: input line 3 is 65 bytes, over chat's 64 (--max_input_bytes): this message"
        assert shown == f"{'a' * 65}\n{refusal} is skipped\n>>> "
        os.write(terminal, b"/reset\n")
        shown = read_until(terminal, b">>> ").decode().replace("\r\n", "\n")
        assert shown == "/reset\nastrai-fabric: a new conversation\n>>> "
        time.sleep(0.5)  # let input() reach its wait: a SIGINT just before it is seen only at the next key (CPython)
        os.write(terminal, b"\x03")  # Ctrl-C at the prompt: leave
        deadline = time.monotonic() + 30
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status[0] == pid and os.waitstatus_to_exitcode(status[1]) == 130
    finally:
        if status[0] != pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(terminal)
