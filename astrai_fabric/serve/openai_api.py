"""The OpenAI-compatible HTTP API (FastAPI): ``POST /v1/chat/completions`` and ``/v1/completions`` (streamed as
server-sent events or whole), ``GET /v1/models`` and ``/health``; the only importer of FastAPI.

A request's JSON is read here, once: every field checked against the protocol's types and the engine's ranges,
a mistake answered 400 in OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``), never a
traceback. Whatever model a client names, the one model served answers, under its own name.

Streamed text is whole characters (a token that ends inside a UTF-8 character waits for the rest), and never part
of a stop string: the text that could still begin one is held back until the next token or the end. A client that
leaves mid-stream cancels its request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from astrai_fabric.errors import UserError
from astrai_fabric.inference import Completion, RequestError, SamplingParams
from astrai_fabric.serve.runner import EngineRunner, QueueFull
from astrai_fabric.tokenizer import Tokenizer

MAX_BODY_BYTES = 16 * 2**20
"""The largest request body read."""


class BadRequest(UserError):
    """A request the API answers with 400, naming the field (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Served:
    """What the API serves: the engine's runner, the tokenizer, the name reported, the key clients must send."""

    runner: EngineRunner
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="astrai-fabric", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if served.api_key is not None and request.url.path != "/health":
            given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), served.api_key.encode()):
                return error(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **served.runner.health()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "astrai-fabric"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _complete(request, served, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _complete(request, served, chat=False)

    return app


async def _complete(request: Request, served: Served, chat: bool) -> Any:
    try:
        body = await _json_object(request)
        prompt = _chat_prompt(body, served.tokenizer) if chat else _text_prompt(body, served.tokenizer)
        params, stream, include_usage = _sampling(body, served.tokenizer, served.runner.engine.vocab_size)
    except BadRequest as err:
        return error(400, str(err), param=err.param)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        request_id = served.runner.submit(
            prompt, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        )
    except RequestError as err:
        field = str(err).split(":", 1)[0]
        return error(400, str(err), param=field if field.isidentifier() else None)
    except QueueFull:
        busy = error(429, "the server's queue is full: retry shortly", "rate_limit_error")
        busy.headers["Retry-After"] = "1"
        return busy
    reply = Reply(served, chat, len(prompt), params)
    if stream:
        return StreamingResponse(reply.stream(request_id, events, include_usage), media_type="text/event-stream")
    try:
        completions = await reply.wait(events)
    except asyncio.CancelledError:  # the client left
        served.runner.cancel(request_id)
        raise
    if isinstance(completions, str):
        return error(500, completions, "server_error")
    return reply.whole(completions)


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body is {len(raw):,} bytes, over {MAX_BODY_BYTES:,}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of messages", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{index}]: expected an object with a role system, user or assistant", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append({"role": role, "content": _text_content(message.get("content"), f"messages[{index}].content")})
    try:
        ids = tokenizer.apply_chat_template(rendered)
    except UserError as err:
        raise BadRequest(f"messages: {err}", "messages") from None
    if not ids:
        raise BadRequest("messages: the conversation renders as no token", "messages")
    return ids


def _text_content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise BadRequest(f"{where}: expected a string or a list of text parts", "messages")


def _text_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: expected a non-empty string", "prompt")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise BadRequest("prompt: encodes as no token", "prompt")
    return ids


def _sampling(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> tuple[SamplingParams, bool, bool]:
    """``SamplingParams`` from the protocol's fields, each type checked here (the ranges by ``SamplingParams``);
    whether to stream, and whether a stream ends with the usage."""

    def number(name: str, default: float) -> float:
        value = body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadRequest(f"{name}: expected a finite number, got {value!r}", name)
        return float(value)

    def integer(name: str, default: int | None) -> int | None:
        value = body.get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadRequest(f"{name}: expected an integer, got {value!r}", name)
        return value

    max_tokens = integer("max_completion_tokens", None) or integer("max_tokens", 16 if "messages" not in body else 256)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop: expected a string or a list of strings", "stop")
    bias = body.get("logit_bias") or {}
    try:
        bias = {int(token): float(value) for token, value in bias.items()}
    except (AttributeError, TypeError, ValueError):
        raise BadRequest("logit_bias: expected an object of token ids to numbers", "logit_bias") from None
    logprobs = body.get("logprobs")
    if "messages" in body:  # chat: logprobs a boolean, top_logprobs how many
        logprobs = integer("top_logprobs", 0) if logprobs else None
    elif logprobs is not None:
        logprobs = integer("logprobs", None)
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadRequest("stream: expected a boolean (and stream_options an object)", "stream")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number("temperature", 1.0),
        top_p=number("top_p", 1.0),
        top_k=integer("top_k", 0) or 0,
        min_p=number("min_p", 0.0),
        presence_penalty=number("presence_penalty", 0.0),
        frequency_penalty=number("frequency_penalty", 0.0),
        repetition_penalty=number("repetition_penalty", 1.0),
        logit_bias=bias,
        seed=integer("seed", None),
        stop_token_ids=tokenizer.stop_ids,
        stop=stop,
        n=integer("n", 1),
        logprobs=logprobs,
    )
    try:
        params.check(vocab_size)
    except RequestError as err:
        raise BadRequest(str(err), str(err).split(":", 1)[0]) from None
    return params, stream, bool(options.get("include_usage"))


class Reply:
    """One request's answer in the protocol's shape, whole or streamed."""

    def __init__(self, served: Served, chat: bool, num_prompt: int, params: SamplingParams) -> None:
        self.served, self.chat, self.num_prompt, self.params = served, chat, num_prompt, params
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.held = max((len(s) for s in params.stop), default=1) - 1
        """Characters held back while streaming: the most of a stop string the text's end could begin."""

    async def wait(self, events: asyncio.Queue) -> list[Completion] | str:
        while True:
            kind, value = await events.get()
            if kind in ("done", "error"):
                return value

    def whole(self, completions: list[Completion]) -> dict[str, Any]:
        choices = [self._choice(c.index, self._text(c), _finish(c), c) for c in completions]
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.model_name,
            "choices": choices,
            "usage": self._usage(completions),
        }

    async def stream(self, request_id: int, events: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
        sent = [""] * self.params.n
        try:
            if self.chat:
                for index in range(self.params.n):
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None)
            while True:
                kind, value = await events.get()
                if kind == "error":
                    yield _event({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
                    break
                if kind == "token":
                    ready = _whole_characters(self._text(value))
                    ready = ready[: max(0, len(ready) - self.held)]
                    if len(ready) > len(sent[value.index]):
                        yield self._chunk(value.index, ready[len(sent[value.index]) :], None)
                        sent[value.index] = ready
                    continue
                for completion in value:  # done: the rest of each completion's text, then its finish reason
                    text = self._text(completion)
                    rest = text[len(sent[completion.index]) :]
                    yield self._chunk(completion.index, rest, _finish(completion))
                if include_usage:
                    yield _event(self._frame([], usage=self._usage(value)))
                break
            yield "data: [DONE]\n\n"
        finally:  # also when the client left mid-stream (the generator is closed): free its blocks at once
            self.served.runner.cancel(request_id)

    def _text(self, completion: Completion) -> str:
        return completion.text if completion.text is not None else ""

    def _chunk(self, index: int, text: str | dict, finish: str | None) -> str:
        if self.chat:
            delta = text if isinstance(text, dict) else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        return _event(self._frame([choice]))

    def _frame(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        frame = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.served.model_name,
            "choices": choices,
        }
        if usage is not None:
            frame["usage"] = usage
        return frame

    def _choice(self, index: int, text: str, finish: str, completion: Completion) -> dict[str, Any]:
        logprobs = None
        if completion.logprobs is not None:
            decode = self.served.tokenizer.decode
            entries = [
                {
                    "token": decode([token], skip_special_tokens=False),
                    "logprob": record.logprob,
                    "top_logprobs": [
                        {"token": decode([t], skip_special_tokens=False), "logprob": p} for t, p in record.top
                    ],
                }
                for token, record in zip(completion.tokens, completion.logprobs, strict=True)
            ]
            logprobs = {"content": entries} if self.chat else {"tokens": [e["token"] for e in entries]}
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def _usage(self, completions: list[Completion]) -> dict[str, int]:
        generated = sum(len(c.tokens) for c in completions)
        total = self.num_prompt + generated
        return {"prompt_tokens": self.num_prompt, "completion_tokens": generated, "total_tokens": total}


def _finish(completion: Completion) -> str:
    """OpenAI's finish reason: ``length`` where ``max_tokens`` cut it, else ``stop`` (a stop token or string)."""
    return "length" if completion.finish_reason == "length" else "stop"


def _whole_characters(text: str) -> str:
    """``text`` without a trailing U+FFFD: the decoder's stand-in for a character whose bytes are not all sampled."""
    return text.rstrip("\ufffd")


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
