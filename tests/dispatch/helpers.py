"""Small helpers shared by the dispatcher tests."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from llmgw.dispatch.base import Dispatcher
from llmgw.dispatch.ssh import SshDispatcher
from tests.fixtures.sshd_fleet import SshdFleet, _marked_pids


def ssh_dispatcher(fleet: SshdFleet, *, agent_dir: str | Path, **options: Any) -> SshDispatcher:
    """A dispatcher for ``fleet`` with short timeouts; ``agent_dir`` keeps tests from sharing uploads."""
    options.setdefault("connect_timeout", 5.0)
    # python3 on this machine's PATH may be a pyenv shim (a shell script, ~120 ms a start):
    # the system interpreter keeps connects fast. The default ("python3") is what nodes use.
    if os.path.exists("/usr/bin/python3"):
        options.setdefault("python", "/usr/bin/python3")
    options.setdefault("call_timeout", 10.0)
    return SshDispatcher(
        options.pop("targets", None) or fleet.targets(),
        client_key=fleet.client_key,
        known_hosts=options.pop("known_hosts", fleet.known_hosts),
        agent_dir=str(agent_dir),
        **options,
    )


async def fetch_done(d: Dispatcher, node_id: str, source: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """Ask for ``source`` until the node reports it complete (fetch runs detached on the node).
    ``timeout``, here and below, is a bound on a hang, not a claim about the machine's speed."""
    deadline = time.monotonic() + timeout
    while True:
        answer = await d.fetch(node_id, source)
        if answer["state"] == "done":
            return answer
        assert answer["state"] == "running", answer
        assert time.monotonic() < deadline, f"fetch of {source} not done within {timeout}s: {answer}"
        await asyncio.sleep(0.05)


def http_status(url: str) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


async def wait_http(url: str, *, up: bool, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(http_status, url) is not None) != up:
        assert time.monotonic() < deadline, f"{url} still {'down' if up else 'up'} after {timeout}s"
        await asyncio.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def serve_pids(node_dir: Path) -> list[int]:
    """The node's ``serve`` agent processes (found by the marker sshd puts in their environment)."""
    found = []
    for pid in _marked_pids(str(node_dir)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and any(a.endswith(b".py") for a in argv):
            found.append(pid)
    return found


async def wait_until(predicate: Any, *, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        await asyncio.sleep(0.02)
