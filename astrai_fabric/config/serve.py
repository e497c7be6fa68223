"""``ServeArgs``: the flags of ``astrai-fabric serve`` (``serve.run_serve`` reads them), a config of its own so that
the options page and the CLI read them without importing the model or the server."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from astrai_fabric.config.devices import parse_bytes
from astrai_fabric.config.generate import DEVICE_TYPES
from astrai_fabric.errors import ConfigError

API_KEY_VARIABLE = "ASTRAI_FABRIC_API_KEY"
"""The environment variable ``--api_key`` is read from when the flag is not given (a key on a command line shows in
the process list)."""


@dataclass
class ServeArgs:
    """``astrai-fabric serve SRC``: the model behind OpenAI's and Anthropic's HTTP APIs (``/v1/chat/completions``,
    ``/v1/completions``, ``/v1/models``, ``/v1/messages``, ``/health``), every request on the generation engine."""

    param_path: str | None = None
    """Model or checkpoint directory (ours or AstrAI's, a LoRA checkpoint merged, a Hugging Face directory or a Hub
    id)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; default: the model's."""
    host: str = "127.0.0.1"
    """The address to listen on; another than loopback needs an API key."""
    port: int = 8000
    """The port to listen on."""
    api_key: str | None = None
    """The key clients must send (``Authorization: Bearer KEY`` or ``x-api-key``); default: the environment variable
    ASTRAI_FABRIC_API_KEY, else none (then only a loopback host is allowed)."""
    model_name: str | None = None
    """The name the API reports (and answers to, as to any other): default, the model directory's name."""
    max_num_seqs: int = 64
    """Requests decoded at once (the engine's running batch); the others wait."""
    kv_cache_memory: str | None = None
    """The engine's KV cache (``512MiB``, ``8GB``); default: 90% of the free memory on CUDA, 1 GiB on CPU."""
    max_queued: int = 256
    """Requests that may wait for a slot; one more is answered 429 with Retry-After."""
    drain_seconds: float = 30.0
    """On SIGTERM or Ctrl-C: no new connections, the requests in flight answered for at most this long, then exit 0."""
    max_model_len: int | None = None
    """The longest prompt plus completion served; default: the model's positions."""
    device_type: str | None = None
    """``cuda`` or ``cpu``; default: cuda when available."""
    seed: int = 0
    """Draws the seed of each request that gives none."""

    def validate(self) -> None:
        if self.param_path is None:
            raise ConfigError("serve needs a model: astrai-fabric serve SRC (a checkpoint or model directory)")
        if not 0 < self.port < 65536:
            raise ConfigError(f"serve: port must be in 1-65535, got {self.port}")
        if self.max_queued < 0 or not 0 <= self.drain_seconds < float("inf"):
            raise ConfigError(
                f"serve: need max_queued >= 0 and a finite drain_seconds >= 0, got {self.max_queued} and "
                f"{self.drain_seconds}"
            )
        if self.max_num_seqs < 1 or (self.max_model_len is not None and self.max_model_len < 2):
            raise ConfigError(
                f"serve: need max_num_seqs >= 1 and max_model_len >= 2, got {self.max_num_seqs} and "
                f"{self.max_model_len}"
            )
        if self.device_type not in (None, *DEVICE_TYPES):
            raise ConfigError(f"serve: device_type must be cpu or cuda, got {self.device_type!r}")
        if self.kv_cache_memory is not None and parse_bytes(self.kv_cache_memory, "kv_cache_memory") < 2**20:
            raise ConfigError(f"kv_cache_memory {self.kv_cache_memory!r}: at least 1 MiB")
        if self.resolved_api_key() is None and not _loopback(self.host):
            raise ConfigError(
                f"serve: host {self.host} is reachable from other machines: give --api_key (or the environment "
                f"variable {API_KEY_VARIABLE}), or serve on 127.0.0.1"
            )

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_VARIABLE) or None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
