"""Rollouts through the admin API of a controller on 2 real sshd nodes (sim engines): a canary
started by a real commit, seen in the API, the metrics and the dashboard, promoted and aborted
through the API with the caller's name; a rolled-back one (a real canary whose record is then
marked as a failed check leaves it) shown with its figures and its reason, escaped, and promoted."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any

import pytest

from llmgw.decide import ReplicaState
from llmgw.decide.rollout import Analysis, Figures, Phase
from tests.admin.conftest import TOKEN, Running
from tests.reconciler.fleet_e2e import ready, sim_model

pytestmark = pytest.mark.slow

CANARY = "rollout:\n  strategy: canary\n  steps: [50]\n  interval: 1h\n"  # judged never: an operator decides


def api(running: Running, method: str, path: str, *, actor: str | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(running.url + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {TOKEN}", **({"X-Llmgw-Actor": actor} if actor
                                                                                  else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat_spec(running: Running, *args: str) -> str:
    return sim_model("chat", running.weights, min_=1, max_=2, args=args) + CANARY


def canary_ready(running: Running) -> bool:
    return any(r.canary and r.state == ReplicaState.READY for r in running.controller.reconciler.snapshot())


def rollout_of(running: Running) -> dict[str, Any] | None:
    status, body = api(running, "GET", "/api/v1/rollouts/chat")
    return body if status == 200 else None


def test_errors_before_any_rollout_are_404_and_409(running: Running) -> None:
    assert api(running, "GET", "/api/v1/rollouts") == (200, [])
    assert api(running, "GET", "/api/v1/rollouts/chat") == (
        404, {"error": 'model "chat" has had no rollout (it runs the version the catalog has)'})
    assert api(running, "GET", "/api/v1/rollouts/nope") == (404, {"error": 'model "nope" is not in the catalog'})
    assert api(running, "POST", "/api/v1/rollouts/nope/promote") == (
        404, {"error": 'model "nope" is not in the catalog'})
    status, body = api(running, "POST", "/api/v1/rollouts/chat/abort")
    assert status == 409 and body == {"error": "chat has no rollout in progress to abort"}
    status, body = api(running, "POST", "/api/v1/rollouts/chat/promote")
    assert status == 409 and body == {"error": "chat has no canary or rolled-back rollout to promote"}
    assert api(running, "GET", "/api/v1/rollouts/chat/promote")[0] == 405  # a write is a POST


def test_a_canary_is_shown_then_promoted_through_the_api(running: Running) -> None:
    c = running.controller
    (old,) = ready(c, "chat")
    sha = running.repo.commit({"models/chat.yaml": chat_spec(running, "--ttft", "0.01")}, "Chat: faster first token")
    c.follower.trigger()
    running.wait(lambda: canary_ready(running), timeout=60, what="canary ready")
    r = rollout_of(running)
    assert r is not None
    (canary,) = [x for x in c.reconciler.snapshot() if x.canary]
    assert (r["phase"], r["strategy"], r["step"], r["steps"], r["percent"]) == ("canary", "canary", 1, [50], 50)
    assert r["canary"] == canary.id and r["revision"] == sha and r["interval"] == 3600
    assert r["analysis"] is None and r["target"] != r["stable"] and r["serving_version"] == r["stable"]
    assert api(running, "GET", "/api/v1/rollouts") == (200, [r])

    status, metrics = api(running, "GET", "/api/v1/metrics")
    assert status == 200
    assert 'llmgw_rollout_phase{model="chat",phase="canary"} 1.0' in metrics
    assert 'llmgw_rollout_phase{model="chat",phase="promoting"} 0.0' in metrics
    assert 'llmgw_rollout_canary_percent{model="chat"} 50.0' in metrics
    assert "llmgw_rollouts_rolled_back 0.0" in metrics

    status, summary = api(running, "GET", "/api/v1/summary")
    assert [x["model"] for x in summary["rollouts"]] == ["chat"] and summary["rollouts"][0]["phase"] == "canary"

    status, body = api(running, "POST", "/api/v1/rollouts/chat/promote", actor="alice")
    assert status == 200 and body["phase"] == "promoting" and body["reason"] == "promoted by alice"
    assert any(e.kind == "rollout-promoted" and "promoted by alice" in e.message for e in c.store.events())
    # The promoted canary serves as an ordinary replica; the old version's replica goes.
    running.wait(lambda: (rollout_of(running) or {}).get("phase") == "done", timeout=60, what="rollout done")
    running.wait(lambda: old.id not in c.reconciler.replicas, timeout=30, what="old replica stopped")
    (now,) = ready(c, "chat")  # the canary took over from the old replica: still one, as min says
    assert now.id == canary.id and not now.canary
    status, summary = api(running, "GET", "/api/v1/summary")
    assert summary["rollouts"] == []  # a finished rollout is history, not news


def test_an_abort_through_the_api_stops_the_canary_and_keeps_the_version(running: Running) -> None:
    c = running.controller
    stable = {x.id for x in ready(c, "chat")}
    assert len(stable) == 1
    running.repo.commit({"models/chat.yaml": chat_spec(running, "--ttft", "0.02")}, "Chat: another try")
    c.follower.trigger()
    running.wait(lambda: canary_ready(running), timeout=60, what="canary ready")
    (canary,) = [x for x in c.reconciler.snapshot() if x.canary]

    status, body = api(running, "POST", "/api/v1/rollouts/chat/abort", actor="bob")
    assert status == 200 and body["phase"] == "aborted" and body["reason"] == "aborted by bob"
    assert body["canary"] is None and body["percent"] == 0
    running.wait(lambda: canary.id not in c.reconciler.replicas, timeout=30, what="canary stopped")
    assert {x.id for x in ready(c, "chat")} == stable  # the last good version keeps serving
    assert any(e.kind == "rollout-aborted" and "aborted by bob" in e.message for e in c.store.events())
    status, body = api(running, "POST", "/api/v1/rollouts/chat/abort")
    assert status == 409 and "no rollout in progress" in body["error"]
    assert (rollout_of(running) or {}).get("phase") == "aborted"


def _rolled_back(running: Running, reason: str, ttft: str) -> str:
    """A real canary (a commit with ``--ttft ttft``), then its record as the driver leaves it after
    a failed check (the figures made up: a failing canary is the e2e tests' business); the sha."""
    c = running.controller
    sha = running.repo.commit({"models/chat.yaml": chat_spec(running, "--ttft", ttft)}, "Chat: " + ttft)
    c.follower.trigger()
    running.wait(lambda: canary_ready(running), timeout=60, what="canary ready")

    async def put() -> None:  # on the controller's loop, between two ticks
        rec = c.reconciler.rollouts.records["chat"]
        assert rec.rollout is not None and rec.rollout.phase == Phase.CANARY
        analysis = Analysis(at=1000.0, seconds=60.0, canary=Figures(140, 17, 0.25, 0.05),
                            stable=Figures(400, 2, 0.1, 0.02), verdict="fail", reason=reason)
        ended = replace(rec.rollout.ended(Phase.ROLLED_BACK, c.reconciler.clock(), reason), analysis=analysis,
                        history=(f"step 1/1 (50 %): fail: {reason}",))
        c.reconciler.rollouts.records["chat"] = replace(rec, rollout=ended)

    running.call(put())
    running.wait(lambda: not any(x.canary for x in c.reconciler.snapshot()), timeout=30, what="canary stopped")
    return sha


def test_a_rolled_back_rollout_shows_its_figures_and_reason_escaped(running: Running) -> None:
    reason = "canary error rate 12.1 % > stable 0.5 % + 2 % <script>alert(1)</script> over 60 s"
    sha = _rolled_back(running, reason, "0.03")
    r = rollout_of(running)
    assert r is not None and r["phase"] == "rolled-back" and r["reason"] == reason and r["revision"] == sha
    assert r["serving_version"] == r["stable"] != r["target"]  # the last good version keeps serving
    a = r["analysis"]
    assert a["verdict"] == "fail" and a["seconds"] == 60
    assert a["canary"] == {"requests": 140, "errors": 17, "error_rate": 17 / 140, "ttft_p95": 0.25, "itl_p95": 0.05}
    assert a["stable"]["requests"] == 400 and a["stable"]["error_rate"] == 2 / 400

    status, metrics = api(running, "GET", "/api/v1/metrics")
    assert 'llmgw_rollout_rolled_back{model="chat"} 1.0' in metrics and "llmgw_rollouts_rolled_back 1.0" in metrics
    assert 'llmgw_rollout_phase{model="chat",phase="rolled-back"} 1.0' in metrics

    req = urllib.request.Request(running.url + "/", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        page = resp.read().decode()
    section = page[page.index('<table id="rollouts">'):]
    section = section[: section.index("</table>")]
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in section
    assert "rolled-back" in section and "requests 140 vs 400" in section
    assert "errors 12.1 % vs 0.5 %" in section and "p95 TTFT 250 ms vs 100 ms" in section
    assert "p95 ITL 50 ms vs 20 ms" in section

    # Git still asks for it: an operator may push it through; then there is nothing to abort.
    status, body = api(running, "POST", "/api/v1/rollouts/chat/promote", actor="erin")
    assert status == 200 and body["phase"] == "promoting" and body["reason"] == "promoted by erin"
    running.wait(lambda: (rollout_of(running) or {}).get("phase") == "done", timeout=60, what="rollout done")
    status, body = api(running, "POST", "/api/v1/rollouts/chat/promote")
    assert status == 409 and body == {"error": "chat has no canary or rolled-back rollout to promote"}
