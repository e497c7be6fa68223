"""``EngineRunner``: the generation engine on a thread of its own, stepping while it has work, and the requests of the
HTTP server (another thread, asyncio's) handed to it and answered through callbacks.

The engine is not thread-safe: every call into it holds ``lock``, the step included (a request submitted meanwhile
waits for the step to end, a few milliseconds). Each request's ``listener`` is called from the engine's thread with
``("token", completion)`` for each token sampled, then ``("done", completions)`` once all of the request's
completions have ended, or ``("error", message)``; the server turns them into its responses.
"""

from __future__ import annotations

import bisect
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from astrai_fabric.inference import Engine, SamplingParams

Listener = Callable[[tuple[str, Any]], None]
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""The upper bounds (seconds) of the time-to-first-token histogram's buckets (``metrics``)."""


class QueueFull(Exception):
    """``max_queued`` requests wait already."""


class EngineRunner:
    """``submit`` and ``cancel`` from any thread; ``close`` stops the engine's thread."""

    def __init__(self, engine: Engine, max_queued: int = 256) -> None:
        self.engine, self.max_queued = engine, max_queued
        self.lock = threading.Condition()
        self.listeners: dict[int, tuple[Listener, int]] = {}
        """Each running request's listener and how many completions it waits for."""
        self.closed = False
        self.submitted_at: dict[int, float] = {}
        """When each request waiting for its first token was submitted."""
        self.num_requests = self.num_prompt_tokens = self.num_generated_tokens = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.thread = threading.Thread(target=self._run, name="astrai-fabric-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, listener: Listener) -> int:
        """Queue a request (``Engine.add_request``: a ``RequestError`` names what cannot be served; ``QueueFull``
        when ``max_queued`` wait already); its id."""
        with self.lock:
            if len(self.engine.waiting) >= self.max_queued:
                raise QueueFull
            request_id = self.engine.add_request(prompt, params)
            self.listeners[request_id] = (listener, params.n)
            self.submitted_at[request_id] = time.perf_counter()
            self.num_requests += 1
            self.num_prompt_tokens += len(prompt)
            self.lock.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        """Stop a request (its client left): its blocks back to the pool at once, its listener not called again."""
        with self.lock:
            self.submitted_at.pop(request_id, None)
            if self.listeners.pop(request_id, None) is not None:
                self.engine.cancel(request_id)
                self.engine.completions.pop(request_id, None)

    def metrics(self) -> str:
        """Prometheus' text format, as vLLM names its serving metrics (prefix ``astrai_fabric:``)."""
        with self.lock:
            pool, engine = self.engine.pool, self.engine
            held = sum(1 for block in pool.blocks if block.refs > 0)
            gauges = {
                "num_requests_running": ("gauge", "Requests decoding now.", len(engine.running)),
                "num_requests_waiting": ("gauge", "Requests waiting for a slot.", len(engine.waiting)),
                "kv_cache_usage_ratio": ("gauge", "Share of the KV cache's blocks held.", held / pool.num_blocks),
                "requests_total": ("counter", "Requests received.", self.num_requests),
                "prompt_tokens_total": ("counter", "Prompt tokens received.", self.num_prompt_tokens),
                "generation_tokens_total": ("counter", "Tokens sampled.", self.num_generated_tokens),
                "requests_cancelled_total": ("counter", "Requests cancelled before they ended.", engine.num_cancelled),
                "prefix_cache_hit_ratio": ("gauge", "Prompt positions not computed.", engine.prefix_hit_rate),
            }
            lines = []
            for name, (kind, help_text, value) in gauges.items():
                lines += [f"# HELP astrai_fabric:{name} {help_text}", f"# TYPE astrai_fabric:{name} {kind}"]
                lines.append(f"astrai_fabric:{name} {value}")
            name = "astrai_fabric:time_to_first_token_seconds"
            lines += [f"# HELP {name} From a request's arrival to its first token.", f"# TYPE {name} histogram"]
            total = 0
            for bound, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts, strict=True):
                total += count
                lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
            lines += [f"{name}_sum {self.ttft_sum}", f"{name}_count {total}"]
            return "\n".join(lines) + "\n"

    def health(self) -> dict[str, int]:
        """Requests running and waiting, requests cancelled so far, KV blocks held."""
        with self.lock:
            pool = self.engine.pool
            held = sum(1 for block in pool.blocks if block.refs > 0)
            return {
                "running": len(self.engine.running),
                "waiting": len(self.engine.waiting),
                "cancelled": self.engine.num_cancelled,
                "kv_blocks_used": held,
            }

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.closed and not self.engine.has_work():
                    self.lock.wait()
                if self.closed:
                    return
                try:
                    sampled = self.engine.step()
                except Exception as err:  # the engine's fault, not a request's: every request told, the loop goes on
                    message = f"{type(err).__name__}: {err}"
                    traceback.print_exc()
                    self._fail_all(message)
                    continue
                events = self._events(sampled)
            for listener, event in events:  # outside the lock: a listener may be slow
                listener(event)

    def _events(self, sampled: list) -> list[tuple[Listener, tuple[str, Any]]]:
        """Each sampled token's event, then each finished request's (its listener dropped, its completions taken)."""
        events = []
        now = time.perf_counter()
        self.num_generated_tokens += len(sampled)
        for completion, _ in sampled:
            if (arrived := self.submitted_at.pop(completion.request_id, None)) is not None:
                self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, now - arrived)] += 1
                self.ttft_sum += now - arrived
            if (entry := self.listeners.get(completion.request_id)) is not None:
                events.append((entry[0], ("token", completion)))
        for request_id, (listener, count) in list(self.listeners.items()):
            group = self.engine.completions.get(request_id, [])
            if len(group) == count and all(c.finish_reason for c in group):
                events.append((listener, ("done", self.engine.completions.pop(request_id))))
                del self.listeners[request_id]
        return events

    def _fail_all(self, message: str) -> None:
        for request_id, (listener, _) in list(self.listeners.items()):
            self.engine.cancel(request_id)
            self.engine.completions.pop(request_id, None)
            listener(("error", message))
        self.listeners.clear()
