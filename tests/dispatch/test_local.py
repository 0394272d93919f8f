"""The local transport: the same agent and verbs as over SSH, as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from llmgw.dispatch.base import AGENT_PATH, NodeTarget
from llmgw.dispatch.local import LocalDispatcher
from llmgw.errors import AgentError, DispatchError, NodeUnreachable
from tests.dispatch.helpers import fetch_done, pid_alive, serve_pids, wait_http, wait_until
from tests.fixtures.sshd_fleet import MARKER_ENV, SshdNode


def local_dispatcher(node: SshdNode, **options: object) -> LocalDispatcher:
    target = NodeTarget(node.id, "localhost", transport="local", agent_config=str(node.config_path))
    return LocalDispatcher([target], env={MARKER_ENV: str(node.dir)}, **options)  # type: ignore[arg-type]


async def test_local_transport_runs_the_same_verbs(local_node, http_root: tuple[Path, str], tmp_path: Path) -> None:
    node = local_node()
    served, base_url = http_root
    (served / "m.gguf").write_bytes(b"m" * 512)
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "w.bin").write_bytes(b"w" * 256)

    async with local_dispatcher(node) as d:
        hello = await d.hello(node.id)
        assert hello["locked"] is False and hello["agent_path"] == str(AGENT_PATH)
        inventory = await d.inventory(node.id)
        assert [g["memory_gb"] for g in inventory["gpus"]] == [24, 24]
        assert inventory["filesystems"][0]["path"] == str(node.cache_dir)
        from_file = await fetch_done(d, node.id, f"file://{weights}")
        from_http = await fetch_done(d, node.id, f"{base_url}/m.gguf")
        started = await d.start(node.id, {
            "replica_id": "local-r", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"],
            "weights": from_http["path"],
        })
        await wait_http(started["endpoint"] + "/", up=True)
        with pytest.raises(AgentError, match="not allowed"):
            await d.start(node.id, {"replica_id": "x", "engine": "sh"})

    assert pid_alive(started["pid"])  # closing the dispatcher leaves engines running
    async with local_dispatcher(node) as d:
        (engine,) = (await d.status(node.id))["engines"]
        assert engine["replica_id"] == "local-r" and engine["alive"] is True
        assert (await d.stop(node.id, "local-r", grace_seconds=5))["was_running"] is True
        removed = await d.remove_weights(node.id, [from_file["path"], from_http["path"], str(weights)])
        assert [r["removed"] for r in removed["results"]] == [True, True, False]
    await wait_http(started["endpoint"] + "/", up=False)


async def test_a_dead_local_agent_is_restarted(local_node) -> None:
    node = local_node()
    async with local_dispatcher(node) as d:
        await d.status(node.id)
        (pid,) = serve_pids(node.dir)
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: serve_pids(node.dir) == [], what="the agent to die")
        await asyncio.sleep(0.05)
        try:
            await d.status(node.id)
        except NodeUnreachable:  # the call raced the exit; the next one gets a fresh agent
            pass
        assert (await d.status(node.id))["engines"] == []
        assert len(serve_pids(node.dir)) == 1 and serve_pids(node.dir) != [pid]
    await wait_until(lambda: serve_pids(node.dir) == [], what="the agent to exit on close")


async def test_a_hung_local_agent_is_killed_after_the_timeout(local_node) -> None:
    node = local_node()
    async with local_dispatcher(node, call_timeout=0.5) as d:
        await d.call(node.id, "hello", {}, timeout=10)  # the agent's start is not what is timed here
        (pid,) = serve_pids(node.dir)
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(NodeUnreachable, match="said nothing within 0.5s"):
            await d.inventory(node.id)
        assert not pid_alive(pid)
        assert (await d.call(node.id, "hello", {}, timeout=10))["agent_version"]


async def test_unknown_node_and_closed_dispatcher(local_node) -> None:
    node = local_node()
    d = local_dispatcher(node)
    with pytest.raises(NodeUnreachable, match="not open"):
        await d.status(node.id)
    async with d:
        with pytest.raises(DispatchError, match="no such node"):
            await d.status("elsewhere")
