"""Scaling driven by real demand: a standalone `llmgw router` process reports what its clients do
to an `llmgw controller` process over sshd nodes, and the controller wakes, scales up, scales down
and stops a `min: 0` model from those reports alone (it was tested only with demand injected).

Engines are the simulator (no GPU here), paced so load lasts long enough to be seen."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import time
import urllib.request

import openai
import pytest

from tests.conftest import git
from tests.e2e.processes import catalog_repo, controller_config, free_port, start, stop, wait_for
from tests.reconciler.fleet_e2e import sim_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~25 s here; the waits are bounds on hangs

TOKEN = "demand-admin-token"
KEY = "sk-team-lazy"


def api(admin: str, path: str, body: dict | None = None) -> object:
    req = urllib.request.Request(admin + path, data=json.dumps(body).encode() if body is not None else None,
                                 method="POST" if body is not None else "GET",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def live(admin: str) -> list[dict]:
    return [r for r in api(admin, "/api/v1/replicas") if r["state"] != "stopped"]  # type: ignore[union-attr]


def ready(admin: str) -> list[dict]:
    return [r for r in live(admin) if r["state"] == "ready"]


def test_a_model_at_zero_is_woken_scaled_up_and_back_to_zero_by_a_routers_reports(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(2)
    lazy = sim_model("lazy", "sim://lazy", min_=0, max_=2, idle_after="4s", args=["--tokens-per-second", "20"])
    repo = catalog_repo(tmp_path, fleet, {"lazy": lazy.replace("scaling:\n", "scaling:\n  target_inflight: 2\n")},
                        "A lazy model")
    router_port = free_port()
    # The controller's keys reach the standalone router over the feed: it has no --api-keys.
    config, admin = controller_config(tmp_path, "data", repo, fleet, TOKEN, api_keys=[
        {"name": "team", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "models": ["lazy"]}])
    ctl = start(["controller", "--config", str(config)], tmp_path / "controller.log")
    router = None
    try:
        wait_for(lambda: api(admin, "/api/v1/summary")["sync"]["state"] == "synced", 60, "synced", ctl)
        router = start(["router", "--controller", admin, "--admin-token", TOKEN, "--listen",
                        f"127.0.0.1:{router_port}", "--report-interval", "0.5", "--hold-timeout", "60"],
                       tmp_path / "router.log")
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{router_port}/health", timeout=5).status == 200,
                 60, "router listening", router)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key=KEY, max_retries=0, timeout=90)
        wait_for(lambda: [m.id for m in client.models.list().data] == ["lazy"], 60, "router follows", router)
        assert live(admin) == []  # min 0: nothing runs before anyone asks
        stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="guess", max_retries=0)
        with stranger, pytest.raises(openai.AuthenticationError):  # closed: its socket is not left to the GC
            stranger.chat.completions.create(model="lazy", messages=[{"role": "user", "content": "hi"}])
        assert live(admin) == []  # a refused request wakes nothing

        # 1. A request for the model at zero is held by the router, whose report wakes a replica.
        answer = client.chat.completions.create(model="lazy", messages=[{"role": "user", "content": "wake up"}],
                                                max_tokens=4)
        assert answer.choices[0].message.content
        assert len(ready(admin)) == 1
        woken = [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == "replica-starting"]  # type: ignore
        assert len(woken) == 1

        # 2. Load above target_inflight (2 per replica), reported by the router: a second replica.
        async def load(bound: float) -> tuple[int, int]:
            """8 clients until two replicas are ready at once (or ``bound`` seconds, a bound on a hang:
            a new replica takes what it takes on a busy machine); (answers, most replicas ready at once)."""
            async_client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key=KEY,
                                              max_retries=0, timeout=90)
            deadline = time.monotonic() + bound
            done, most = 0, 0

            def going() -> bool:
                return most < 2 and time.monotonic() < deadline

            async def one() -> None:
                nonlocal done
                while going():
                    r = await async_client.chat.completions.create(
                        model="lazy", messages=[{"role": "user", "content": "go on"}], max_tokens=40)
                    assert r.choices[0].message.content
                    done += 1

            async def watch() -> None:
                nonlocal most
                while going():
                    most = max(most, len(await asyncio.to_thread(ready, admin)))
                    await asyncio.sleep(0.2)

            await asyncio.gather(*(one() for _ in range(8)), watch())
            await async_client.close()
            return done, most

        answered, most = asyncio.run(load(120))
        assert answered > 0 and most == 2, (answered, most)
        starts = [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == "replica-starting"]  # type: ignore
        assert len(starts) == 2

        # 3. No more requests: idle past idle_after (4 s) by the router's last-use reports, both stop.
        wait_for(lambda: live(admin) == [], 120, "idle replicas stopped", ctl)  # a bound on a hang
        stops = [e for e in api(admin, "/api/v1/events?limit=1000") if e["kind"] == "replica-stopping"]  # type: ignore
        assert len(stops) == 2 and all("idle for" in e["message"] for e in stops)
        client.close()
    finally:
        if router is not None:
            stop(router, signal.SIGTERM)
        (repo / "models" / "lazy.yaml").unlink()
        git(repo, "commit", "-qam", "Retire\n\nLlmgw-Allow-Prune: yes")
        try:
            api(admin, "/api/v1/sync", {})
            wait_for(lambda: live(admin) == [], 60, "replicas stopped", ctl)
        finally:
            stop(ctl, signal.SIGTERM)
