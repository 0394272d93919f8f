"""Two processes with one holder id (a copied data dir, or a restart after a crash), as the live
inventory sees a node through the fenced dispatcher and a real agent: a node held by a live copy
is fenced and stays so; one held by a silent instance is handed over, then ours at a higher epoch
(the silent one's engines foreign), and at the same epoch only to a proven restart. Time is never
waited out: the lease's "last heard" is moved back instead."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.catalog import NodeId, NodeSpec
from llmgw.catalog.model import GpuSpec
from llmgw.dispatch.base import NodeTarget
from llmgw.dispatch.fence import LEASE_BEAT, FencedDispatcher
from llmgw.dispatch.local import LocalDispatcher
from llmgw.inventory import NodeState
from llmgw.inventory.model import engine_is_ours
from llmgw.reconciler.live import LiveInventory
from llmgw.state import Store
from tests.fixtures.sshd_fleet import MARKER_ENV, SshdNode

GRACE = 5.0
ENGINE = {"replica_id": "r1", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"], "gpus": [0],
          "labels": {"llmgw.replica": "r1"}}


def instance(node: SshdNode, tmp_path: Path, name: str, *, holder: str = "ctl", clock: Callable[[], float] = time.time,
             beat: float = LEASE_BEAT) -> tuple[FencedDispatcher, LiveInventory]:
    """One controller process: holder "ctl" (both copies share it), its own instance and store."""
    target = NodeTarget(node.id, "localhost", transport="local", agent_config=str(node.config_path))
    local = LocalDispatcher([target], env={MARKER_ENV: str(node.dir)})
    fleet = FencedDispatcher(local, holder, instance=name, grace=GRACE, beat=beat)
    live = LiveInventory(fleet, Store(tmp_path / f"{name}.db").open(), clock=clock)
    # As its agent config declares them (else the disagreement's event is among the lease's).
    live.set_nodes([NodeSpec(NodeId(node.id), "localhost", transport="local", gpus=GpuSpec(2, "sim", 24))])
    return fleet, live


def silence(node: SshdNode, seconds: float) -> None:
    """As if the holding instance was last heard ``seconds`` ago."""
    then = time.time() - seconds
    for name in ("lease.json", "lease.beat"):
        path = node.state_dir / name
        if path.exists():
            os.utime(path, (then, then))


def state(live: LiveInventory, node: SshdNode) -> NodeState:
    n = live.snapshot().node(node.id)
    assert n is not None
    return n.state


async def test_a_copy_of_a_running_controller_is_fenced_and_cannot_take_the_node(local_node, tmp_path) -> None:
    node = local_node()
    a, live_a = instance(node, tmp_path, "a")
    b, live_b = instance(node, tmp_path, "b")
    async with a, b:
        await live_a.poll()
        assert state(live_a, node) == NodeState.READY and a.epoch(node.id) == 1
        silence(node, 1)
        await live_b.poll()  # first sight: it may be a dead earlier life, so nothing is given up yet
        assert state(live_b, node) == NodeState.HANDOVER
        await live_a.poll()  # ...but it speaks again: a live copy
        await live_b.poll()
        assert state(live_b, node) == NodeState.FENCED
        error = live_b.snapshot().node(node.id).error  # type: ignore[union-attr]
        assert "another instance of controller ctl (epoch 1), which is running (a copied data dir?)" in error
        for _ in range(3):  # A keeps renewing: B never gets the node, A never loses it
            silence(node, GRACE - 1)
            await live_a.poll()
            await live_b.poll()
            assert (state(live_a, node), state(live_b, node)) == (NodeState.READY, NodeState.FENCED)
        # B stopping cleanly gives nothing away; A stopping cleanly hands the node to B at once.
        before = json.loads((node.state_dir / "lease.json").read_text())
        await b.release()
        assert json.loads((node.state_dir / "lease.json").read_text()) == before
        await live_a.poll()
        assert state(live_a, node) == NodeState.READY
        await a.call(node.id, "start", ENGINE)
        await a.release()
        await live_b.poll()
        # B gets the node at once, but at a higher epoch: nothing proves it is A restarted (it
        # may be the copy that sat fenced), so A's engine is foreign to it, never stale.
        assert state(live_b, node) == NodeState.READY and b.epoch(node.id) == 2
        report = live_b.snapshot().node(node.id).report  # type: ignore[union-attr]
        assert report is not None and [e.replica_id for e in report.engines] == ["r1"]
        assert not engine_is_ours(report.engines[0], report.lease, holder="ctl")
        await b.call(node.id, "stop", {"replica_id": "r1", "grace_seconds": 1})


async def test_an_instance_succeeding_a_silent_one_gets_the_node_at_a_higher_epoch(local_node, tmp_path) -> None:
    node = local_node()
    a, live_a = instance(node, tmp_path, "a")
    async with a:
        await live_a.poll()
        await a.call(node.id, "start", ENGINE)
    # A is silent (gone without a word, or only paused): its lease is live for another minute.
    b, live_b = instance(node, tmp_path, "b")
    async with b:
        await live_b.poll()
        assert state(live_b, node) == NodeState.HANDOVER
        assert "succeeded once silent for 5s" in live_b.snapshot().node(node.id).error  # type: ignore[union-attr]
        silence(node, GRACE + 1)
        await live_b.poll()
        assert state(live_b, node) == NodeState.READY and b.epoch(node.id) == 2
        assert [e.kind for e in live_b.store.events()][-2:] == ["node-handover", "node-lease"]
        report = live_b.snapshot().node(node.id).report  # type: ignore[union-attr]
        assert report is not None and not engine_is_ours(report.engines[0], report.lease, holder="ctl")
        await b.call(node.id, "stop", {"replica_id": "r1", "grace_seconds": 1})


async def test_a_paused_instance_that_lost_its_node_is_told_what_happened_and_what_to_do(local_node, tmp_path) -> None:
    node = local_node()
    a, live_a = instance(node, tmp_path, "a")
    b, live_b = instance(node, tmp_path, "b")
    async with a, b:
        await live_a.poll()
        await live_b.poll()
        silence(node, GRACE + 1)  # A paused (SIGSTOP, a VM migrating) longer than the grace
        await live_b.poll()
        assert state(live_b, node) == NodeState.READY and b.epoch(node.id) == 2
        await live_a.poll()  # A resumes
        assert state(live_a, node) == NodeState.FENCED
        error = live_a.snapshot().node(node.id).error  # type: ignore[union-attr]
        assert ("taken over by another instance of controller ctl (now epoch 2; this one held it at epoch 1) "
                "after this one was not heard from for 5s") in error
        assert "llmgw node takeover" in error and "--stop-foreign" in error
        fenced = [e for e in live_a.store.events() if e.kind == "node-fenced"]
        assert len(fenced) == 1 and "taken over by another instance" in fenced[0].message
        # Not locked out: once the other stops (cleanly), the node is A's again at its next poll...
        await b.release()
        await live_a.poll()
        assert state(live_a, node) == NodeState.READY and a.epoch(node.id) == 3
        assert live_a.snapshot().node(node.id).error is None  # type: ignore[union-attr]
        # ...or, with the other still running, by the operator's takeover.
        silence(node, GRACE + 1)
        await live_b.poll()
        await live_a.poll()
        assert state(live_a, node) == NodeState.FENCED
        await a.takeover(node.id)
        await live_a.poll()
        assert state(live_a, node) == NodeState.READY and a.epoch(node.id) == 5


async def test_the_keeper_renews_between_polls(local_node) -> None:
    node = local_node()
    target = NodeTarget(node.id, "localhost", transport="local", agent_config=str(node.config_path))
    fleet = FencedDispatcher(LocalDispatcher([target], env={MARKER_ENV: str(node.dir)}), "ctl", beat=1.0,
                             grace=GRACE)
    async with fleet:
        await fleet.inventory(node.id)
        silence(node, GRACE + 1)
        heard = (node.state_dir / "lease.beat").stat().st_mtime
        # No poll: the keeper alone must be heard within a beat or two (waited for, not timed).
        deadline = time.monotonic() + 30
        while (node.state_dir / "lease.beat").stat().st_mtime <= heard:
            assert time.monotonic() < deadline, "the keeper did not renew the lease"
            await asyncio.sleep(0.1)


async def test_a_restart_that_names_the_instance_it_replaces_gets_its_node_at_once(local_node, tmp_path) -> None:
    node = local_node()
    a, live_a = instance(node, tmp_path, "a")
    async with a:
        await live_a.poll()
    b, live_b = instance(node, tmp_path, "b")
    b.predecessor = "a"  # what the data dir's lock and instance record tell a restart (datadir.succeed)
    async with b:
        await live_b.poll()
        assert state(live_b, node) == NodeState.READY and b.epoch(node.id) == 1
        assert "node-handover" not in [e.kind for e in live_b.store.events()]


async def test_a_node_fenced_by_a_silent_controller_is_lapsing_and_by_a_live_one_is_not(local_node, tmp_path) -> None:
    """Another controller's node (not a copy of this one): fenced either way, but while its holder
    is silent (killed, paused) its lease lapses to this controller, so its replicas are kept and its
    engines adopted then, not replaced meanwhile (llmgw.inventory.becomes_ours)."""
    node = local_node()
    now = [time.time()]
    # A's keeper does not renew on its own here: A speaks only when it polls.
    a, live_a = instance(node, tmp_path, "a", holder="ctl-a", beat=3600)
    b, live_b = instance(node, tmp_path, "b", holder="ctl-b", clock=lambda: now[0])

    def lapsing() -> bool:
        n = live_b.snapshot().node(node.id)
        assert n is not None and n.state == NodeState.FENCED
        return n.lapsing

    async with a, b:
        await live_a.poll()
        silence(node, 1)
        await live_b.poll()
        assert lapsing()  # first sight: not heard from since, so it may be a killed one
        await live_a.poll()
        await live_b.poll()
        assert not lapsing()  # it spoke: alive
        now[0] += GRACE - 1
        await live_b.poll()
        assert not lapsing()  # silent for less than its grace
        now[0] += 2
        await live_b.poll()
        assert lapsing()  # silent past its grace: killed, or paused
        await live_a.poll()
        now[0] += 1
        await live_b.poll()
        assert not lapsing()  # it came back
        now[0] += GRACE + 1
        silence(node, 3600)  # heard from, on a node whose clock stepped back an hour (NTP, a VM restored)
        await live_b.poll()
        assert not lapsing()  # it spoke: "heard" moved, backwards or not
