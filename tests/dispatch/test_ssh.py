"""The SSH transport against real sshd nodes and the real agent."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import pytest

from llmgw.dispatch.base import AGENT_PATH
from llmgw.errors import AgentError
from tests.dispatch.helpers import (
    fetch_done,
    http_status,
    pid_alive,
    serve_pids,
    ssh_dispatcher,
    wait_http,
    wait_until,
)
from tests.fixtures.sshd_fleet import SshdFleet, SshdNode

AGENT_SHA = hashlib.sha256(AGENT_PATH.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def fleet(sshd_fleet) -> SshdFleet:
    return sshd_fleet(3)


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    return tmp_path / "agent-home"


async def test_inventory_from_three_nodes_at_once(fleet: SshdFleet, agent_dir: Path) -> None:
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        answers = await asyncio.gather(*(d.inventory(node.id) for node in fleet))
        hellos = await asyncio.gather(*(d.hello(node.id) for node in fleet))
        stats = [d.stats(node.id) for node in fleet]
    for node, inventory, hello, stat in zip(fleet, answers, hellos, stats, strict=True):
        assert [(g["index"], g["class"], g["memory_gb"], g["declared"]) for g in inventory["gpus"]] == [
            (0, "sim", 24, True),
            (1, "sim", 24, True),
        ]
        assert inventory["filesystems"][0]["path"] == str(node.cache_dir)  # each node answered for itself
        assert inventory["memory_mb"]["total"] > 0
        assert inventory["weights"] == [] and inventory["engines"] == []
        assert hello["agent_sha256"] == AGENT_SHA and hello["locked"] is False
        assert hello["agent_path"] == f"{agent_dir}/llmgw_agent-{AGENT_SHA[:12]}.py"
        assert (stat.connects, stat.agent_starts, stat.locked) == (1, 1, False)


async def test_calls_are_round_trips_on_one_agent_process(fleet: SshdFleet, agent_dir: Path) -> None:
    node = fleet[0]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        await d.hello(node.id)
        answers = await asyncio.gather(*(d.status(node.id) for _ in range(40)))
        stat = d.stats(node.id)
    assert all(a["engines"] == [] for a in answers)
    # One connection and one agent process for all 40: each call was a round trip on the open
    # channel, not a session of its own (~170 ms each). Counted, not timed: the suite runs on
    # busy machines.
    assert (stat.connects, stat.agent_starts) == (1, 1)


def nfs_mounts(node: SshdNode) -> dict[str, str]:
    """Agent config extra: a mount table where the node's cache dir is an NFS mount."""
    table = node.dir / "mounts"
    node.dir.mkdir(parents=True, exist_ok=True)
    table.write_text(f"/dev/vda1 / ext4 rw 0 0\nnas:/export/models {node.cache_dir} nfs4 rw,relatime 0 0\n")
    return {"mounts_file": str(table)}


async def test_network_filesystem_is_reported_shared(sshd_fleet, agent_dir: Path) -> None:
    fleet = sshd_fleet(1, agent_extra=nfs_mounts)
    node = fleet[0]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        inventory = await d.inventory(node.id)
    by_path = {fs["path"]: fs for fs in inventory["filesystems"]}
    assert by_path[str(node.cache_dir)]["shared"] is True
    assert by_path[str(node.cache_dir)]["fstype"] == "nfs4"
    assert by_path[str(node.model_dir)]["shared"] is False


async def test_fetch_start_survive_disconnect_reconnect_stop(
    fleet: SshdFleet, agent_dir: Path, http_root: tuple[Path, str], tmp_path: Path
) -> None:
    node = fleet[1]
    local = tmp_path / "weights"
    local.mkdir()
    (local / "model.bin").write_bytes(b"w" * 4096)
    served, base_url = http_root
    (served / "model.gguf").write_bytes(b"g" * 8192)
    replica = {
        "replica_id": "r-pyhttp",
        "engine": "pyhttp",
        "args": ["{port}", "--bind", "{host}"],
        "env": {"LLMGW_TEST": "1"},
        "gpus": [0],
        "port": None,
        "weights": None,
        "labels": {"model": "tiny"},
    }

    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        from_file = await fetch_done(d, node.id, f"file://{local}")
        from_http = await fetch_done(d, node.id, f"{base_url}/model.gguf")
        assert Path(from_file["path"]).parent == node.cache_dir and from_file["bytes_total"] == 4096
        assert from_http["bytes_total"] == 8192
        inventory = await d.inventory(node.id)
        assert {w["source"] for w in inventory["weights"]} == {f"file://{local}", f"{base_url}/model.gguf"}

        started = await d.start(node.id, {**replica, "weights": from_file["path"]})
        assert started["already_running"] is False
        lo, hi = node.port_range
        assert lo <= started["port"] <= hi and started["endpoint"] == f"http://{node.host}:{started['port']}"
        await wait_http(started["endpoint"] + "/", up=True)
        refused = await d.remove_weights(node.id, [from_file["path"]])
        assert refused["results"][0]["removed"] is False and "in use" in refused["results"][0]["reason"]

    # The connection is gone; the engine is not.
    assert pid_alive(started["pid"])
    assert http_status(started["endpoint"] + "/") == 200

    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        again = await d.start(node.id, {**replica, "weights": from_file["path"]})
        assert again["already_running"] is True and again["pid"] == started["pid"]
        (engine,) = (await d.status(node.id))["engines"]
        assert engine["alive"] is True and engine["labels"] == {"model": "tiny"}
        stopped = await d.stop(node.id, "r-pyhttp", grace_seconds=5)
        assert stopped["was_running"] is True
        await wait_http(started["endpoint"] + "/", up=False)
        removed = await d.remove_weights(node.id, [from_file["path"], from_http["path"], "/etc/passwd"])
        assert [r["removed"] for r in removed["results"]] == [True, True, False]
        assert (await d.inventory(node.id))["weights"] == []
    assert not pid_alive(started["pid"])


async def test_agent_errors_come_back_as_agent_error(fleet: SshdFleet, agent_dir: Path) -> None:
    node = fleet[0]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        with pytest.raises(AgentError, match="not allowed on this node"):
            await d.start(node.id, {"replica_id": "r", "engine": "bash", "args": ["-c", "id"]})
        with pytest.raises(AgentError, match="shell metacharacters"):
            await d.fetch(node.id, "file:///tmp/x;id")
        assert (await d.status(node.id))["engines"] == []  # the channel is still fine
        assert d.stats(node.id).agent_starts == 1


async def test_agent_uploaded_only_when_missing_or_different(fleet: SshdFleet, agent_dir: Path) -> None:
    node = fleet[2]
    remote = agent_dir / f"llmgw_agent-{AGENT_SHA[:12]}.py"
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        assert (await d.hello(node.id))["agent_sha256"] == AGENT_SHA
        assert d.stats(node.id).uploads == 1
    assert remote.read_bytes() == AGENT_PATH.read_bytes()
    assert [p.name for p in agent_dir.iterdir()] == [remote.name]  # no temporary file left behind
    before = remote.stat()

    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        assert (await d.hello(node.id))["agent_sha256"] == AGENT_SHA
        assert d.stats(node.id).uploads == 0
    assert (remote.stat().st_ino, remote.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    # A different agent under our name (edited by hand, or tampered with): replaced.
    remote.write_bytes(AGENT_PATH.read_bytes() + b"\n# edited on the node\n")
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        assert (await d.hello(node.id))["agent_sha256"] == AGENT_SHA
        assert d.stats(node.id).uploads == 1
    # A torn file that does not even run: replaced too.
    remote.write_bytes(AGENT_PATH.read_bytes()[:1000])
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        assert (await d.inventory(node.id))["hostname"]
        assert d.stats(node.id).uploads == 1
    assert remote.read_bytes() == AGENT_PATH.read_bytes()


async def test_a_dead_agent_is_restarted_on_the_same_connection(fleet: SshdFleet, agent_dir: Path) -> None:
    node = fleet[0]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        await d.hello(node.id)
        (pid,) = serve_pids(node.dir)
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: not d.stats(node.id).connected, what="the channel noticing the agent died")
        assert (await d.status(node.id))["engines"] == []
        stat = d.stats(node.id)
        assert (stat.connects, stat.agent_starts) == (1, 2)
        assert serve_pids(node.dir) != [pid]


async def test_a_slow_stop_holds_up_neither_other_calls_nor_the_connection(fleet: SshdFleet, agent_dir: Path) -> None:
    node = fleet[2]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        started = await d.start(node.id, {"replica_id": "stubborn", "engine": "stubborn"})
        # Until it ignores SIGTERM (it says so), however long its start takes here.
        deadline = asyncio.get_running_loop().time() + 60
        while "ready" not in (await d.status(node.id))["engines"][0]["log_tail"]:
            assert asyncio.get_running_loop().time() < deadline, "the stubborn engine never said ready"
            await asyncio.sleep(0.05)
        # A stop that waits out a 5 s grace; a status call meanwhile, allowed less than the grace,
        # is answered while the stop is still waiting.
        stop = asyncio.create_task(d.stop(node.id, "stubborn", grace_seconds=5))
        await asyncio.sleep(0.1)
        (engine,) = (await d.call(node.id, "status", {}, timeout=4.0))["engines"]
        assert engine["alive"] is True and not stop.done()  # answered while the stop waits
        stopped = await stop
        assert stopped["was_running"] is True and stopped["exit_code"] == -9
        stat = d.stats(node.id)
        assert stat.connected and stat.connects == 1
    assert not pid_alive(started["pid"])
