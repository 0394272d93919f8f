"""Two controllers on one real PostgreSQL store (DESIGN §5): the one holding the lease follows git,
reconciles and drives its nodes; the other sends no node command, answers the routers' feed and
the admin API's changes with 503 naming the leader, and takes over at once when the leader stops.

Each controller drives its own in-memory nodes (RecordingDispatcher), so "no node command" is
every call that controller's dispatcher saw."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.admin.app import build_admin_app
from llmgw.contract import REPORT_PATH, WATCH_PATH
from llmgw.control.config import ControllerConfig
from llmgw.control.controller import Controller
from llmgw.control.feed import FeedHub
from llmgw.control.leadership import LeadershipConfig
from llmgw.dispatch.recording import FakeNode, RecordingDispatcher
from llmgw.reconciler.config import ReconcilerConfig
from tests.conftest import git
from tests.fixtures.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures for this module
from tests.fixtures.sshd_fleet import free_port

TOKEN = "admin-secret"
DISK = {"path": "/var/cache/llmgw", "mount_point": "/", "fstype": "ext4", "total_bytes": 100 * 2**30,
        "free_bytes": 50 * 2**30, "shared": False, "exists": True}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CATALOG = {
    "llmgw.yaml": "pools:\n  - name: default\n",
    "nodes.yaml": "nodes:\n  - id: n1\n    address: 127.0.0.1\n    gpus: {count: 2, class: sim, memory_gb: 24}\n"
                  "    disk_gb: 100\n",
    "models/m.yaml": "name: m\nsource: hf://org/m\nsize_gb: 0.1\nscaling:\n  min: 1\n  max: 1\n"
                     "profiles:\n  - name: sim\n    engine: sim\n    gpus: 1\n    gpu_class: [sim]\n",
}
# Nothing here lapses: a lease of 30 s that a stall of the shared event loop (two controllers, their
# reconcilers, the admin app and PostgreSQL on a busy machine) cannot lose, so the handover after
# close (well under 30 s) is the release, not a lapse.
STEADY = LeadershipConfig(ttl=30.0, renew=0.3, retry=0.1, margin=5.0)


def _catalog_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "catalog"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for rel, text in CATALOG.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text, encoding="utf-8")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Initial catalog")
    return repo


async def until(check: Callable[[], object], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def admin_served(controller: Controller) -> AsyncIterator[str]:
    """The controller's admin API and feed on a free port, as `llmgw controller` serves them."""
    hub = FeedHub()
    hub.standby = controller.standing_by
    controller.role_listeners.append(hub.leadership_changed)
    runner = web.AppRunner(build_admin_app(controller, token=TOKEN, hub=hub), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def ask(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body, headers=AUTH,
                                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_only_the_leader_drives_nodes_and_the_standby_names_it(tmp_path: Path, postgres_url: str) -> None:  # noqa: F811
    repo = _catalog_repo(tmp_path)

    def controller(name: str) -> tuple[Controller, RecordingDispatcher]:
        config = ControllerConfig(repo=str(repo), data_dir=tmp_path / f"data-{name}", fetch_interval=60, watch=False,
                                  store=postgres_url, reconciler=ReconcilerConfig(tick_interval=0.2))
        nodes = RecordingDispatcher({"n1": FakeNode(hostname="n1", filesystems=[DISK])})
        return Controller(config, dispatcher=nodes, advertise=f"http://ctl-{name}:8081", lease=STEADY), nodes

    a, nodes_a = controller("a")
    b, nodes_b = controller("b")
    await a.start()
    try:
        await until(lambda: a.leading)
        await b.start()
        await until(lambda: nodes_a.calls_of("start"))  # the leader starts engines
        # b learns the leader from the store on its own task, after start returned.
        await until(lambda: b.standing_by() == (True, "http://ctl-a:8081"))
        assert not b.leading
        view = b.leadership_view()
        assert (view["role"], view["leader_url"], view["epoch"], view["shared"]) == \
            ("standby", "http://ctl-a:8081", 1, True)
        assert view["leader"] == a.leadership_view()["holder"] and view["last_takeover"] is not None
        # Each checks in on the store: the leader's view names the standby, and the other way round.
        both = {a.leadership_view()["holder"]: "leader", view["holder"]: "standby"}
        await until(lambda: {c["holder"]: c["role"] for c in a.leadership_view()["controllers"]} == both)
        await until(lambda: {c["holder"]: c["role"] for c in b.leadership_view()["controllers"]} == both)
        assert {c["url"] for c in a.leadership_view()["controllers"]} == {"http://ctl-a:8081", "http://ctl-b:8081"}
        async with admin_served(b) as url:
            status, body = await ask("GET", url + WATCH_PATH)
            assert status == 503 and body["error"]["type"] == "standby" and body["leader"] == "http://ctl-a:8081"
            status, body = await ask("POST", url + REPORT_PATH, {"router_id": "r1"})
            assert status == 503 and body["leader"] == "http://ctl-a:8081"
            status, body = await ask("POST", url + "/api/v1/nodes/n1/state", {"state": "cordon"})
            assert status == 503 and "http://ctl-a:8081" in body["error"] and body["leader"] == "http://ctl-a:8081"
            status, body = await ask("POST", url + "/api/v1/sync", {})  # a standby's follower does not run
            assert status == 503 and body["leader"] == "http://ctl-a:8081"
            status, body = await ask("GET", url + "/api/v1/summary")
            assert status == 200 and body["leadership"]["role"] == "standby"
            dash_status, page = await ask_text(url + "/")
            assert dash_status == 200 and 'id="controllers"' in page and "standby" in page
            assert page.count("data-controller=") == 2 and "http://ctl-a:8081" in page
            shown = status_text(body)  # `llmgw status` on the standby: its role, who leads, both controllers
            assert "role      standby  leader" in shown and "at http://ctl-a:8081" in shown
            assert "leader   http://ctl-a:8081  seen" in shown and "standby  http://ctl-b:8081  seen" in shown
            status, metrics = await ask_text(url + "/api/v1/metrics")
            assert 'llmgw_controller_leader{' in metrics and "llmgw_controller_lease_epoch 1.0" in metrics
            assert 'llmgw_controller_seen_seconds{holder="' in metrics and 'role="leader"' in metrics
        assert nodes_b.calls == []  # not one node command, not even an inventory poll
        handed = time.monotonic()
    finally:
        await a.close()
    try:
        await until(lambda: b.leading, within=15)  # released: at once, not after the TTL
        assert time.monotonic() - handed < STEADY.ttl
        await until(lambda: nodes_b.calls_of("start"))  # the new leader reconciles
        assert b.leadership_view()["epoch"] == 2 and b.standing_by() == (False, "http://ctl-b:8081")
        async with admin_served(b) as url:
            status, body = await ask("POST", url + REPORT_PATH,
                                     {"router_id": "r1", "last_used": {}, "demand": {}, "report_interval": 2.0})
            assert status == 200
    finally:
        await b.close()


async def ask_text(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=AUTH, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, await r.text()


def status_text(summary: dict[str, Any]) -> str:
    """What `llmgw status` prints for ``summary`` (the admin API's answer), as plain text."""
    import argparse

    from rich.console import Console

    from llmgw.cli.fleet import status

    class Answers:
        def request(self, method: str, path: str) -> dict[str, Any]:
            assert (method, path) == ("GET", "/api/v1/summary")
            return summary

    console = Console(record=True, width=200, color_system=None)
    assert status(argparse.Namespace(output="text"), Answers(), console) == 0  # type: ignore[arg-type]
    return console.export_text()
