"""`POST /api/v1/hooks/git`: a push notification from GitHub or Gitea triggers a fetch now.

The body is not trusted for anything but the signature: whatever it says, the
controller fetches and judges the branch itself, so a forged payload can at most cause
a fetch, and only with the secret.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.serving import read_plain

MAX_BODY = 5 * 1024 * 1024


def signature_ok(secret: bytes, body: bytes, headers: "web.BaseRequest | dict[str, str]") -> bool:
    """True when GitHub's ``X-Hub-Signature-256`` or Gitea's ``X-Gitea-Signature`` matches."""
    expected = hmac.new(secret, body, hashlib.sha256).hexdigest()
    get = headers.headers.get if isinstance(headers, web.BaseRequest) else headers.get
    github = get("X-Hub-Signature-256") or ""
    gitea = get("X-Gitea-Signature") or ""
    candidates = []
    if github.startswith("sha256="):
        candidates.append(github[len("sha256="):])
    if gitea:
        candidates.append(gitea)
    # compare_digest on every candidate: constant time in the secret's digest.
    # Bytes, not str: compare_digest raises TypeError on a non-ASCII str (a header with such
    # bytes would have been a 500, not a 401).
    return any(hmac.compare_digest(expected.encode(), c.strip().lower().encode("utf-8", "surrogateescape"))
               for c in candidates)


def webhook_handler(secret: str, trigger: Callable[[], None]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler: 401 without a valid signature (nothing triggered), 202 with one."""
    key = secret.encode("utf-8")

    async def handle(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY:
            return web.json_response({"error": "webhook body too large"}, status=413)
        body = await read_plain(request)  # a compressed body is a 415, not decompressed (nor a 500)
        if not key or not signature_ok(key, body, request):
            return web.json_response({"error": "missing or invalid webhook signature"}, status=401)
        trigger()
        return web.json_response({"status": "fetch scheduled"}, status=202)

    return handle
