"""The control plane running a fleet of 3 real sshd nodes with simulated engines.

Engines are the built-in simulator (no GPU here); GPUs are declared in each node's agent
config. Everything else is real: git commits, sshd, the agent, fetches, processes, HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import openai
import pytest

from llmgw.contract import Demand
from llmgw.control.datadir import held_here, release_data_dir
from llmgw.gitops.status import SyncState
from llmgw.inventory import NodeState
from tests.dispatch.helpers import pid_alive
from tests.reconciler.fleet_e2e import Recorder, make_controller, make_repo, nodes_yaml, ready, sim_model, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # up to ~18 s each on a busy box; waits of 40 s


@pytest.fixture(scope="module")
def fleet(sshd_fleet):
    return sshd_fleet(3)


@pytest.fixture
def weights(tmp_path: Path) -> str:
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(4096))
    return f"file://{f}"


def engine_pids(c) -> dict[str, int]:
    return {r.id: r.shards[0].pid for r in c.reconciler.snapshot()}


async def stop_all(c, repo) -> None:
    for f in (repo.path / "models").glob("*.yaml"):
        f.unlink()
    repo.commit({}, "Retire every model\n\nLlmgw-Allow-Prune: yes")
    c.follower.trigger()
    await until(lambda: not c.reconciler.snapshot(), what="all replicas stopped")


async def test_replicas_come_up_on_the_expected_nodes_and_gpus_and_serve(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=2)})
    rec = Recorder()
    c = make_controller(repo, tmp_path / "data", fleet, rec)
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 2, what="2 ready replicas")
        # Best fit packs the first node before opening the next.
        assert sorted((r.nodes, r.placement.shards[0].gpus) for r in ready(c)) == [(("n1",), (0,)), (("n1",), (1,))]
        assert len(rec.current) == 2
        for ep in rec.current:
            client = openai.OpenAI(base_url=ep.url + "/v1", api_key="x", timeout=10)
            answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content
        # The weights were really fetched into the hash-named cache on that node.
        n1 = c.inventory.snapshot().node("n1")
        assert n1.report is not None and c.desired.catalog.model("chat").cache_name in n1.report.held

        # Cordon n1: no new placement there.
        c.inventory.set_operator_state("n1", NodeState.CORDONED)
        repo.commit({"models/chat.yaml": sim_model("chat", weights, min_=3)}, "Three chat replicas")
        c.follower.trigger()
        await until(lambda: len(ready(c)) == 3, what="3 ready replicas")
        assert sorted(r.nodes[0] for r in ready(c)) == ["n1", "n1", "n2"]

        # Drain n1: replacements start elsewhere before the old ones stop, never below min.
        lows = []
        c.inventory.set_operator_state("n1", NodeState.DRAINING)
        c.reconciler.notify()

        def moved() -> bool:
            lows.append(len(ready(c)))
            return len(ready(c)) == 3 and all(r.nodes[0] != "n1" for r in c.reconciler.snapshot())

        await until(moved, timeout=30, what="replicas moved off n1")
        assert min(lows) >= 3
        # Best fit again: n2's last free GPU first, then the empty n3.
        assert sorted(r.nodes[0] for r in ready(c)) == ["n2", "n2", "n3"]
        fresh = await c.inventory.poll()
        assert not [e for e in fresh.node("n1").report.engines if e.alive]
        c.inventory.set_operator_state("n1", NodeState.READY)
        await stop_all(c, repo)
    finally:
        await c.close()


async def test_a_killed_engine_is_restarted_with_backoff(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=1)})
    rec = Recorder()
    c = make_controller(repo, tmp_path / "data", fleet, rec)
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 1, what="ready replica")
        (r,) = ready(c)
        published = len(rec.history)
        os.kill(r.shards[0].pid, signal.SIGKILL)
        await until(lambda: c.reconciler.replicas[r.id].failures >= 1, what="failure noticed")
        await until(lambda: len(ready(c)) == 1 and ready(c)[0].shards[0].pid != r.shards[0].pid,
                    what="restarted")
        # Withdrawn while it was failed: read off every endpoint list published since the kill, not
        # polled for (the restart, 0.3 s later, may already have put it back).
        since = rec.history[published:]
        assert any(all(e.replica_id != r.id for e in eps) for eps in since), since
        kinds = [e.kind for e in c.store.events()]
        assert "replica-failed" in kinds
        failed = [e for e in c.store.events() if e.kind == "replica-failed"][0]
        assert "exited with code" in failed.message and "retry in" in failed.message
        await stop_all(c, repo)
    finally:
        await c.close()


async def test_backoff_forgets_once_a_replica_has_served_for_the_reset_period(fleet, tmp_path, weights) -> None:
    offset = [0.0]  # the controller's clock runs ahead when the test says so
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=1)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder(), clock=lambda: time.time() + offset[0])
    await c.start()

    async def crash() -> tuple[int, str]:
        (r,) = ready(c)

        def failed_events() -> list:
            return [e for e in c.store.events() if e.kind == "replica-failed" and e.subject == r.id]

        before = len(failed_events())
        os.kill(r.shards[0].pid, signal.SIGKILL)
        # Its event, not its state: the failed state lasts only the backoff (0.3 s), a poll may miss it.
        await until(lambda: len(failed_events()) > before, what="failure noticed")
        failed = failed_events()[-1]
        await until(lambda: len(ready(c)) == 1 and ready(c)[0].shards[0].pid != r.shards[0].pid, what="restarted")
        return c.reconciler.replicas[r.id].failures, failed.message

    try:
        await until(lambda: len(ready(c)) == 1, what="ready replica")
        assert (await crash())[0] == 1
        failures, message = await crash()  # again at once: the count goes on, the backoff doubles
        assert failures == 2 and "retry in 0.6s" in message, message
        offset[0] += 601  # it has now served for longer than crash_reset_after (600 s)
        failures, message = await crash()
        assert failures == 1 and "retry in 0.3s" in message, message
        assert "after 601s ready, so the count starts again" in message
        await stop_all(c, repo)
    finally:
        await c.close()


async def test_restarted_controller_adopts_every_engine(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=2)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    await until(lambda: len(ready(c)) == 2, what="2 ready")
    before = engine_pids(c)
    # The first controller goes away without stopping anything (as after kill -9).
    await c.follower.close()
    await c.reconciler.close()
    await c.fleet.close()
    c.store.close()

    rec = Recorder()
    c2 = make_controller(repo, tmp_path / "data", fleet, rec)
    await c2.start()
    try:
        await until(lambda: len(ready(c2)) == 2, what="adopted")
        assert engine_pids(c2) == before
        # The same data dir on the same machine: the earlier instance is named, no handover waited.
        assert not [e for e in c2.store.events() if e.kind == "node-handover"]
        assert len(rec.current) == 2
        assert [e.message.endswith("adopted at " + e.message.rsplit(" ", 1)[-1])
                for e in c2.store.events() if e.kind == "replica-ready"][-2:] == [True, True]
        await stop_all(c2, repo)
    finally:
        await c2.close()


@pytest.mark.timeout(120)  # it waits out the succession grace on purpose
async def test_a_restored_backup_of_a_dead_controller_takes_over_after_the_grace(fleet, tmp_path, weights) -> None:
    """The controller's machine is gone; its data dir, restored elsewhere (another directory: the
    nodes cannot know the first is dead), waits the silence out, then adopts every engine."""
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=2)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    await until(lambda: len(ready(c)) == 2, what="2 ready")
    before = engine_pids(c)
    await c.follower.close()  # gone without a word (as after kill -9)
    await c.reconciler.close()
    await c.fleet.close()
    c.store.close()
    shutil.copytree(tmp_path / "data", tmp_path / "restored")

    rec = Recorder()
    c2 = make_controller(repo, tmp_path / "restored", fleet, rec)

    def n1() -> NodeState | None:
        node = c2.inventory.snapshot().node("n1")
        return node.state if node is not None else None

    await c2.start()
    try:
        await until(lambda: n1() == NodeState.HANDOVER, what="handover")
        # Meanwhile its engines serve through this controller's router, and the model is never
        # called unrunnable (the router would refuse requests it should hold).
        await until(lambda: len(ready(c2)) == 2 and len(rec.current) == 2, what="served while handed over")
        assert n1() == NodeState.HANDOVER
        await until(lambda: n1() == NodeState.READY, timeout=60,
                    what="the node is this controller's after the grace")
        assert engine_pids(c2) == before
        assert all("chat" not in reasons for reasons in rec.unrunnable_history), rec.unrunnable_history
        assert [e for e in c2.store.events() if e.kind == "stale-engine-stopped"] == []
        await stop_all(c2, repo)
    finally:
        await c2.close()
    # A controller started in-process holds its data dir's lock until it is closed, no longer.
    assert not held_here(tmp_path / "restored") and held_here(tmp_path / "data")
    release_data_dir(tmp_path / "data")  # what the kernel does for a killed process


async def test_node_loss_moves_replicas_and_stale_engines_stop_on_return(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=2)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 2, what="2 ready")
        assert {r.nodes[0] for r in ready(c)} == {"n1"}
        stale_pids = [r.shards[0].pid for r in ready(c)]
        await c.fleet.inner._ssh.disconnect("n1")  # type: ignore[attr-defined]
        fleet.kill(fleet[0])
        await until(lambda: len(ready(c)) == 2 and all(r.nodes[0] != "n1" for r in ready(c)), timeout=40,
                    what="replicas placed elsewhere")
        # The old engines still run on the cut-off node.
        assert all(pid_alive(p) for p in stale_pids)
        fleet.restart(fleet[0])
        await until(lambda: not any(pid_alive(p) for p in stale_pids), timeout=40, what="stale engines stopped")
        # The event is written once the agent's stop answers, after the engines are gone.
        await until(lambda: "stale-engine-stopped" in [e.kind for e in c.store.events()], timeout=40,
                    what="the stale-engine-stopped event")
        await stop_all(c, repo)
    finally:
        await c.close()


async def test_a_commit_emptying_nodes_yaml_is_held_and_serving_goes_on(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {"chat": sim_model("chat", weights, min_=2)})
    c = make_controller(repo, tmp_path / "data", fleet, Recorder())
    await c.start()
    try:
        await until(lambda: len(ready(c)) == 2, what="2 ready")
        pids = engine_pids(c)
        good = c.follower.status.applied_sha
        repo.commit({"nodes.yaml": "nodes: []\n"}, "Tidy nodes.yaml")
        c.follower.trigger()
        await until(lambda: c.follower.status.state == SyncState.NEEDS_CONFIRMATION, what="held")
        (reason,) = c.follower.status.pending.reasons
        assert reason == "stops 2 of 2 ready replicas (more than 50%): 2 because node n1 left nodes.yaml", reason
        for _ in range(3):  # three ticks later nothing has moved
            await c.reconciler.tick()
        assert c.follower.status.applied_sha == good
        assert engine_pids(c) == pids and all(pid_alive(p) for p in pids.values())
        for r in ready(c):
            client = openai.OpenAI(base_url=f"{r.endpoint}/v1", api_key="x", timeout=10)
            assert client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}]).choices
        # A commit that puts the nodes back supersedes the held one and changes nothing.
        back = repo.commit({"nodes.yaml": nodes_yaml(fleet)}, "Put the nodes back")
        c.follower.trigger()
        await until(lambda: c.follower.status.applied_sha == back, what="applied")
        assert engine_pids(c) == pids
        await stop_all(c, repo)
    finally:
        await c.close()


async def test_removed_model_is_withdrawn_then_stopped_and_idle_and_zero_scaling(fleet, tmp_path, weights) -> None:
    repo = make_repo(tmp_path, fleet, {
        "chat": sim_model("chat", weights, min_=1, max_=3, idle_after="1s"),
        "other": sim_model("other", weights, min_=1),
        "lazy": sim_model("lazy", weights, min_=0, max_=1),
    })
    rec = Recorder()
    c = make_controller(repo, tmp_path / "data", fleet, rec)
    await c.start()
    try:
        await until(lambda: len(ready(c, "chat")) == 1 and len(ready(c, "other")) == 1, what="ready")
        assert ready(c, "lazy") == []

        # Scale from zero: the router holds a request for "lazy".
        rec.wanted = {"lazy": Demand(held=1)}
        c.reconciler.notify()
        await until(lambda: len(ready(c, "lazy")) == 1, what="lazy woken")
        rec.wanted = {}

        # Load above target_inflight (16 a replica) adds a chat replica; once idle it goes back to min.
        # 20 in flight want two replicas and no third (40 would, once two were ready: a count of 2
        # seen only if a poll fell between the second replica ready and the third).
        rec.wanted = {"chat": Demand(inflight=20)}
        await until(lambda: len(ready(c, "chat")) == 2, what="scaled up")
        rec.wanted = {}
        await until(lambda: len(ready(c, "chat")) == 1, timeout=20, what="idle scale-down to min")

        # Remove "other" in git: first out of the endpoint list, then stopped.
        (other,) = ready(c, "other")
        repo.commit({"models/other.yaml": None}, "Remove other")
        c.follower.trigger()
        await until(lambda: other.id not in c.reconciler.replicas, what="other stopped")
        withdrawn = next(i for i, eps in enumerate(rec.history) if all(e.model != "other" for e in eps)
                         and i > 0 and any(e.model == "other" for e in rec.history[i - 1]))
        assert withdrawn is not None
        stop_event = [e for e in c.store.events() if e.kind == "replica-stopped" and e.subject == other.id]
        assert stop_event and "model left the catalog" in stop_event[0].message
        await stop_all(c, repo)
    finally:
        await c.close()
