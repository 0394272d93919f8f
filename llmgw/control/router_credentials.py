"""Router credentials (issue 41): what a standalone router holds instead of the admin token.

A router needs two routes of the admin listener, the watch stream and its report; it used to
reach them with the admin token, so a compromised router host (the internet-facing tier) held
the keys to the whole fleet. A router credential opens those two routes and nothing else, names
its router (the reports it sends are that router's, whatever their body says), and is revoked
alone: ``llmgw routers create|list|revoke``.

Kept like API keys (llmgw.control.keys): made here, shown once, only its sha256 stored, in the
store's key records under a name no API key can have (``router:NAME``: ":" is outside a key
name), so one mechanism keeps both, another controller on the same store sees the same set, and
an API key can never be taken for a router credential or the other way round.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.access.roles import Principal
from llmgw.control.keys import NAME, ROUTER_RECORD, KeyRefused, is_router_record
from llmgw.router.keys import hash_key

PREFIX = "llmgw-router-"
KIND = "router"
RECORD = ROUTER_RECORD


@dataclass(frozen=True)
class MadeCredential:
    name: str
    credential: str  # shown once, never kept


class RouterCredentials:
    """The routers' credentials in the store; :meth:`who` is the admin listener's lookup."""

    def __init__(self, store: Any, *, clock: Callable[[], float] = time.time,
                 on_revoke: Callable[[str], None] | None = None) -> None:
        self._store = store
        self._clock = clock
        self.on_revoke = on_revoke  # the feed closes the router's watch and forgets its report
        self._by_digest: dict[str, str] = {}
        self._records: list[dict[str, Any]] = []

    def reload(self) -> None:
        """Read the store's records again (another controller may have made or revoked one)."""
        records = [e for e in self._store.api_keys() if is_router_record(e)]
        before = set(self._by_digest.items())
        self._records = records
        self._by_digest = {e["sha256"]: e["name"].removeprefix(RECORD)
                           for e in records if not e.get("revoked_at") and e.get("sha256")}
        # By credential, not by name: a name revoked and made again between two reloads (through
        # another controller) is a new credential, and the old one's watch must end all the same.
        for _digest, gone in before - set(self._by_digest.items()):
            if self.on_revoke is not None:
                self.on_revoke(gone)

    def who(self, credential: str) -> Principal | None:
        """The router ``credential`` names (with which credential it is), or None."""
        if not credential.startswith(PREFIX):
            return None
        digest = hash_key(credential)
        for known, name in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                return Principal(f"router:{name}", None, via="router", router=name, credential=digest)
        return None

    def live(self, name: str) -> bool:
        return name in self._by_digest.values()

    def live_credential(self, digest: str) -> bool:
        """The credential with this sha256 is still good (a name revoked and made again is not)."""
        return digest in self._by_digest

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": e["name"].removeprefix(RECORD), "created_at": e.get("created_at")}
                for e in self._records if not e.get("revoked_at")]

    def create(self, name: str) -> MadeCredential:
        if not NAME.fullmatch(name):
            raise KeyRefused(f"router name {name!r}: letters, digits, '.', '_' or '-', starting with a letter or "
                             "digit, at most 64 characters", 400)
        self.reload()
        if self.live(name):
            raise KeyRefused(f"a router credential named {name!r} exists; revoke it first, or choose another name")
        credential = PREFIX + secrets.token_urlsafe(32)
        record = RECORD + name
        entry = {"name": record, "kind": KIND, "sha256": hash_key(credential), "created_at": self._clock()}
        revoked = any(e["name"] == record for e in self._records)
        if not (self._store.replace_api_key(record, entry) if revoked else self._store.add_api_key(entry)):
            raise KeyRefused(f"a router credential named {name!r} exists; revoke it first, or choose another name")
        self.reload()
        return MadeCredential(name, credential)

    def revoke(self, name: str) -> None:
        self.reload()
        record = RECORD + name
        if not self.live(name) or not self._store.replace_api_key(
                record, {"name": record, "kind": KIND, "revoked_at": self._clock()}):
            raise KeyRefused(f"no router credential named {name!r}", 404)
        self.reload()
