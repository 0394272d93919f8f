"""The controller's own configuration: what stays out of git.

A local YAML file (`llmgw controller --config FILE`). Every secret can also come from an
environment variable (which wins) or a file, so the YAML itself can be committed to an
ops repository without them. Secrets are never logged or returned by the API.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from llmgw.access.oidc import OidcConfig, Refused, check_url, loopback
from llmgw.access.roles import Role
from llmgw.catalog.durations import DurationError, parse_duration
from llmgw.control.leadership import LeadershipConfig
from llmgw.errors import ConfigError
from llmgw.gitops.commit_status import CommitStatusConfig
from llmgw.paths import default_data_dir
from llmgw.reconciler.config import ReconcilerConfig
from llmgw.redact import redact
from llmgw.router.config import RouterConfig
from llmgw.router.keys import KeyRing
from llmgw.store.opening import store_for

ENV_ADMIN_TOKEN = "LLMGW_ADMIN_TOKEN"
ENV_WEBHOOK_SECRET = "LLMGW_WEBHOOK_SECRET"
ENV_STORE = "LLMGW_STORE"  # a postgresql:// URL may hold a password: settable outside the file

KNOWN = {"repo", "branch", "path", "data_dir", "fetch_interval", "watch", "listen", "ssh", "local_agent_config",
         "admin_token", "admin_token_file", "webhook_secret", "webhook_secret_file", "api_keys", "reconciler",
         "router", "store", "leadership", "commit_status", "oidc"}
ENV_COMMIT_STATUS_TOKEN = "LLMGW_COMMIT_STATUS_TOKEN"
ENV_OIDC_CLIENT_SECRET = "LLMGW_OIDC_CLIENT_SECRET"


@dataclass
class Listen:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, what: str) -> Listen:
        host, sep, port = str(text).rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"listen.{what}: {text!r} is not HOST:PORT")
        return cls(host.strip("[]") or "127.0.0.1", int(port))


@dataclass
class ControllerConfig:
    """What the control plane itself needs: the repository it follows and how it reaches nodes."""

    repo: str = field(repr=False)  # its URL may hold a credential: shown only through llmgw.redact
    data_dir: Path
    branch: str = "main"
    subdir: str = ""
    fetch_interval: float = 15.0
    watch: bool = True
    ssh_key: Path | None = None
    known_hosts: Path | None = None
    local_agent_config: Path | None = None
    transports: tuple[str, ...] = ("ssh", "local")  # `llmgw up` manages only its local node
    # The controller's store (llmgw.store.opening): None is SQLite in the data dir, as `llmgw up` has
    # it; else a path (SQLite) or a postgresql:// URL, whose password is shown only redacted.
    store: str | None = field(default=None, repr=False)
    reconciler: ReconcilerConfig = field(default_factory=ReconcilerConfig)
    # With a shared store: how long the leader's lease lasts, how often it is renewed and tried
    # for. A longer TTL rides out a slower database; a failover then takes about as long.
    leadership: LeadershipConfig = field(default_factory=LeadershipConfig)
    # Where the controller says what became of each commit (GitHub's or Gitea's commit statuses).
    commit_status: CommitStatusConfig | None = field(default=None, repr=False)


@dataclass
class ServerConfig:
    """A whole controller process: the control plane plus its listeners, secrets and router."""

    controller: ControllerConfig
    router_listen: Listen = field(default_factory=lambda: Listen("127.0.0.1", 8080))
    admin_listen: Listen = field(default_factory=lambda: Listen("127.0.0.1", 8081))
    admin_token: str = ""
    webhook_secret: str = ""
    api_keys: list[dict[str, Any]] = field(default_factory=list)
    router: dict[str, Any] = field(default_factory=dict)
    oidc: OidcConfig | None = None  # operators sign in at this provider (issue 41); None: the admin token only

    def __repr__(self) -> str:  # never print a secret by accident
        c = self.controller
        return f"ServerConfig(repo={redact(c.repo)!r}, data_dir={str(c.data_dir)!r}, branch={c.branch!r})"


def _secret(raw: dict[str, Any], key: str, env: str, base: Path) -> str:
    if os.environ.get(env):
        return os.environ[env]
    if raw.get(key):
        return str(raw[key])
    file = raw.get(f"{key}_file")
    if file:
        p = (base / file) if not Path(file).is_absolute() else Path(file)
        try:
            return p.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{key}_file: cannot read {p}: {exc}") from exc
    return ""


# Knobs where zero is not "off" but a loop that spins or a wait that cannot succeed.
POSITIVE = frozenset({"tick_interval", "fetch_interval", "probe_timeout", "start_timeout", "concurrency",
                      "crash_loop_after", "connect_timeout", "first_byte_timeout", "body_timeout", "load_interval",
                      "body_limit", "buffered_limit", "keepalive_timeout", "prefix_block_chars",
                      "prefix_index_blocks", "key_parse_bodies"})
# What nodes accept: a longer stop grace is refused by every agent (its MAX_GRACE).
MAXIMUM = {"stop_grace": 600.0}


def _seconds(raw: Any, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigError(f"{what}: {raw!r} is not a duration such as 90s, 15m or 1h30m")
    if isinstance(raw, int | float):
        if not math.isfinite(raw):  # .nan would never time out, .inf never fire
            raise ConfigError(f"{what}: {raw!r} is not a finite duration")
        if raw < 0:
            raise ConfigError(f"{what}: {raw!r} is negative")
        seconds = float(raw)
    else:
        try:
            seconds = parse_duration(raw)
        except DurationError as exc:
            raise ConfigError(f"{what}: {exc}") from exc
    key = what.rsplit(".", 1)[-1]
    if seconds == 0 and key in POSITIVE:
        raise ConfigError(f"{what}: must be more than 0")
    if key in MAXIMUM and seconds > MAXIMUM[key]:
        raise ConfigError(f"{what}: at most {MAXIMUM[key]:g} s (what the nodes' agents accept)")
    return seconds


def _value(raw: Any, kind: Any, what: str) -> Any:
    """``raw`` as the field type ``kind`` says: every float is a duration (``10s`` or seconds),
    an int a whole number, a bool true or false (YAML's "false" as a string is not false)."""
    if kind is float:
        return _seconds(raw, what)
    if kind is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{what}: {raw!r} must be true or false")
        return raw
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"{what}: {raw!r} must be a whole number")
        if raw < 0:
            raise ConfigError(f"{what}: {raw!r} is negative")
        if raw == 0 and what.rsplit(".", 1)[-1] in POSITIVE:
            raise ConfigError(f"{what}: must be at least 1")
        return raw
    if kind is str:
        # A string, not anything YAML turned into one: `branch: 1.10` is the float 1.1.
        if not isinstance(raw, str):
            raise ConfigError(f"{what}: {raw!r} must be a string (quote it)")
        return raw
    return raw


def _mapping(raw: Any, what: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: expected a mapping, got {type(raw).__name__}")
    return raw


def _known(raw: dict[str, Any], known: Iterable[str], what: str) -> None:
    unknown = sorted(str(k) for k in set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{what}: unknown key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def typed_section(cls: type, raw: Any, what: str) -> dict[str, Any]:
    """The keys of ``raw`` checked and converted against the fields of the dataclass ``cls``:
    one mechanism for every section, so ``probe_timeout: 10s`` parses as ``tick_interval``
    does (seen: only five keys were durations; the rest reached arithmetic as strings)."""
    section = _mapping(raw, what)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    _known(section, names, what)
    return {key: _value(value, hints[key], f"{what}.{key}") for key, value in section.items()}


def _commit_status(raw: Any, base: Path) -> CommitStatusConfig | None:
    """The ``commit_status:`` section: provider, url, repo, token (or token_file, or the
    environment), dashboard. None when absent."""
    if raw is None:
        return None
    section = _mapping(raw, "commit_status")
    _known(section, ("provider", "url", "repo", "token", "token_file", "dashboard"), "commit_status")
    for key in ("provider", "url", "repo", "token", "token_file", "dashboard"):
        if section.get(key) is not None:
            _value(section[key], str, f"commit_status.{key}")
    provider = section.get("provider")
    if provider not in ("github", "gitea"):
        raise ConfigError(f"commit_status.provider: {provider!r} must be github or gitea")
    url = section.get("url") or ("https://api.github.com" if provider == "github" else "")
    if not url.startswith(("https://", "http://")) or "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ConfigError("commit_status.url: the API's base URL (https://api.github.com, or the Gitea server's), "
                          "without a credential in it (the token has its own key)")
    repo = section.get("repo") or ""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise ConfigError(f"commit_status.repo: {repo!r} must be owner/name")
    token = _secret(section, "token", ENV_COMMIT_STATUS_TOKEN, base)
    if not token:
        raise ConfigError(f"commit_status: no token (token, token_file or ${ENV_COMMIT_STATUS_TOKEN})")
    return CommitStatusConfig(provider, url, repo, token, section.get("dashboard") or "")


def _oidc(raw: Any, base: Path, admin: Listen) -> OidcConfig | None:
    """The ``oidc`` section: the provider operators sign in at, and which of its groups get which role."""
    if raw is None:
        return None
    section = _mapping(raw, "oidc")
    _known(section, ("issuer", "client_id", "client_secret", "client_secret_file", "audience", "groups_claim",
                     "roles", "redirect_url", "scopes"), "oidc")
    for key in ("issuer", "client_id", "audience", "groups_claim", "redirect_url", "scopes"):
        if section.get(key) is not None:
            _value(section[key], str, f"oidc.{key}")
    issuer, client_id = section.get("issuer") or "", section.get("client_id") or ""
    if not issuer or not client_id:
        raise ConfigError("oidc: issuer and client_id are required (the provider's issuer URL, this controller's "
                          "client id there)")
    try:
        check_url(issuer, "oidc.issuer")
    except Refused as exc:
        raise ConfigError(str(exc)) from None
    roles: dict[str, Role] = {}
    for group, role in _mapping(section.get("roles"), "oidc.roles").items():
        try:
            roles[str(group)] = Role.parse(_value(role, str, f"oidc.roles.{group}"))
        except ValueError as exc:
            raise ConfigError(f"oidc.roles.{group}: {exc}") from None
    if not roles:
        raise ConfigError("oidc.roles: map at least one of the provider's groups to a role (viewer, operator, "
                          "admin); a person in no mapped group may do nothing")
    redirect = section.get("redirect_url") or ""
    if redirect:
        try:
            check_url(redirect, "oidc.redirect_url")
        except Refused as exc:
            raise ConfigError(str(exc)) from None
        if urllib.parse.urlsplit(redirect).path != "/auth/callback":
            raise ConfigError(f"oidc.redirect_url: {redirect!r} must end in /auth/callback (the dashboard's callback)")
    elif not loopback(f"http://[{admin.host}]/" if ":" in admin.host else f"http://{admin.host}/"):
        # Built from each request's Host header, the callback would be whatever a request says
        # (a provider allowing a pattern of redirect URIs sends the code there).
        raise ConfigError(f"oidc.redirect_url is required when the admin API listens on {admin.host} (not this "
                          "machine only): the dashboard's https://HOST/auth/callback as the provider knows it")
    return OidcConfig(issuer=issuer, client_id=client_id, audience=section.get("audience") or "",
                      groups_claim=section.get("groups_claim") or "groups", roles=roles,
                      redirect_url=section.get("redirect_url") or "",
                      scopes=section.get("scopes") or "openid email profile groups",
                      client_secret=_secret(section, "client_secret", ENV_OIDC_CLIENT_SECRET, base))


def load_config(path: str | Path) -> ServerConfig:
    """Read and check a controller config file; ConfigError names what is wrong and where."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return _load(raw, path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _load(raw: dict[str, Any], path: Path) -> ServerConfig:
    _known(raw, KNOWN, "the top level")
    if not raw.get("repo"):
        raise ConfigError("repo is required (a path, file://, ssh or https URL of the catalog repo)")
    for key in ("repo", "data_dir", "local_agent_config", "admin_token", "admin_token_file", "webhook_secret",
                "webhook_secret_file", "store"):
        if key in raw and raw[key] is not None:
            _value(raw[key], str, key)
    base = path.parent
    listen = _mapping(raw.get("listen"), "listen")
    _known(listen, ("router", "admin"), "listen")
    ssh = _mapping(raw.get("ssh"), "ssh")
    _known(ssh, ("key", "known_hosts"), "ssh")
    for key, value in [*ssh.items(), *listen.items()]:
        if value is not None:
            _value(value, str, f"{'ssh' if key in ssh else 'listen'}.{key}")
    reconciler = ReconcilerConfig(**typed_section(ReconcilerConfig, raw.get("reconciler"), "reconciler"))
    router = typed_section(RouterConfig, raw.get("router"), "router")
    try:
        leadership = LeadershipConfig(**typed_section(LeadershipConfig, raw.get("leadership"), "leadership"))
    except ValueError as exc:  # the timings do not fit together (a renewal after the lease ends)
        raise ConfigError(f"leadership: {exc}") from None
    api_keys = raw.get("api_keys") or []
    if not isinstance(api_keys, list):
        raise ConfigError("api_keys: expected a list of {name, sha256, models}")
    KeyRing.from_entries(api_keys, where="api_keys")  # checked here, so a bad entry stops the start
    top = {key: _value(raw[key], kind, key) for key, kind in
           (("branch", str), ("path", str), ("watch", bool), ("fetch_interval", float)) if key in raw}

    def rel(p: Any) -> Path | None:
        return None if not p else (Path(p) if Path(p).is_absolute() else (base / p).resolve())

    commit_status = _commit_status(raw.get("commit_status"), base)
    data_dir = rel(raw.get("data_dir")) or default_data_dir()
    store = os.environ.get(ENV_STORE) or raw.get("store") or None
    store_for(store, data_dir)  # a malformed URL or an unknown scheme stops the start here
    return ServerConfig(
        controller=ControllerConfig(
            repo=str(raw["repo"]),
            data_dir=data_dir,
            branch=top.get("branch", "main"),
            subdir=top.get("path", ""),
            fetch_interval=top.get("fetch_interval", 15.0),
            watch=top.get("watch", True),
            ssh_key=rel(ssh.get("key")),
            known_hosts=rel(ssh.get("known_hosts")),
            local_agent_config=rel(raw.get("local_agent_config")),
            reconciler=reconciler,
            store=store,
            leadership=leadership,
            commit_status=commit_status,
        ),
        router_listen=Listen.parse(listen.get("router", "127.0.0.1:8080"), "router"),
        admin_listen=Listen.parse(listen.get("admin", "127.0.0.1:8081"), "admin"),
        admin_token=_secret(raw, "admin_token", ENV_ADMIN_TOKEN, base),
        webhook_secret=_secret(raw, "webhook_secret", ENV_WEBHOOK_SECRET, base),
        api_keys=list(api_keys),
        router=router,
        oidc=_oidc(raw.get("oidc"), base, Listen.parse(listen.get("admin", "127.0.0.1:8081"), "admin")),
    )
