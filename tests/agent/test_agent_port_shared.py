"""An engine whose port another process listens on too (issue 41's CI run: two `llmgw up`s on one
machine picked the same port before either engine bound it; vLLM and llama.cpp's server both bind
with SO_REUSEPORT, so the kernel shared the connections and a vLLM model was answered by
llama.cpp). The agent says how many sockets listen on an engine's port that its processes do not
hold; the controller starts such a replica again elsewhere (tests/reconciler)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.helpers import Node, wait_for

# Listens on --port as engines do: SO_REUSEPORT, like vLLM's server and llama.cpp's.
REUSEPORT_ENGINE = (
    "import socket, sys, time; port = int(sys.argv[sys.argv.index('--port') + 1]); "
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); "
    "s.bind(('127.0.0.1', port)); s.listen(); print('listening', port, flush=True); time.sleep(120)"
)


@pytest.fixture
def sharing_node(node: Node) -> Node:
    node.write_config(engines={**node.settings["engines"], "reuse": [sys.executable, "-c", REUSEPORT_ENGINE]})
    return node


def socket_owner(port: int) -> int:
    """The user of the socket listening on ``port`` (the kernel's table says it)."""
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = row.split()
        if f[3] == "0A" and int(f[1].rpartition(":")[2], 16) == port:
            return int(f[7])
    raise AssertionError(f"nothing listens on {port}")


def view(node: Node, replica_id: str) -> dict:
    return next(e for e in node.ok("status")["engines"] if e["replica_id"] == replica_id)


def test_a_port_another_process_also_listens_on_is_said(sharing_node: Node) -> None:
    started = sharing_node.ok("start", {"replica_id": "m-g1.r1", "engine": "reuse", "args": ["--port", "{port}"]})
    port = started["port"]
    wait_for(lambda: any(f"listening {port}" in line for line in view(sharing_node, "m-g1.r1")["log_tail"]))
    assert view(sharing_node, "m-g1.r1")["port_shared_with"] == 0  # its own socket only
    # Another process of the engine's user (the kernel shares a port only between one user's sockets).
    uid = socket_owner(port)
    # The system's interpreter: the engine's user may not reach this one (under /root here).
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    other = subprocess.Popen([python, "-c", REUSEPORT_ENGINE, "--port", str(port)],
                             stdout=subprocess.PIPE, text=True, user=uid if os.getuid() == 0 else None)
    try:
        assert other.stdout is not None and other.stdout.readline().startswith("listening")
        assert view(sharing_node, "m-g1.r1")["port_shared_with"] == 1
    finally:
        other.kill()
        other.wait(10)
        other.stdout.close()
    wait_for(lambda: view(sharing_node, "m-g1.r1")["port_shared_with"] == 0)
    sharing_node.ok("stop", {"replica_id": "m-g1.r1", "grace_seconds": 2})
    with socket.socket() as s:  # and the port is free again
        s.bind(("127.0.0.1", port))
