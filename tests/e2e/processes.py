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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class LocalController:
    """An `llmgw controller` config serving one local node (a data dir as `llmgw up` makes it)."""

    config: Path
    repo: Path  # the catalog repository the controller follows (commit here to change it)
    data: Path  # every process the controller starts runs under it
    router: str
    admin: str


def local_controller(tmp: Path, *, model_yaml: str, token: str, llmgw_yaml: str = "pools:\n  - name: local\n",
                     reconciler: dict[str, Any] | None = None, gpus: int = 1, **extra: Any) -> LocalController:
    """A catalog of one local node and ``model_yaml`` (as models/sim-chat.yaml), seeded by `llmgw
    up`'s own preparation, and a controller config for it; start it with ``start(["controller",
    "--config", str(c.config)], ...)``."""
    from llmgw.control.up import prepare

    source = tmp / "catalog-src"
    (source / "models").mkdir(parents=True)
    (source / "llmgw.yaml").write_text(llmgw_yaml)
    (source / "nodes.yaml").write_text(local_node_yaml(gpus))
    (source / "models" / "sim-chat.yaml").write_text(model_yaml)
    data = tmp / "state"
    router_port, admin_port = free_port(), free_port()
    up = prepare(data, catalog=source, router_port=router_port, admin_port=admin_port)
    config = tmp / "controller.yaml"
    config.write_text(json.dumps({
        "repo": up.controller.repo, "data_dir": str(up.controller.data_dir),
        "local_agent_config": str(up.controller.local_agent_config),
        "listen": {"router": f"127.0.0.1:{router_port}", "admin": f"127.0.0.1:{admin_port}"},
        "admin_token": token, "reconciler": {"tick_interval": "300ms", **(reconciler or {})}, **extra,
    }))
    return LocalController(config, Path(up.controller.repo), data, f"http://127.0.0.1:{router_port}",
                           f"http://127.0.0.1:{admin_port}")


def stop_everything(procs: list[subprocess.Popen], under: Path) -> None:
    """Stop ``procs`` (SIGTERM, then what the stop does), then kill whatever still runs under ``under``
    (engines a failed test left behind)."""
    from tests.e2e.test_up import processes_under

    for p in procs:
        stop(p, signal.SIGTERM, timeout=60)
    for pid in processes_under(under):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
