"""A real git server over HTTP with Basic authentication: `git http-backend` (git's own smart-HTTP
CGI program) behind a small threaded http.server, for repository URLs that carry a credential."""

from __future__ import annotations

import base64
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class GitHttp:
    root: Path  # bare repositories under here are served as /<name>
    user: str
    password: str  # what the server accepts now; change it to make fetches fail with 401
    port: int = 0

    def url(self, repo: str, *, password: str | None = None, query: str = "") -> str:
        secret = self.password if password is None else password
        return f"http://{self.user}:{secret}@127.0.0.1:{self.port}/{repo}" + (f"?{query}" if query else "")


@contextmanager
def git_http(root: Path, *, user: str, password: str) -> Iterator[GitHttp]:
    served = GitHttp(root, user, password)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            self._backend()

        def do_POST(self) -> None:  # noqa: N802
            self._backend()

        def _backend(self) -> None:
            body = self._body()
            wanted = "Basic " + base64.b64encode(f"{served.user}:{served.password}".encode()).decode()
            if self.headers.get("Authorization") != wanted:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="git"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path, _, query = self.path.partition("?")
            env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(served.root), "GIT_HTTP_EXPORT_ALL": "1",
                   "PATH_INFO": path, "QUERY_STRING": query, "REQUEST_METHOD": self.command,
                   "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                   "REMOTE_USER": served.user, "REMOTE_ADDR": "127.0.0.1",
                   "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
                   "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
            proc = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60,
                                  check=False)
            head, sep, payload = proc.stdout.partition(b"\r\n\r\n")
            if not sep:
                head, _, payload = proc.stdout.partition(b"\n\n")
            status, headers = 200, []
            for line in head.decode("latin-1").splitlines():
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002, ARG002 - silence
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    served.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
