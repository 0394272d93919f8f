"""What an operator does through the CLI and the admin API, against a controller on 2 sshd nodes:
drain a node, see a rejected commit in `llmgw status`, confirm a held commit, follow the events,
and a git host's signed webhook (these were tested only by calling the parts underneath)."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.admin.conftest import SECRET, TOKEN, Running
from tests.admin.test_cli_against_controller import cli
from tests.e2e.processes import LLMGW
from tests.reconciler.fleet_e2e import ready, sim_model

pytestmark = pytest.mark.slow


def chat_nodes(running: Running) -> set[str]:
    return {n for r in ready(running.controller, "chat") for n in r.nodes}


def test_drain_through_the_cli_moves_the_replica_before_stopping_it(run_cli, running: Running) -> None:
    (before,) = ready(running.controller, "chat")
    (where,) = before.nodes
    other = "n2" if where == "n1" else "n1"
    try:
        code, out = cli(run_cli, running, "drain", where)
        assert code == 0 and out.strip() == f"node {where} is now draining"
        running.wait(lambda: chat_nodes(running) == {other} and before.id not in running.controller.reconciler.replicas,
                     what="moved off the drained node")
        kinds = [(e.kind, e.subject) for e in running.controller.store.events()]
        assert kinds.index(("replica-stopping", before.id)) > max(
            i for i, (k, _) in enumerate(kinds) if k == "replica-starting")  # the new one first
    finally:
        cli(run_cli, running, "uncordon", where)


def test_status_shows_a_rejected_commit_and_a_held_one_is_confirmed_through_the_cli(run_cli, running: Running) -> None:
    c = running.controller
    good = c.follower.status.applied_sha
    chat = (running.repo.path / "models" / "chat.yaml").read_text()
    bad = running.repo.commit({"models/chat.yaml": chat.replace("engine: sim", "engine: simm")}, "Typo in chat")
    c.follower.trigger()
    running.wait(lambda: c.follower.status.state.value == "rejected", what="rejected")
    code, out = cli(run_cli, running, "status")
    assert code == 0 and "sync      rejected" in out
    assert f"rejected  {bad[:12]}" in out and "Typo in chat" in out and "models/chat.yaml:" in out
    assert c.follower.status.applied_sha == good

    # Removing the only model is held; the CLI shows it and confirms it.
    held = running.repo.commit({"models/chat.yaml": None}, "Remove chat")
    c.follower.trigger()
    running.wait(lambda: c.follower.status.state.value == "needs-confirmation", what="held")
    code, out = cli(run_cli, running, "status")
    assert f"held      {held[:12]}: removes 1 of 1 models" in out and "llmgw sync --allow-prune" in out
    assert ready(c, "chat")
    code, out = cli(run_cli, running, "sync", "--allow-prune")
    assert code == 0 and out.startswith("synced: applied")
    running.wait(lambda: c.follower.status.applied_sha == held and not ready(c, "chat"), what="applied")
    applied = [e for e in c.store.events() if e.kind == "applied"][-1]
    assert "confirmed by an operator" in applied.message

    running.repo.commit({"models/chat.yaml": sim_model("chat", running.weights, min_=1, max_=2)}, "Chat back")
    c.follower.trigger()
    running.wait(lambda: len(ready(c, "chat")) == 1, what="chat back")


def set_state(running: Running, node: str, state: str) -> None:
    req = urllib.request.Request(running.url + f"/api/v1/nodes/{node}/state", method="POST",
                                 data=json.dumps({"state": state}).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


def test_events_follow_prints_new_events_as_they_happen(running: Running) -> None:
    import queue
    import threading

    [last] = running.controller.store.events(limit=1)  # the newest event before the CLI starts
    proc = subprocess.Popen([LLMGW, "events", "--follow", "--interval", "0.2",
                             "--url", running.url, "--token", TOKEN, "-o", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.put(line)
        except (OSError, ValueError):  # closed under it once the test is over
            pass

    threading.Thread(target=read, daemon=True).start()

    def next_event() -> dict:
        return json.loads(lines.get(timeout=30))  # a bound on a hang

    try:
        # The past first, to its last event: the CLI is following (not a guess at how long it takes
        # to start), so what comes next is an event that happened while it followed.
        while next_event()["id"] < last.id:
            pass
        set_state(running, "n2", "cordon")
        seen = [next_event()]
        while seen[-1]["kind"] != "node-cordoned":
            seen.append(next_event())
        assert seen[-1]["subject"] == "n2" and seen[-1]["id"] > last.id, seen[-3:]
    finally:
        proc.kill()
        proc.wait(5)
        proc.stdout.close()  # type: ignore[union-attr]
        set_state(running, "n2", "uncordon")


@pytest.mark.parametrize("host", ["github", "gitea"])
def test_a_signed_webhook_from_github_or_gitea_is_accepted(running: Running, host: str) -> None:
    body = json.dumps({"ref": "refs/heads/main", "after": "0" * 40}).encode()
    digest = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    header = {"github": ("X-Hub-Signature-256", f"sha256={digest}"), "gitea": ("X-Gitea-Signature", digest)}[host]
    req = urllib.request.Request(running.url + "/api/v1/hooks/git", data=body, method="POST",
                                 headers={header[0]: header[1], "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:  # no admin token: the signature is the credential
        assert r.status == 202 and json.loads(r.read()) == {"status": "fetch scheduled"}
    forged = urllib.request.Request(running.url + "/api/v1/hooks/git", data=body + b" ", method="POST",
                                    headers={header[0]: header[1]})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(forged, timeout=10)
    with err.value:
        assert err.value.code == 401


def test_taking_over_a_node_this_controller_already_drives_changes_nothing(run_cli, running: Running) -> None:
    before = running.controller.fleet.epoch("n1")
    assert before is not None
    code, out = cli(run_cli, running, "node", "takeover", "n1")
    assert code == 0 and "already driven by this controller" in out and f"epoch {before})" in out
    assert running.controller.fleet.epoch("n1") == before  # no epoch raised against our own commands
    code, out = cli(run_cli, running, "node", "takeover", "n9")
    assert code == 1 and 'node "n9" is not in the fleet' in out
