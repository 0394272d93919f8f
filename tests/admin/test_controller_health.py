"""A controller whose loops fail is visibly unhealthy (issue 40): a reconcile tick that raises at
every turn, a git remote that cannot be fetched. Seen where an operator looks: `llmgw status`, the
admin API's summary, /healthz, /metrics and the dashboard; and healthy again once mended."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from llmgw.health import UNHEALTHY_AFTER
from tests.admin.conftest import TOKEN, Running

pytestmark = pytest.mark.slow


def get(running: Running, path: str, *, accept: str = "application/json") -> tuple[int, str]:
    req = urllib.request.Request(running.url + path, headers={"Authorization": f"Bearer {TOKEN}", "Accept": accept})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def loop(running: Running, name: str) -> dict[str, Any]:
    _, body = get(running, "/api/v1/summary")
    return next(h for h in json.loads(body)["health"]["loops"] if h["name"] == name)


def test_a_reconcile_tick_that_keeps_failing_makes_the_controller_unhealthy_until_mended(
        run_cli, running: Running) -> None:
    c = running.controller
    assert get(running, "/api/v1/healthz") == (200, json.dumps({"status": "ok", "problems": []}))
    before = loop(running, "reconcile")
    assert before["state"] == "ok" and before["last_ok"] is not None

    async def broken() -> None:
        raise RuntimeError("inventory store exploded")

    c.inventory.poll = broken  # type: ignore[method-assign] - a bug in a part the tick calls
    try:
        running.wait(lambda: loop(running, "reconcile")["consecutive_failures"] >= UNHEALTHY_AFTER,
                     what="the reconcile loop counted its failures")
        rec = loop(running, "reconcile")
        assert rec["state"] == "unhealthy" and rec["critical"] is True
        assert rec["last_error"] == "RuntimeError: inventory store exploded"
        assert rec["last_ok"] == pytest.approx(before["last_ok"], abs=60) and rec["last_failure"] >= rec["last_ok"]

        code, body = get(running, "/api/v1/healthz")
        assert code == 503, body
        problem = json.loads(body)
        assert problem["status"] == "unhealthy"
        assert any(p.startswith("reconcile unhealthy: failed ") and "inventory store exploded" in p
                   for p in problem["problems"]), problem

        code, out = run_cli("status", "--url", running.url, "--token", TOKEN)
        assert code == 0, out
        assert "health    unhealthy" in out and "inventory store exploded" in out

        _, metrics = get(running, "/api/v1/metrics", accept="text/plain")
        row = next(line for line in metrics.splitlines()
                   if line.startswith('llmgw_controller_loop_consecutive_failures{loop="reconcile"}'))
        assert float(row.split()[-1]) >= UNHEALTHY_AFTER
        assert "llmgw_controller_healthy 0.0" in metrics
        assert 'llmgw_controller_loop_failures_total{loop="reconcile"}' in metrics

        _, page = get(running, "/", accept="text/html")
        assert 'data-loop="reconcile"' in page and "RuntimeError: inventory store exploded" in page
        assert '<span class="state unhealthy">unhealthy</span>' in page
    finally:
        del c.inventory.poll  # the method again
    running.wait(lambda: loop(running, "reconcile")["consecutive_failures"] == 0, what="a good tick again")
    assert get(running, "/api/v1/healthz")[0] == 200
    after = loop(running, "reconcile")
    assert after["state"] == "ok" and after["failures"] >= UNHEALTHY_AFTER  # the count since start stays
    _, metrics = get(running, "/api/v1/metrics", accept="text/plain")
    assert "llmgw_controller_healthy 1.0" in metrics


def test_a_git_remote_that_cannot_be_fetched_shows_but_does_not_fail_liveness(run_cli, running: Running) -> None:
    repo: Path = running.repo.path
    away = repo.with_name(repo.name + ".away")
    repo.rename(away)
    try:
        running.wait(lambda: loop(running, "git-sync")["consecutive_failures"] >= UNHEALTHY_AFTER,
                     what="the git loop counted its failures")
        sync = loop(running, "git-sync")
        assert sync["state"] == "unhealthy" and sync["critical"] is False
        assert sync["last_error"].startswith("fetch: ")
        # The last good catalog is still in force, and a restart would not bring the remote back.
        code, body = get(running, "/api/v1/healthz")
        assert code == 200 and json.loads(body)["status"] == "unhealthy", body
        code, out = run_cli("status", "--url", running.url, "--token", TOKEN)
        assert code == 0 and "git-sync unhealthy: failed" in out, out
    finally:
        away.rename(repo)
    running.wait(lambda: loop(running, "git-sync")["consecutive_failures"] == 0, what="a good fetch again")
