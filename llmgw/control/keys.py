"""API keys without a text editor: `llmgw keys create|list|revoke`.

A key is made here, shown once, and only its sha256 is kept, in the controller's store (outside
git: a catalog is read by every reviewer of a pull request). The keys every router checks are the
controller config's `api_keys` and these together; a change reaches the controller's own router at
once and standalone routers with their next snapshot, without a restart (seen: a key added to
controller.yaml was `invalid_api_key` until the controller restarted).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmgw.catalog import Catalog
from llmgw.errors import LlmgwError
from llmgw.router.keys import ALL_MODELS, hash_key

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # whole: fullmatch (a "$" lets a "\n" end it)
CLOSED = "(no key: the last one was revoked)"
PREFIX = "llmgw-"  # a made key says what it is (secret scanners and people can tell it apart)
# Router credentials (llmgw.control.router_credentials) are kept among the key records under this
# prefix, which no key name can start with (":" is not in NAME): never an API key.
ROUTER_RECORD = "router:"


def is_router_record(entry: dict[str, Any]) -> bool:
    return str(entry.get("name", "")).startswith(ROUTER_RECORD)


class KeyRefused(LlmgwError):
    """A key request that cannot be done (a name taken, none such, a config key); ``status``: the
    admin API's answer."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Made:
    name: str
    key: str  # shown once, never kept
    models: tuple[str, ...]
    tenant: str | None = None


class KeyBook:
    """The controller config's keys and the store's, as one list for every router."""

    def __init__(self, config: Sequence[Mapping[str, Any]], store: Any, *,
                 on_change: Callable[[list[dict[str, Any]]], None],
                 clock: Callable[[], float] = time.time) -> None:
        self._config = [dict(e) for e in config]
        self._store = store
        self._on_change = on_change
        self._clock = clock
        self._made: list[dict[str, Any]] = []  # the store's records, revoked ones included
        # The digest of a key never made (see entries): random, never kept.
        self._closed_digest = hash_key(secrets.token_urlsafe(32))

    def reload(self) -> None:
        """Read the store's keys again (another controller on the same store may have made one)."""
        made = [e for e in self._store.api_keys() if not is_router_record(e)]
        if made != self._made:
            self._made = made
            self._on_change(self.entries())

    @property
    def _active(self) -> list[dict[str, Any]]:
        return [e for e in self._made if not e.get("revoked_at")]

    def entries(self) -> list[dict[str, Any]]:
        """Every key as routers take them: ``{name, sha256, models}``. With none left after a
        revocation, one no one holds: a router with no keys serves anyone, and revoking the last
        (perhaps leaked) key must not open it to the world."""
        keys = [{"name": e.get("name"), "sha256": e["sha256"], "models": list(e.get("models") or [ALL_MODELS]),
                 **({"tenant": e["tenant"]} if e.get("tenant") else {})}
                for e in [*self._config, *self._active]]
        if not keys and self._made:
            keys = [{"name": CLOSED, "sha256": self._closed_digest, "models": []}]
        return keys

    def names(self) -> set[str]:
        return {str(e.get("name")) for e in [*self._config, *self._active] if e.get("name")}

    def listing(self) -> list[dict[str, Any]]:
        """For `llmgw keys list`: names, models, where each is kept, when it was made; no digest."""
        out = [{"name": e.get("name"), "models": list(e.get("models") or [ALL_MODELS]), "source": "config",
                "created_at": None, "tenant": e.get("tenant")} for e in self._config]
        out += [{"name": e["name"], "models": list(e.get("models") or [ALL_MODELS]), "source": "store",
                 "created_at": e.get("created_at"), "tenant": e.get("tenant")} for e in self._active]
        return out

    def create(self, name: str, models: Sequence[str] = (ALL_MODELS,), tenant: str | None = None) -> Made:
        if not NAME.fullmatch(name):
            raise KeyRefused(f"key name {name!r}: letters, digits, '.', '_' or '-', starting with a letter or digit, "
                             "at most 64 characters", 400)
        if tenant is not None and not NAME.fullmatch(tenant):
            raise KeyRefused(f"tenant {tenant!r}: letters, digits, '.', '_' or '-', starting with a letter or digit, "
                             "at most 64 characters", 400)
        models = tuple(models) or (ALL_MODELS,)
        if not all(isinstance(m, str) and m for m in models):
            raise KeyRefused("models: a list of model names or aliases, or '*'", 400)
        if name in self.names():
            raise KeyRefused(f"a key named {name!r} exists; revoke it first, or choose another name")
        key = PREFIX + secrets.token_urlsafe(32)
        entry = {"name": name, "sha256": hash_key(key), "models": list(models), "created_at": self._clock(),
                 **({"tenant": tenant} if tenant else {})}
        revoked = next((e for e in self._made if e["name"] == name and e.get("revoked_at")), None)
        done = self._store.replace_api_key(name, entry) if revoked else self._store.add_api_key(entry)
        if not done:
            raise KeyRefused(f"a key named {name!r} exists; revoke it first, or choose another name")
        self.reload()
        return Made(name, key, models, tenant)

    def revoke(self, name: str) -> None:
        if any(e.get("name") == name for e in self._config):
            raise KeyRefused(f"key {name!r} is in the controller config (api_keys): remove it there and restart")
        entry = next((e for e in self._active if e["name"] == name), None)
        # Kept as a tombstone (its digest dropped): the name may be made again, and the router
        # stays closed when it was the last key.
        if entry is None or not self._store.replace_api_key(name, {"name": name, "revoked_at": self._clock()}):
            raise KeyRefused(f"no key named {name!r}", 404)
        self.reload()


def tenants_overruled(catalog: Catalog | None, entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each key made for one tenant that a catalog tenant names for another, in words: the
    catalog's word wins (git is the truth), and the operator who made it should know."""
    if catalog is None:
        return []
    whose = {k: t.name for t in catalog.settings.tenants for k in t.keys}
    return [f'key "{e["name"]}" was made for tenant "{e["tenant"]}", but the catalog\'s tenant "{whose[e["name"]]}" '
            "names it: it counts as that one's"
            for e in entries if e.get("tenant") and e.get("name") in whose and whose[e["name"]] != e["tenant"]]
