"""A flood of idle connections on the router, under the common limit of 1,024 descriptors,
leaves the admin API answering and the process alive (seen: "Too many open files" for the
admin API and git fetch alike, and ~300 MB of accept-error log in 15 s)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.processes import LLMGW, free_port, stop, wait_for

pytestmark = pytest.mark.slow
LIMIT = 1024


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def test_idle_connections_past_the_descriptor_limit_leave_the_admin_api_answering(tmp_path: Path) -> None:
    data, log = tmp_path / "state", tmp_path / "up.log"
    router_port, admin_port = free_port(), free_port()
    with log.open("ab") as fh:
        proc = subprocess.Popen([LLMGW, "up", "--data-dir", str(data), "--router-port", str(router_port),
                                 "--admin-port", str(admin_port)], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=limited, start_new_session=True,
                                env={**os.environ, "COLUMNS": "200"})
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: "Ctrl-C stops everything" in log.read_text(), 60, "llmgw up printed its welcome", proc)
        token = (data / "admin.token").read_text().strip()
        for _ in range(LIMIT + 100):
            try:
                socks.append(socket.create_connection(("127.0.0.1", router_port), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
        size_before = log.stat().st_size
        req = urllib.request.Request(f"http://127.0.0.1:{admin_port}/api/v1/summary",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:  # answered, not starved by the flood
            assert r.status == 200
        # Past the cap a new router connection is told so and closed, not left hanging.
        with socket.create_connection(("127.0.0.1", router_port), timeout=5) as extra:
            extra.settimeout(5)
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"overloaded" in answer, answer[:200]
        time.sleep(2.0)
        assert log.stat().st_size - size_before < 100_000  # no error log flood
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        assert stop(proc, signal.SIGINT, timeout=30) == 0, log.read_text()[-2000:]
