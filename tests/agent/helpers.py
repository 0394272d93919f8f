"""Helpers for the node agent tests: a node laid out on disk and a way to call its agent.

The agent is the file a node runs, so most tests drive it exactly as the dispatcher does: argv,
one JSON object on stdin, one on stdout. The guard's race and property tests import it in-process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmgw.catalog import cache_name  # noqa: F401 - the agent's one rule, as the tests name it
from tests.fixtures.confinement import confined_settings  # noqa: F401 - re-exported for the agent tests

AGENT = Path(__file__).resolve().parents[2] / "llmgw" / "agent" / "llmgw_agent.py"

# Prints its argv, CUDA_VISIBLE_DEVICES and one env var as JSON, then exits 0.
ECHO_ENGINE = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
    "'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), 'value': os.environ.get('LLMGW_TEST_VALUE')}), flush=True)"
)


def make_entry(cache: Path, source: str, *, manifest_source: str | None = None, name: str | None = None) -> Path:
    """A cache entry as the agent writes it (a directory with weights and a manifest)."""
    entry = cache / (name or cache_name(source))
    entry.mkdir(parents=True)
    (entry / "weights.bin").write_bytes(os.urandom(64))
    manifest = {"source": manifest_source or source, "fetched_at": time.time(), "bytes": 64, "agent_version": "0.1.0"}
    (entry / "llmgw-manifest.json").write_text(json.dumps(manifest))
    return entry


def snapshot(root: Path, *, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """Every path under root with a fingerprint (sha256 of files, targets of links), no link followed."""
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in dirnames + filenames:
            path = here / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def own_start_time() -> int:
    """This process's start time from /proc (what the agent records as pid_start)."""
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])


def wait_for(check: Callable[[], Any], *, timeout: float = 60.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class Node:
    """A node laid out under root, and a way to call its agent."""

    root: Path
    cache: Path
    models: Path
    state: Path
    bin: Path
    config: Path
    ports: tuple[int, int]
    settings: dict[str, Any] = field(default_factory=dict)

    def write_config(self, **overrides: Any) -> None:
        self.settings.update(overrides)
        self.config.write_text(json.dumps(self.settings))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SSH_ORIGINAL_COMMAND", "LLMGW_AGENT_CONFIG")}
        env["PATH"] = str(self.bin)  # no nvidia-smi unless a test puts a fake one there
        env.update(extra)
        return env

    def run(self, verb: str | None, request: Any = None, *, raw: bytes | None = None,
            env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        argv = [sys.executable, str(AGENT), "--config", str(self.config)] + ([verb] if verb else [])
        data = raw if raw is not None else json.dumps({} if request is None else request).encode()
        proc = subprocess.run(argv, input=data, capture_output=True, timeout=20, env=env or self.env(),
                              cwd=self.root, check=False)
        assert proc.stdout.count(b"\n") == 1, (proc.stdout, proc.stderr)
        return proc.returncode, json.loads(proc.stdout)

    def ok(self, verb: str, request: Any = None, **kwargs: Any) -> dict[str, Any]:
        code, answer = self.run(verb, request, **kwargs)
        assert code == 0, answer
        assert set(answer) != {"error"}, answer
        return answer

    def fail(self, verb: str | None, request: Any = None, **kwargs: Any) -> tuple[int, str]:
        code, answer = self.run(verb, request, **kwargs)
        assert code != 0, answer
        assert set(answer) in ({"error"}, {"error", "refused"}), answer
        return code, answer["error"]

    def fetch_settled(self, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """Fetch, and the fetch's final state (done or failed) as the agent records it: asking again
        would start a failed fetch over."""
        answer = self.ok("fetch", request)
        if answer["state"] != "running":
            return answer
        state_file = self.state / "fetches" / f"{cache_name(request['source'])}.json"

        def settled() -> dict[str, Any] | None:
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                return None
            return state if state["state"] != "running" else None

        return wait_for(settled, timeout=timeout)

    def fetch_until_done(self, source: str, timeout: float = 10.0) -> dict[str, Any]:
        """Fetch, wait for the worker by watching its state file (cheaper than asking), ask again."""
        answer = self.ok("fetch", {"source": source})
        if answer["state"] == "done":
            return answer
        state_file = self.state / "fetches" / f"{cache_name(source)}.json"

        def settled() -> bool:
            try:
                return json.loads(state_file.read_text())["state"] != "running"
            except (OSError, ValueError):
                return False

        wait_for(settled, timeout=timeout)
        answer = self.ok("fetch", {"source": source})
        assert answer["state"] == "done", answer
        return answer


SYSTEM_PYTHON = "/usr/bin/python3"


@contextlib.contextmanager
def unsandboxed_node(node: Node, engines: dict[str, list[str]], *, prefix: str) -> Iterator[Node]:
    """``node`` without a sandbox (sandbox: none), laid out under /tmp where the engine user can
    traverse (pytest's tmp dirs are 0700 under /tmp/pytest-of-root), so engines really run as that
    user; its engines killed and its tree removed afterwards."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs /usr/bin/python3")
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    base.chmod(0o755)
    moved = Node(root=base, cache=base / "cache", models=base / "models", state=base / "state", bin=base / "bin",
                 config=base / "agent.json", ports=node.ports, settings=dict(node.settings))
    for path in (moved.cache, moved.models, moved.state, moved.bin):
        path.mkdir()
        path.chmod(0o755)
    # check_visible looks at <state>/run before prepare_area creates it: on a fresh state dir the
    # first unsandboxed start was refused ("run is not searchable").
    (moved.state / "run").mkdir(mode=0o711)
    moved.write_config(cache_dir=str(moved.cache), state_dir=str(moved.state), model_dirs=[str(moved.models)],
                       sandbox="none", engines=engines)
    try:
        yield moved
    finally:
        for record_file in (moved.state / "engines").glob("*.json"):
            pid = json.loads(record_file.read_text())["pid"]
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class FileServer:
    """A local HTTP server with Range support (http.server has none) and a log of requests."""

    files: dict[str, bytes]
    url: str = ""
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    hold: dict[str, threading.Event] = field(default_factory=dict)  # path -> sent half, wait for this


def fetch_workers(node: Node) -> list[int]:
    """The pids of ``node``'s running fetch workers (what a test kills mid-fetch)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if b"_fetch-worker" in cmd and str(node.config).encode() in cmd:
                out.append(int(d.name))
    return out
