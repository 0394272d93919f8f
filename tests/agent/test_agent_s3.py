"""s3:// sources against a real S3-compatible server (``rclone serve s3``, SigV4 checked): a
prefix and a single object land as complete cache entries; a wrong secret, a missing object and a
missing bucket fail naming the bucket and key, never the credentials; a fetch killed mid-object
resumes from the bytes it had; an object whose bytes do not match its ETag is not kept."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Iterator

import pytest

from llmgw.agent.parts.protocol import CHUNKS_NAME, MANIFEST_NAME, TMP_PREFIX, cache_name
from tests.agent.helpers import Node, fetch_workers, wait_for
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, S3Server, s3_server

WEIGHTS = os.urandom(3_000_000)


@pytest.fixture
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        server.put("weights", "models/tiny/config.json", b'{"layers": 2}')
        server.put("weights", "models/tiny/model.safetensors", WEIGHTS)
        server.put("weights", "models/tiny/tokenizer/vocab.txt", b"a\nb\n")
        server.put("weights", "models/tiny2/other.bin", b"not this model's")  # a sibling prefix
        server.put("weights", "gguf/smol-q4.gguf", WEIGHTS[:100_000])
        yield server


def s3_node(node: Node, s3: S3Server, secret: str = SECRET_KEY) -> Node:
    secret_file = node.root / "s3-secret"
    secret_file.write_text(secret + "\n")
    node.write_config(s3={"endpoint": s3.url, "region": "us-east-1", "access_key_id": ACCESS_KEY,
                          "secret_access_key_file": str(secret_file)})
    return node


def test_a_prefix_lands_as_a_complete_entry_and_a_single_object_under_its_name(node: Node, s3: S3Server) -> None:
    s3_node(node, s3)
    source = "s3://weights/models/tiny"
    done = node.fetch_settled({"source": source})
    assert done["state"] == "done", done
    entry = node.cache / cache_name(source)
    files = sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file())
    assert files == sorted([MANIFEST_NAME, CHUNKS_NAME, "config.json", "model.safetensors",
                            "tokenizer/vocab.txt"])  # not tiny2's
    assert (entry / "model.safetensors").read_bytes() == WEIGHTS
    assert json.loads((entry / MANIFEST_NAME).read_text())["source"] == source
    objects = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file() and p.name not in (MANIFEST_NAME,
                                                                                                CHUNKS_NAME))
    assert done["bytes_done"] == done["bytes_total"] == objects

    one = node.fetch_settled({"source": "s3://weights/gguf/smol-q4.gguf"})
    assert one["state"] == "done", one
    stored = node.cache / cache_name("s3://weights/gguf/smol-q4.gguf") / "smol-q4.gguf"
    assert stored.read_bytes() == WEIGHTS[:100_000]


def test_a_wrong_secret_is_refused_naming_the_bucket_and_key_never_the_credentials(node: Node,
                                                                                   s3: S3Server) -> None:
    s3_node(node, s3, secret="not-the-secret")
    failed = node.fetch_settled({"source": "s3://weights/models/tiny"})
    assert failed["state"] == "failed"
    assert "s3://weights/models/tiny" in failed["error"] and "access denied" in failed["error"], failed["error"]
    logs = "".join(p.read_text() for p in (node.state / "logs").rglob("*.log"))
    for secret in ("not-the-secret", SECRET_KEY):
        assert secret not in failed["error"] and secret not in logs
    assert not (node.cache / cache_name("s3://weights/models/tiny")).exists()


def test_a_missing_object_and_a_missing_bucket_say_so(node: Node, s3: S3Server) -> None:
    s3_node(node, s3)
    nothing = node.fetch_settled({"source": "s3://weights/models/absent"})
    assert nothing["state"] == "failed" and "s3://weights/models/absent: no object there" in nothing["error"], nothing
    no_bucket = node.fetch_settled({"source": "s3://no-such-bucket/models/tiny"})
    assert no_bucket["state"] == "failed" and "s3://no-such-bucket/models/tiny: not found" in no_bucket["error"], \
        no_bucket


def test_the_endpoint_and_credentials_are_the_nodes_not_the_catalogs(node: Node, s3: S3Server) -> None:
    # No credentials on the node: its requests go unsigned, to its own endpoint, which refuses them.
    node.write_config(s3={"endpoint": s3.url})
    failed = node.fetch_settled({"source": "s3://weights/models/tiny"})
    assert failed["state"] == "failed" and f"s3://weights/models/tiny: HTTP 400 from {s3.url}" in failed["error"]
    # A source cannot name another endpoint (userinfo, a host): the bucket is a bucket name.
    code, error = node.fail("fetch", {"source": "s3://weights@evil.example/x"})
    assert "s3://bucket/key-prefix" in error


def test_a_fetch_killed_mid_object_resumes_from_the_bytes_it_had(node: Node, s3: S3Server) -> None:
    s3_node(node, s3)
    big = os.urandom(6_000_000)
    s3.put("weights", "models/big/model.safetensors", big)
    source = "s3://weights/models/big"
    partial = node.cache / (TMP_PREFIX + cache_name(source)) / "model.safetensors"
    s3.proxy.delay = 0.02  # about 3 MB/s: the kill comes mid-object
    node.ok("fetch", {"source": source})
    wait_for(lambda: partial.exists() and partial.stat().st_size > 1_000_000, timeout=60)
    workers = wait_for(lambda: fetch_workers(node), timeout=30)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not fetch_workers(node), timeout=30)
    had = partial.stat().st_size
    assert 0 < had < len(big)
    s3.proxy.delay = 0.0
    first = len(s3.proxy.by_connection)  # the killed worker's connection may count a piece more
    done = node.fetch_settled({"source": source})
    assert done["state"] == "done", done["error"]
    assert (node.cache / cache_name(source) / "model.safetensors").read_bytes() == big
    # The rest of the object, a listing and headers: not what it had.
    again = sum(s3.proxy.by_connection[first:])
    assert again < len(big) - had + 100_000, (again, had)


def test_bytes_that_do_not_match_the_objects_etag_are_not_kept(node: Node, s3: S3Server) -> None:
    s3_node(node, s3)
    s3.proxy.spoil = True  # one byte flipped in every answer, past its first 64 KiB
    failed = node.fetch_settled({"source": "s3://weights/models/tiny"})
    assert failed["state"] == "failed" and "does not match its ETag" in failed["error"], failed
    assert not (node.cache / cache_name("s3://weights/models/tiny")).exists()
    s3.proxy.spoil = False
    done = node.fetch_settled({"source": "s3://weights/models/tiny"})
    assert done["state"] == "done"
    entry = node.cache / cache_name("s3://weights/models/tiny")
    assert hashlib.sha256((entry / "model.safetensors").read_bytes()).digest() == hashlib.sha256(WEIGHTS).digest()


def test_the_entry_is_what_the_listing_says_and_a_partial_file_of_another_version_is_read_whole(
        node: Node, s3: S3Server) -> None:
    """An earlier try left a file whose object is gone and a partial file of an older version of
    an object (its ETag on record): the entry holds the listed objects only, an empty object is a
    file, and the old partial bytes are not spliced with the new version (read whole, once)."""
    s3_node(node, s3)
    s3.put("weights", "models/tiny/empty.marker", b"")
    source = "s3://weights/models/tiny"
    tmp = node.cache / (TMP_PREFIX + cache_name(source))
    (tmp / "tokenizer").mkdir(parents=True)
    (tmp / "old.safetensors").write_bytes(b"from a key deleted since")
    (tmp / "model.safetensors").write_bytes(b"X" * 500_000)  # the first half-megabyte of another version
    (tmp / ".llmgw-s3-verified.json").write_text(json.dumps(
        {"models/tiny/model.safetensors": ["0" * 32, len(WEIGHTS), False]}))
    before = s3.proxy.sent
    done = node.fetch_settled({"source": source})
    assert done["state"] == "done", done
    entry = node.cache / cache_name(source)
    files = sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file())
    assert files == sorted([MANIFEST_NAME, CHUNKS_NAME, "config.json", "empty.marker", "model.safetensors",
                            "tokenizer/vocab.txt"])
    assert (entry / "model.safetensors").read_bytes() == WEIGHTS and (entry / "empty.marker").read_bytes() == b""
    assert s3.proxy.sent - before < len(WEIGHTS) * 1.2  # read once, whole


def test_a_key_in_the_agents_own_names_is_refused(node: Node, s3: S3Server) -> None:
    s3_node(node, s3)
    s3.put("weights", "models/tricky/.llmgw-s3-verified.json.new", b"x")
    failed = node.fetch_settled({"source": "s3://weights/models/tricky"})
    assert failed["state"] == "failed" and "no plain relative path" in failed["error"], failed
