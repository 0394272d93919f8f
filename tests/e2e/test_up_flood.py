"""A flood of idle connections on the router, under the common limit of 1,024 descriptors,
leaves the admin API answering and the process alive (seen: "Too many open files" for the
admin API and git fetch alike, and ~300 MB of accept-error log in 15 s)."""

from __future__ import annotations

import concurrent.futures
import os
import resource
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from llmgw.serving import KEEPALIVE_TIMEOUT
from tests.e2e.processes import LLMGW, free_port, stop, wait_for

pytestmark = pytest.mark.slow
LIMIT = 1024


def connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=30)
    except OSError:
        return None


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
        # The server closes an idle connection KEEPALIVE_TIMEOUT (15 s) after taking it: the flood
        # holds the router at its cap only that long. So it is opened many at a time (one by one, a
        # busy machine took 3-6 s), and checked at once, with the time it took checked too.
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            socks = [s for s in pool.map(connect, [router_port] * (LIMIT + 100)) if s is not None]
        # Past the cap a new router connection is told so and closed, not left hanging. Accepted in
        # turn after the flood's (all but a backlog's worth of them taken already), so at the cap.
        with socket.create_connection(("127.0.0.1", router_port), timeout=30) as extra:
            extra.settimeout(30)
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.recv(4096)
        req = urllib.request.Request(f"http://127.0.0.1:{admin_port}/api/v1/summary",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:  # answered, not starved by the flood
            assert r.status == 200
        took = time.monotonic() - started
        assert took < KEEPALIVE_TIMEOUT, f"the flood took {took:.1f} s: idle ones closed before the checks"
        assert len(socks) > LIMIT and answer.startswith(b"HTTP/1.1 503") and b"overloaded" in answer, answer[:200]
        size_before = log.stat().st_size
        time.sleep(2.0)
        assert log.stat().st_size - size_before < 100_000  # no error log flood
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        assert stop(proc, signal.SIGINT, timeout=30) == 0, log.read_text()[-2000:]
