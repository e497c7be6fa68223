"""The HTTP server's app (FastAPI; this package is its only importer): OpenAI's API here, ``POST /v1/chat/completions``
and ``/v1/completions`` (streamed as server-sent events or whole), ``GET /v1/models``, ``/health`` and ``/metrics``
(Prometheus' text format), and
Anthropic's ``POST /v1/messages`` from ``anthropic_api``.

A request's JSON is read once: every field checked against the protocol's types and the engine's ranges, a mistake
answered 400 in the protocol's error shape (OpenAI's ``{"error": {"message", "type", "param", "code"}}``), never a
traceback. Whatever model a client names, the one model served answers, under its own name. A client that leaves
mid-stream cancels its request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from astrai_fabric.inference import Completion, RequestError, SamplingParams
from astrai_fabric.serve import anthropic_api
from astrai_fabric.serve.requests import (
    BadRequest,
    Served,
    finished,
    read_json_object,
    render,
    submit,
    text_pieces,
)
from astrai_fabric.tokenizer import Tokenizer


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    """OpenAI's error shape; ``param`` by default the field a 400's message begins with (``max_tokens: ...``)."""
    named = message.split(":", 1)[0]
    if param is None and status == 400 and named.isidentifier():
        param = named
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="astrai-fabric", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if served.api_key is not None and request.url.path != "/health":
            given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), served.api_key.encode()):
                shape = anthropic_api.error if request.url.path == "/v1/messages" else error
                return shape(
                    401, "a valid API key is required (x-api-key or Authorization: Bearer)", "authentication_error"
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **served.runner.health()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.runner.metrics(), media_type="text/plain; version=0.0.4")

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

    anthropic_api.add_routes(app, served)
    return app


async def _complete(request: Request, served: Served, chat: bool) -> Any:
    try:
        body = await read_json_object(request)
        roles = ("system", "developer", "user", "assistant")
        prompt = render(body.get("messages"), served.tokenizer, roles) if chat else _text_prompt(body, served.tokenizer)
        room = served.runner.engine.max_model_len - len(prompt)  # OpenAI's default: up to the model's window
        params, stream, include_usage = _sampling(body, served.tokenizer, served.runner.engine.vocab_size, room)
    except BadRequest as err:
        return error(400, str(err), param=err.param)
    submitted = submit(served, prompt, params, error)
    if isinstance(submitted, JSONResponse):
        return submitted
    request_id, events = submitted
    reply = Reply(served, chat, len(prompt), params)
    if stream:
        return StreamingResponse(reply.stream(request_id, events, include_usage), media_type="text/event-stream")
    completions = await finished(served, request_id, events)
    if isinstance(completions, str):
        return error(500, completions, "server_error")
    return reply.whole(completions)


def _text_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: expected a non-empty string", "prompt")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise BadRequest("prompt: encodes as no token", "prompt")
    return ids


def _sampling(
    body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int, room: int
) -> tuple[SamplingParams, bool, bool]:
    """``SamplingParams`` from the protocol's fields, each type checked here (the ranges by ``SamplingParams``);
    whether to stream, and whether a stream ends with the usage. ``room``: the positions the prompt leaves."""

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

    # Not given: chat fills the window the prompt leaves (OpenAI's), text completions 16 tokens (OpenAI's)
    default = max(room, 1) if "messages" in body else min(16, max(room, 1))
    max_tokens = integer("max_completion_tokens", None)
    max_tokens = integer("max_tokens", None) if max_tokens is None else max_tokens
    max_tokens = default if max_tokens is None else max_tokens
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
        try:
            if self.chat:
                for index in range(self.params.n):
                    yield self._chunk(index, {"role": "assistant", "content": ""}, None)
            async for kind, value, piece in text_pieces(events, self.params):
                if kind == "text":
                    yield self._chunk(value, piece, None)
                elif kind == "error":
                    yield _event({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
                else:
                    for completion in value:
                        yield self._chunk(completion.index, "", _finish(completion))
                    if include_usage:
                        yield _event(self._frame([], usage=self._usage(value)))
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


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
