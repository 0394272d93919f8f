"""Bad bytes from outside get a clear 401, never a 500: an Authorization header or a webhook
signature that is not ASCII (seen: a traceback in the token compare and in the HMAC compare)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

from tests.admin.conftest import Running

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
