"""Fixtures of the CLI tests: a stand-in admin API that records every Authorization header, the
data dir a running `llmgw up` leaves, and no admin settings from the developer's shell."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SUMMARY = {
    "sync": {"state": "synced", "applied_sha": "a" * 40, "head_sha": "a" * 40, "branch": "main", "url": "repo"},
    "nodes": 1, "nodes_ready": 1, "nodes_by_state": {"ready": 1}, "gpus_total": 0, "gpus_unhealthy": 0,
    "models": 0, "replicas": 0, "replicas_ready": 0, "replicas_by_state": {}, "unplaced": {},
}



@dataclass
class AdminServer:
    """A stand-in admin API: answers with its token only, remembers every Authorization header."""

    token: str
    nodes: list[dict] = field(default_factory=list)
    redirect_to: str | None = None
    seen: list[str | None] = field(default_factory=list)
    url: str = ""

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.seen.append(self.headers.get("Authorization"))
                if server.redirect_to:
                    self.send_response(302)
                    self.send_header("Location", server.redirect_to + self.path)
                    self.end_headers()
                    return
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    self.reply(401, {"error": "missing or invalid admin token"})
                elif self.path == "/api/v1/summary":
                    self.reply(200, SUMMARY)
                elif self.path == "/api/v1/nodes":
                    self.reply(200, server.nodes)
                else:
                    self.reply(404, {"error": "not found"})

            def reply(self, status: int, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        return Handler

    @property
    def authorizations(self) -> list[str]:
        return [a for a in self.seen if a is not None]


@pytest.fixture
def admin_server() -> Iterator[Callable[..., AdminServer]]:
    started: list[ThreadingHTTPServer] = []

    def make(token: str, **kw: object) -> AdminServer:
        s = AdminServer(token, **kw)  # type: ignore[arg-type]
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), s.handler())
        s.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return s

    yield make
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


# Descriptors holding the locks of the data dirs up_dir made "running"; closed after each test.
_HELD_LOCKS: list[int] = []


def up_dir(path: Path, url: str | None, token: str | None, *, running: bool = True) -> Path:
    """A data dir as a `llmgw up` leaves it: running (its controller's lock held, as up holds it
    for its whole life), or ``running=False``: killed without its shutdown (the lock gone with it)."""
    path.mkdir(parents=True)
    if running:
        (path / "controller").mkdir()  # up's controller locks its directory (llmgw.control.datadir)
        fd = os.open(path / "controller", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _HELD_LOCKS.append(fd)
    if url is not None:
        (path / "admin.url").write_text(url + "\n")
    if token is not None:
        (path / "admin.token").write_text(token + "\n")
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No admin settings from the developer's shell, and an empty default data dir."""
    monkeypatch.delenv("LLMGW_ADMIN_URL", raising=False)
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "llmgw"


@pytest.fixture(autouse=True)
def _release_up_locks() -> Iterator[None]:
    yield
    while _HELD_LOCKS:
        os.close(_HELD_LOCKS.pop())
