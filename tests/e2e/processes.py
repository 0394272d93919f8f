"""Run `llmgw` itself as a subprocess (a controller, `llmgw up`), as an operator would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

LLMGW = str(Path(sys.executable).parent / "llmgw")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        try:
            value = check()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last})")


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([LLMGW, *args], stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "200", **(env or {})}, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig) if sig == signal.SIGKILL else proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


def catalog_repo(tmp: Path, fleet, models: dict[str, str], message: str) -> Path:  # noqa: ANN001 - an SshdFleet
    """A real catalog repository: the fleet's nodes.yaml and ``models`` (name → YAML), one commit."""
    from tests.conftest import git
    from tests.reconciler.fleet_e2e import nodes_yaml

    repo = tmp / "catalog"
    (repo / "models").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "nodes.yaml").write_text(nodes_yaml(fleet))
    for name, text in models.items():
        (repo / "models" / f"{name}.yaml").write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return repo


def controller_config(tmp: Path, name: str, repo: Path, fleet, token: str,  # noqa: ANN001 - an SshdFleet
                      **extra: object) -> tuple[Path, str]:
    """An `llmgw controller` config on free ports with its own data dir; (its path, the admin URL)."""
    admin_port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(json.dumps({
        "repo": str(repo), "data_dir": str(tmp / name),
        "listen": {"router": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{admin_port}"},
        "ssh": {"key": str(fleet.client_key), "known_hosts": str(fleet.known_hosts)},
        "admin_token": token, "reconciler": {"tick_interval": "300ms"}, **extra,
    }))
    return config, f"http://127.0.0.1:{admin_port}"


# One local node and one simulated chat model: the smallest catalog an `llmgw controller` serves.
def local_node_yaml(gpus: int) -> str:
    return ("nodes:\n  - id: local\n    transport: local\n    address: 127.0.0.1\n    pool: local\n"
            f"    gpus: {{count: {gpus}, class: sim, memory_gb: 24}}\n    memory_gb: 16\n    disk_gb: 50\n")


SIM_CHAT_MODEL_YAML = """\
name: sim-chat
aliases: [chat]
task: chat
source: sim://tiny-chat
size_gb: 0.1
scaling: {min: 1, max: 1}
profiles:
  - name: sim
    engine: sim
    gpus: 1
    gpu_class: [sim]
    gpu_memory_gb: 2
    memory_gb: 1
    pool: local
"""
