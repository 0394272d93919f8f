"""The controller's own configuration: what stays out of git.

A local YAML file (`llmgw controller --config FILE`). Every secret can also come from an
environment variable (which wins) or a file, so the YAML itself can be committed to an
ops repository without them. Secrets are never logged or returned by the API.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog.durations import DurationError, parse_duration
from llmgw.errors import ConfigError
from llmgw.paths import default_data_dir
from llmgw.reconciler import ReconcilerConfig

ENV_ADMIN_TOKEN = "LLMGW_ADMIN_TOKEN"
ENV_WEBHOOK_SECRET = "LLMGW_WEBHOOK_SECRET"

KNOWN = {"repo", "branch", "path", "data_dir", "fetch_interval", "watch", "listen", "ssh", "local_agent_config",
         "admin_token", "admin_token_file", "webhook_secret", "webhook_secret_file", "api_keys", "reconciler",
         "router"}


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

    repo: str
    data_dir: Path
    branch: str = "main"
    subdir: str = ""
    fetch_interval: float = 15.0
    watch: bool = True
    ssh_key: Path | None = None
    known_hosts: Path | None = None
    local_agent_config: Path | None = None
    transports: tuple[str, ...] = ("ssh", "local")  # `llmgw up` manages only its local node
    reconciler: ReconcilerConfig = field(default_factory=ReconcilerConfig)


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

    def __repr__(self) -> str:  # never print a secret by accident
        c = self.controller
        return f"ServerConfig(repo={c.repo!r}, data_dir={str(c.data_dir)!r}, branch={c.branch!r})"


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


def _seconds(raw: Any, what: str) -> float:
    if isinstance(raw, int | float):
        return float(raw)
    try:
        return parse_duration(str(raw))
    except DurationError as exc:
        raise ConfigError(f"{what}: {exc}") from exc


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
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s): {', '.join(unknown)} (known: {', '.join(sorted(KNOWN))})")
    if not raw.get("repo"):
        raise ConfigError(f"{path}: repo is required (a path, file://, ssh or https URL of the catalog repo)")
    base = path.parent
    listen = raw.get("listen") or {}
    ssh = raw.get("ssh") or {}
    rec = dict(raw.get("reconciler") or {})
    for key in ("tick_interval", "unreachable_grace", "start_timeout", "stop_grace", "backoff_cap"):
        if key in rec:
            rec[key] = _seconds(rec[key], f"reconciler.{key}")
    try:
        reconciler = ReconcilerConfig(**rec)
    except TypeError as exc:
        raise ConfigError(f"{path}: reconciler: {exc}") from exc

    def rel(p: Any) -> Path | None:
        return None if not p else (Path(p) if Path(p).is_absolute() else (base / p).resolve())

    data_dir = rel(raw.get("data_dir")) or default_data_dir()
    return ServerConfig(
        controller=ControllerConfig(
            repo=str(raw["repo"]),
            data_dir=data_dir,
            branch=str(raw.get("branch", "main")),
            subdir=str(raw.get("path", "")),
            fetch_interval=_seconds(raw.get("fetch_interval", 15), "fetch_interval"),
            watch=bool(raw.get("watch", True)),
            ssh_key=rel(ssh.get("key")),
            known_hosts=rel(ssh.get("known_hosts")),
            local_agent_config=rel(raw.get("local_agent_config")),
            reconciler=reconciler,
        ),
        router_listen=Listen.parse(listen.get("router", "127.0.0.1:8080"), "router"),
        admin_listen=Listen.parse(listen.get("admin", "127.0.0.1:8081"), "admin"),
        admin_token=_secret(raw, "admin_token", ENV_ADMIN_TOKEN, base),
        webhook_secret=_secret(raw, "webhook_secret", ENV_WEBHOOK_SECRET, base),
        api_keys=list(raw.get("api_keys") or []),
        router=dict(raw.get("router") or {}),
    )
