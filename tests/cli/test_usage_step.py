"""`llmgw usage --step` in a table, over a real controller's usage ledger (it was read only with -o json,
and silently dropped from the table)."""

from __future__ import annotations

import time

import pytest

from llmgw.contract import UsageBatch, UsageRow
from tests.admin.conftest import TOKEN, Running, running  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


def test_usage_step_prints_each_tenants_use_per_step(running: Running, run_cli) -> None:  # noqa: F811, ANN001
    hour = int(time.time()) // 3600 * 3600
    running.controller.store.record_usage(UsageBatch(f"step-{hour}", 1, (
        UsageRow(hour - 3600, "search", "web", "chat", 3, 0, 30, 60, 0),
        UsageRow(hour - 3600, "batch", "ci", "chat", 1, 1, 5, 5, 0, refused=2),
        UsageRow(hour, "batch", "ci", "chat", 4, 0, 400, 800, 0),
    )))
    code, out = run_cli("usage", "--url", running.url, "--token", TOKEN, "--since", "3h", "--step", "1h")
    assert code == 0, out
    series = out[out.index("per 1h, by tenant"):]
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in series.splitlines() if "│" in line]
    day = lambda t: time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))  # noqa: E731
    header = next(line for line in series.splitlines() if "TENANT" in line)
    assert header.strip("┃ ").split() == ["FROM", "(UTC)", "┃", "TENANT", "┃", "REQUESTS", "┃", "ERRORS", "┃",
                                          "REFUSED", "┃", "PROMPT", "┃", "COMPLETION", "┃", "TOTAL"]
    assert cells == [[day(hour - 3600), "batch", "1", "1", "2", "5", "5", "10"],
                     [day(hour - 3600), "search", "3", "0", "0", "30", "60", "90"],
                     [day(hour), "batch", "4", "0", "0", "400", "800", "1,200"]]
    code, out = run_cli("usage", "--url", running.url, "--token", TOKEN, "--step", "30s")
    assert code == 1 and "whole minutes" in out, out
