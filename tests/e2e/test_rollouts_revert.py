"""Review 5 (issue 26), on real processes: a `git revert` during a promotion, through `llmgw
controller` on real sshd nodes, real commits, the openai client as load (tests/e2e/rollout_fleet.py).

HIGH. The operator's usual emergency lever is `git revert`. When it lands while the model is
promoting, the controller aborts the rollout as "superseded" (not "went back"), keeps serving the
reverted version B, and starts a *canary* rollout from B back to A: the tick goes on replacing the
old replicas with the version being reverted. `llmgw rollout abort` would have set serving back
to A (RolloutDriver.abort uses rec.previous); the revert does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.rollout_fleet import Controller, Load, canary_policy, close, model_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = "models/chat.yaml"
POLICY = canary_policy(steps=(50,), interval="2s", min_requests=5)
# Each new replica of B takes 20 s to load: the promotion, replacing the old replicas one at a
# time, lasts 20 s at the least after its event, some ten times what the revert's commit takes to
# be applied even on a busy machine (checked below, not assumed).
BAD = ["--max-tokens-default", "20", "--startup-delay", "20"]


def chat(args: list[str] | None = None) -> str:
    return model_yaml("chat", replicas=3, args=args or [], rollout=POLICY)


def test_a_revert_during_promotion_takes_the_model_back_to_the_old_version(sshd_fleet, tmp_path: Path) -> None:
    fleet = sshd_fleet(2)
    ctl = Controller.create(tmp_path, fleet, {CHAT: chat()})  # 2 nodes x 2 GPUs: room for one surge
    try:
        ctl.start()
        ctl.ready("chat", 3)
        with Load(ctl.router, "chat") as load:
            load.wait_answered(20, proc=ctl.proc)
            mark = ctl.last_event_id()
            ctl.commit({CHAT: chat(BAD)}, "chat: new build")
            ctl.wait_event("rollout-promoted", "chat", after=mark, timeout=180)
            old_version = ctl.api("/api/v1/rollouts/chat")["stable"]
            revert = ctl.last_event_id()
            ctl.commit({CHAT: chat()}, "Revert \"chat: new build\"")
            # The controller's answer to the revert: the rollout ends (aborted), one way or another.
            ctl.wait_event(("rollout-aborted", "rollout-started", "rollout-done"), "chat", after=revert)
            events = ctl.events(after=mark)
            assert not any(e["kind"] == "rollout-done" for e in events), \
                "precondition: the promotion ended before the revert was applied (box too slow?)"
            status = ctl.api("/api/v1/rollouts/chat")
            after = [f"{e['kind']} {e['subject']} {e['message']}" for e in ctl.events(after=revert)]
            assert status["serving_version"] == old_version, (
                f"after the revert the controller still serves the reverted version: phase {status['phase']}, "
                f"serving {status['serving_version']}, stable {status['stable']} (old {old_version});\n"
                + "\n".join(after))
    finally:
        close(ctl, fleet)
