"""A stand-in Hugging Face hub on 127.0.0.1 for tests: serves repos the test writes, counts requests per file.

It answers what huggingface_hub's ``hf_hub_download`` (0.36) asks: ``HEAD``/``GET /{org}/{repo}/resolve/{rev}/
{file}`` with ``X-Repo-Commit`` (a 40-hex commit), ``ETag`` and ``Content-Length``; a missing file is a 404
with ``X-Error-Code: EntryNotFound`` and, as the real hub sends it, the repo's ``X-Repo-Commit`` (so open_clip
falls back from safetensors to .bin, transformers skips optional files, and the client records the file's absence
in the cache: transformers 5's AutoTokenizer looks for a config.json the tokenizer repo lacks, offline too), a
missing repo a 404 with ``RepoNotFound``. The 2.x client asks the same. Anything else (``/api/...``) is a 404
and counted too. Point ``HF_ENDPOINT`` at ``hub.url``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


class StandInHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.files: dict[str, bytes] = {}  # plain URL path -> content
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path) -> count
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandInHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)

    def add_file(self, path: str, data: bytes) -> str:
        """Serve ``data`` at the plain URL ``{url}{path}``; returns that URL."""
        self.files[path] = data
        return f"{self.url}{path}"

    def gets(self, repo: str, filename: str | None = None) -> int:
        """GET requests (downloads) of one file of ``repo``, or of all its files."""
        prefix = f"/{repo}/resolve/"
        with self._lock:
            return sum(
                n
                for (method, path), n in self.requests.items()
                if method == "GET"
                and path.startswith(prefix)
                and (filename is None or path.endswith(f"/{filename}"))
            )

    def total(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(handler.path.split("?", 1)[0])
        with self._lock:
            self.requests[(handler.command, path)] += 1
        if path in self.files:  # a plain URL (open_clip's download_pretrained_from_url)
            return self._send(handler, self.files[path], body=body, commit=None)
        parts = path.strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._missing(handler, "EntryNotFound")
        repo, filename = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
        if repo not in self.repos:
            return self._missing(handler, "RepoNotFound")
        data, commit = self.repos[repo].get(filename), hashlib.sha1(repo.encode()).hexdigest()
        if data is None:
            return self._missing(handler, "EntryNotFound", commit)
        self._send(handler, data, body=body, commit=commit)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, data: bytes, *, body: bool, commit: str | None) -> None:
        handler.send_response(200)
        if commit is not None:
            handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def _missing(handler: BaseHTTPRequestHandler, code: str, commit: str | None = None) -> None:
        handler.send_response(404)
        handler.send_header("X-Error-Code", code)
        if commit is not None:
            handler.send_header("X-Repo-Commit", commit)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
