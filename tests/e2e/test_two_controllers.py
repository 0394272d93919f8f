"""Two `llmgw controller` processes pointed at one fleet of real sshd nodes (a failover, a copy
started by mistake): the second acts on nothing until an operator moves a node to it, no engine
of the first is stopped, and after the takeover the first's commands are refused by the node
(seen: two controllers stopped each other's engines) and the second adopts the first's engines
there. A copy of the first's data dir (a restored backup: the same holder id and epochs) is
another instance, fenced the same way (seen: each obeyed, each stopped the other's replicas as
stale every few seconds). Two processes on one data dir are refused outright."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from llmgw.dispatch.fence import SUCCESSION_GRACE, FencedDispatcher
from llmgw.dispatch.ssh import SshDispatcher
from llmgw.errors import StartRefused
from tests.conftest import git
from tests.dispatch.helpers import pid_alive
from tests.e2e.processes import LLMGW, catalog_repo, controller_config, free_port, start, stop, wait_for
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
        # B holds n1 now: A's engines there are what B's catalog asks for, so B adopts them (the same
        # processes, nothing started beside them) instead of leaving them orphaned (issue 36).
        n1 = node(admin_b, "n1")
        assert n1["lease"]["held"] and n1["lease"]["epoch"] == 2
        adopted = wait_for(lambda: (r := ready(admin_b)) and len(r) == 2 and r, 60, "B: A's n1 engines adopted", b)
        assert sorted(pid for shards in adopted.values() for _, pid in shards) == sorted(pids)
        assert set(adopted) == set(first)  # the very replica ids A numbered
        assert len(events(admin_b, "replica-adopted")) == 2 and events(admin_b, "replica-starting") == []

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

        # Asked to stop what the other controller left there, the takeover finds nothing unclaimed.
        done = api(admin_b, "/api/v1/nodes/n1/takeover", {"stop_foreign": True})
        assert done["stopped"] == []  # type: ignore[index]
        assert all(pid_alive(p) for p in pids)
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


def copy_data_dir(src: Path, dst: Path) -> None:
    """A copy of a running controller's data dir, as a backup would take it: the files as they
    are, the database through SQLite's online backup (a plain copy of a live one may be torn)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("llmgw.db", "llmgw.db-*"))
    with contextlib.closing(sqlite3.connect(src / "llmgw.db")) as live, \
            contextlib.closing(sqlite3.connect(dst / "llmgw.db")) as copy:
        live.backup(copy)


@pytest.mark.timeout(240)  # it waits past the succession grace on purpose, on a box that may be busy
def test_a_copied_data_dir_is_another_instance_and_is_fenced(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(2)
    repo = catalog_repo(tmp_path, fleet, {"chat": sim_model("chat", "sim://chat", min_=2, max_=2)},
                        "Two chat replicas")
    config_a, admin_a = controller_config(tmp_path, "a", repo, fleet, TOKEN)
    config_b, admin_b = controller_config(tmp_path, "b", repo, fleet, TOKEN)  # its data dir: tmp_path / "b"
    a = start(["controller", "--config", str(config_a)], tmp_path / "a.log")
    b = None
    try:
        first = wait_for(lambda: (r := ready(admin_a)) and len(r) == 2 and r, 60, "A: 2 ready", a)
        pids = [pid for shards in first.values() for _, pid in shards]
        holder = node(admin_a, "n1")["lease"]["holder"]

        copy_data_dir(tmp_path / "a", tmp_path / "b")  # while A runs
        b = start(["controller", "--config", str(config_b)], tmp_path / "b.log")
        assert node(admin_a, "n1")["lease"]["holder"] == holder  # the copy has the very same holder id
        # B sees its own holder id on every lease, held by a live instance: fenced, not obeyed.
        wait_for(lambda: all(node(admin_b, n).get("state") == "fenced" for n in ("n1", "n2")), 60, "B: fenced", b)
        assert (f"held by another instance of controller {holder} (epoch 1), which is running (a copied data "
                "dir?)") in node(admin_b, "n1")["error"]
        # B gives up the replicas it copied (A's) without stopping anything; it starts nothing.
        wait_for(lambda: [r for r in api(admin_b, "/api/v1/replicas") if r["state"] != "stopped"] == [],  # type: ignore
                 30, "B: copied replicas given up", b)
        fenced_at = time.monotonic()

        # A commit: both follow it. A places the new model on n2 and keeps serving chat; B, fenced
        # everywhere, places nothing and stops nothing.
        (repo / "models" / "extra.yaml").write_text(sim_model("extra", "sim://extra", min_=1, max_=1))
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "Add extra")
        after = wait_for(lambda: (r := ready(admin_a)) and len(r) == 3 and r, 60, "A: extra ready too", a)
        assert {rid: shards for rid, shards in after.items() if rid in first} == first
        assert all(pid_alive(p) for p in pids)
        # The copy cannot displace the live instance, however long it waits: A renews its leases
        # (its polls and its keeper) well inside the grace a silent instance would lose them after.
        wait_for(lambda: time.monotonic() - fenced_at > SUCCESSION_GRACE + 5, SUCCESSION_GRACE + 30, "past the grace")
        for n in ("n1", "n2"):
            lease = node(admin_a, n)["lease"]
            assert (lease["held"], lease["epoch"]) == (True, 1), lease
            assert node(admin_b, n)["state"] == "fenced"
        assert ready(admin_a) == after and all(pid_alive(p) for p in pids)
        for admin in (admin_a, admin_b):
            assert events(admin, "stale-engine-stopped") == []
        assert [r for r in api(admin_b, "/api/v1/replicas") if r["state"] != "stopped"] == []  # type: ignore

        # The copy stops cleanly (it releases only leases it holds: none); A goes on untouched.
        assert stop(b, signal.SIGTERM) == 0
        b = None
        api(admin_a, "/api/v1/sync", {})
        assert all(node(admin_a, n)["lease"]["held"] for n in ("n1", "n2"))
        assert ready(admin_a) == after and all(pid_alive(p) for p in pids)
    finally:
        for model in ("chat", "extra"):
            with contextlib.suppress(FileNotFoundError):
                (repo / "models" / f"{model}.yaml").unlink()
        git(repo, "commit", "-qam", "Retire\n\nLlmgw-Allow-Prune: yes")
        if b is not None:
            stop(b, signal.SIGTERM)
        if a.poll() is None:
            try:
                api(admin_a, "/api/v1/sync", {})
                wait_for(lambda: not [r for r in api(admin_a, "/api/v1/replicas")  # type: ignore
                                      if r["state"] != "stopped"], 60, "replicas stopped", a)
            finally:
                stop(a, signal.SIGTERM)


def test_a_second_process_on_the_same_data_dir_is_refused(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(1)
    repo = catalog_repo(tmp_path, fleet, {}, "No models")
    config, admin = controller_config(tmp_path, "a", repo, fleet, TOKEN)
    a = start(["controller", "--config", str(config)], tmp_path / "a.log")
    try:
        wait_for(lambda: node(admin, "n1").get("state") == "ready", 60, "A: running", a)
        # The same config (its ports are taken too: the data dir is what it is told about), then
        # another config on other ports with the same data dir.
        other = tmp_path / "other.yaml"
        raw = json.loads(config.read_text())
        raw["listen"] = {"router": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"}
        other.write_text(json.dumps(raw))
        for cfg in (config, other):
            out = subprocess.run([LLMGW, "controller", "--config", str(cfg)], capture_output=True, text=True,
                                 timeout=60, check=False)
            assert out.returncode == 1, out.stdout + out.stderr
            text = " ".join((out.stdout + out.stderr).split())
            assert f"data dir {tmp_path / 'a'} is in use by another llmgw process (pid {a.pid})" in text, text
        assert a.poll() is None and node(admin, "n1")["lease"]["held"]
    finally:
        stop(a, signal.SIGTERM)
