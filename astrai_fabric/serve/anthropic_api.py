"""Anthropic's Messages API: ``POST /v1/messages``, whole or streamed as its events (``message_start``,
``content_block_start``, ``content_block_delta``..., ``content_block_stop``, ``message_delta``, ``message_stop``).

Fields: ``model`` (a label: the one model served answers), ``max_tokens`` (required, as Anthropic requires it),
``messages`` (user and assistant turns, content a string or text blocks), ``system`` (a string or text blocks),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``. ``stop_reason`` is ``end_turn`` (a stop
token), ``stop_sequence`` (naming it), or ``max_tokens``. Errors are Anthropic's shape: ``{"type": "error",
"error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from astrai_fabric.inference import Completion, RequestError, SamplingParams
from astrai_fabric.serve.requests import (
    BadRequest,
    Served,
    finished,
    read_json_object,
    render,
    submit,
    text_content,
    text_pieces,
)


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def add_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        try:
            body = await read_json_object(request)
            prompt, params = _request(body, served)
        except BadRequest as err:
            return error(400, str(err))
        submitted = submit(served, prompt, params, error)
        if isinstance(submitted, JSONResponse):
            return submitted
        request_id, events = submitted
        message = _Message(served, len(prompt), params)
        if body.get("stream"):
            return StreamingResponse(message.stream(request_id, events), media_type="text/event-stream")
        completions = await finished(served, request_id, events)
        if isinstance(completions, str):
            return error(500, completions, "api_error")
        return message.whole(completions[0])


def _request(body: dict[str, Any], served: Served) -> tuple[list[int], SamplingParams]:
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest(f"max_tokens: expected an integer (Anthropic requires it), got {max_tokens!r}")
    system = body.get("system")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("messages: expected a non-empty list of messages")
    if any(isinstance(turn, dict) and turn.get("role") == "system" for turn in turns):
        raise BadRequest("messages: a system message goes in the system field, not among the messages")
    conversation = [{"role": "system", "content": text_content(system, "system")}] if system else []
    prompt = render(conversation + turns, served.tokenizer, ("system", "user", "assistant"))
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise BadRequest("stop_sequences: expected a list of strings")

    def number(name: str, default: float) -> float:
        value = body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadRequest(f"{name}: expected a finite number, got {value!r}")
        return float(value)

    top_k = body.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise BadRequest(f"top_k: expected an integer, got {top_k!r}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number("temperature", 1.0),
        top_p=number("top_p", 1.0),
        top_k=top_k,
        stop_token_ids=served.tokenizer.stop_ids,
        stop=stops,
    )
    try:
        params.check(served.runner.engine.vocab_size)
    except RequestError as err:
        raise BadRequest(str(err)) from None
    return prompt, params


class _Message:
    """One request's answer as Anthropic's message, whole or as its stream of events."""

    def __init__(self, served: Served, num_prompt: int, params: SamplingParams) -> None:
        self.served, self.num_prompt, self.params = served, num_prompt, params
        self.id = f"msg_{uuid.uuid4().hex}"

    def whole(self, completion: Completion) -> dict[str, Any]:
        return self._message([{"type": "text", "text": completion.text or ""}], completion, len(completion.tokens))

    async def stream(self, request_id: int, events: asyncio.Queue) -> AsyncIterator[str]:
        try:
            yield _event("message_start", {"type": "message_start", "message": self._message([], None, 0)})
            block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            yield _event("content_block_start", block)
            async for kind, value, piece in text_pieces(events, self.params):
                if kind == "text":
                    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
                    yield _event("content_block_delta", delta)
                elif kind == "error":
                    yield _event("error", {"type": "error", "error": {"type": "api_error", "message": value}})
                    return
                else:
                    completion = value[0]
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                    reason, sequence = _stop(completion)
                    delta = {"stop_reason": reason, "stop_sequence": sequence}
                    usage = {"output_tokens": len(completion.tokens)}
                    yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
                    yield _event("message_stop", {"type": "message_stop"})
        finally:  # also when the client left mid-stream: free its blocks at once
            self.served.runner.cancel(request_id)

    def _message(self, content: list[dict], completion: Completion | None, output_tokens: int) -> dict[str, Any]:
        reason, sequence = _stop(completion) if completion is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.served.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": self.num_prompt, "output_tokens": output_tokens},
        }


def _stop(completion: Completion) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _event(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
