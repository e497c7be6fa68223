"""``astrai-fabric serve``: a real server process on a loopback port, met by the official ``openai`` client.

One server for the module (the bundled tiny architecture, random weights, an API key): greedy answers equal the
static batch's tokens for the same rendered conversation; streamed and whole answers agree; bad requests get 400 in
OpenAI's error shape naming the field; a wrong key gets 401; concurrent clients are all answered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import load_model, save_checkpoint
from astrai_fabric.config import ModelConfig
from astrai_fabric.generate import generate
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

KEY = "test-key"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(directory: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """A server process on a free loopback port (the API key ``KEY``), once its /health answers."""
    port = free_port()
    argv = [sys.executable, "-m", "astrai_fabric", "serve", str(directory), "--port", str(port), *flags]
    env = dict(os.environ, ASTRAI_FABRIC_API_KEY=KEY, OMP_NUM_THREADS="1")
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                assert json.load(response)["status"] == "ok"
            return process, url
        except OSError:
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.stderr.read()[-2000:]}")
            time.sleep(0.1)
    pytest.fail("the server did not answer /health in 30 s")


def save_model(directory: Path, **sizes: int) -> Path:
    """The bundled tiny architecture (``sizes`` changed), untied, random weights, with the bundled tokenizer."""
    torch.manual_seed(9)  # replies of varied tokens (chat's tests' seed)
    values = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    config = ModelConfig.from_dict({**values, "tie_word_embeddings": False, **sizes})
    model = AutoRegressiveLM(config)
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    return save_checkpoint(directory, model.state_dict(), config.to_dict(), files=files)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(base url, model directory)`` of a server process, stopped after the module."""
    directory = save_model(tmp_path_factory.mktemp("serve") / "model")
    process, url = start_server(directory, "--model_name", "tiny", "--max_num_seqs", "8")
    yield url, directory
    process.terminate()
    process.wait(timeout=30)


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def expected_reply(directory: Path, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """The static batch's greedy reply to ``messages`` (rendered as the server renders them) and its finish reason."""
    model, tokenizer = load_model(directory).eval(), Tokenizer.from_dir(directory)
    ids = tokenizer.apply_chat_template(messages)
    out = generate(model, [ids], max_tokens, temperature=0, stop_ids=tokenizer.stop_ids)[0]
    stopped = bool(out) and out[-1] in tokenizer.stop_ids
    return tokenizer.decode(out), "stop" if stopped else "length"


CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_greedy_answers_equal_the_static_batch_whole_and_streamed(server, messages):
    url, directory = server
    text, finish = expected_reply(directory, messages, 24)
    whole = client(url).chat.completions.create(model="anything", messages=messages, max_tokens=24, temperature=0)
    assert whole.model == "tiny" and whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason == finish
    stream = client(url).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == text and reasons[-1] == finish
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_stop_string_cuts_the_answer_whole_and_streamed_and_is_never_half_sent(server):
    url, directory = server
    messages = CONVERSATIONS[1]
    model, tokenizer = load_model(directory).eval(), Tokenizer.from_dir(directory)
    out = generate(model, [tokenizer.apply_chat_template(messages)], 24, temperature=0, stop_ids=tokenizer.stop_ids)[0]
    text = tokenizer.decode(out)
    # A stop string whose first character ends one token's text and whose second begins the next token's
    ends = [len(tokenizer.decode(out[:j])) for j in range(1, len(out))]
    end = next(e for e in ends if 0 < e < len(text) and text.find(text[e - 1 : e + 1]) == e - 1)
    stop, cut = text[end - 1 : end + 1], text[: end - 1]
    request = dict(model="tiny", messages=messages, max_tokens=24, temperature=0, stop=[stop])
    whole = client(url).chat.completions.create(**request)
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in client(url).chat.completions.create(**request, stream=True)]
    assert "".join(pieces) == cut  # the stop string's first character was never sent


def test_without_max_tokens_a_chat_answer_may_fill_the_window_the_prompt_leaves(server):
    url, directory = server
    room = 256 - len(Tokenizer.from_dir(directory).apply_chat_template(CONVERSATIONS[0]))
    text, _ = expected_reply(directory, CONVERSATIONS[0], room)
    answer = client(url).chat.completions.create(model="tiny", messages=CONVERSATIONS[0], temperature=0)
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= 256


def test_text_completions_and_the_model_list(server):
    url, directory = server
    model, tokenizer = load_model(directory).eval(), Tokenizer.from_dir(directory)
    out = generate(model, [tokenizer.encode("Once upon a time")], 8, temperature=0, stop_ids=tokenizer.stop_ids)[0]
    answer = client(url).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert answer.choices[0].text == tokenizer.decode(out)
    assert [m.id for m in client(url).models.list().data] == ["tiny"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(temperature="hot"), "temperature: expected a finite number, got 'hot'"),
        (dict(max_tokens=0), "max_tokens: expected an integer >= 1, got 0"),
        (dict(top_p=2), r"top_p: expected a number in \(0, 1\], got 2.0"),
        (dict(n=1000), r"n: expected an integer in \[1, 256\], got 1000"),
        (dict(max_tokens=300), "exceed the model's 256 positions"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages.0.: expected an object with a role"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, fields, message):
    url, _ = server
    request = dict(model="tiny", messages=[{"role": "user", "content": "hello"}]) | fields
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        client(url).chat.completions.create(**request)
    assert refused.value.status_code == 400 and refused.value.body["type"] == "invalid_request_error"


def test_a_wrong_key_gets_401_and_health_needs_none(server):
    url, _ = server
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        assert json.load(response)["status"] == "ok"


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
        return json.load(response)


def test_a_client_leaving_a_stream_cancels_its_request_and_frees_its_blocks(server):
    url, _ = server
    before = health(url)["cancelled"]
    # Eight completions of 240 tokens: seconds of work, of which the client waits for the first chunk only
    request = dict(model="tiny", messages=CONVERSATIONS[0], max_tokens=240, temperature=1.0, n=8, stream=True)
    stream = client(url).chat.completions.create(**request)
    next(iter(stream))
    stream.close()
    for _ in range(100):
        now = health(url)
        if now["cancelled"] == before + 1:
            break
        time.sleep(0.05)
    assert now["cancelled"] == before + 1 and now["running"] == 0 and now["kv_blocks_used"] == 0


def metrics(url: str) -> dict[str, float]:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}


def test_prometheus_metrics_count_requests_tokens_and_first_token_times(server):
    url, _ = server
    before = metrics(url)
    answer = client(url).chat.completions.create(model="tiny", messages=CONVERSATIONS[0], max_tokens=5)
    after = metrics(url)
    assert after["astrai_fabric:requests_total"] == before["astrai_fabric:requests_total"] + 1
    sampled = after["astrai_fabric:generation_tokens_total"] - before["astrai_fabric:generation_tokens_total"]
    assert sampled == answer.usage.completion_tokens
    prompt = after["astrai_fabric:prompt_tokens_total"] - before["astrai_fabric:prompt_tokens_total"]
    assert prompt == answer.usage.prompt_tokens
    count = "astrai_fabric:time_to_first_token_seconds_count"
    assert after[count] == before[count] + 1 == after['astrai_fabric:time_to_first_token_seconds_bucket{le="+Inf"}']
    assert after["astrai_fabric:num_requests_running"] == 0 and after["astrai_fabric:kv_cache_usage_ratio"] == 0


def test_a_server_without_a_key_is_refused_off_loopback(tmp_path, capsys, monkeypatch):
    from astrai_fabric.cli import main

    monkeypatch.delenv("ASTRAI_FABRIC_API_KEY", raising=False)
    assert main(["serve", str(tmp_path), "--host", "0.0.0.0"]) == 2
    assert "host 0.0.0.0 is reachable from other machines: give --api_key" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the serve extra not installed
    assert main(["serve", str(tmp_path)]) == 2
    assert "serve needs FastAPI and uvicorn (uvicorn is missing): pip install" in capsys.readouterr().err


def test_concurrent_clients_are_all_answered_as_one_alone(server):
    url, directory = server
    questions = [[{"role": "user", "content": f"question {i}"}] for i in range(16)]  # twice the 8 slots

    def ask(messages: list[dict]) -> str:
        answer = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        return answer.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, questions))
    assert answers == [expected_reply(directory, messages, 12)[0] for messages in questions]


def test_a_full_queue_gets_429_and_sigterm_drains_what_is_in_flight_then_exits_0(tmp_path):
    """One slot, one place in the queue, a model slow enough (6 x 512) that a long answer is still being sampled
    when the others arrive: the third request is turned away with 429 and Retry-After; SIGTERM then lets the first
    two finish and the process exit 0."""
    directory = save_model(tmp_path / "model", hidden_size=512, num_hidden_layers=6, intermediate_size=1408)
    process, url = start_server(directory, "--max_num_seqs", "1", "--max_queued", "1", "--drain_seconds", "60")
    answers = {}

    def long_stream() -> None:
        request = dict(model="m", messages=CONVERSATIONS[0], max_tokens=200, temperature=1.0, stream=True)
        chunks = list(client(url).chat.completions.create(**request))
        answers["first"] = (chunks[-1].choices[0].finish_reason, sum(1 for c in chunks if c.choices[0].delta.content))

    def queued() -> None:
        answer = client(url).chat.completions.create(model="m", messages=CONVERSATIONS[1], max_tokens=8)
        answers["second"] = answer.choices[0].finish_reason

    def wait_for(key: str, value: int) -> None:
        for _ in range(400):
            if health(url)[key] >= value:
                return
            time.sleep(0.02)
        pytest.fail(f"/health never showed {key} {value}")

    first, second = threading.Thread(target=long_stream), threading.Thread(target=queued)
    first.start()
    wait_for("running", 1)
    second.start()
    wait_for("waiting", 1)
    with pytest.raises(openai.RateLimitError) as busy:
        client(url).chat.completions.create(model="m", messages=CONVERSATIONS[2], max_tokens=8)
    assert busy.value.response.headers["retry-after"] == "1"
    process.send_signal(signal.SIGTERM)
    first.join(timeout=120)
    second.join(timeout=120)
    assert process.wait(timeout=60) == 0
    assert answers["first"][0] == "length" and answers["second"] in ("stop", "length")
    assert "stopped serving model" in process.stdout.read()


anthropic = pytest.importorskip("anthropic")


def anthropic_client(url: str, key: str = KEY):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


@pytest.mark.parametrize("stop_at", [None, "a stop sequence"])
def test_anthropic_messages_whole_and_streamed_equal_the_static_batch(server, stop_at):
    url, directory = server
    system, turns = "Be brief.", [{"role": "user", "content": "What is 2 + 2?"}]
    text, finish = expected_reply(directory, [{"role": "system", "content": system}, *turns], 24)
    stops, reason, sequence = [], "end_turn" if finish == "stop" else "max_tokens", None
    if stop_at:
        stops = [sequence := text[4:7]]
        text, reason = text[: text.find(sequence)], "stop_sequence"
    # Greedy: this SDK (anthropic 2.x) sends no sampling fields of its own; the server reads them from the body
    request = dict(model="tiny", max_tokens=24, system=system, messages=turns, stop_sequences=stops)
    request["extra_body"] = {"temperature": 0}
    whole = anthropic_client(url).messages.create(**request)
    assert whole.content[0].text == text and whole.model == "tiny"
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    with anthropic_client(url).messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == reason and final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_errors_are_its_shape(server):
    url, _ = server
    turns = [{"role": "user", "content": "hello"}]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: expected an integer >= 1, got 0") as refused:
        anthropic_client(url).messages.create(model="tiny", max_tokens=0, messages=turns)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(url, key="wrong").messages.create(model="tiny", max_tokens=4, messages=turns)
