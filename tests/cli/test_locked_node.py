"""`llmgw nodes` says which nodes are locked (their key pinned to the installed agent), as the controller's
log does: the report was a node logged as "locked node" and shown as `"locked": false`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import git
from tests.e2e.processes import controller_config, start, stop, wait_for
from tests.reconciler.fleet_e2e import sim_model

pytestmark = pytest.mark.slow

TOKEN = "locked-admin-token"
LLMGW = str(Path(sys.executable).parent / "llmgw")


def nodes_json(admin: str) -> dict[str, dict]:
    done = subprocess.run([LLMGW, "nodes", "-o", "json", "--url", admin],
                          env={**os.environ, "LLMGW_ADMIN_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60,
                          check=False)
    if done.returncode != 0:  # the controller not listening yet: wait_for tries again on an OSError
        raise OSError(done.stdout + done.stderr)
    return {n["id"]: n for n in json.loads(done.stdout)}


def test_a_locked_node_is_shown_locked_and_an_open_one_not(sshd_fleet, tmp_path: Path) -> None:
    locked, unlocked = sshd_fleet(1, locked=True)[0], sshd_fleet(1)[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(locked.known_hosts.read_text() + unlocked.known_hosts.read_text())
    repo = tmp_path / "catalog"
    (repo / "models").mkdir(parents=True)
    (repo / "nodes.yaml").write_text("nodes:\n" + "".join(
        f"  - id: {name}\n    address: {n.host}\n    port: {n.port}\n    user: root\n"
        "    gpus: {count: 2, class: sim, memory_gb: 24}\n    disk_gb: 100\n"
        for name, n in (("locked", locked), ("open", unlocked))))
    (repo / "models" / "chat.yaml").write_text(sim_model("chat", "sim://chat", min_=0, max_=1))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Catalog")
    ssh = SimpleNamespace(client_key=locked.client_key, known_hosts=known_hosts)
    config, admin = controller_config(tmp_path, "controller", repo, ssh, TOKEN)
    log = tmp_path / "controller.log"
    proc = start(["controller", "--config", str(config)], log)
    try:
        wait_for(lambda: {n["state"] for n in nodes_json(admin).values()} == {"ready"}, 60, "both nodes ready", proc)
        # Logged before the node is ready, but written to the file by the output thread: waited for.
        wait_for(lambda: "locked: locked node, agent version" in log.read_text(), 30, "the locked node's line", proc)
        assert {k: n["locked"] for k, n in nodes_json(admin).items()} == {"locked": True, "open": False}
    finally:
        stop(proc, signal.SIGTERM)
