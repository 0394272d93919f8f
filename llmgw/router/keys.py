"""API keys: who may call the router, and for which models.

Keys are stored as sha256 hex digests (the controller config, or ``--api-keys FILE`` for a
standalone router), never in clear, so a leaked config does not leak a usable key. Each entry
names the models it may use, by canonical name or alias, or ``"*"`` for all::

    - {name: team-a, sha256: 9f86d0…, models: ["*"]}
    - {name: search, sha256: 2c26b4…, models: [embed-small, chat-fast], tenant: search-team}

With **no keys configured the router is open**: every request is served without a key. That
is the single-machine default (`llmgw up`); a fleet reachable by others should configure keys.

A request's ``Authorization: Bearer <key>`` is hashed and compared with every stored digest by
:func:`hmac.compare_digest`, without stopping at the first match, so the time taken does not
tell an attacker how many leading bytes of some digest they guessed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog.model import Tenant
from llmgw.errors import ConfigError
from llmgw.router.routes import RouteModel

ALL_MODELS = "*"


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # sha256 of the key
    models: frozenset[str]  # names or aliases; "*" = every model
    # The tenant it was made for (`llmgw keys create --tenant`), unless a catalog tenant names it:
    # git's word wins (:func:`with_key_tenants`).
    tenant: str | None = None

    def allows(self, model: RouteModel) -> bool:
        """May this key use ``model``? Listing any of its names (canonical or alias) is enough.

        A request served by one of the model's fallbacks is allowed too: the key was checked
        against the model the client asked for, and the fallback is the operator's substitute.
        """
        return ALL_MODELS in self.models or not self.models.isdisjoint(model.names)


def hash_key(plaintext: str) -> str:
    """The sha256 hex digest to store for ``plaintext`` (what an operator puts in the config)."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


class KeyRing:
    """The configured keys; empty means open."""

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys: tuple[ApiKey, ...] = tuple(keys)

    @property
    def open(self) -> bool:
        return not self.keys

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key presented in an ``Authorization`` header value, or None when it is missing,
        not a Bearer token, or matches no stored digest."""
        if not authorization or authorization[:7].lower() != "bearer ":
            return None
        token = authorization[7:].strip()
        if not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return found

    @classmethod
    def from_entries(cls, entries: Sequence[Any], *, where: str = "api keys", strict: bool = True) -> KeyRing:
        """Keys from raw entries (config file or controller config); raises ConfigError on a bad one.
        ``strict``: an unknown field is an error (a misspelt "models" in a file a person wrote);
        not for the controller's snapshot, where it is a field a newer controller sends (seen: a
        router one version behind refused every snapshot once a key had a tenant, and went on
        honouring revoked keys)."""
        keys = []
        for i, raw in enumerate(entries):
            if not isinstance(raw, dict):
                raise ConfigError(f"{where}[{i}]: expected a mapping with sha256 and models")
            # A misspelt "models" would otherwise leave the key its default: every model.
            unknown = sorted(str(k) for k in set(raw) - {"name", "sha256", "models", "tenant"})
            if unknown and strict:
                raise ConfigError(f"{where}[{i}]: unknown key(s): {', '.join(unknown)} "
                                  "(known: models, name, sha256, tenant)")
            tenant = raw.get("tenant")
            if tenant is not None and (not isinstance(tenant, str) or not tenant):
                raise ConfigError(f"{where}[{i}]: tenant must be a tenant's name")
            digest = raw.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ConfigError(f"{where}[{i}]: sha256 must be 64 hex digits (the key's sha256, not the key)")
            try:
                raw_digest = bytes.fromhex(digest)
            except ValueError as exc:
                raise ConfigError(f"{where}[{i}]: sha256 is not hex") from exc
            models = raw.get("models", [ALL_MODELS])
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ConfigError(f"{where}[{i}]: models must be a list of model names or aliases, or ['*']")
            name = raw.get("name") or f"key-{i}"
            keys.append(ApiKey(name=str(name), digest=raw_digest, models=frozenset(models), tenant=tenant))
        return cls(keys)

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """Keys from a YAML or JSON file: a list of entries, or ``{"api_keys": [...]}``."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read API keys: {exc.strerror}") from exc
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"{p}: not valid YAML/JSON: {exc}") from exc
        if isinstance(data, dict):
            data = data.get("api_keys", data.get("keys"))
        if data is None:
            data = []
        if not isinstance(data, list):
            raise ConfigError(f"{p}: expected a list of API keys or a mapping with api_keys")
        return cls.from_entries(data, where=str(p))


def with_key_tenants(tenants: Sequence[Tenant], keys: Iterable[ApiKey]) -> tuple[Tenant, ...]:
    """The catalog's tenants with the keys made for a tenant (``ApiKey.tenant``) added to it; a
    tenant the catalog does not define is one with no limits (its use is still the tenant's in the
    ledger). A key a catalog tenant names stays that tenant's: git is the truth."""
    named = {k for t in tenants for k in t.keys}
    extra: dict[str, list[str]] = {}
    for key in keys:
        if key.tenant and key.name not in named:
            extra.setdefault(key.tenant, []).append(key.name)
    if not extra:
        return tuple(tenants)
    out = [replace(t, keys=(*t.keys, *extra.pop(t.name, ()))) for t in tenants]
    return (*out, *(Tenant(name, tuple(names)) for name, names in sorted(extra.items())))
