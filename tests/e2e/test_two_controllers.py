"""Two `llmgw controller` processes pointed at one fleet of real sshd nodes (a failover, a copy
started by mistake): the second acts on nothing until an operator moves a node to it, no engine
of the first is stopped, and after the takeover the first's commands are refused by the node
(seen: two controllers stopped each other's engines)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import urllib.request

import pytest

from llmgw.dispatch.fence import FencedDispatcher
from llmgw.dispatch.ssh import SshDispatcher
from llmgw.errors import StartRefused
from tests.conftest import git
from tests.dispatch.helpers import pid_alive
from tests.e2e.processes import LLMGW, catalog_repo, controller_config, start, stop, wait_for
from tests.reconciler.fleet_e2e import sim_model

pytestmark = pytest.mark.slow

TOKEN = "two-controllers-token"


def api(admin: str, path: str, body: dict | None = None) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(admin + path, data=data, method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def ready(admin: str) -> dict[str, list[tuple[str, int]]]:
    return {r["id"]: [(s["node"], s["pid"]) for s in r["shards"]]
            for r in api(admin, "/api/v1/replicas") if r["state"] == "ready"}  # type: ignore[union-attr]


def node(admin: str, node_id: str) -> dict:
    """The node as the admin API shows it; {} before the controller has read nodes.yaml."""
    return next((n for n in api(admin, "/api/v1/nodes") if n["id"] == node_id), {})  # type: ignore[union-attr]


def events(admin: str, kind: str) -> list[dict]:
    return [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == kind]  # type: ignore[union-attr]


def test_a_second_controller_is_fenced_until_takeover_and_then_the_first_is_refused(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(2)
    repo = catalog_repo(tmp_path, fleet, {"chat": sim_model("chat", "sim://chat", min_=2, max_=2)},
                        "Two chat replicas")
    config_a, admin_a = controller_config(tmp_path, "a", repo, fleet, TOKEN)
    config_b, admin_b = controller_config(tmp_path, "b", repo, fleet, TOKEN)
    a = start(["controller", "--config", str(config_a)], tmp_path / "a.log")
    b = None
    try:
        first = wait_for(lambda: (r := ready(admin_a)) and len(r) == 2 and r, 60, "A: 2 ready", a)
        pids = [pid for shards in first.values() for _, pid in shards]
        assert {n for shards in first.values() for n, _ in shards} == {"n1"}  # best fit packs n1
        holder_a = node(admin_a, "n1")["lease"]["holder"]
        assert node(admin_a, "n1")["lease"]["held"] is True

        # B starts on the same fleet: every node is fenced for it, it starts and stops nothing.
        b = start(["controller", "--config", str(config_b)], tmp_path / "b.log")
        wait_for(lambda: all(node(admin_b, n).get("state") == "fenced" for n in ("n1", "n2")), 30, "B: fenced", b)
        wait_for(lambda: len(events(admin_b, "foreign-engine")) == 2, 20, "B: A's engines reported", b)
        assert f"held by controller {holder_a} (epoch 1)" in node(admin_b, "n1")["error"]
        assert api(admin_b, "/api/v1/replicas") == []
        assert ready(admin_a) == first and all(pid_alive(p) for p in pids)

        # An operator moves n1 to B, through the CLI. A's engines there keep running.
        out = subprocess.run([LLMGW, "node", "takeover", "n1", "--url", admin_b, "--token", TOKEN],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "node n1 is now driven by" in out.stdout and "(epoch 2)" in out.stdout
        wait_for(lambda: node(admin_a, "n1")["state"] == "fenced", 20, "A: n1 fenced", a)
        assert all(pid_alive(p) for p in pids)
        # A gives its replicas there up (without stopping them: it cannot) and runs them on n2.
        moved = wait_for(lambda: (r := ready(admin_a)) and len(r) == 2 and
                         all(n == "n2" for shards in r.values() for n, _ in shards) and r, 60, "A: on n2", a)
        assert "driven by another controller" in events(admin_a, "replica-lost")[0]["message"]
        # B holds n1, but A's engines still take both its GPUs: B places nothing on top of them.
        n1 = node(admin_b, "n1")
        assert n1["lease"]["held"] and n1["lease"]["epoch"] == 2
        assert sorted(e["holder"] for e in n1["unclaimed_engines"]) == [holder_a, holder_a]
        assert [r for r in api(admin_b, "/api/v1/replicas") if r["state"] != "stopped"] == []  # type: ignore

        # The node itself refuses what A would send it now: its epoch-1 lease is over.
        async def as_a() -> None:
            ssh = SshDispatcher([t for t in _targets(fleet) if t.id == "n1"], client_key=fleet.client_key,
                                known_hosts=fleet.known_hosts)
            fenced = FencedDispatcher(ssh, holder_a)
            fenced.leases["n1"] = {"holder": holder_a, "epoch": 1, "held": True}
            async with fenced:
                with pytest.raises(StartRefused) as err:
                    await fenced.stop("n1", next(iter(first)) + ".r0", grace_seconds=1)
            assert err.value.setting == "lease" and "epoch 2" in str(err.value)

        asyncio.run(as_a())
        assert all(pid_alive(p) for p in pids)

        # Asked explicitly, the takeover stops what the other controller left there.
        done = api(admin_b, "/api/v1/nodes/n1/takeover", {"stop_foreign": True})
        assert len(done["stopped"]) == 2  # type: ignore[index]
        wait_for(lambda: not any(pid_alive(p) for p in pids), 20, "A's old engines stopped")
        wait_for(lambda: len(ready(admin_b)) == 2, 60, "B: 2 ready on n1", b)
        assert ready(admin_a) == moved  # A's replicas on n2, untouched by B
    finally:
        (repo / "models" / "chat.yaml").unlink()
        git(repo, "commit", "-qam", "Retire\n\nLlmgw-Allow-Prune: yes")
        for proc, admin in ((a, admin_a), (b, admin_b)):
            if proc is None or proc.poll() is not None:
                continue
            try:
                api(admin, "/api/v1/sync", {})
                wait_for(lambda admin=admin: not [r for r in api(admin, "/api/v1/replicas")  # type: ignore
                                                  if r["state"] != "stopped"], 60, "replicas stopped", proc)
            finally:
                stop(proc, signal.SIGTERM)


def _targets(fleet):  # noqa: ANN001, ANN202
    from llmgw.catalog import NodeId, NodeSpec
    from llmgw.control.fleet_dispatch import target_of

    return [target_of(NodeSpec(NodeId(f"n{i}"), n.host, port=n.port, user="root")) for i, n in enumerate(fleet, 1)]
