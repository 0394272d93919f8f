"""Bad bytes from outside get a clear 4xx, never a 500: an Authorization header or a webhook
signature that is not ASCII (seen: a traceback in the token compare and in the HMAC compare), a
JSON body nested deeper than any request (seen: a traceback after the parse)."""

from __future__ import annotations

import gzip
import socket
from urllib.parse import urlsplit

import pytest

from tests.admin.conftest import TOKEN, Running

pytestmark = pytest.mark.slow


def raw_request(url: str, request: bytes) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):  # every request here ends with the connection closed
            data += chunk
    return data


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe\xe9t\xc3", b"Bearer \xe2\x82\xac-token", b"\xff"])
def test_a_non_latin1_bearer_token_is_401(running: Running, value: bytes) -> None:
    answer = raw_request(running.url, b"GET /api/v1/summary HTTP/1.1\r\nHost: x\r\nAuthorization: " + value
                         + b"\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize("header", [b"X-Hub-Signature-256: sha256=\xe9\xe9\xe9", b"X-Gitea-Signature: \xff\xfe"])
def test_a_webhook_signature_with_non_ascii_bytes_is_401(running: Running, header: bytes) -> None:
    body = b"{}"
    answer = raw_request(running.url, b"POST /api/v1/hooks/git HTTP/1.1\r\nHost: x\r\n" + header
                         + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
                         + body)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_bytes_the_http_parser_rejects_get_the_admin_apis_json_error(running: Running) -> None:
    answer = raw_request(running.url, b"GET /api/v1/summary HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000
                         + b"\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head[9:12] == b"400" and b"application/json" in head, answer[:300]
    assert b'"error": "The request is not valid HTTP/1.1' in body


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Every route of the admin listener that reads a JSON body, with a body it would otherwise take.
JSON_ROUTES = [
    ("/api/v1/sync", b'{"allow_prune": false, "x": %s}'),
    ("/api/v1/nodes/node-0/state", b'{"state": "ready", "x": %s}'),
    ("/api/v1/nodes/node-0/takeover", b'{"x": %s}'),
    ("/api/v1/models", b'{"name": "deep", "x": %s}'),
    ("/api/v1/weights/collect", b'{"paths": %s}'),
    ("/api/v1/router/report", b'{"router_id": "r1", "last_used": {}, "demand": %s}'),  # the routers' reports
]


@pytest.mark.parametrize("depth", [100, 976, 100_000])
def test_deep_json_is_a_400_naming_the_limit_on_every_admin_route(running: Running, depth: int) -> None:
    """A body 976 levels deep passed the parse and failed later, as a 500 with a traceback."""
    head = running.controller.desired.catalog
    for path, shape in JSON_ROUTES:
        body = shape % nested(depth)
        answer = raw_request(running.url, b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                             b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                             % (path.encode(), TOKEN.encode(), len(body), body))
        status, _, rest = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400"), (path, answer[:300])
        assert b"more than 64 levels deep (the limit)" in rest, (path, rest[:300])
    assert running.controller.desired.catalog is head  # nothing was committed or applied


@pytest.mark.parametrize("body", [gzip.compress(b'{"allow_prune": false}', mtime=0), b"not gzip at all"],
                         ids=["gzip", "not-gzip"])  # mtime=0, ids: xdist's workers must collect the same tests
def test_a_compressed_body_is_a_415_on_every_admin_route_that_reads_one(running: Running, body: bytes) -> None:
    """aiohttp decompresses request bodies (size limits then apply to what comes out), and one that
    does not decompress was a 500 with a traceback, also on the unauthenticated webhook. No client
    of llmgw compresses a body: every route refuses one, saying so."""
    head = running.controller.desired.catalog
    for path in [p for p, _ in JSON_ROUTES] + ["/api/v1/hooks/git"]:
        answer = raw_request(running.url, b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                             b"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (path.encode(), TOKEN.encode(), len(body), body))
        status, _, rest = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 415") and b"application/json" in status, (path, answer[:300])
        assert b"Content-Encoding `gzip` are not accepted" in rest, (path, rest[:300])
    assert running.controller.desired.catalog is head  # nothing was committed or applied
