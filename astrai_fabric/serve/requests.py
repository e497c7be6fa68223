"""What both protocols (``openai_api``, ``anthropic_api``) share: the request body read once, messages rendered
with the chat template, a request handed to the engine's runner, and its text as it grows.

Streamed text is whole characters (a token that ends inside a UTF-8 character waits for the rest), and never part
of a stop string: the text that could still begin one is held back until the next token or the end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from astrai_fabric.errors import UserError
from astrai_fabric.inference import Completion, RequestError, SamplingParams
from astrai_fabric.serve.runner import EngineRunner, QueueFull
from astrai_fabric.tokenizer import Tokenizer

MAX_BODY_BYTES = 16 * 2**20
"""The largest request body read."""


class BadRequest(UserError):
    """A request answered with 400, naming the field (``param``)."""

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


async def read_json_object(request: Request) -> dict[str, Any]:
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


def text_content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise BadRequest(f"{where}: expected a string or a list of text parts", where.split(".")[0].split("[")[0])


def render(messages: Any, tokenizer: Tokenizer, roles: tuple[str, ...]) -> list[int]:
    """``messages`` (each ``{"role", "content"}``, a role of ``roles``; ``developer`` read as ``system``) rendered
    with the chat template, the generation prompt after them."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of messages", "messages")
    rendered = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in roles:
            raise BadRequest(f"messages[{index}]: expected an object with a role {', '.join(roles)}", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        rendered.append({"role": role, "content": text_content(message.get("content"), f"messages[{index}].content")})
    try:
        ids = tokenizer.apply_chat_template(rendered)
    except UserError as err:
        raise BadRequest(f"messages: {err}", "messages") from None
    if not ids:
        raise BadRequest("messages: the conversation renders as no token", "messages")
    return ids


Refusal = Callable[[int, str, str], JSONResponse]
"""A protocol's error response: ``refuse(status, message, error type)``."""


def submit(
    served: Served, prompt: list[int], params: SamplingParams, refuse: Refusal
) -> tuple[int, asyncio.Queue] | JSONResponse:
    """The request handed to the engine and the queue its events arrive on, in this event loop; or the refusal: 400
    naming what cannot be served (``RequestError``), 429 with Retry-After when the queue is full."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        request_id = served.runner.submit(
            prompt, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        )
    except RequestError as err:
        return refuse(400, str(err), "invalid_request_error")
    except QueueFull:
        busy = refuse(429, "the server's queue is full: retry shortly", "rate_limit_error")
        busy.headers["Retry-After"] = "1"
        return busy
    return request_id, events


async def finished(served: Served, request_id: int, events: asyncio.Queue) -> list[Completion] | str:
    """The request's completions once all have ended, or the engine's error message; a client that leaves first
    cancels it."""
    try:
        while True:
            kind, value = await events.get()
            if kind in ("done", "error"):
                return value
    except asyncio.CancelledError:
        served.runner.cancel(request_id)
        raise


async def text_pieces(events: asyncio.Queue, params: SamplingParams) -> AsyncIterator[tuple[str, Any, Any]]:
    """``("text", index, piece)`` as each completion's text grows (whole characters, nothing that could begin a stop
    string), then ``("done", completions, None)`` with the rest sent, or ``("error", message, None)``."""
    held = max((len(stop) for stop in params.stop), default=1) - 1
    sent = [""] * params.n
    while True:
        kind, value = await events.get()
        if kind == "error":
            yield "error", value, None
            return
        if kind == "token":
            ready = (value.text or "").rstrip("\ufffd")  # U+FFFD: a character whose bytes are not all sampled
            ready = ready[: max(0, len(ready) - held)]
            if len(ready) > len(sent[value.index]):
                yield "text", value.index, ready[len(sent[value.index]) :]
                sent[value.index] = ready
            continue
        for completion in value:  # its last text, what was held back included (cut before a stop string)
            rest = (completion.text or "")[len(sent[completion.index]) :]
            if rest:
                yield "text", completion.index, rest
        yield "done", value, None
        return
