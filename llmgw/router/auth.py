"""The first stage: who is asking. A router with keys configured serves only a request that
carries one of them (``Authorization: Bearer <key>``); an open router (no keys) serves anyone.
What a key may use (its models) is checked once the model is known; its tenant's limits at
admission (:mod:`llmgw.router.admit`).
"""

from __future__ import annotations

from aiohttp import web

from llmgw.router import respond
from llmgw.router.keys import ApiKey, KeyRing


def authenticate(keys: KeyRing, request: web.Request) -> tuple[ApiKey | None, web.Response | None]:
    """The key the request carries (None on an open router), or the 401 to answer."""
    if keys.open:
        return None, None
    header = request.headers.get("Authorization")
    key = keys.authenticate(header)
    if key is None:
        why = "No API key was given" if not header else "The API key is not valid"
        return None, respond.unauthorized(f"{why}: send `Authorization: Bearer <key>` with a key "
                                          "configured for this router.")
    return key, None
