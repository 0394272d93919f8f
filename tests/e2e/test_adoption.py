"""Adoption, not restart (issue 36): a controller serving two replicas on real sshd nodes is killed
with SIGKILL, and another takes the fleet over once the node leases lapse: (a) on a fresh, empty
data dir with the same catalog, (b) on a copy of the first one's data dir taken before its replicas
started (a restored backup: the same holder id, an older generation counter). Either way the very
engine processes (same replica ids, same pids) serve through the new controller's router, nothing
new is started, and the engine of a model that left the catalog meanwhile is stopped (seen: 2 new
engines started beside the 2 that served, which were left orphaned holding their GPUs until an
operator ran `llmgw node takeover --stop-foreign`).

The leases are not shortened: the controller config has no setting for them, so (a) waits for the
first one's leases to expire (60 s, renewed at half) and (b) for the 20 s of silence after which a
sibling instance may succeed it. Nothing sleeps: each step waits for what the API or the router
shows. Each run prints its figures (start → lease, start → router answering)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import git
from tests.dispatch.helpers import pid_alive
from tests.e2e.processes import catalog_repo, controller_config, start, stop, wait_for
from tests.e2e.test_two_controllers import copy_data_dir
from tests.reconciler.fleet_e2e import sim_model

pytestmark = pytest.mark.slow

TOKEN = "adoption-token"
MODELS = {"chat": sim_model("chat", "sim://chat", min_=2, max_=2), "old": sim_model("old", "sim://old", min_=1, max_=1)}


def api(admin: str, path: str, body: dict | None = None):  # noqa: ANN201
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(admin + path, data=data, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def ready(admin: str) -> dict[str, dict]:
    return {r["id"]: r for r in api(admin, "/api/v1/replicas") if r["state"] == "ready"}


def events(admin: str, kind: str) -> list[dict]:
    return [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == kind]


def holds(admin: str, node_id: str) -> bool:
    node = next((n for n in api(admin, "/api/v1/nodes") if n["id"] == node_id), {})
    return bool((node.get("lease") or {}).get("held"))


def ask(router: str, model: str = "chat") -> str:
    """One chat completion through the router; its text (an error status raises)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    req = urllib.request.Request(router + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:  # a request held while the replica is probed
            return json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:  # its body not read: closed here, not left to the collector
        exc.close()
        raise ValueError(f"the router answered {exc.code}") from None


def served(endpoint: str) -> float:
    """Requests the simulator behind ``endpoint`` has accepted (its own counter)."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("llmgw_sim_requests_total"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{endpoint}/metrics has no llmgw_sim_requests_total")


@pytest.mark.timeout(420)  # the first controller's leases must lapse (60 s), on a box that may be busy
@pytest.mark.parametrize("data_dir", ["fresh", "copy-before-replicas"])
def test_a_new_controller_adopts_the_engines_of_one_killed(sshd_fleet, tmp_path, data_dir: str) -> None:
    fleet = sshd_fleet(2)
    copy = data_dir == "copy-before-replicas"
    repo = catalog_repo(tmp_path, fleet, {} if copy else MODELS, "The fleet" if copy else "Chat and old")
    config_a, admin_a = controller_config(tmp_path, "a", repo, fleet, TOKEN)
    config_b, admin_b = controller_config(tmp_path, "b", repo, fleet, TOKEN)  # its data dir: tmp_path / "b"
    router_b = "http://" + json.loads(config_b.read_text())["listen"]["router"]
    a = start(["controller", "--config", str(config_a)], tmp_path / "a.log")
    b = None
    try:
        if copy:
            # A backup taken once A runs (its holder id is in it) and before any replica started.
            wait_for(lambda: holds(admin_a, "n1") and holds(admin_a, "n2"), 60, "A: both nodes held", a)
            copy_data_dir(tmp_path / "a", tmp_path / "b")
            for name, text in MODELS.items():
                (repo / "models" / f"{name}.yaml").write_text(text)
            git(repo, "add", "-A")
            git(repo, "commit", "-qm", "Chat and old")
            api(admin_a, "/api/v1/sync", {})
        first = wait_for(lambda: (r := ready(admin_a)) and len(r) == 3 and r, 90, "A: 3 ready", a)
        chat = {rid: r for rid, r in first.items() if r["model"] == "chat"}
        (old,) = [r for r in first.values() if r["model"] == "old"]
        pids = {rid: [s["pid"] for s in r["shards"]] for rid, r in chat.items()}
        old_pid = old["shards"][0]["pid"]

        os.kill(a.pid, signal.SIGKILL)  # no cleanup of any kind: its leases stay until they lapse
        a.wait(10)
        (repo / "models" / "old.yaml").unlink()
        git(repo, "commit", "-qam", "Retire old\n\nLlmgw-Allow-Prune: yes")

        started = time.time()
        b = start(["controller", "--config", str(config_b)], tmp_path / "b.log")
        answer = wait_for(lambda: ask(router_b), 300, "B's router answering chat", b)
        answered = time.time()
        assert answer

        # The very engines A started serve, under A's replica ids; nothing was started.
        now_ready = wait_for(lambda: (r := ready(admin_b)) and len(r) == 2 and r, 60, "B: 2 ready", b)
        assert {rid: [s["pid"] for s in r["shards"]] for rid, r in now_ready.items()} == pids
        adopted = events(admin_b, "replica-adopted")
        assert sorted(e["subject"] for e in adopted) == sorted(pids)
        for e in adopted:
            assert f"pid {pids[e['subject']][0]} " in e["message"], e
        assert events(admin_b, "replica-created") == [] and events(admin_b, "replica-starting") == []
        # Through B's router, on those processes: each request lands on one of them.
        endpoints = [r["endpoint"] for r in now_ready.values()]
        before = sum(served(ep) for ep in endpoints)
        for _ in range(6):
            assert ask(router_b)
        assert sum(served(ep) for ep in endpoints) - before == 6
        # The model that left the catalog: its engine stopped, with the reason.
        wait_for(lambda: not pid_alive(old_pid), 60, "old's engine stopped", b)
        # Said once the node answered the stop: the process may be gone a moment before (CI saw it).
        (stopped,) = wait_for(lambda: events(admin_b, "stale-engine-stopped") or None, 60,
                              "the stale-engine-stopped event", b)
        assert stopped["subject"] == old["id"] + ".r0" and "model old left the catalog" in stopped["message"]
        assert all(pid_alive(p) for ps in pids.values() for p in ps)

        leased = min(e["time"] for e in events(admin_b, "node-lease"))
        waited = "node-handover" if copy else "node-fenced"
        assert events(admin_b, waited), f"B did not wait for the lease as {waited}"
        figures = {"data_dir": data_dir, "start_to_lease_s": round(leased - started, 2),
                   "lease_to_answer_s": round(answered - leased, 2),
                   "start_to_answer_s": round(answered - started, 2)}
        print(f"\nadoption figures: {json.dumps(figures)}")
    finally:
        if a.poll() is None:
            stop(a, signal.SIGTERM)
        if b is not None and b.poll() is None:
            try:
                (repo / "models" / "chat.yaml").unlink()
                git(repo, "commit", "-qam", "Retire\n\nLlmgw-Allow-Prune: yes")
                api(admin_b, "/api/v1/sync", {})
                wait_for(lambda: not [r for r in api(admin_b, "/api/v1/replicas") if r["state"] != "stopped"],
                         60, "replicas stopped", b)
            finally:
                stop(b, signal.SIGTERM)
