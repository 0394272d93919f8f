"""The in-memory dispatcher: the protocol's behaviour without a node, and scripted failures."""

from __future__ import annotations

import pytest

from llmgw.dispatch import Dispatcher, RecordingDispatcher
from llmgw.dispatch.recording import cache_name
from llmgw.errors import AgentError, DispatchError, NodeUnreachable


def test_it_is_a_dispatcher() -> None:
    assert isinstance(RecordingDispatcher(["a"]), Dispatcher)


async def test_verbs_change_the_model_and_are_recorded() -> None:
    async with RecordingDispatcher(["a", "b"]) as d:
        assert (await d.hello("a"))["hostname"] == "a"
        fetched = await d.fetch("a", "file:///models/x")
        assert fetched["name"] == cache_name("file:///models/x") and fetched["state"] == "done"
        engine = await d.start("a", {"replica_id": "r1", "engine": "sim", "args": [], "weights": fetched["path"]})
        assert engine["port"] == 8000
        assert (await d.start("a", {"replica_id": "r2", "engine": "sim"}))["port"] == 8001
        inventory = await d.inventory("a")
        assert [w["name"] for w in inventory["weights"]] == [fetched["name"]]
        assert {e["replica_id"] for e in inventory["engines"]} == {"r1", "r2"}
        refused = await d.remove_weights("a", [fetched["path"], "/etc/passwd"])
        assert [r["removed"] for r in refused["results"]] == [False, False]
        assert (await d.stop("a", "r1", grace_seconds=1))["was_running"] is True
        removed = await d.remove_weights("a", [fetched["path"]])
        assert removed["results"] == [{"path": fetched["path"], "removed": True}]
        assert (await d.status("a"))["engines"][0]["replica_id"] == "r2"
        assert (await d.inventory("b"))["engines"] == []
    assert [c.verb for c in d.calls_of(node_id="a")] == [
        "hello", "fetch", "start", "start", "inventory", "remove-weights", "stop", "remove-weights", "status",
    ]
    assert d.calls_of("stop")[0].request == {"replica_id": "r1", "grace_seconds": 1}


async def test_scripted_failures() -> None:
    d = RecordingDispatcher(["a"])
    d.fail_next("a", "start", AgentError("a: start: no free GPU"))
    with pytest.raises(AgentError, match="no free GPU"):
        await d.start("a", {"replica_id": "r", "engine": "sim"})
    assert (await d.start("a", {"replica_id": "r", "engine": "sim"}))["replica_id"] == "r"
    d.set_reachable("a", False)
    with pytest.raises(NodeUnreachable):
        await d.status("a")
    with pytest.raises(DispatchError, match="no such node"):
        await d.status("zz")
    with pytest.raises(AgentError, match="not allowed"):
        d.set_reachable("a", True)
        await d.start("a", {"replica_id": "q", "engine": "bash"})
    with pytest.raises(ValueError):
        d.fail_next("a", "rm", AgentError("x"))
    assert len(d.calls) == 5


async def test_a_default_fake_node_starts_every_engine_the_catalog_knows_and_refuses_others() -> None:
    """Spelt as the catalog spells them (the list spelt "llamacpp": every llama.cpp start refused)."""
    from typing import get_args

    from llmgw.catalog.model import Engine

    async with RecordingDispatcher(["a"]) as d:
        for i, engine in enumerate(get_args(Engine)):
            assert (await d.start("a", {"replica_id": f"r{i}", "engine": engine}))["port"] == 8000 + i
        assert "llama.cpp" in get_args(Engine)
        with pytest.raises(AgentError, match="'llamacpp' is not allowed"):
            await d.start("a", {"replica_id": "x", "engine": "llamacpp"})
