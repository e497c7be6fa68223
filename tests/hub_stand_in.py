"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests: nothing is downloaded in tests, ever.

It serves repositories held in memory (``add``: model or dataset repos, branches and tags, a gated one, one with
pickled weights only) at exactly the endpoints huggingface_hub 2.x calls for ``HfApi.repo_info``,
``snapshot_download`` and ``hf_hub_download`` (read from its source: ``hf_api.py``, ``_snapshot_download.py``,
``file_download.py``, ``utils/_http.py``):

- ``GET /api/{models|datasets}/{org}/{name}/revision/{rev}`` (and without ``/revision/{rev}``: ``main``):
  ``repo_info``/``model_info``, JSON ``{id, sha, siblings: [{rfilename}], private, gated}``; ``sha`` is what a
  branch or tag resolves to, and ``snapshot_download`` names the snapshot after it;
- ``GET /api/{models|datasets}/{org}/{name}/tree/{rev}?recursive=...``: the file list ``snapshot_download``
  filters with ``allow_patterns`` and caches (``trees/COMMIT.json``, what makes the cache usable offline): JSON
  ``[{type: "file", path, size, oid}]``, one page (no ``Link`` header);
- ``HEAD`` and ``GET /{org}/{name}/resolve/{rev}/{file}`` and ``/datasets/{org}/{name}/resolve/...``: a file's
  metadata (``X-Repo-Commit``, ``ETag``: the blob's name in the cache, ``Content-Length``; no ``X-Xet-Hash``, so
  the plain HTTP download is used) and its bytes;
- ``GET /api/agent-harnesses`` (huggingface_hub's user-agent registry; telemetry is disabled by ``serving``, so
  it is never asked): 404.

Errors carry the headers ``hf_raise_for_status`` reads to choose its exception: ``X-Error-Code: RepoNotFound``
(404), ``RevisionNotFound`` (404), ``EntryNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with one).
Anything else is a 404 and recorded in ``unexpected``, which the tests check is empty: the stand-in covers what
huggingface_hub asks. It stands in for the Hub because huggingface_hub talks to it through ``HF_ENDPOINT`` with
its own client, cache layout, locks and error handling, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub.constants  # imported here, before any test sets HF_HUB_OFFLINE: see ``serving``
import pytest


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False


class HubStandIn:
    """The server and its repositories; ``url`` is what ``HF_ENDPOINT`` is set to."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[str] = []
        self.unexpected: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
                stand_in._answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                stand_in._answer(self, body=True)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes] | Path,
        *,
        repo_type: str = "model",
        revision: str = "main",
        gated: bool = False,
    ) -> str:
        """Put ``files`` (a mapping, or a directory's files) at ``revision`` of ``repo_id``; returns its commit."""
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
        repo = self.repos.setdefault((repo_type, repo_id), Repo())
        repo.gated = repo.gated or gated
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha256(files[name]).digest())
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[revision] = commit
        return commit

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- the endpoints ----------------------------------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlsplit(handler.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        self.requests.append(f"{handler.command} {url.path}")
        authorized = bool(handler.headers.get("Authorization"))
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            repo_type, repo_id, rest = parts[1][:-1], "/".join(parts[2:4]), parts[4:]
            if not rest or rest[0] == "revision":
                return self._repo_info(handler, repo_type, repo_id, rest[1] if len(rest) > 1 else "main", authorized)
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(handler, repo_type, repo_id, rest[1], authorized)
        repo_type = "dataset" if parts[:1] == ["datasets"] else "model"
        parts = parts[1:] if repo_type == "dataset" else parts
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(handler, repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body, authorized)
        if url.path != "/api/agent-harnesses":
            self.unexpected.append(f"{handler.command} {handler.path}")
        self._send(handler, 404, b"", {})

    def _find(self, handler, repo_type: str, repo_id: str, revision: str, authorized: bool):  # noqa: ANN001, ANN202
        """The repository and commit, or None after answering the error the Hub gives."""
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            return self._error(handler, 404, "RepoNotFound", "Repository not found")
        if repo.gated:
            return self._error(
                handler,
                403 if authorized else 401,
                "GatedRepo",
                "Access to model is restricted. You must have access to it and be authenticated.",
            )
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return self._error(handler, 404, "RevisionNotFound", "Invalid rev id")
        return repo, commit

    def _repo_info(self, handler, repo_type: str, repo_id: str, revision: str, authorized: bool) -> None:  # noqa: ANN001
        found = self._find(handler, repo_type, repo_id, revision, authorized)
        if found is not None:
            repo, commit = found
            siblings = [{"rfilename": name} for name in sorted(repo.commits[commit])]
            info = {"id": repo_id, "sha": commit, "siblings": siblings, "private": False, "gated": repo.gated}
            self._json(handler, info)

    def _tree(self, handler, repo_type: str, repo_id: str, revision: str, authorized: bool) -> None:  # noqa: ANN001
        found = self._find(handler, repo_type, repo_id, revision, authorized)
        if found is not None:
            repo, commit = found
            files = repo.commits[commit]
            entries = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in sorted(files.items())
            ]
            self._json(handler, entries)

    def _file(
        self,
        handler,
        repo_type: str,
        repo_id: str,
        revision: str,
        name: str,
        body: bool,  # noqa: ANN001
        authorized: bool,
    ) -> None:
        found = self._find(handler, repo_type, repo_id, revision, authorized)
        if found is None:
            return
        repo, commit = found
        data = repo.commits[commit].get(name)
        if data is None:
            return self._error(handler, 404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        self._send(handler, 200, data if body else None, headers, length=len(data))

    def _error(self, handler, status: int, code: str, message: str, extra: dict | None = None) -> None:  # noqa: ANN001
        headers = {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}
        self._send(handler, status, json.dumps({"error": message}).encode(), headers)

    def _json(self, handler, value: object) -> None:  # noqa: ANN001
        self._send(handler, 200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    @staticmethod
    def _send(handler, status: int, data: bytes | None, headers: dict, length: int | None = None) -> None:  # noqa: ANN001
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(length if length is not None else len(data or b"")))
        handler.end_headers()
        if data and handler.command != "HEAD":
            handler.wfile.write(data)


@contextmanager
def serving(monkeypatch: pytest.MonkeyPatch, home: Path) -> Iterator[HubStandIn]:
    """A stand-in, with the environment of a process pointed at it: ``HF_ENDPOINT`` its URL, ``HF_HOME`` ``home``
    (the cache in ``home/hub``), no token, online. huggingface_hub reads some of these once, at its import (which
    may have happened in this test process before): those module constants are set to what that import would have
    read, so the library behaves as in a fresh process with this environment."""
    stand_in = HubStandIn()
    env = {"HF_ENDPOINT": stand_in.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    template = stand_in.url + "/{repo_id}/resolve/{revision}/{filename}"
    read_at_import = {
        "ENDPOINT": stand_in.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": template,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
    }
    for name, value in read_at_import.items():
        monkeypatch.setattr(huggingface_hub.constants, name, value)
    try:
        yield stand_in
    finally:
        stand_in.close()


def go_offline(monkeypatch: pytest.MonkeyPatch, stand_in: HubStandIn) -> None:
    """``HF_HUB_OFFLINE=1`` from here on, and the stand-in stopped: a request now could not be answered."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    stand_in.close()
