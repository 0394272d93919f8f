"""Routers hold a router credential, never the admin token (issue 41): an `llmgw controller`
process, a standalone `llmgw router` process given a credential made by `llmgw routers create`.

The credential serves the router (watch, report) and opens nothing else; its reports are its
router's whatever their body claims; revoking it ends the router's hold on the controller. A
router still on the admin token is named in status."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from llmgw.contract import REPORT_PATH
from tests.e2e.processes import SIM_CHAT_MODEL_YAML, free_port, local_controller, start, stop_everything, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "credential-admin-token"


def call(admin: str, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(admin + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw.cli.main", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def routers(admin: str) -> dict[str, dict]:
    status, data = call(admin, "GET", "/api/v1/routers", TOKEN)
    assert status == 200, data
    return {r["name"]: r for r in data}  # type: ignore[union-attr]


def test_a_router_credential_serves_a_router_and_opens_nothing_else(tmp_path: Path) -> None:
    c = local_controller(tmp_path, model_yaml=SIM_CHAT_MODEL_YAML, token=TOKEN)
    procs = [start(["controller", "--config", str(c.config)], tmp_path / "controller.log")]
    try:
        wait_for(lambda: call(c.admin, "GET", "/api/v1/summary", TOKEN)[1]["replicas_ready"] == 1,  # type: ignore[index]
                 90, "the model ready", procs[0])
        made = cli("routers", "create", "edge-1", "--url", c.admin, "--token", TOKEN, "-o", "json")
        assert made.returncode == 0, made.stderr
        credential = json.loads(made.stdout)["credential"]
        assert credential.startswith("llmgw-router-")

        # Everything an operator does is refused to it, reading included, saying what it would need.
        for method, path, body in (("POST", "/api/v1/nodes/local/state", {"state": "drain"}),
                                   ("POST", "/api/v1/sync", {}), ("GET", "/api/v1/summary", None),
                                   ("POST", "/api/v1/keys", {"name": "mine"}),
                                   ("POST", "/api/v1/weights/collect", {"collect": True}),
                                   ("POST", "/api/v1/routers", {"name": "edge-2"})):
            status, answer = call(c.admin, method, path, credential, body)
            assert status == 403, (method, path, status, answer)
            assert "router:edge-1 has the router role" in answer["error"]  # type: ignore[index]
        assert call(c.admin, "GET", "/api/v1/nodes", TOKEN)[1][0]["state"] == "ready"  # type: ignore[index]

        port = free_port()
        procs.append(start(["router", "--url", c.admin, "--listen", f"127.0.0.1:{port}", "--report-interval",
                            "0.5"], tmp_path / "router.log", env={"LLMGW_ADMIN_TOKEN": credential}))
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200,
                 60, "the router listening", procs[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        wait_for(lambda: "sim-chat" in [m.id for m in client.models.list().data], 60, "the router follows",
                 procs[1])
        answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert answer.choices[0].message.content
        wait_for(lambda: (routers(c.admin)["edge-1"]["report"] or {}).get("replicas_used") == 1, 30,
                 "the router's report, under its credential's name", procs[1])

        # A report claiming to be another router's is this credential's router's still.
        status, _ = call(c.admin, "POST", REPORT_PATH, credential,
                         {"router_id": "someone-else", "demand": {"sim-chat": {"held": 7, "inflight": 0}}})
        assert status == 200
        seen = routers(c.admin)
        assert set(seen) == {"edge-1"} and seen["edge-1"]["report"]["demand"]["sim-chat"]["held"] == 7
        # Nor can it write (or move the sequence of) another router process's usage by naming it.
        status, answer = call(c.admin, "POST", REPORT_PATH, credential, {
            "router_id": "edge-1", "usage": {"instance": "victim-process", "seq": 1, "rows": []}})
        assert status == 200 and answer["usage_acked"] == 1  # type: ignore[index]
        db = sqlite3.connect(c.data / "controller" / "llmgw.db")
        try:
            instances = {row[0] for row in db.execute("SELECT instance FROM usage_batches")}
        finally:
            db.close()
        assert "edge-1/victim-process" in instances and "victim-process" not in instances

        # Revoked: refused at once, its report no longer counts, its watch is closed.
        out = cli("routers", "revoke", "edge-1", "--url", c.admin, "--token", TOKEN)
        assert out.returncode == 0, out.stderr
        assert call(c.admin, "POST", REPORT_PATH, credential, {"router_id": "edge-1"})[0] == 401
        assert routers(c.admin) == {}
        events = call(c.admin, "GET", "/api/v1/events?limit=100", TOKEN)[1]
        kinds = [e["kind"] for e in events]  # type: ignore[union-attr]
        assert "router-credential-created" in kinds and "router-credential-revoked" in kinds

        # A router on the admin token still works, and status names it.
        port2 = free_port()
        procs.append(start(["router", "--url", c.admin, "--listen", f"127.0.0.1:{port2}", "--report-interval",
                            "0.5", "--router-id", "old-edge"], tmp_path / "router2.log",
                           env={"LLMGW_ADMIN_TOKEN": TOKEN}))
        wait_for(lambda: any("old-edge" in w and "admin token" in w for w in
                             call(c.admin, "GET", "/api/v1/summary", TOKEN)[1]["warnings"]),  # type: ignore[index]
                 60, "the warning about a router on the admin token", procs[2])
    finally:
        stop_everything(procs, c.data)


SCALING_MODEL_YAML = SIM_CHAT_MODEL_YAML.replace(
    "scaling: {min: 1, max: 1}", "scaling: {min: 1, max: 3, target_inflight: 1}").replace(
    "    pool: local", '    pool: local\n    args: ["--tokens-per-second", "4"]')


def test_a_routers_report_moves_no_replica_its_engines_do_not_bear_out(tmp_path: Path) -> None:
    """A router host taken over reports demand no client made (seen: 50 in flight took a model
    from 1 to 3 replicas). The controller scales for load only as far as the model's engines count
    it, and says what it did not believe (llmgw_controller_demand_unconfirmed); real streams, which
    the engine counts, still scale the model up."""
    c = local_controller(tmp_path, model_yaml=SCALING_MODEL_YAML, token=TOKEN, gpus=3)
    procs = [start(["controller", "--config", str(c.config)], tmp_path / "controller.log")]
    try:
        def summary() -> dict:
            return call(c.admin, "GET", "/api/v1/summary", TOKEN)[1]  # type: ignore[return-value]

        wait_for(lambda: summary()["replicas_ready"] == 1, 90, "the model ready", procs[0])
        made = cli("routers", "create", "edge-1", "--url", c.admin, "--token", TOKEN, "-o", "json")
        credential = json.loads(made.stdout)["credential"]
        forged = {"router_id": "edge-1", "demand": {"sim-chat": {"held": 0, "inflight": 50}}}

        def metrics() -> str:
            req = urllib.request.Request(c.admin + "/api/v1/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.read().decode()

        def unconfirmed_said() -> bool:
            assert call(c.admin, "POST", REPORT_PATH, credential, forged)[0] == 200  # kept fresh
            return 'llmgw_controller_demand_unconfirmed{model="sim-chat"} 50.0' in metrics()

        wait_for(unconfirmed_said, 60, "the forged demand named as unconfirmed", procs[0])

        def last_tick() -> float:
            [loop] = [h for h in summary()["health"]["loops"] if h["name"] == "reconcile"]
            return loop["last_ok"] or 0.0

        # Ten ticks go by with the report fresh (each waited for: the reconcile loop's last good
        # turn moves): not one replica more, none wanted.
        for _ in range(10):
            assert call(c.admin, "POST", REPORT_PATH, credential, forged)[0] == 200
            seen = last_tick()
            wait_for(lambda: last_tick() > seen, 60, "a reconcile tick", procs[0])  # noqa: B023 - waited at once
            s = summary()
            assert s["replicas"] == 1 and not s.get("unplaced"), s
            assert 'demand_unconfirmed{model="sim-chat"} 50.0' in metrics()

        # Real streams through the controller's own router: the engine counts them, the model scales.
        client = openai.OpenAI(base_url=c.router + "/v1", api_key="unused", max_retries=0, timeout=120)
        import threading

        def stream() -> None:
            try:
                for _ in client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=200, stream=True):
                    pass
            except openai.APIError:
                pass  # cut when the controller stops at the end

        streams = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        for t in streams:
            t.start()
        wait_for(lambda: summary()["replicas"] >= 2, 90, "a replica added for the load the engine counts", procs[0])
    finally:
        stop_everything(procs, c.data)


def test_a_routers_report_holds_no_stop_its_engine_does_not_bear_out(tmp_path: Path) -> None:
    """A router host taken over reports requests in flight on a replica being stopped (seen: it held
    a scale-down stop for the whole drain timeout). After DRAIN_CONFIRM_AFTER the replica drains
    only while its engine counts requests: stopped within seconds, with an event saying why, not
    after the 60 s drain timeout."""
    from llmgw.reconciler.reconciler import DRAIN_CONFIRM_AFTER

    c = local_controller(tmp_path, model_yaml=SIM_CHAT_MODEL_YAML, token=TOKEN,
                         reconciler={"drain_timeout": "60s"})
    procs = [start(["controller", "--config", str(c.config)], tmp_path / "controller.log")]
    try:
        def replicas() -> list:
            return call(c.admin, "GET", "/api/v1/replicas", TOKEN)[1]  # type: ignore[return-value]

        [replica] = wait_for(lambda: [r for r in replicas() if r["state"] == "ready"], 90, "the model ready",
                             procs[0])
        made = cli("routers", "create", "edge-1", "--url", c.admin, "--token", TOKEN, "-o", "json")
        credential = json.loads(made.stdout)["credential"]
        forged = {"router_id": "edge-1", "in_flight": {replica["id"]: 5}}
        assert call(c.admin, "POST", REPORT_PATH, credential, forged)[0] == 200
        # The model retired: its replica withdrawn and drained, the forged report kept fresh.
        (c.repo / "models" / "sim-chat.yaml").unlink()
        from tests.conftest import git

        git(c.repo, "commit", "-qam", "Retire sim-chat\n\nLlmgw-Allow-Prune: yes")
        assert call(c.admin, "POST", "/api/v1/sync", TOKEN, {})[0] == 200

        def gone() -> bool:
            assert call(c.admin, "POST", REPORT_PATH, credential, forged)[0] == 200
            return replicas() == []

        asked = time.monotonic()
        wait_for(gone, 45, "the replica stopped though a router says 5 are in flight", procs[0])
        assert time.monotonic() - asked < 45  # not the drain timeout (60 s)
        events = call(c.admin, "GET", "/api/v1/events?limit=200", TOKEN)[1]
        [said] = [e for e in events if e["kind"] == "replica-drain-unconfirmed"]  # type: ignore[union-attr]
        assert "routers report 5 request(s) in flight" in said["message"] and "counts none" in said["message"]
        assert not [e for e in events if e["kind"] == "replica-drain-timeout"]  # type: ignore[union-attr]
        assert DRAIN_CONFIRM_AFTER < 45
    finally:
        stop_everything(procs, c.data)


def test_a_routers_usage_charges_no_tokens_its_engines_did_not_generate(tmp_path: Path) -> None:
    """A router host taken over reports usage for a key no client used: a million completion tokens
    charged to another tenant's budget. The controller records no more completion tokens for a
    model than its engines generated (as its own router reads them); the rest is held, shown, and
    dropped against the router that sent it. A real request's tokens are charged as ever."""
    c = local_controller(tmp_path, model_yaml=SIM_CHAT_MODEL_YAML, token=TOKEN)
    procs = [start(["controller", "--config", str(c.config)], tmp_path / "controller.log")]
    try:
        wait_for(lambda: call(c.admin, "GET", "/api/v1/summary", TOKEN)[1]["replicas_ready"] == 1,  # type: ignore[index]
                 90, "the model ready", procs[0])
        made = cli("routers", "create", "edge-1", "--url", c.admin, "--token", TOKEN, "-o", "json")
        credential = json.loads(made.stdout)["credential"]
        minute = int(time.time()) // 60 * 60
        forged = {"router_id": "edge-1", "usage": {"instance": "p1", "seq": 1, "rows": [
            {"minute": minute, "tenant": "", "key": "victim", "model": "sim-chat", "requests": 1,
             "prompt_tokens": 10, "completion_tokens": 1_000_000}]}}

        def metrics() -> str:
            req = urllib.request.Request(c.admin + "/api/v1/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.read().decode()

        # Once the controller's router has read the engine (it shows its queue), what it counted
        # bounds the forged rows: held, not charged (after 60 s, dropped against edge-1).
        def read() -> bool:
            models = call(c.admin, "GET", "/api/v1/models", TOKEN)[1]
            return any(m["name"] == "sim-chat" and m.get("engine_queue") for m in models)  # type: ignore[union-attr]

        wait_for(read, 60, "the engine read by the controller's router", procs[0])
        status, said = call(c.admin, "POST", REPORT_PATH, credential, forged)
        assert status == 200, said

        def bounded() -> bool:
            text = metrics()
            held = re.search(r'^llmgw_controller_usage_held_tokens\{model="sim-chat"\} (\S+)$', text, re.M)
            dropped = re.search(r'^llmgw_controller_usage_unconfirmed_tokens_total\{router="edge-1"\} (\S+)$', text,
                                re.M)
            return any(m is not None and float(m.group(1)) == 1_000_010 for m in (held, dropped))

        wait_for(bounded, 60, "the forged tokens held or dropped", procs[0])
        client = openai.OpenAI(base_url=c.router + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=12)
        assert answer.usage is not None and answer.usage.completion_tokens > 0

        def charged() -> dict[str, int]:
            rows = call(c.admin, "GET", "/api/v1/usage?by=key", TOKEN)[1]["rows"]  # type: ignore[index]
            return {r["key"]: r["completion_tokens"] for r in rows}

        # The real request is charged (its key: none, the router is open); the forged one is not.
        wait_for(lambda: sum(charged().values()) >= answer.usage.completion_tokens, 60,  # type: ignore[union-attr]
                 "the real request in the ledger", procs[0])
        assert "victim" not in charged()
    finally:
        stop_everything(procs, c.data)
