"""A Hugging Face hub on 127.0.0.1 serving local checkpoints: only the endpoints that
`huggingface_hub.snapshot_download` calls (repo info, the file tree, ``resolve`` HEAD/GET).

Every request is recorded in `FakeHub.requests` (method and path), so a test can check what
was asked. Unknown repos answer 404 with ``X-Error-Code: RepoNotFound``, as the hub does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

#: The commit every fake repo is at.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Serve ``repos`` (``{"org/name": checkpoint directory}``) until `stop`.

    Attributes
    ----------
    endpoint:
        ``http://127.0.0.1:<port>`` (what ``HF_ENDPOINT`` is set to).
    requests:
        ``(method, path)`` of every request, in order.
    """

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = {
            rid: {p.relative_to(root).as_posix(): p.read_bytes()
                  for p in sorted(root.rglob("*")) if p.is_file()}
            for rid, root in repos.items()
        }
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path))
        status, headers, payload = self._route(path)
        handler.send_response(status)
        for key, value in {"Content-Length": str(len(payload)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(payload)

    def _route(self, path: str) -> tuple[int, dict[str, str], bytes]:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind = "/".join(parts[2:4]), parts[4]
            files = self.repos.get(repo)
            if files is None:
                return _not_found(repo)
            if kind == "revision":  # HfApi.repo_info
                return _json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                              "siblings": [{"rfilename": f} for f in files]})
            if kind == "tree":  # HfApi.list_repo_tree (one page)
                return _json([{"type": "file", "path": f, "size": len(data),
                               "oid": hashlib.sha1(data).hexdigest()}
                              for f, data in files.items()])
        if len(parts) >= 5 and parts[2] == "resolve":  # hf_hub_download: HEAD, then GET
            repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
            files = self.repos.get(repo)
            if files is None:
                return _not_found(repo)
            data = files.get(filename)
            if data is None:
                return 404, {"X-Error-Code": "EntryNotFound"}, b"{}"
            return 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                         "Content-Type": "application/octet-stream"}, data
        return 404, {}, b"{}"


def _json(obj: Any) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(obj).encode()


def _not_found(repo: str) -> tuple[int, dict[str, str], bytes]:
    return 404, {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"}, \
        json.dumps({"error": f"Repository Not Found for url: {repo}"}).encode()
