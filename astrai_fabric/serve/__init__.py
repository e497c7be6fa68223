"""``astrai-fabric serve SRC``: a model behind OpenAI's and Anthropic's HTTP APIs, every request on the generation
engine.

``run_serve`` loads the model and its tokenizer (``generate.load_sampler``, as ``generate`` and ``chat`` do), starts
the engine on a thread of its own (``runner.EngineRunner``) and serves ``openai_api``'s app (Anthropic's routes from
``anthropic_api``, what both share in ``requests``) with uvicorn; it does not import Lightning. FastAPI and uvicorn
are the ``serve`` extra's (``pip install astrai-fabric[serve]``).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from astrai_fabric.config.devices import parse_bytes
from astrai_fabric.config.serve import ServeArgs
from astrai_fabric.errors import ConfigError


def _draining_server() -> type:
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server, except that SIGTERM and SIGINT end it with exit 0 once it has drained (uvicorn raises
        the signal again after its graceful shutdown, and the process would end 143 or 130)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Draining


def run_serve(args: ServeArgs) -> int:
    """Serve until SIGTERM or Ctrl-C, then drain (no new connections; the requests in flight answered for at most
    ``drain_seconds``, the rest cancelled): exit 0."""
    args.validate()
    try:
        import uvicorn

        from astrai_fabric.serve.openai_api import Served, build_app
    except ImportError as err:
        raise ConfigError(
            f"serve needs FastAPI and uvicorn ({err.name} is missing): pip install 'astrai-fabric[serve]'"
        ) from None
    from astrai_fabric.generate import load_sampler
    from astrai_fabric.inference import Engine
    from astrai_fabric.serve.runner import EngineRunner

    model, tokenizer = load_sampler(args.param_path, args.tokenizer_path, args.device_type, "serve")
    memory = parse_bytes(args.kv_cache_memory, "kv_cache_memory") if args.kv_cache_memory else None
    engine = Engine(
        model,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=memory,
        max_model_len=args.max_model_len,
        decode=tokenizer.decode,
        seed=args.seed,
    )
    name = args.model_name or Path(args.param_path).name
    runner = EngineRunner(engine, args.max_queued)
    app = build_app(Served(runner, tokenizer, name, args.resolved_api_key()))
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1: KV cache of {engine.capacity_tokens:,} positions, "
        f"{args.max_num_seqs} requests at once",
        flush=True,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=args.drain_seconds
    )
    try:
        _draining_server()(config).run()
    finally:
        runner.close()
    print(f"stopped serving {name}", flush=True)
    return 0
