"""Host keys: fetched and recorded on an operator's word, otherwise refused with their fingerprint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import paramiko
import pytest

from llmgw.dispatch.ssh import SshDispatcher
from llmgw.dispatch.trust import fetch_host_key, trust
from llmgw.errors import HostKeyRejected, NodeUnreachable
from tests.fixtures.sshd_fleet import SshdFleet, free_port


@pytest.fixture(scope="module")
def fleet(sshd_fleet) -> SshdFleet:
    return sshd_fleet(2)


def keygen_fingerprint(fleet: SshdFleet, host: str) -> str:
    pub = str(fleet.env.host_key_path(host)) + ".pub"
    return subprocess.run(["ssh-keygen", "-l", "-f", pub], capture_output=True, text=True, check=True).stdout.split()[1]


def test_fetch_host_key_matches_ssh_keygen(fleet: SshdFleet) -> None:
    node = fleet[0]
    key = fetch_host_key(node.host, node.port, timeout=5)
    assert key.key_type == "ssh-ed25519"
    assert key.fingerprint == keygen_fingerprint(fleet, node.host)


def test_fetch_host_key_from_a_closed_port() -> None:
    with pytest.raises(NodeUnreachable, match="cannot connect"):
        fetch_host_key("127.0.0.1", free_port(), timeout=2)


@pytest.mark.parametrize("hashed", [False, True])
async def test_trusted_key_lets_the_dispatcher_connect(fleet: SshdFleet, tmp_path: Path, hashed: bool) -> None:
    node = fleet[0]
    known_hosts = tmp_path / "ssh" / "known_hosts"
    recorded = trust(node.host, node.port, known_hosts, hashed=hashed, timeout=5)
    assert trust(node.host, node.port, known_hosts, hashed=hashed, timeout=5) == recorded
    lines = known_hosts.read_text().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("|1|" if hashed else f"[{node.host}]:{node.port} ssh-ed25519 ")
    assert known_hosts.stat().st_mode & 0o777 == 0o600
    d = SshDispatcher([node.target()], client_key=fleet.client_key, known_hosts=known_hosts,
                      agent_dir=str(tmp_path / "agent-home"))
    async with d:
        assert (await d.hello(node.id))["agent_version"]


async def test_unknown_host_key_is_refused_with_its_fingerprint(fleet: SshdFleet, tmp_path: Path) -> None:
    node = fleet[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    d = SshDispatcher([node.target()], client_key=fleet.client_key, known_hosts=known_hosts, connect_timeout=5)
    async with d:
        with pytest.raises(HostKeyRejected) as info:
            await d.inventory(node.id)
    assert keygen_fingerprint(fleet, node.host) in str(info.value)
    assert "llmgw node trust" in str(info.value)
    assert known_hosts.read_text() == ""  # never auto-accepted


async def test_changed_host_key_is_refused_naming_both(fleet: SshdFleet, tmp_path: Path) -> None:
    node, other = fleet[0], fleet[1]
    # known_hosts claims node has other's key: what a reinstalled node (or an impostor) looks like
    other_pub = (str(fleet.env.host_key_path(other.host)) + ".pub")
    key_type, blob = Path(other_pub).read_text().split()[:2]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{node.host}]:{node.port} {key_type} {blob}\n")
    async with SshDispatcher([node.target()], client_key=fleet.client_key, known_hosts=known_hosts) as d:
        with pytest.raises(HostKeyRejected, match="changed") as info:
            await d.status(node.id)
    assert keygen_fingerprint(fleet, node.host) in str(info.value)
    assert keygen_fingerprint(fleet, other.host) in str(info.value)
    with pytest.raises(HostKeyRejected, match="changed"):
        trust(node.host, node.port, known_hosts, timeout=5)
    recorded = trust(node.host, node.port, known_hosts, replace=True, timeout=5)
    assert known_hosts.read_text() == f"[{node.host}]:{node.port} ssh-ed25519 {recorded.key_base64}\n"
    assert paramiko.HostKeys(str(known_hosts)).lookup(f"[{node.host}]:{node.port}")
