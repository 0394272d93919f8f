"""A controller that no longer leads sends nothing that changes a node (issue 36, review): a leader
that stalled past its lease's deadline and resumed had overdue timers fire a tick before its lease
loop noticed; every change, takeover and lease renewal is refused locally, and a poll only reads."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.dispatch.fence import FencedDispatcher
from llmgw.dispatch.recording import FakeNode, RecordingDispatcher
from llmgw.errors import DispatchError


def test_nothing_that_changes_a_node_leaves_a_controller_that_no_longer_leads() -> None:
    async def main() -> None:
        nodes = RecordingDispatcher({"n1": FakeNode(hostname="n1")})
        fence = FencedDispatcher(nodes, "ctl")
        fence.term = 7
        leading = [True]
        fence.may_act = lambda: leading[0]
        await fence.inventory("n1")
        assert nodes.calls[-1].request["lease"]["term"] == 7  # a leader's poll takes and renews its lease
        leading[0] = False
        for call in (fence.stop("n1", "r1.r0", grace_seconds=1), fence.takeover("n1"), fence.renew("n1")):
            with pytest.raises(DispatchError, match="no longer leads"):
                await call
        sent = len(nodes.calls)
        await fence.inventory("n1")
        assert len(nodes.calls) == sent + 1 and "lease" not in nodes.calls[-1].request  # it only reads

    asyncio.run(main())
