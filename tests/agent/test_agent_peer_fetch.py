"""Nodes fetch from each other: node A holds a complete entry, the controller (here the test) has
A `seed` it for a token, and node B reads it from A's peer server chunk by chunk, each chunk
checked against A's chunk list, whose digest B is handed with the fetch. B's own origin is out
of its reach in the first test, so an entry done on B came from A. A's server answers only
token holders, only for complete entries; a peer that lies about a chunk or its list is caught
and the origin read instead."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path

from llmgw.agent.parts.protocol import CHUNKS_NAME, PEER_CHUNK, cache_name
from llmgw.engines.testing import free_port
from tests.agent.helpers import Node, wait_for

BIG = os.urandom(2 * PEER_CHUNK + 12345)  # three chunks, the last one short


def other_node(root: Path, *, reads: list[str]) -> Node:
    """A second node under ``root``; ``reads``: the local sources it may read (its origin)."""
    paths = {name: root / name for name in ("cache", "models", "state", "bin")}
    for path in paths.values():
        path.mkdir(parents=True)
    made = Node(root=root, config=root / "agent.json", ports=(31000, 31011), **paths)
    made.write_config(cache_dir=str(made.cache), state_dir=str(made.state), model_dirs=[str(made.models)],
                      port_range=[31000, 31011], advertise_address="127.0.0.1", engines={},
                      gpus=[{"index": 0, "class": "h100", "memory_gb": 80}], local_sources=reads, sandbox="none")
    return made


def seeded(a: Node, src: Path) -> tuple[str, dict, str]:
    """A holds ``src`` as an entry and seeds it: (its name, the seed's answer, the token)."""
    a.write_config(peer_port=free_port(), fabric_address="127.0.0.1")
    a.fetch_until_done(str(src))
    name = cache_name(str(src))
    token = secrets.token_urlsafe(32)
    answer = a.ok("seed", {"name": name, "token_sha256": hashlib.sha256(token.encode()).hexdigest(), "ttl": 600})
    return name, answer, token


def weights(root: Path) -> Path:
    src = root / "weights"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(BIG)
    (src / "sub" / "config.json").write_text('{"layers": 2}')
    return src


def get(url: str, token: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_a_node_reads_an_entry_from_a_peer_chunk_by_chunk(node: Node, tmp_path: Path) -> None:
    src = weights(node.root)
    name, seed, token = seeded(node, src)
    b = other_node(tmp_path / "b", reads=[str(tmp_path / "b")])  # A's copy of the origin is not B's to read
    done = b.fetch_settled({"source": str(src), "peer": {"url": seed["url"], "token": token,
                                                    "chunks_sha256": seed["chunks_sha256"]}})
    assert done["state"] == "done", done
    entry = b.cache / name
    assert (entry / "model.safetensors").read_bytes() == BIG
    assert (entry / "sub" / "config.json").read_text() == '{"layers": 2}'
    # B keeps the list it checked: it can serve the entry to the next node with the same digest.
    assert json.loads((entry / CHUNKS_NAME).read_text()) == json.loads((node.cache / name / CHUNKS_NAME).read_text())


def test_the_peer_serves_only_token_holders_and_only_complete_entries(node: Node) -> None:
    src = weights(node.root)
    name, seed, token = seeded(node, src)
    url = seed["url"]
    assert get(f"{url}/v1/{name}/chunks", token) == 200
    assert get(f"{url}/v1/{name}/chunks", None) == 403
    assert get(f"{url}/v1/{name}/chunks", "not-the-token") == 403
    assert get(f"{url}/v1/{name}/0/0", token) == 200 and get(f"{url}/v1/{name}/0/99", token) == 404
    other = cache_name("/somewhere/else")
    assert get(f"{url}/v1/{other}/chunks", token) == 403  # the token opens its own entry only
    for path in ("/v1/../../etc/passwd", f"/v1/.tmp-{name}/chunks", "/etc/passwd", f"/v1/{name}/..%2f..%2fetc/0"):
        assert get(url + path, token) in (403, 404), path
    short = secrets.token_urlsafe(16)
    node.ok("seed", {"name": name, "token_sha256": hashlib.sha256(short.encode()).hexdigest(), "ttl": 0.5})
    wait_for(lambda: get(f"{url}/v1/{name}/chunks", short) == 403, timeout=30)  # expired
    code, error = node.fail("seed", {"name": other, "token_sha256": "0" * 64})
    assert "neither a complete cache entry" in error


def test_a_peer_that_lies_is_caught_and_the_origin_read(node: Node, tmp_path: Path) -> None:
    src = weights(node.root)
    name, seed, token = seeded(node, src)
    b = other_node(tmp_path / "b", reads=[str(node.root)])  # B may read the origin this time
    # A's copy spoiled after it was listed: chunk 1 of the model no longer matches the list.
    served = node.cache / name / "model.safetensors"
    served.chmod(0o644)
    with open(served, "r+b") as fh:
        fh.seek(PEER_CHUNK + 7)
        fh.write(b"\xff")
    done = b.fetch_settled({"source": str(src), "peer": {"url": seed["url"], "token": token,
                                                    "chunks_sha256": seed["chunks_sha256"]}})
    assert done["state"] == "done", done
    assert (b.cache / name / "model.safetensors").read_bytes() == BIG  # the origin's, not the lie
    log = (b.state / "logs" / "fetches" / f"{name}.log").read_text()
    assert "chunk 1 of model.safetensors from the peer does not match its list" in log
    assert "reading the origin" in log and token not in log
    # A list that is not the one the controller was told of is refused before any chunk.
    c = other_node(tmp_path / "c", reads=[str(node.root)])
    done = c.fetch_settled({"source": str(src), "peer": {"url": seed["url"], "token": token,
                                                    "chunks_sha256": "0" * 64}})
    assert done["state"] == "done"
    assert "not the one the controller was told of" in (c.state / "logs" / "fetches" / f"{name}.log").read_text()


def test_seed_needs_a_peer_port(node: Node) -> None:
    code, error = node.fail("seed", {"name": cache_name("/x"), "token_sha256": "0" * 64})
    assert "peer_port" in error
