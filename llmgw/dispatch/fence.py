"""The controller's side of fencing (DESIGN §4): hold each node's lease and show it on every change.

A :class:`FencedDispatcher` wraps the fleet's dispatcher. Every inventory poll asks the node to
renew this controller's lease (or to grant it, when nobody holds it or it has expired), and every
change (``start``, ``stop``, ``remove-weights``) carries the holder, this process's instance and
the epoch last granted, so a node that another controller has taken over refuses it with the
reason. ``takeover`` is the operator's "this controller drives that node now" (``llmgw node
takeover``).

The holder id comes from the data dir, so a copied or restored data dir shares it; the instance,
a nonce made for each process, tells the two apart. Between polls (a tick can be long: a stop
waits out its grace) a keeper renews each held lease every ``beat`` seconds, because a sibling
instance may succeed an instance silent for ``grace`` (at a higher epoch: it may be a copy, so the
silent one's engines are foreign to it, never stopped as stale), and the keeper is what keeps a live
controller from looking dead to a copy. A restart on the same data dir and machine knows the
instance it replaces (``predecessor``) and names it: the node hands that one's leases over at once
and at the same epoch, so the restart adopts its engines. Only that proof keeps the epoch.

Controllers sharing a PostgreSQL store share its holder id; the one leading sets ``term`` to its
store lease's epoch before it asks for a node, and every lease request and change carries it. That
is the other proof a node accepts (one fencing mechanism: the store's epoch is the nodes' token):
a later term takes the lease at once, at the same epoch, so a new leader drives the old one's
engines within a poll instead of waiting out the grace, and the old leader is refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from llmgw.catalog import NodeSpec
from llmgw.dispatch.base import AgentVerbs, Answer
from llmgw.errors import DispatchError
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FENCED_VERBS = frozenset({"start", "stop", "remove-weights"})
# Renewed at every poll (a tick, seconds apart); a controller gone this long loses its nodes to
# whichever controller asks next, without an operator.
LEASE_TTL = 60.0
# Heard from at least this often while it runs (polls, else the keeper)...
LEASE_BEAT = 5.0
# ...so a silence of this long means the instance is gone: another instance of the same controller
# (a restart that cannot prove it, a restored backup, or a copy) takes its nodes over at a higher
# epoch. Four missed beats: a stalled loop or one slow SSH round trip must not make a live
# controller look dead to a copy of it. A longer stall (SIGSTOP, a VM paused or migrated, deep swap)
# does lose the nodes to a running copy; the resumed instance is told so (its nodes' error and a
# node-fenced event) and leaves them alone, and its engines keep running, foreign to the copy.
# A longer grace only moves that line, and a restart unable to prove itself waits it out.
SUCCESSION_GRACE = 20.0


class FencedDispatcher(AgentVerbs):
    def __init__(self, inner: AgentVerbs, holder: str, *, ttl: float = LEASE_TTL, instance: str | None = None,
                 grace: float = SUCCESSION_GRACE, beat: float = LEASE_BEAT) -> None:
        self.inner = inner
        self.holder = holder
        # A new nonce per process: a copy of the data dir has our holder id, never our instance.
        self.instance = instance or secrets.token_hex(8)
        self.ttl = ttl
        self.grace = grace
        self.beat = beat
        # The instance of this controller that ran before this one on the same data dir, when it is
        # known to have ended (llmgw.control.datadir.succeed): its leases are handed over at once.
        self.predecessor: str | None = None
        # The leader's term on a shared store (None: this controller leads alone, on SQLite).
        self.term: int | None = None
        # Whether this controller may act now (a shared store: it leads, within its lease's
        # deadline). Asked before every change and every lease taken or renewed: a leader that
        # stalled past its deadline and resumed must not send one more (review: timers overdue
        # after SIGCONT fired a tick before the lease loop noticed the deadline had passed).
        self.may_act: Callable[[], bool] = lambda: True
        self.leases: dict[str, Answer] = {}  # node → the lease as its last answer showed it
        self._heard: dict[str, float] = {}  # node → when (monotonic) it last renewed our lease
        self._keeper: asyncio.Task[None] | None = None
        self.call_timeout = inner.call_timeout

    async def open(self) -> None:
        await self.inner.open()
        self._keeper = asyncio.create_task(self._keep(), name="lease keeper")

    async def close(self) -> None:
        await cancel_and_wait(self._keeper)
        self._keeper = None
        await self.inner.close()

    async def set_nodes(self, specs: Iterable[NodeSpec]) -> None:
        specs = list(specs)
        set_nodes = getattr(self.inner, "set_nodes", None)
        if set_nodes is not None:
            await set_nodes(specs)
        keep = {s.id for s in specs}
        for node_id in [n for n in self.leases if n not in keep]:  # a node that left: nothing to renew
            self.leases.pop(node_id, None)
            self._heard.pop(node_id, None)

    def epoch(self, node_id: str) -> int | None:
        lease = self.leases.get(node_id)
        return int(lease["epoch"]) if lease and lease.get("held") else None

    def _asking(self, **extra: Any) -> Answer:
        asked = {"holder": self.holder, "instance": self.instance, "ttl": self.ttl, "grace": self.grace, **extra}
        if self.term is not None:
            asked["term"] = self.term
        return {**asked, "succeeds": self.predecessor} if self.predecessor else asked

    def _saw(self, node_id: str, lease: Any) -> None:
        if isinstance(lease, dict):
            self.leases[node_id] = lease
            if lease.get("held"):
                self._heard[node_id] = time.monotonic()

    def _acting(self, what: str) -> None:
        if not self.may_act():
            raise DispatchError(f"{what}: this controller no longer leads; nothing sent")

    async def inventory(self, node_id: str) -> Answer:
        # A poll of a controller that no longer leads only reads: no lease taken or renewed.
        answer = await self.inner.call(node_id, "inventory", {"lease": self._asking()} if self.may_act() else {})
        self._saw(node_id, answer.get("lease"))
        return answer

    async def takeover(self, node_id: str) -> Answer:
        """Take the node's lease even from a live holder; the epoch goes up, the old holder is refused."""
        self._acting("takeover")
        lease = await self.inner.call(node_id, "lease", self._asking(takeover=True))
        self._saw(node_id, lease)
        return lease

    async def renew(self, node_id: str) -> Answer:
        """Renew (or take, when it is free) the node's lease without a whole inventory."""
        self._acting("lease renewal")
        lease = await self.inner.call(node_id, "lease", self._asking(), timeout=min(self.call_timeout, self.grace / 2))
        self._saw(node_id, lease)
        return lease

    async def _keep(self) -> None:
        """Renew every held lease not renewed for a beat; a poll renews too, so most beats send nothing."""
        while True:
            await asyncio.sleep(self.beat)
            now = time.monotonic()
            due = [n for n, lease in self.leases.items()
                   if lease.get("held") and now - self._heard.get(n, 0.0) >= self.beat]
            results = await asyncio.gather(*(self.renew(n) for n in due), return_exceptions=True)
            for node_id, result in zip(due, results, strict=True):
                if isinstance(result, DispatchError):  # the node is away: the inventory reports that
                    log.debug("lease renewal on %s: %s", node_id, result)
                elif isinstance(result, BaseException):
                    log.error("lease renewal on %s failed", node_id, exc_info=result)

    async def release(self) -> None:
        """End this controller's leases now (a clean stop): the next controller need not wait them out."""
        await cancel_and_wait(self._keeper)  # nothing renews what is being given back
        self._keeper = None
        for node_id, lease in list(self.leases.items()):
            if not lease.get("held"):
                continue
            try:
                self.leases[node_id] = await self.inner.call(node_id, "lease", self._asking(release=True), timeout=5.0)
            except DispatchError as exc:  # the node is away: the lease runs out on its own
                log.info("could not release the lease on %s: %s", node_id, exc)

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        if verb in FENCED_VERBS:
            self._acting(verb)
            lease = self.leases.get(node_id) or {}
            # The epoch last granted to us, or the one we saw (then the node refuses, with the reason).
            fence: dict[str, Any] = {"holder": self.holder, "epoch": lease.get("epoch", 0), "instance": self.instance}
            if self.term is not None:
                fence["term"] = self.term
            request = {**request, "fence": fence}
        return await self.inner.call(node_id, verb, request, timeout=timeout)
