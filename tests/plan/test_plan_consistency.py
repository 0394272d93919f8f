"""The plan is what happens: after the controller applies the diffed commit on 3 sshd nodes,
the replicas it started and stopped are the plan's."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from llmgw.decide import ReplicaState
from llmgw.gitops.gitcli import read_tree
from llmgw.plan import FleetSnapshot, build_report
from tests.reconciler.fleet_e2e import Recorder, make_controller, make_repo, ready, sim_model, until

pytestmark = pytest.mark.slow


async def test_applied_commit_does_what_the_plan_said(sshd_fleet, tmp_path) -> None:
    fleet = sshd_fleet(3)
    w = tmp_path / "w.bin"
    w.write_bytes(os.urandom(1024))
    src = f"file://{w}"
    repo = make_repo(tmp_path, fleet, {
        "chat": sim_model("chat", src, min_=1), "embed": sim_model("embed", src, min_=1),
        "old": sim_model("old", src, min_=1)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    c.follower.interval = 3600  # only sync_once below moves it
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 3, timeout=30, what="3 ready")
        base_sha = c.follower.status.applied_sha
        head_sha = repo.commit({
            "models/chat.yaml": sim_model("chat", src, min_=2),             # one more chat
            "models/embed.yaml": sim_model("embed", src, min_=1, args=["--ttft", "0.01"]),  # replace
            "models/old.yaml": None,                                       # stop
            "models/new.yaml": sim_model("new", src, min_=1),              # start
        }, "Reshape the fleet")
        await asyncio.to_thread(c.follower.mirror.fetch)  # the commit is in the mirror, not yet judged
        before = {r.id: r for r in c.reconciler.snapshot()}
        snapshot = FleetSnapshot(c.inventory.snapshot(), tuple(c.reconciler.snapshot()), time.time())
        report = build_report(base_sha, read_tree(c.follower.mirror.path, base_sha), head_sha,
                              read_tree(c.follower.mirror.path, head_sha), snapshot, now=time.time())
        plan = report.plan
        assert plan is not None and not report.problems
        planned_starts = sorted((s.model, s.where) for s in plan.steps if s.action in ("start", "replace"))
        planned_gone = sorted(s.replica for s in plan.steps if s.action in ("stop", "replace"))

        await c.follower.sync_once()
        assert c.follower.status.applied_sha == head_sha

        def settled() -> bool:
            now = c.reconciler.snapshot()
            return (all(r.state == ReplicaState.READY for r in now)
                    and {r.model for r in ready(c)} == {"chat", "embed", "new"} and len(now) == 4)

        await until(settled, timeout=60, what="fleet settled on the new catalog")
        after = {r.id: r for r in c.reconciler.snapshot()}
        started = sorted((r.model, tuple((s.node, s.gpus) for s in r.placement.shards))
                         for rid, r in after.items() if rid not in before)
        gone = sorted(rid for rid in before if rid not in after)
        assert started == planned_starts
        assert gone == planned_gone
        assert report.plan.count("start") == 2 and report.plan.count("replace") == 1 and report.plan.count("stop") == 1
    finally:
        for f in (repo.path / "models").glob("*.yaml"):
            f.unlink()
        repo.commit({}, "Retire\n\nLlmgw-Allow-Prune: yes")
        await c.follower.sync_once()
        await until(lambda: not c.reconciler.snapshot(), timeout=30, what="all stopped")
        await c.close()
