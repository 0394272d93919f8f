"""Trust on an operator's word: fetch a node's host key and record it in known_hosts.

The SSH transport never accepts a host key it does not already know (a fleet of GPU machines is
exactly what a man in the middle would want to impersonate), so adding a node takes one explicit
step, ``llmgw node trust HOST[:PORT]``, which shows the fingerprint and records the key. A key
that differs from the one already recorded is refused unless the caller asks to replace it: a
changed key is either a reinstalled node or an attack, and only the operator can tell which.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import paramiko

from llmgw.errors import HostKeyRejected, NodeUnreachable


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as ``ssh-keygen -l`` prints it: ``SHA256:<base64, no padding>``."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_name(host: str, port: int) -> str:
    """The name OpenSSH files a host under: ``host`` on port 22, ``[host]:port`` otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


@dataclass(frozen=True)
class HostKey:
    """A node's host key as seen on the wire."""

    host: str
    port: int
    key_type: str
    key_base64: str
    fingerprint: str

    @classmethod
    def of(cls, host: str, port: int, key: paramiko.PKey) -> HostKey:
        return cls(host, port, key.get_name(), key.get_base64(), fingerprint(key))


def fetch_host_key(host: str, port: int = 22, *, timeout: float = 10.0) -> HostKey:
    """Connect, run the key exchange only (no authentication), and return the server's host key."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise NodeUnreachable(f"{host}:{port}: cannot connect: {exc}") from exc
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        return HostKey.of(host, port, transport.get_remote_server_key())
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise NodeUnreachable(f"{host}:{port}: SSH handshake failed: {exc}") from exc
    finally:
        transport.close()
        sock.close()


def trust(
    host: str,
    port: int,
    known_hosts_path: str | os.PathLike[str],
    *,
    hashed: bool = False,
    replace: bool = False,
    timeout: float = 10.0,
    expect: str | None = None,
) -> HostKey:
    """Fetch the node's host key and record it in ``known_hosts_path``; return what was recorded.
    ``expect``: the fingerprint the operator read on the node; the key is recorded only if it is the
    one presented.

    Already recorded with the same key: nothing is written. Recorded with a different key:
    ``HostKeyRejected`` naming both fingerprints, unless ``replace`` (then the old entries for this
    host are dropped). The file is rewritten through a temporary file and a rename, so a reader
    never sees half of it.
    """
    key = fetch_host_key(host, port, timeout=timeout)
    if expect is not None and key.fingerprint != expect.strip():
        raise HostKeyRejected(f"{host}:{port} presents {key.fingerprint}, not {expect.strip()}: nothing recorded "
                              "(a wrong copy, another machine at that address, or someone in between)")
    path = Path(known_hosts_path)
    name = known_hosts_name(host, port)
    known = paramiko.HostKeys()
    if path.exists():
        known.load(str(path))
    recorded = known.lookup(name) or {}
    if key.key_type in recorded:
        if recorded[key.key_type].get_base64() == key.key_base64:
            return key
        if not replace:
            raise HostKeyRejected(
                f"{name}: the host key changed: the node presents {key.fingerprint}, {path} has "
                f"{fingerprint(recorded[key.key_type])}; if the node was reinstalled, trust it again "
                "with replace"
            )
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    if replace:
        lines = [line for line in lines if not _names_host(line, name)]
    entry_name = paramiko.HostKeys.hash_host(name) if hashed else name
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    lines.append(f"{entry_name} {key.key_type} {key.key_base64}\n")
    _write_atomically(path, "".join(lines))
    return key


def _names_host(line: str, name: str) -> bool:
    """Whether a known_hosts line (plain or hashed) is an entry for ``name``."""
    fields = line.split()
    if len(fields) < 3 or line.lstrip().startswith("#"):
        return False
    for pattern in fields[0].split(","):
        if pattern.startswith("|1|"):
            if paramiko.HostKeys.hash_host(name, pattern) == pattern:
                return True
        elif pattern == name:
            return True
    return False


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
