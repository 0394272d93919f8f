"""`llmgw rollout status|promote|abort` and the rollout lines of `llmgw status`, run through the
CLI's main() against a controller on 2 real sshd nodes (its admin API on a real port)."""

from __future__ import annotations

import json

import pytest

from tests.admin.conftest import (
    TOKEN,
    Running,
    running,  # noqa: F401 - the fixture: a controller with its admin API
)
from tests.admin.test_rollout_api import _rolled_back, canary_ready, chat_spec

pytestmark = pytest.mark.slow


def cli(run_cli, server: Running, *args: str) -> tuple[int, str]:  # noqa: ANN001 - the fixture
    return run_cli(*args, "--url", server.url, "--token", TOKEN)


def test_nothing_to_show_or_do_is_said_with_exit_codes(run_cli, running: Running) -> None:  # noqa: F811
    assert cli(run_cli, running, "rollout", "status") == (
        0, "no rollouts: a commit that changes a model's engines starts one\n")
    code, out = cli(run_cli, running, "rollout", "status", "chat")
    assert code == 1 and 'model "chat" has had no rollout' in out
    code, out = cli(run_cli, running, "rollout", "promote", "nope")
    assert code == 1 and 'error: model "nope" is not in the catalog' in out
    code, out = cli(run_cli, running, "rollout", "abort", "chat", "-o", "json")
    assert code == 1 and json.loads(out) == {"error": "chat has no rollout in progress to abort"}


def test_status_of_a_canary_then_an_abort_by_name(run_cli, running: Running) -> None:  # noqa: F811
    c = running.controller
    sha = running.repo.commit({"models/chat.yaml": chat_spec(running, "--ttft", "0.01")}, "Chat: try it")
    c.follower.trigger()
    running.wait(lambda: canary_ready(running), timeout=60, what="canary ready")
    (canary,) = [x for x in c.reconciler.snapshot() if x.canary]

    code, out = cli(run_cli, running, "rollout", "status")
    assert code == 0
    (row,) = [line for line in out.splitlines() if "chat" in line]
    cells = [x.strip() for x in row.split("│") if x.strip()]
    assert cells[:6] == ["chat", "canary", "canary", "1/1", "50", sha[:12]]
    code, out = cli(run_cli, running, "rollout", "status", "chat")
    assert code == 0 and out.startswith(f"chat: canary (canary), commit {sha[:12]}, started ")
    assert f"  step 1/1 (steps 50 %, 3600 s each); canary takes 50 %, replica {canary.id}" in out
    code, out = cli(run_cli, running, "rollout", "status", "chat", "-o", "json")
    assert json.loads(out)["canary"] == canary.id
    code, out = cli(run_cli, running, "status")
    assert code == 0 and f"rollout   chat: canary {sha[:12]}, step 1/1, 50 % of traffic" in out

    code, out = cli(run_cli, running, "rollout", "abort", "chat", "--actor", "carol")
    assert (code, out) == (0, "chat: aborted: the model goes back to the version it ran (aborted)\n")
    running.wait(lambda: canary.id not in c.reconciler.replicas, timeout=30, what="canary stopped")
    code, out = cli(run_cli, running, "status")
    assert f"rollout   chat: aborted {sha[:12]}: aborted by carol" in out
    # Git still asks for that version: an operator may push it through after all.
    code, out = cli(run_cli, running, "rollout", "promote", "chat", "--actor", "dave")
    assert (code, out) == (0, "chat: promoted: the rest is replaced with the new version (promoting)\n")
    code, out = cli(run_cli, running, "rollout", "status", "chat")
    assert "  reason: promoted by dave" in out


def test_a_rolled_back_model_is_one_line_of_status_with_its_reason_as_text(run_cli, running: Running) -> None:  # noqa: F811
    reason = "canary error rate 30.0 % > stable 0.0 % + 2 % [bold red]ok[/] \x1b]8;;http://x\x07 over 60 s"
    sha = _rolled_back(running, reason, "0.04")
    code, out = cli(run_cli, running, "status")
    assert code == 0
    (line,) = [x for x in out.splitlines() if x.startswith("rollout")]
    assert line == (f"rollout   chat: rolled back {sha[:12]}, keeps its last good version: canary error rate "
                    "30.0 % > stable 0.0 % + 2 % [bold red]ok[/] \\x1b]8;;http://x\\x07 over 60 s (a new commit to "
                    "it starts a new rollout; `llmgw rollout promote` forces it)")
    code, out = cli(run_cli, running, "rollout", "status")
    assert "rolled-back" in out and "fail over 60 s: requests 140 vs 400, errors 12.1 % vs 0.5 %" in out
    code, out = cli(run_cli, running, "rollout", "status", "-o", "json")
    (r,) = json.loads(out)
    assert r["phase"] == "rolled-back" and r["reason"] == reason and r["analysis"]["canary"]["errors"] == 17
