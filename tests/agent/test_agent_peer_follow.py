"""Nodes follow the node that reads the origin (issue 42): node A reads a model over HTTP from an
origin the test holds half-way; B, told to follow A, reads A's first chunk while A still waits for
the origin, and has the whole entry once A does, the origin asked by A alone. A follower whose
leader stops, or serves a chunk that is not what it hashed, reads the origin itself."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import signal
import threading
import urllib.request
from pathlib import Path

from llmgw.agent.parts.protocol import CHUNKS_NAME, PEER_CHUNK, TMP_PREFIX, cache_name
from llmgw.engines.testing import free_port
from tests.agent.helpers import FileServer, Node, fetch_workers, wait_for
from tests.agent.test_agent_peer_fetch import get, other_node

BIG = os.urandom(2 * PEER_CHUNK + 12345)  # the origin holds back its second half: chunk 0 is there


def following(a: Node, source: str) -> dict:
    """The fetch request that has a node follow ``a`` (what the controller sends): A seeded while it
    reads, with the key it signs that node's lists with."""
    token, mac_key = secrets.token_urlsafe(32), secrets.token_hex(32)
    seed = a.ok("seed", {"name": cache_name(source), "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                         "ttl": 600, "mac_key": mac_key})
    assert seed.get("growing") is True and "chunks_sha256" not in seed, seed
    return {"source": source, "peer": {"url": seed["url"], "token": token, "follow": True, "mac_key": mac_key}}


def state_of(n: Node, source: str) -> str | None:
    return next((f["state"] for f in n.ok("status")["fetches"] if f["name"] == cache_name(source)), None)


def started_reading(node: Node, file_server: FileServer, path: str) -> tuple[str, threading.Event]:
    """``node`` (serving peers) reads ``path`` from the origin, which holds its second half back."""
    node.write_config(peer_port=free_port(), fabric_address="127.0.0.1")
    file_server.files[path] = BIG
    gate = file_server.hold[path] = threading.Event()
    source = f"{file_server.url}{path}"
    assert node.ok("fetch", {"source": source})["state"] == "running"
    return source, gate


def test_a_follower_reads_chunks_as_the_origin_reader_has_them(node: Node, file_server: FileServer,
                                                               tmp_path: Path) -> None:
    source, gate = started_reading(node, file_server, "/m.safetensors")
    name = cache_name(source)
    wait_for(lambda: (node.state / "growing" / f"{name}.json").exists(), timeout=60)
    b = other_node(tmp_path / "b", reads=[])
    request = following(node, source)
    assert b.ok("fetch", request)["state"] == "running"
    partial = b.cache / (TMP_PREFIX + name) / "m.safetensors"
    # B holds A's first chunk while A still waits for the origin's second half.
    wait_for(lambda: partial.exists() and partial.stat().st_size >= PEER_CHUNK, timeout=120)
    assert state_of(node, source) == "running"
    gate.set()
    wait_for(lambda: state_of(b, source) in ("done", "failed"), timeout=120)
    assert state_of(b, source) == "done"
    assert (b.cache / name / "m.safetensors").read_bytes() == BIG
    assert [p for p, _range in file_server.requests] == ["/m.safetensors"]  # A's read alone
    # B's list is A's: it serves the next node with the digest the controller kept from A.
    assert json.loads((b.cache / name / CHUNKS_NAME).read_text()) == \
        json.loads((node.cache / name / CHUNKS_NAME).read_text())
    assert b.ok("fetch", {"source": source})["chunks_sha256"] == node.ok("fetch", {"source": source})["chunks_sha256"]
    assert not (node.state / "growing" / f"{name}.json").exists()  # A's record goes with its fetch
    assert not list((b.cache / name).glob("*.part"))


def test_the_growing_record_opens_to_its_token_only_and_within_the_download(node: Node,
                                                                            file_server: FileServer) -> None:
    source, gate = started_reading(node, file_server, "/g.safetensors")
    name = cache_name(source)
    request = following(node, source)
    url, token = request["peer"]["url"], request["peer"]["token"]
    wait_for(lambda: get(f"{url}/v1/{name}/growing/0?path=g.safetensors", token) == 200, timeout=120)
    # The sums come signed with the key the controller gave with the token, and only with it.
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/{name}/growing",
                                                       headers={"Authorization": f"Bearer {token}"}), timeout=30) as r:
        body, said = r.read(), r.headers["X-Llmgw-Signature"]
    assert said == hmac.new(bytes.fromhex(request["peer"]["mac_key"]), body, hashlib.sha256).hexdigest()
    assert get(f"{url}/v1/{name}/growing", None) == 403
    assert get(f"{url}/v1/{name}/growing", "not-the-token") == 403
    assert get(f"{url}/v1/{name}/growing/1?path=g.safetensors", token) == 404  # not there yet
    for bad in ("../../etc/passwd", "/etc/passwd", "llmgw-manifest.json", "nothing"):
        assert get(f"{url}/v1/{name}/growing/0?path={bad}", token) == 404, bad
    # A link planted in the download's directory is not followed, whatever its name.
    (node.cache / (TMP_PREFIX + name) / "link").symlink_to("/etc/passwd")
    assert get(f"{url}/v1/{name}/growing/0?path=link", token) == 404
    gate.set()
    wait_for(lambda: state_of(node, source) == "done", timeout=120)
    assert get(f"{url}/v1/{name}/growing/0?path=g.safetensors", token) == 404  # complete: read its list


def test_a_follower_reads_the_origin_when_its_leader_stops(node: Node, file_server: FileServer,
                                                           tmp_path: Path) -> None:
    source, gate = started_reading(node, file_server, "/s.safetensors")
    name = cache_name(source)
    wait_for(lambda: (node.state / "growing" / f"{name}.json").exists(), timeout=60)
    b = other_node(tmp_path / "b", reads=[])
    b.ok("fetch", following(node, source))
    partial = b.cache / (TMP_PREFIX + name) / "s.safetensors"
    wait_for(lambda: partial.exists() and partial.stat().st_size >= PEER_CHUNK, timeout=120)
    for pid in fetch_workers(node):
        os.kill(pid, signal.SIGKILL)  # A's fetch dies with its chunk 0 served
    gate.set()
    wait_for(lambda: state_of(b, source) in ("done", "failed"), timeout=120)
    assert state_of(b, source) == "done"
    assert (b.cache / name / "s.safetensors").read_bytes() == BIG
    log = (b.state / "logs" / "fetches" / f"{name}.log").read_text()
    assert "stopped before it had the entry" in log and "reading the origin" in log
    # B's own read of the origin went on from the chunk it had verified (against sums A signed).
    assert ("/s.safetensors", f"bytes={PEER_CHUNK}-") in file_server.requests  # from its verified chunk on


def test_a_follower_takes_nothing_its_leader_did_not_sign(node: Node, file_server: FileServer,
                                                          tmp_path: Path) -> None:
    """Whoever answers at the followed node's address (a spoofed address, a port taken while its
    server was down) could send any sums and list: without the key the controller gave the two
    nodes, they are not signed, and the follower reads the origin instead, keeping none of it."""
    source, gate = started_reading(node, file_server, "/v.safetensors")
    name = cache_name(source)
    wait_for(lambda: (node.state / "growing" / f"{name}.json").exists(), timeout=60)
    b = other_node(tmp_path / "b", reads=[])
    request = following(node, source)
    request["peer"]["mac_key"] = "0" * 64  # not the key A signs with
    b.ok("fetch", request)
    gate.set()
    wait_for(lambda: state_of(b, source) in ("done", "failed"), timeout=120)
    assert state_of(b, source) == "done"
    assert (b.cache / name / "v.safetensors").read_bytes() == BIG  # the origin's, read by B itself
    log = (b.state / "logs" / "fetches" / f"{name}.log").read_text()
    assert "not signed by the node the controller named" in log and "reading the origin" in log
    assert [r for p, r in file_server.requests if p == "/v.safetensors"] == [None, None]  # A's and B's, whole




def test_a_follower_started_again_reads_a_chunk_torn_meanwhile_again(
        node: Node, file_server: FileServer, tmp_path: Path) -> None:
    """A follower's fetch killed (or its node rebooted) and run again hashes the chunks it had
    again against their sums before it goes on from them: one spoiled meanwhile (a write torn by
    the power going) is read again, never kept."""
    source, gate = started_reading(node, file_server, "/t.safetensors")
    name = cache_name(source)
    wait_for(lambda: (node.state / "growing" / f"{name}.json").exists(), timeout=60)
    b = other_node(tmp_path / "b", reads=[])
    request = following(node, source)
    b.ok("fetch", request)
    partial = b.cache / (TMP_PREFIX + name) / "t.safetensors"
    wait_for(lambda: partial.exists() and partial.stat().st_size >= PEER_CHUNK, timeout=120)
    for pid in fetch_workers(b):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not fetch_workers(b), timeout=30)
    with open(partial, "r+b") as fh:  # the "reboot": a block of the verified chunk lost
        fh.seek(4096)
        fh.write(b"\0" * 4096)
    assert b.ok("fetch", request)["state"] == "running"  # the controller asks again: the same follow
    gate.set()
    wait_for(lambda: state_of(b, source) in ("done", "failed"), timeout=120)
    assert state_of(b, source) == "done"
    assert (b.cache / name / "t.safetensors").read_bytes() == BIG
    assert [p for p, _range in file_server.requests] == ["/t.safetensors"]  # A's read alone
