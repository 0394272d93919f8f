"""Fixtures for the node agent tests (helpers live in tests/agent/helpers.py)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.agent.helpers import AGENT, ECHO_ENGINE, FileServer, Node, confined_settings


def _port_block(size: int = 12) -> tuple[int, int]:
    # Spread over a wide range so parallel runs rarely meet; the agent skips busy ports anyway.
    base = 20000 + (os.getpid() * 37 + time.monotonic_ns()) % 30000
    return base, base + size - 1


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    root = tmp_path.resolve()  # a tmp dir reached through a symlink would trip the deletion guard
    paths = {name: root / name for name in ("cache", "models", "state", "bin")}
    for path in paths.values():
        path.mkdir()
    ports = _port_block()
    made = Node(root=root, config=root / "agent.json", ports=ports, **paths)
    made.write_config(
        cache_dir=str(made.cache), state_dir=str(made.state), model_dirs=[str(made.models)],
        port_range=list(ports), advertise_address="127.0.0.1",
        engines={
            "pyhttp": [sys.executable, "-m", "http.server"],
            "pyecho": [sys.executable, "-c", ECHO_ENGINE],
            "pysleep": [sys.executable, "-c", "import time; time.sleep(120)"],
        },
        gpus=[{"index": 0, "class": "h100", "memory_gb": 80}, {"index": 1, "class": "h100", "memory_gb": 80}],
        env_allow=["LLMGW_TEST_VALUE"], **{**confined_settings(), "local_sources": [str(root)]},
    )
    yield made
    _kill_leftover_engines(made.state)


def _kill_leftover_engines(state: Path) -> None:
    """Tests stop what they start; this only keeps a failed test from leaking engines."""
    for record_file in (state / "engines").glob("*.json"):
        record = json.loads(record_file.read_text())
        if not isinstance(record.get("pid"), int) or record["pid"] == os.getpid():
            continue  # the guard tests stand this test process in for a running engine
        stat_file = Path(f"/proc/{record['pid']}/stat")
        if stat_file.exists() and int(stat_file.read_text().rsplit(")", 1)[1].split()[19]) == record["pid_start"]:
            try:
                os.killpg(record["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def agent_module() -> ModuleType:
    """The agent imported in-process (for the guard's race and property tests)."""
    spec = importlib.util.spec_from_file_location("llmgw_agent_under_test", AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    served = FileServer(files={})

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            served.requests.append((self.path, self.headers.get("Range")))
            body = served.files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            start = 0
            match = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
            if match and int(match.group(1)) < len(body):
                start = int(match.group(1))
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            rest = body[start:]
            gate = served.hold.get(self.path)
            if gate is not None:
                self.wfile.write(rest[: len(rest) // 2])
                self.wfile.flush()
                gate.wait(300)  # a test sets it; teardown sets every one
                rest = rest[len(rest) // 2:]
            self.wfile.write(rest)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002, ARG002 - silence
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served
    for gate in served.hold.values():
        gate.set()
    server.shutdown()
    server.server_close()
    thread.join(5)
