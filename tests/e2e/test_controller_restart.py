"""`kill -9` the controller process and start it again: every engine is adopted, none restarted."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from tests.conftest import git
from tests.e2e.processes import catalog_repo, controller_config, start, stop, wait_for
from tests.reconciler.fleet_e2e import sim_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # its waits allow 60 s each (the default timeout: 60)

TOKEN = "restart-admin-token"


def replicas(admin: str) -> list[dict]:
    req = urllib.request.Request(admin + "/api/v1/replicas", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_kill_9_then_restart_adopts_every_replica(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(2)
    repo = catalog_repo(tmp_path, fleet, {"chat": sim_model("chat", "sim://chat", min_=3, max_=3)},
                        "Three chat replicas")
    config, admin = controller_config(tmp_path, "data", repo, fleet, TOKEN)

    def all_ready() -> list[dict] | None:
        reps = replicas(admin)
        return reps if len(reps) == 3 and all(r["state"] == "ready" for r in reps) else None

    proc = start(["controller", "--config", str(config)], tmp_path / "first.log")
    try:
        before = wait_for(all_ready, 60, "3 ready replicas", proc)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup of any kind
        proc.wait(10)
        pids = {r["id"]: [s["pid"] for s in r["shards"]] for r in before}
        proc = start(["controller", "--config", str(config)], tmp_path / "second.log")
        after = wait_for(all_ready, 60, "3 replicas adopted", proc)
        assert {r["id"]: [s["pid"] for s in r["shards"]] for r in after} == pids
        kinds = [e["kind"] for e in _events(admin)]
        assert kinds.count("replica-starting") == 3  # the first life's starts only: nothing restarted
        assert sum(1 for e in _events(admin) if e["kind"] == "replica-ready" and " adopted at " in e["message"]) == 3
    finally:
        (repo / "models" / "chat.yaml").unlink()
        git(repo, "commit", "-qam", "Retire\n\nLlmgw-Allow-Prune: yes")
        try:
            req = urllib.request.Request(admin + "/api/v1/sync", data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            urllib.request.urlopen(req, timeout=30).read()
            wait_for(lambda: replicas(admin) == [], 60, "replicas stopped", proc)
        finally:
            stop(proc, signal.SIGTERM)


def _events(admin: str) -> list[dict]:
    req = urllib.request.Request(admin + "/api/v1/events?limit=1000", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())
