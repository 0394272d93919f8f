"""The commit says what became of it (issue 37): `llmgw controller` over real sshd nodes posts commit
statuses to a local git host that checks every request against GitHub's documented schema
(tests/fixtures/status_host.py): a commit applied (success), one rejected (failure, with its first
problem), one whose canary was rolled back (failure, with the reason) and one rolled out
(success). Gitea's flavour of the API, and a host that refuses, through the poster itself."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from llmgw.decide.rollout import Phase, Rollout
from llmgw.gitops.commit_status import CommitStatusConfig, CommitStatuses
from llmgw.gitops.status import SyncState, SyncStatus
from tests.conftest import commit_files
from tests.e2e.processes import wait_for
from tests.e2e.rollout_fleet import Controller, Load, canary_policy, close, model_yaml
from tests.fixtures.status_host import StatusHost

TOKEN = "ghp-status-token-of-the-test"
CHAT = "models/chat.yaml"
QUESTION = "What is the capital of France?"


def chat(args: list[str], expected: str) -> str:
    acceptance = ("  acceptance:\n    - name: capital\n"
                  f"      messages: [{{role: user, content: {json.dumps(QUESTION)}}}]\n"
                  f"      max_tokens: 8\n      expect: {{contains: [{json.dumps(expected)}]}}\n")
    return model_yaml("chat", replicas=1, args=args, rollout=canary_policy(extra=acceptance, min_requests=1))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_applied_rejected_rolled_back_and_rolled_out_commits_say_so_on_the_git_host(sshd_fleet,
                                                                                    tmp_path: Path) -> None:
    import urllib.request

    host_gen = StatusHost("github", TOKEN).serve()
    host = next(host_gen)
    fleet = sshd_fleet(2)
    # No acceptance yet: every new replica answers it, and what the model says is read below.
    ctl = Controller.create(tmp_path, fleet, {CHAT: model_yaml("chat", replicas=1,
                                                                rollout=canary_policy(min_requests=1))})
    raw = json.loads(ctl.config.read_text())
    raw["commit_status"] = {"provider": "github", "url": host.url, "repo": host.repo, "token": TOKEN,
                            "dashboard": "https://llmgw.example/"}
    ctl.config.write_text(json.dumps(raw))
    try:
        ctl.start()
        ctl.ready("chat", 1)
        me = "llmgw/" + ctl.api("/api/v1/summary")["leadership"]["holder"]
        first = ctl.api("/api/v1/summary")["sync"]["applied_sha"]
        wait_for(lambda: host.of(first, me), 30, "the first commit's status", ctl.proc)
        assert host.of(first, me)[-1] | {"sha": None} == {
            "sha": None, "state": "success", "description": "applied", "context": me,
            "target_url": "https://llmgw.example/"}

        body = {"model": "chat", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}
        req = urllib.request.Request(ctl.router + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            good = json.loads(r.read())["choices"][0]["message"]["content"]
        ctl.commit({CHAT: chat([], good)}, "chat: acceptance")

        # Rejected: the status names the first problem, at its file and line.
        bad = commit_files(ctl.repo, {CHAT: chat([], good).replace("min: 1", "min: -1")}, "chat: min -1")
        ctl.api("/api/v1/sync", {})
        wait_for(lambda: host.of(bad, me), 30, "the rejected commit's status", ctl.proc)
        [said] = host.of(bad, me)
        assert said["state"] == "failure"
        assert said["description"].startswith("rejected: 1 problem(s): models/chat.yaml:"), said

        # Rolled back: other weights behind the same name fail the acceptance prompt.
        mark = ctl.last_event_id()
        wrong = ctl.commit({CHAT: chat(["--weights", "other"], good)}, "chat: other weights")
        ctl.wait_event("rollout-rolled-back", "chat", after=mark)
        wait_for(lambda: any(s["state"] == "failure" for s in host.of(wrong, f"{me}/chat")), 30,
                 "the rolled-back commit's status", ctl.proc)
        states = [s["state"] for s in host.of(wrong, f"{me}/chat")]
        # (pending while it rolled out, if a turn of the poster fell in it: it lasted about a second)
        assert states[-1] == "failure" and set(states) <= {"pending", "failure"}, states
        assert "chat rolled back: canary failed: acceptance 'capital' failed" in host.of(wrong, f"{me}/chat")[-1][
            "description"]
        assert [s["state"] for s in host.of(wrong, me)] == ["success"]  # applied, then rolled back

        # Rolled out (with clients: a canary step is judged on traffic).
        mark = ctl.last_event_id()
        with Load(ctl.router, "chat"):
            fine = ctl.commit({CHAT: chat(["--max-tokens-default", "20"], good)}, "chat: 20 tokens by default")
            ctl.wait_event("rollout-done", "chat", after=mark)
        wait_for(lambda: any(s["state"] == "success" for s in host.of(fine, f"{me}/chat")), 30,
                 "the rolled-out commit's status", ctl.proc)
        assert host.refused == [], host.refused
        assert all(len(s["description"]) <= 140 for s in host.statuses)
        assert TOKEN not in (tmp_path / "controller1.log").read_text()
    finally:
        close(ctl, fleet)
        host_gen.close()


async def test_gitea_statuses_and_a_host_that_refuses_cost_a_warning_never_the_token(
        caplog: pytest.LogCaptureFixture) -> None:
    sha = "a" * 40
    sync = SyncStatus(state=SyncState.SYNCED, applied_sha=sha)
    rollout = Rollout("chat", "v2", "v1", "canary", Phase.CANARY, started_at=0.0, revision="b" * 40, step=1)
    gen = StatusHost("gitea", "gitea-token").serve()
    host = next(gen)
    try:
        poster = CommitStatuses(CommitStatusConfig("gitea", host.url, host.repo, "gitea-token"),
                                controller=lambda: "ctl", sync=lambda: sync, rollouts=lambda: [rollout])
        await poster.start()  # posts at its first turn
        for _ in range(500):
            if len(poster.posted) == 2:
                break
            await asyncio.sleep(0.02)
        await poster.close()
        assert {(s["sha"], s["context"], s["state"]) for s in host.statuses} == {
            (sha, "llmgw/ctl", "success"), ("b" * 40, "llmgw/ctl/chat", "pending")}
        assert host.of("b" * 40)[0]["description"] == "rolling out chat: canary, step 2"
        # Nothing changed: nothing posted again.
        again = CommitStatuses(CommitStatusConfig("gitea", host.url, host.repo, "gitea-token"),
                               controller=lambda: "ctl", sync=lambda: sync, rollouts=lambda: [rollout])
        again.posted = dict(poster.posted)
        await again.start()
        assert await again.post_changes() == 0
        await again.close()
        # A wrong token: refused, a warning without it, and tried again at the next turn.
        wrong = CommitStatuses(CommitStatusConfig("gitea", host.url, host.repo, "not-the-token"),
                               controller=lambda: "ctl", sync=lambda: sync, rollouts=lambda: [])
        with caplog.at_level(logging.WARNING):
            await wrong.start()
            assert await wrong.post_changes() == 0
            await wrong.close()
        assert "answered 401" in caplog.text and "not-the-token" not in caplog.text and wrong.posted == {}
    finally:
        gen.close()
