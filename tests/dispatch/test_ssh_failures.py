"""The SSH transport when nodes fail: killed sshd, hung node, nothing listening, locked nodes."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import paramiko
import pytest

from llmgw.dispatch.base import NodeTarget
from llmgw.dispatch.ssh import SshDispatcher
from llmgw.errors import NodeUnreachable
from tests.dispatch.helpers import fetch_done, ssh_dispatcher, wait_http
from tests.fixtures.sshd_fleet import SshdEnvironment, free_port
from tests.fixtures.sshd_fleet import _marked_pids as marked_pids


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    return tmp_path / "agent-home"


async def test_sshd_killed_mid_call_is_unreachable_at_once_then_reconnects(sshd_fleet, agent_dir: Path) -> None:
    fleet = sshd_fleet(1)
    node = fleet[0]
    # A call timeout far above what a dropped connection may take to notice even on a busy
    # machine, so the bound below tells "noticed the drop" from "waited the timeout out".
    clock = FakeClock()  # the backoff moves when the test says, not with the machine's load
    async with ssh_dispatcher(fleet, agent_dir=agent_dir, call_timeout=40, backoff_initial=0.3,
                              clock=clock) as d:
        await d.hello(node.id)
        fleet.pause(node)  # the node stops answering...
        call = asyncio.create_task(d.inventory(node.id))
        await asyncio.sleep(0.3)
        assert not call.done()
        killed = time.monotonic()
        fleet.kill(node)  # ...and its sshd dies with the call in flight
        with pytest.raises(NodeUnreachable, match="connection to the agent was lost"):
            await call
        assert time.monotonic() - killed < 20, "a dead connection must not wait for the call timeout"

        with pytest.raises(NodeUnreachable, match="cannot connect"):
            await d.status(node.id)
        attempts = d.stats(node.id).consecutive_failures
        with pytest.raises(NodeUnreachable, match="next attempt in"):
            await d.status(node.id)  # within the backoff: refused without trying
        assert d.stats(node.id).consecutive_failures == attempts  # no attempt was made

        fleet.restart(node)
        clock.now += 0.35
        assert (await d.status(node.id))["engines"] == []
        stat = d.stats(node.id)
        assert (stat.connects, stat.consecutive_failures, stat.last_error) == (2, 0, None)


async def test_a_hung_node_is_unreachable_within_the_call_timeout(sshd_fleet, agent_dir: Path) -> None:
    fleet = sshd_fleet(1)
    node = fleet[0]
    async with ssh_dispatcher(fleet, agent_dir=agent_dir, call_timeout=1.0) as d:
        await d.hello(node.id)
        fleet.pause(node)
        started = time.monotonic()
        try:
            with pytest.raises(NodeUnreachable, match="said nothing within 1s; connection dropped"):
                await d.inventory(node.id)
            # The 1 s given, not the default 30 s nor a hang (a bound no busy machine trips).
            assert time.monotonic() - started < 15
            assert not d.stats(node.id).connected
        finally:
            fleet.resume(node)
        assert (await d.hello(node.id))["locked"] is False  # a fresh connection
        assert d.stats(node.id).connects == 2


async def test_nothing_listening_backs_off_exponentially_up_to_the_cap(sshd_env: SshdEnvironment) -> None:
    clock = FakeClock()
    ghost = NodeTarget("ghost", "127.0.0.1", port=free_port())
    d = SshDispatcher(
        [ghost],
        client_key=sshd_env.client_key,
        known_hosts=sshd_env.root / "none",
        connect_timeout=2,
        backoff_initial=1,
        backoff_max=4,
        clock=clock,
    )
    async with d:
        for delay in (1, 2, 4, 4, 4):
            with pytest.raises(NodeUnreachable, match="cannot connect"):
                await d.hello("ghost")  # a real attempt
            failures = d.stats("ghost").consecutive_failures
            clock.now += delay - 0.01
            with pytest.raises(NodeUnreachable, match="cannot connect.*next attempt in"):
                await d.hello("ghost")  # still backing off: refused without trying
            assert d.stats("ghost").consecutive_failures == failures
            clock.now += 0.01


async def test_a_silent_server_times_out_at_the_banner(sshd_env: SshdEnvironment) -> None:
    with socket.socket() as listener:  # accepts TCP (the kernel does) but never says a word
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        target = NodeTarget("mute", "127.0.0.1", port=listener.getsockname()[1])
        d = SshDispatcher([target], client_key=sshd_env.client_key, known_hosts=sshd_env.root / "none",
                          connect_timeout=0.5)
        async with d:
            started = time.monotonic()
            with pytest.raises(NodeUnreachable, match="cannot connect"):
                await d.inventory("mute")
            # Within what the 0.5 s given allows (2 s), far from what the default 10 s would (40 s):
            # a bound no busy machine trips.
            assert time.monotonic() - started < 15


async def test_locked_node_answers_every_verb_and_runs_nothing_else(
    sshd_fleet, agent_dir: Path, tmp_path: Path
) -> None:
    fleet = sshd_fleet(1, locked=True)
    node = fleet[0]
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "w.bin").write_bytes(b"1" * 100)

    async with ssh_dispatcher(fleet, agent_dir=agent_dir) as d:
        hello = await d.hello(node.id)
        assert hello["locked"] is True and hello["agent_version"] and hello["agent_path"] == ""
        assert d.stats(node.id).uploads == 0 and not agent_dir.exists()
        assert [g["class"] for g in (await d.inventory(node.id))["gpus"]] == ["sim", "sim"]
        fetched = await fetch_done(d, node.id, f"file://{weights}")
        started = await d.start(
            node.id, {"replica_id": "locked-r", "engine": "pyhttp", "args": ["{port}", "--bind", "{host}"]}
        )
        await wait_http(started["endpoint"] + "/", up=True)
        assert [e["replica_id"] for e in (await d.status(node.id))["engines"]] == ["locked-r"]
        assert (await d.stop(node.id, "locked-r", grace_seconds=5))["was_running"] is True
        removed = await d.remove_weights(node.id, [fetched["path"], "/etc/hostname"])
        assert [r["removed"] for r in removed["results"]] == [True, False]

    # The key opens nothing but the agent: no command, no shell, no SFTP.
    marker = tmp_path / "pwned"
    client = paramiko.SSHClient()
    client.load_host_keys(str(fleet.known_hosts))
    client.connect(node.host, node.port, username="root", key_filename=str(fleet.client_key),
                   allow_agent=False, look_for_keys=False, timeout=5)
    try:
        outputs = {}
        for command in (f"touch {marker}; id", f"touch {marker}", f"sh -c 'touch {marker}'", f"touch {marker}; hello",
                        f"python3 -c 'open(\"{marker}\", \"w\")' status"):
            stdin, stdout, _ = client.exec_command(command, timeout=10)
            stdin.channel.shutdown_write()
            outputs[command] = (stdout.channel.recv_exit_status(), stdout.read())
        with pytest.raises((paramiko.SSHException, paramiko.SFTPError, EOFError, OSError)):
            sftp = client.open_sftp()
            sftp.put(__file__, str(marker))
    finally:
        client.close()
    time_limit = time.monotonic() + 1
    while time.monotonic() < time_limit and marked_pids(str(node.dir)):
        await asyncio.sleep(0.05)
    assert not marker.exists()
    # Only the last word picks a verb; nothing before it runs.
    assert [status for status, _ in outputs.values()] == [2, 2, 2, 0, 0]
    assert b"agent_version" in outputs[f"touch {marker}; hello"][1]
