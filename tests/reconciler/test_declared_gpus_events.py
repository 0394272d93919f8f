"""A node whose nodes.yaml `gpus` and agent report disagree is visible: an event when the
disagreement starts, changes or ends (once, not every poll), the node view's
`gpu_disagreement` and a problems line in `llmgw nodes` and the dashboard (seen: a node declaring
2 × l40s whose agent reported none showed 0/0 GPUs and nothing said why)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from llmgw.admin.labels import node_problems
from llmgw.admin.views import nodes_view
from llmgw.catalog import NodeId, NodeSpec
from llmgw.catalog.model import GpuSpec
from llmgw.dispatch.recording import RecordingDispatcher
from llmgw.reconciler.live import LiveInventory
from llmgw.state import Store


def _gpu_events(store: Store) -> list[tuple[str, str, str]]:
    return [(e.kind, e.subject, e.message) for e in store.events() if e.kind.startswith("node-gpus")]


def test_a_disagreement_is_an_event_once_per_change_and_a_problem_in_the_view(tmp_path: Path) -> None:
    async def main() -> None:
        dispatcher = RecordingDispatcher(["gpu-1", "agrees"])
        dispatcher.nodes["gpu-1"].gpus = []  # the agent's config declares none, and no nvidia-smi
        store = Store(tmp_path / "llmgw.db").open()
        live = LiveInventory(dispatcher, store)
        live.set_nodes([NodeSpec(NodeId("gpu-1"), "10.0.0.1", gpus=GpuSpec(2, "l40s", 48)),
                        NodeSpec(NodeId("agrees"), "10.0.0.2", gpus=GpuSpec(2, "sim", 24))])
        for _ in range(3):
            await live.poll()
        said = "node gpu-1: nodes.yaml declares 2 × l40s 48 GB, the agent reports none; placement counts the agent's"
        assert _gpu_events(store) == [("node-gpus-disagree", "gpu-1", said)]

        (agrees, view) = nodes_view(live.snapshot(), [], now=0.0)  # by id
        assert view["gpu_disagreement"] == "nodes.yaml declares 2 × l40s 48 GB, the agent reports none"
        assert (view["gpu_total"], view["gpu_free"]) == (0, 0)
        assert ("GPUs: nodes.yaml declares 2 × l40s 48 GB, the agent reports none (placement counts the agent's)"
                in node_problems(view))
        assert agrees["gpu_disagreement"] is None and node_problems(agrees) == []

        # The node's owner declares them in the agent's config: one event saying they agree now.
        dispatcher.nodes["gpu-1"].gpus = [{"index": i, "class": "l40s", "memory_gb": 48} for i in range(2)]
        await live.poll()
        await live.poll()
        assert _gpu_events(store)[1:] == [
            ("node-gpus-agree", "gpu-1", "node gpu-1: nodes.yaml and the agent agree on its GPUs (2 × l40s 48 GB)")]
        # A change of nodes.yaml is judged at the next poll, once.
        live.set_nodes([NodeSpec(NodeId("gpu-1"), "10.0.0.1", gpus=GpuSpec(4, "l40s", 48)),
                        NodeSpec(NodeId("agrees"), "10.0.0.2", gpus=GpuSpec(2, "sim", 24))])
        await live.poll()
        await live.poll()
        assert [e[0] for e in _gpu_events(store)] == ["node-gpus-disagree", "node-gpus-agree", "node-gpus-disagree"]
        assert "declares 4 × l40s 48 GB, the agent reports 2 × l40s 48 GB" in _gpu_events(store)[-1][2]

    asyncio.run(main())
