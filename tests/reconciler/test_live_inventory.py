"""The live inventory: an operator's cordon or drain is never lost to a poll that was gathering
when it landed (seen: `llmgw cordon` answered "cordoned" and the next snapshot said ready)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from llmgw.catalog import NodeId, NodeSpec
from llmgw.dispatch.base import Answer
from llmgw.dispatch.recording import RecordingDispatcher
from llmgw.inventory import NodeState
from llmgw.reconciler.live import LiveInventory
from llmgw.state import Store


class HeldInventory(RecordingDispatcher):
    """Answers ``inventory`` for the node in ``held`` only once ``release`` is set; ``asked``
    is set when that call has started, so a test acts while the poll is gathering."""

    def __init__(self, nodes: list[str], held: str) -> None:
        super().__init__(nodes)
        self.held = held
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def inventory(self, node_id: str) -> Answer:
        if node_id == self.held:
            self.asked.set()
            await self.release.wait()
        return await super().inventory(node_id)


def _live(tmp_path: Path, dispatcher: RecordingDispatcher) -> LiveInventory:
    store = Store(tmp_path / "llmgw.db").open()
    live = LiveInventory(dispatcher, store)
    live.set_nodes([NodeSpec(NodeId(n), "127.0.0.1") for n in dispatcher.nodes])
    return live


async def _cordon_during_poll(live: LiveInventory, dispatcher: HeldInventory, node: str, state: NodeState) -> None:
    poll = asyncio.create_task(live.poll())
    await asyncio.wait_for(dispatcher.asked.wait(), 10)
    live.set_operator_state(node, state)  # lands while the poll still waits for a node
    assert live.snapshot().node(node).state == state  # type: ignore[union-attr]
    dispatcher.release.set()
    snapshot = await asyncio.wait_for(poll, 10)
    assert snapshot.node(node).state == state  # type: ignore[union-attr]
    assert live.snapshot().node(node).state == state  # type: ignore[union-attr]


def test_a_cordon_of_a_node_that_answered_first_survives_the_poll(tmp_path: Path) -> None:
    async def main() -> None:
        dispatcher = HeldInventory(["n1", "n2"], held="n2")
        live = _live(tmp_path, dispatcher)
        dispatcher.release.set()
        await live.poll()  # both known and ready
        dispatcher.release.clear()
        dispatcher.asked.clear()
        await _cordon_during_poll(live, dispatcher, "n1", NodeState.CORDONED)

    asyncio.run(main())


def test_a_drain_of_the_node_being_asked_survives_the_poll(tmp_path: Path) -> None:
    async def main() -> None:
        dispatcher = HeldInventory(["n1", "n2"], held="n2")
        live = _live(tmp_path, dispatcher)
        dispatcher.release.set()
        await live.poll()
        dispatcher.release.clear()
        dispatcher.asked.clear()
        await _cordon_during_poll(live, dispatcher, "n2", NodeState.DRAINING)

    asyncio.run(main())


def test_an_uncordon_during_a_poll_is_kept_too(tmp_path: Path) -> None:
    async def main() -> None:
        dispatcher = HeldInventory(["n1", "n2"], held="n2")
        live = _live(tmp_path, dispatcher)
        dispatcher.release.set()
        await live.poll()
        live.set_operator_state("n1", NodeState.CORDONED)
        dispatcher.release.clear()
        dispatcher.asked.clear()
        await _cordon_during_poll(live, dispatcher, "n1", NodeState.READY)

    asyncio.run(main())


def test_a_node_spec_changed_during_a_poll_is_kept(tmp_path: Path) -> None:
    async def main() -> None:
        dispatcher = HeldInventory(["n1", "n2"], held="n2")
        live = _live(tmp_path, dispatcher)
        poll = asyncio.create_task(live.poll())
        await asyncio.wait_for(dispatcher.asked.wait(), 10)
        live.set_nodes([NodeSpec(NodeId("n1"), "127.0.0.1", pool="big"), NodeSpec(NodeId("n2"), "127.0.0.1")])
        dispatcher.release.set()
        snapshot = await asyncio.wait_for(poll, 10)
        assert snapshot.node("n1").spec.pool == "big"  # type: ignore[union-attr]
        assert snapshot.node("n1").report is not None  # type: ignore[union-attr]

    asyncio.run(main())
