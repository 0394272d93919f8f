"""The live inventory: latest agent reports, reachability, and operator node states.

Polls every node's agent through the dispatcher (concurrently, each call with the
dispatcher's timeout) and keeps one record per node. Cordon and drain are operator
decisions, so they are stored and survive a controller restart; reachability is observed
and is not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from llmgw.catalog import NodeSpec
from llmgw.dispatch.base import Dispatcher
from llmgw.errors import DispatchError
from llmgw.inventory.model import Inventory, Lease, Node, NodeState, follow_nodes, gpu_groups, parse_report
from llmgw.store.protocol import Store

log = logging.getLogger(__name__)

OPERATOR_STATES = (NodeState.READY, NodeState.CORDONED, NodeState.DRAINING)


# How long a holder whose lease states no grace may be silent before its lease is taken to lapse
# (the agent's default succession grace).
_GRACE = 20.0


@dataclass(frozen=True)
class _Holder:
    holder: str
    epoch: int
    heard: float | None  # the node's clock: when the holder last polled it, as last seen
    spoke_at: float | None = None  # this controller's clock: when ``heard`` was last seen to move


class LiveInventory:
    def __init__(self, dispatcher: Dispatcher, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.dispatcher = dispatcher
        self.store = store
        self.clock = clock
        self._nodes: dict[str, Node] = {}
        self._taken_at: float | None = None
        # Node → the controller holding its lease when this one is not: a dead predecessor or a
        # killed leader stays silent (its lease lapses), a live one (or a copy) does not.
        self._holders: dict[str, _Holder] = {}
        # Node → the epoch at which this instance held its lease before another instance of our
        # holder id took it (we were silent past the grace: paused, stalled, cut off), so the
        # operator is told that, and what to do, not "a copied data dir?" as for one never ours.
        self._lost: dict[str, int] = {}
        # Node → how its nodes.yaml gpus and its agent's report last disagreed (None: they agreed),
        # so the event is written when that changes, not on every poll.
        self._gpu_notes: dict[str, str | None] = {}

    # --- the fleet's shape ----------------------------------------------------------
    def set_nodes(self, specs: Iterable[NodeSpec]) -> None:
        """Follow nodes.yaml: keep what is known of nodes that stay, forget nodes that left."""
        self._nodes = follow_nodes(self._nodes, specs)
        self._gpu_notes = {k: v for k, v in self._gpu_notes.items() if k in self._nodes}

    def set_operator_state(self, node_id: str, state: NodeState) -> None:
        """Cordon, drain or uncordon (READY); stored so a restart keeps it."""
        if state not in OPERATOR_STATES:
            raise ValueError(f"{state} is not an operator state")
        if node_id not in self._nodes:
            raise KeyError(node_id)
        self.store.set_node_state(node_id, None if state == NodeState.READY else state.value)
        self.store.add_event("node-" + {"ready": "uncordoned"}.get(state.value, state.value), node_id,
                             f"node {node_id} is now {state.value}")
        node = self._nodes[node_id]
        self._nodes[node_id] = replace(node, state=self._state(node))

    def _state(self, node: Node, operator: dict[str, str] | None = None) -> NodeState:
        """What the node is now: observed (unreachable, unknown, fenced) or else the operator's
        state (``operator``: the stored states, read once by a caller settling many nodes)."""
        if node.unreachable_since is not None:
            return NodeState.UNREACHABLE
        if node.report is None:
            return NodeState.UNKNOWN
        lease_state = self._lease_state(node.id, node.report.lease)
        if lease_state is not None:
            return lease_state
        stored = (operator if operator is not None else self.store.node_states()).get(node.id)
        return NodeState(stored or NodeState.READY.value)

    def _lease_state(self, node_id: str, lease: Lease | None) -> NodeState | None:
        """FENCED or HANDOVER when the node's lease is not ours; None when it is (or none is asked)."""
        if lease is None or lease.held:
            return None
        if lease.sibling and node_id not in self._lost and not self._holder_live(node_id):
            return NodeState.HANDOVER
        return NodeState.FENCED

    def _holder_live(self, node_id: str) -> bool:
        """The holder has been heard from since this controller first saw the node (a sibling in
        handover is proven alive by this once; it then keeps the node until it releases it)."""
        h = self._holders.get(node_id)
        return h is not None and h.spoke_at is not None

    def _holder_silent(self, node_id: str, lease: Lease | None) -> bool:
        """Not heard from since first seen, or not for its lease's grace (a leader that spoke while
        this one stood by, then was killed): its lease lapses and the node becomes ours."""
        h = self._holders.get(node_id)
        if h is None or h.spoke_at is None:
            return True
        return self.clock() - h.spoke_at >= (lease.grace if lease is not None and lease.grace else _GRACE)

    def _watch_holder(self, node_id: str, lease: Lease | None) -> None:
        """Note when the controller holding the node's lease, when not this one, last spoke (its
        "heard" on the node's clock moved; this controller's clock for how long ago: no skew)."""
        if lease is None or lease.held or lease.holder is None:
            self._holders.pop(node_id, None)
            return
        h = self._holders.get(node_id)
        if h is None or (h.holder, h.epoch) != (lease.holder, lease.epoch):  # another took it: judged afresh
            self._holders[node_id] = _Holder(lease.holder, lease.epoch, lease.heard)
        elif lease.heard is not None and lease.heard != h.heard:  # moved either way: a node's clock may step back
            self._holders[node_id] = _Holder(h.holder, h.epoch, lease.heard, self.clock())

    def _note_lost(self, node_id: str, before: Lease | None, now: Lease | None) -> None:
        """Remember that a lease we held went to another instance of our holder id; forget it
        once the node is ours again or in other hands."""
        if now is None or now.held or not now.sibling:
            self._lost.pop(node_id, None)
        elif before is not None and before.held:
            self._lost[node_id] = before.epoch

    def _lease_problem(self, node_id: str, lease: Lease | None) -> str | None:
        """Why this controller does not act on the node (shown as its error), or None."""
        state = self._lease_state(node_id, lease)
        if state is None or lease is None:
            return None
        if state == NodeState.HANDOVER:
            return (f"held by another instance of this controller ({lease.holder}, epoch {lease.epoch}), not heard "
                    f"from again yet: an earlier life of this one (a restart after a crash) is succeeded once silent "
                    f"for {lease.grace or 0:g}s; one still running (a copy of this data dir?) keeps it")
        if lease.sibling and node_id in self._lost:
            return (f"taken over by another instance of controller {lease.holder} (now epoch {lease.epoch}; this one "
                    f"held it at epoch {self._lost[node_id]}) after this one was not heard from for "
                    f"{lease.grace or 0:g}s (paused, stalled or cut off?): this controller no longer acts on it and "
                    "gives its replicas there up; the engines it started keep running, and the other stops none "
                    "of them as stale. Two instances of one controller run (a copied data dir?): stop the one to "
                    "give up; on the one to keep, `llmgw node takeover` (--stop-foreign stops the engines it "
                    "does not claim, so it can start its own)")
        if lease.sibling:
            return (f"held by another instance of controller {lease.holder} (epoch {lease.epoch}), which is running "
                    "(a copied data dir?): this controller does not act on it; stop the other one, or `llmgw node "
                    "takeover` moves it here")
        return (f"held by controller {lease.holder} (epoch {lease.epoch}): this controller does not act on it "
                "(`llmgw node takeover` moves it here)")

    # --- observation ------------------------------------------------------------------
    async def poll(self) -> Inventory:
        """Ask every node for its inventory at once; the new snapshot.

        Each node's state is settled here, when the answers are written back, not when its node
        answered: a cordon or drain that lands while the poll gathers (the API answers it at once)
        must not be overwritten by a state computed before it (seen: a cordon lost this way).
        """
        ids = list(self._nodes)
        answers = await asyncio.gather(*(self._poll_one(i) for i in ids))
        operator = self.store.node_states()  # once, after the gather: the operator's latest word
        for node_id, node in zip(ids, answers, strict=True):
            current = self._nodes.get(node_id)
            if node is not None and current is not None:
                # nodes.yaml may have changed under the gather too (a takeover polls outside a tick).
                node = replace(node, spec=current.spec)
                self._nodes[node_id] = replace(node, state=self._state(node, operator))
                self._note_gpus(self._nodes[node_id])
        self._taken_at = self.clock()
        return self.snapshot()

    async def _poll_one(self, node_id: str) -> Node | None:
        """The node as it answered (or failed to); its state is settled by :meth:`poll`."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        now = self.clock()
        try:
            raw = await self.dispatcher.inventory(node_id)
            report = parse_report(raw)
        except DispatchError as exc:
            since = node.unreachable_since if node.unreachable_since is not None else now
            if node.unreachable_since is None:
                self.store.add_event("node-unreachable", node_id, str(exc))
                log.warning("node %s unreachable: %s", node_id, exc)
            return replace(node, unreachable_since=since, error=str(exc))
        except (KeyError, TypeError, ValueError) as exc:  # an answer we cannot read is a node problem
            return replace(node, unreachable_since=node.unreachable_since or now,
                           error=f"unreadable inventory: {exc}")
        if node.unreachable_since is not None:
            self.store.add_event("node-reachable", node_id, f"node {node_id} answers again")
        lease = report.lease
        self._note_lost(node_id, node.report.lease if node.report is not None else None, lease)
        self._watch_holder(node_id, lease)
        problem = self._lease_problem(node_id, lease)
        state = self._lease_state(node_id, lease)
        if state is not None and state != node.state:
            kind = "node-fenced" if state == NodeState.FENCED else "node-handover"
            self.store.add_event(kind, node_id, f"node {node_id} is {problem}")
            log.warning("node %s is %s", node_id, problem)
        elif state is None and node.state in (NodeState.FENCED, NodeState.HANDOVER):
            self.store.add_event("node-lease", node_id, f"node {node_id}: this controller holds its lease "
                                 f"(epoch {lease.epoch if lease else '?'})")
        return replace(node, report=report, last_seen=now, unreachable_since=None, error=problem,
                       locked=bool(raw.get("locked", False)),  # the SSH transport's finding, not the agent's
                       lapsing=state == NodeState.FENCED and self._holder_silent(node_id, lease))

    def _note_gpus(self, node: Node) -> None:
        """An event and a log line when nodes.yaml's gpus and the agent's report start, change or stop
        disagreeing. Placement counts the agent's report (what the node has); nodes.yaml is what
        validation checked, so a disagreement is the operator's to settle."""
        if node.report is None:
            return
        now, before = node.gpu_disagreement, self._gpu_notes.get(node.id)
        if now == before:
            return
        self._gpu_notes[node.id] = now
        if now is not None:
            message = f"node {node.id}: {now}; placement counts the agent's"
            self.store.add_event("node-gpus-disagree", node.id, message)
            log.warning("%s", message)
        else:
            said = gpu_groups((g.gpu_class, g.memory_gb) for g in node.report.gpus)
            self.store.add_event("node-gpus-agree", node.id,
                                 f"node {node.id}: nodes.yaml and the agent agree on its GPUs ({said})")

    def snapshot(self) -> Inventory:
        return Inventory(dict(self._nodes), self._taken_at)
