"""`llmgw node trust HOST:PORT` records the key sshd really presents, and only that key."""

from __future__ import annotations

import subprocess

import paramiko

from tests.fixtures.sshd import sshd_env, sshd_fleet  # noqa: F401 - fixtures


def test_trust_prints_the_fingerprint_and_records_it(run_cli, sshd_fleet, sshd_env, tmp_path) -> None:  # noqa: F811
    node = sshd_fleet(1)[0]
    known = tmp_path / "known_hosts"
    expected = subprocess.run(["ssh-keygen", "-lf", str(sshd_env.host_key_path(node.host)) + ".pub"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.split()[1]
    # First the fingerprint, and nothing recorded until the operator has compared it (seen: recorded
    # first, then told to compare).
    code, out = run_cli("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known))
    assert code == 2 and f"{node.host}:{node.port} ssh-ed25519 {expected}" in out
    assert f"--fingerprint {expected}" in out and not known.exists()
    # Another fingerprint than the one presented: refused, nothing recorded.
    code, out = run_cli("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known),
                        "--fingerprint", "SHA256:" + "A" * 43)
    assert code == 1 and f"presents {expected}" in out and not known.exists()
    code, out = run_cli("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known),
                        "--fingerprint", expected)
    assert code == 0, out
    assert f"{node.host}:{node.port} ssh-ed25519 {expected}" in out
    keys = paramiko.HostKeys(str(known))
    assert keys.lookup(f"[{node.host}]:{node.port}") is not None
    # Trusting again is a no-op; a port with nothing listening is a clear error.
    assert run_cli("node", "trust", f"{node.host}:{node.port}", "--known-hosts", str(known), "--yes")[0] == 0
    code, out = run_cli("node", "trust", f"{node.host}:9", "--known-hosts", str(known), "--timeout", "2", "--yes")
    assert code == 1 and "cannot connect" in out
