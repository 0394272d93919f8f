"""The usage ledger as operators read it: `GET /api/v1/usage`, `llmgw usage` and the dashboard's
chart of tokens per tenant (in headless Chromium), over a real controller's store."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from llmgw.contract import UsageBatch, UsageRow
from tests.admin.conftest import TOKEN, Running
from tests.admin.test_admin_api import http

pytestmark = pytest.mark.slow

NOW = int(time.time()) // 60 * 60


@pytest.fixture(scope="module")
def recorded(running: Running) -> Running:
    """Two tenants' use, as routers would have reported it: an hour ago and in the last minutes."""
    rows = (
        UsageRow(NOW - 3600, "search", "web", "chat", 3, 0, 30, 60, 0),
        UsageRow(NOW - 120, "search", "web", "chat", 2, 1, 20, 25, 1),
        UsageRow(NOW - 60, "batch", "ci", "chat", 4, 0, 400, 800, 0),
        UsageRow(NOW - 60, "batch", "ci", "embed", 1, 0, 50, 0, 0),
        UsageRow(NOW - 2 * 86400, "batch", "ci", "chat", 9, 0, 9000, 9000, 0),  # outside the last day
    )
    running.controller.store.record_usage(UsageBatch(f"test-{NOW}", 1, rows))
    return running


def usage(running: Running, **query: str) -> tuple[int, dict]:
    status, body, _ = http("GET", f"{running.url}/api/v1/usage?{urllib.parse.urlencode(query)}")
    return status, json.loads(body)


def test_the_api_sums_per_group_over_the_range_asked(recorded: Running) -> None:
    status, data = usage(recorded)
    assert status == 200
    assert data["by"] == ["tenant", "key", "model"]
    rows = {(r["tenant"], r["key"], r["model"]): r for r in data["rows"]}
    assert set(rows) == {("search", "web", "chat"), ("batch", "ci", "chat"), ("batch", "ci", "embed")}
    assert rows[("search", "web", "chat")] | {} == {
        "tenant": "search", "key": "web", "model": "chat", "requests": 5, "errors": 1, "prompt_tokens": 50,
        "completion_tokens": 85, "counted_from_stream": 1, "refused": 0, "total_tokens": 135}
    assert data["total"]["total_tokens"] == 135 + 1200 + 50
    _, data = usage(recorded, by="tenant", since="30m")
    assert {r["tenant"]: r["total_tokens"] for r in data["rows"]} == {"search": 45, "batch": 1250}
    _, data = usage(recorded, by="model", tenant="batch", since="7d")
    assert {r["model"]: r["requests"] for r in data["rows"]} == {"chat": 13, "embed": 1}
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 3000))
    _, data = usage(recorded, by="", until=until)  # ISO 8601, UTC
    assert data["rows"] == [data["total"]] and data["total"]["requests"] == 3
    _, data = usage(recorded, by="tenant", step="1h", since="3h")
    assert sum(p["total_tokens"] for p in data["series"]) == 135 + 1250 and data["step"] == 3600
    assert all(p["time"] % 3600 == 0 for p in data["series"])


@pytest.mark.parametrize(("query", "says"), [
    ({"since": "yesterday-ish"}, "since: 'yesterday-ish' is not a time"),
    ({"since": "1h", "until": "2h"}, "must be after since"),
    ({"by": "tenant,team"}, "by: team: group by"),
    ({"step": "30s"}, "whole minutes"),
    ({"step": "1m", "since": "30d"}, "at most 2000"),
    ({"step": "\u00b2"}, "is not a step"),  # a digit to str.isdigit(), not to int()
    ({"step": "6" + "0" * 400}, "is not a step"),
    ({"step": "60000000000000000000"}, "is not a step"),
    ({"since": "999999999999999d"}, "is not a time"),  # past a duration's 12 digits a unit
    ({"since": "9" * 400 + "d"}, "is not a time"),
])
def test_a_query_that_does_not_parse_is_a_400_that_says_why(recorded: Running, query: dict, says: str) -> None:
    status, data = usage(recorded, **query)
    assert status == 400 and says in data["error"]


def test_llmgw_usage_prints_the_table_and_json(recorded: Running, run_cli) -> None:  # noqa: ANN001
    code, out = run_cli("usage", "--url", recorded.url, "--token", TOKEN, "--by", "tenant,model")
    assert code == 0, out
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines() if "│" in line]
    rows = {(c[0], c[1]): c[2:] for c in cells}
    assert rows[("batch", "chat")] == ["4", "0", "0", "400", "800", "1,200"]  # requests, errors, refused, ...
    assert rows[("search", "chat")] == ["5", "1", "0", "50", "85", "135"]
    assert rows[("all", "")] == ["10", "1", "0", "500", "885", "1,385"]
    assert "cut short or without a usage report: 1" in out
    code, out = run_cli("usage", "--url", recorded.url, "--token", TOKEN, "--tenant", "batch", "-o", "json")
    assert code == 0 and json.loads(out)["total"]["total_tokens"] == 1250
    code, out = run_cli("usage", "--url", recorded.url, "--token", TOKEN, "--since", "soon")
    assert code != 0 and "is not a time" in out


@pytest.mark.skipif(not shutil.which("chromium"), reason="chromium is not installed (apt-get install chromium)")
def test_the_dashboard_charts_tokens_per_tenant(recorded: Running, tmp_path: Path) -> None:
    base = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1400"]
    url = f"{recorded.url}/?token={TOKEN}"
    shot = tmp_path / "usage.png"
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=False)
    assert shot.exists() and shot.stat().st_size > 10_000
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=False).stdout
    assert '<svg id="usage-chart"' in dom
    lines = {t: dom.split(f'data-tenant="{t}" data-total="', 1)[1].split('"', 1)[0] for t in ("search", "batch")}
    assert lines == {"search": "135", "batch": "1250"}  # the last day only
    points = dom.split('data-tenant="batch"', 1)[1].split('points="', 1)[1].split('"', 1)[0].split()
    assert len(points) == 48  # half hours
    ys = [float(p.split(",")[1]) for p in points]
    assert min(ys) == 0.0 and ys.index(0.0) >= 46  # the busiest step, the last minutes', touches the top
    assert max(ys) == 178.0  # the axis: 0 tokens in every other step
    assert "batch 1,250 tokens" in dom
