"""The controller's side of fencing (DESIGN §4): hold each node's lease and show it on every change.

A :class:`FencedDispatcher` wraps the fleet's dispatcher. Every inventory poll asks the node to
renew this controller's lease (or to grant it, when nobody holds it or it has expired), and every
change (``start``, ``stop``, ``remove-weights``) carries the holder and the epoch last granted, so
a node that another controller has taken over refuses it with the reason. ``takeover`` is the
operator's "this controller drives that node now" (``llmgw node takeover``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from llmgw.catalog import NodeSpec
from llmgw.dispatch.base import AgentVerbs, Answer
from llmgw.errors import DispatchError

log = logging.getLogger(__name__)

FENCED_VERBS = frozenset({"start", "stop", "remove-weights"})
# Renewed at every poll (a tick, seconds apart); a controller gone this long loses its nodes to
# whichever controller asks next, without an operator.
LEASE_TTL = 60.0


class FencedDispatcher(AgentVerbs):
    def __init__(self, inner: AgentVerbs, holder: str, *, ttl: float = LEASE_TTL) -> None:
        self.inner = inner
        self.holder = holder
        self.ttl = ttl
        self.leases: dict[str, Answer] = {}  # node → the lease as its last answer showed it
        self.call_timeout = inner.call_timeout

    async def open(self) -> None:
        await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def set_nodes(self, specs: Iterable[NodeSpec]) -> None:
        set_nodes = getattr(self.inner, "set_nodes", None)
        if set_nodes is not None:
            await set_nodes(specs)

    def epoch(self, node_id: str) -> int | None:
        lease = self.leases.get(node_id)
        return int(lease["epoch"]) if lease and lease.get("held") else None

    async def inventory(self, node_id: str) -> Answer:
        answer = await self.inner.call(node_id, "inventory", {"lease": {"holder": self.holder, "ttl": self.ttl}})
        lease = answer.get("lease")
        if isinstance(lease, dict):
            self.leases[node_id] = lease
        return answer

    async def takeover(self, node_id: str) -> Answer:
        """Take the node's lease even from a live holder; the epoch goes up, the old holder is refused."""
        lease = await self.inner.call(node_id, "lease", {"holder": self.holder, "ttl": self.ttl, "takeover": True})
        self.leases[node_id] = lease
        return lease

    async def release(self) -> None:
        """End this controller's leases now (a clean stop): the next controller need not wait them out."""
        for node_id, lease in list(self.leases.items()):
            if not lease.get("held"):
                continue
            try:
                self.leases[node_id] = await self.inner.call(
                    node_id, "lease", {"holder": self.holder, "ttl": self.ttl, "release": True}, timeout=5.0)
            except DispatchError as exc:  # the node is away: the lease runs out on its own
                log.info("could not release the lease on %s: %s", node_id, exc)

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        if verb in FENCED_VERBS:
            lease = self.leases.get(node_id) or {}
            # The epoch last granted to us, or the one we saw (then the node refuses, with the reason).
            fence: dict[str, Any] = {"holder": self.holder, "epoch": lease.get("epoch", 0)}
            request = {**request, "fence": fence}
        return await self.inner.call(node_id, verb, request, timeout=timeout)
