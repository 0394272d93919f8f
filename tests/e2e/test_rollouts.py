"""Progressive delivery on real processes (issue 26): `llmgw controller` over real sshd nodes running
simulated engines, real commits to its catalog repository, the real openai client as constant load
through the controller's router. A good change is promoted without a failed request; a bad one
(the simulator's --fail-rate, or a 5x --ttft) is rolled back by the canary's own figures; a full
fleet is changed max_unavailable at a time; a controller restarted mid-canary carries on.

Intervals are short (2 s steps, a handful of requests per step) so each rollout takes seconds.
Every wait is for an event or a state, never for a duration.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.e2e.rollout_fleet import (
    Controller,
    Load,
    canary_policy,
    close,
    default_tokens,
    failures,
    model_yaml,
    nodes_yaml,
    ready_counts,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GOOD = ["--max-tokens-default", "20"]  # visible only to a request that names no max_tokens
CHAT = "models/chat.yaml"


def chat(args: list[str] | None = None, *, rollout: str | None = None, replicas: int = 2) -> str:
    return model_yaml("chat", replicas=replicas, args=args or [],
                      rollout=canary_policy() if rollout is None else rollout)


def kinds(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events if e["kind"].startswith("rollout-")]


def assert_every_replica_runs(ctl: Controller, model: str, *, count: int, default: int) -> list[dict]:
    """Every replica of ``model`` serving, each engine answering with ``default`` tokens unasked."""
    reps = ctl.ready(model, count)
    assert [default_tokens(r["endpoint"], model) for r in reps] == [default] * count, reps
    return reps


def test_a_good_change_is_promoted_under_load_without_a_failed_request(sshd_fleet, tmp_path: Path) -> None:
    fleet = sshd_fleet(2)
    ctl = Controller.create(tmp_path, fleet, {CHAT: chat()})
    try:
        ctl.start()
        before = {r["id"] for r in assert_every_replica_runs(ctl, "chat", count=2, default=16)}
        with Load(ctl.router, "chat") as load:
            load.wait_answered(20, proc=ctl.proc)
            mark = ctl.last_event_id()
            ctl.commit({CHAT: chat(GOOD)}, "chat: answer 20 tokens by default")
            started = ctl.wait_event("rollout-started", "chat", after=mark)
            assert "canary, steps 25 %, 50 %, 2 s each" in started["message"], started
            ctl.wait_event(("rollout-done", "rollout-rolled-back", "rollout-aborted"), "chat", after=mark)
            load.wait_answered(20, proc=ctl.proc)  # and the new version goes on serving
        events = ctl.events(after=mark)
        assert kinds(events) == ["rollout-started", "rollout-step", "rollout-promoted", "rollout-done"], events
        assert len(ctl.canaries("chat", after=mark)) == 1
        assert failures(load.outcomes) == [], failures(load.outcomes)[:5]
        after = assert_every_replica_runs(ctl, "chat", count=2, default=20)
        assert not before & {r["id"] for r in after}  # every replica is a new one
    finally:
        close(ctl, fleet)
