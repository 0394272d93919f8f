"""`llmgw up`: everything on one machine, from nothing, in one command.

Prepares a data dir on first run — a git repository holding a copy of the example catalog,
the local node's agent config (simulated GPUs, the sim engine), an admin token — and
builds the server config that runs the controller, router, admin API and dashboard in one
process. A second run finds all of it and comes back on the same state.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog.schema import SCHEMA_DIR
from llmgw.control.config import ControllerConfig, Listen, ServerConfig
from llmgw.errors import ConfigError
from llmgw.reconciler import ReconcilerConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "catalog"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the llmgw checkout or site-packages
TOKEN_FILE = "admin.token"
ENGINE_PORTS = (39000, 39199)
GIT_ENV = {"GIT_AUTHOR_NAME": "llmgw up", "GIT_AUTHOR_EMAIL": "up@llmgw.invalid",
           "GIT_COMMITTER_NAME": "llmgw up", "GIT_COMMITTER_EMAIL": "up@llmgw.invalid"}


@dataclass(frozen=True)
class UpLayout:
    data_dir: Path

    @property
    def catalog(self) -> Path:
        return self.data_dir / "catalog"

    @property
    def node_dir(self) -> Path:
        return self.data_dir / "node"

    @property
    def agent_config(self) -> Path:
        return self.node_dir / "agent.json"

    @property
    def token_file(self) -> Path:
        return self.data_dir / TOKEN_FILE

    @property
    def controller_dir(self) -> Path:
        return self.data_dir / "controller"


def _git(cwd: Path, *args: str) -> None:
    proc = subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_ENV}, capture_output=True, text=True,
                          timeout=30, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"git {args[0]} in {cwd} failed: {proc.stderr.strip()}")


def init_catalog(layout: UpLayout, source: Path) -> bool:
    """Copy ``source`` into a new git repository, unless one is there; True when created."""
    repo = layout.catalog
    if (repo / ".git").exists():
        return False
    if not (source / "nodes.yaml").exists():
        raise ConfigError(f"--catalog {source}: not a catalog directory (no nodes.yaml)")
    shutil.copytree(source, repo, dirs_exist_ok=True)
    # Point each file's schema comment at the installed schemas, so an editor opening the
    # copy still completes and checks it.
    for f in [repo / "llmgw.yaml", repo / "nodes.yaml", *sorted((repo / "models").glob("*.yaml"))]:
        if f.exists():
            text = f.read_text()
            text = re.sub(r"\$schema=\S*/(\w+\.schema\.json)",
                          lambda m: f"$schema={(SCHEMA_DIR / m.group(1)).as_uri()}", text)
            f.write_text(text)
    _git(repo, "init", "-q", "-b", "main")
    # Pushes from the controller's commit writer (models added through the API) update the
    # checked-out tree, as long as it has no uncommitted edits.
    _git(repo, "config", "receive.denyCurrentBranch", "updateInstead")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "Initial catalog (llmgw up)")
    return True


def local_node_spec(catalog_dir: Path) -> dict:
    data = yaml.safe_load((catalog_dir / "nodes.yaml").read_text()) or {}
    local = [n for n in data.get("nodes") or [] if n.get("transport") == "local"]
    if not local:
        raise ConfigError(f"{catalog_dir}/nodes.yaml has no node with transport: local for llmgw up to run")
    return local[0]


def local_confinement(needed: list[Path]) -> dict:
    """The local node's engine confinement (DESIGN §4): as root, engines run as `nobody` (a
    single-machine try-out has no dedicated user; the README's real-fleet guide creates one),
    in bubblewrap where it runs. What the sim engine needs to start (this Python, this
    package) is exposed read-only, since the sandbox hides /root, /home and /tmp."""
    settings: dict = {"sandbox_paths": sorted({str(p.resolve()) for p in needed})}
    if os.geteuid() == 0:
        settings["engine_user"] = "nobody"
    return settings


def write_agent_config(layout: UpLayout) -> None:
    """The local node's own config (rewritten each run: it only describes this machine)."""
    spec = local_node_spec(layout.catalog)
    gpus = spec.get("gpus") or {}
    config: dict[str, Any] = {
        "cache_dir": str(layout.node_dir / "cache"),
        "model_dirs": [],
        "state_dir": str(layout.node_dir / "state"),
        "port_range": list(ENGINE_PORTS),
        "advertise_address": "127.0.0.1",
        "engines": {"sim": [sys.executable, "-m", "llmgw.engines.sim"]},
        # Declared, not detected: this machine may have no GPU, and the sim needs none.
        "gpus": [{"index": i, "class": gpus.get("class", "sim"), "memory_gb": gpus.get("memory_gb", 24)}
                 for i in range(int(gpus.get("count", 0)))],
    }
    llama = shutil.which("llama-server")
    if llama:
        config["engines"]["llama.cpp"] = llama
    config.update(local_confinement([Path(p) for p in (sys.prefix, sys.base_prefix, PACKAGE_ROOT)]
                                    + ([Path(llama).resolve().parents[1]] if llama else [])))
    # The controller's data (its database, the admin token) lives beside the node here: hidden
    # from engines as a whole; the node's own cache and state are bound back one entry at a time.
    config["sandbox_hide"] = [str(layout.data_dir.resolve())]
    for d in (layout.node_dir / "cache", layout.node_dir / "state"):
        d.mkdir(parents=True, exist_ok=True)
    layout.agent_config.write_text(json.dumps(config, indent=2))


def admin_token(layout: UpLayout) -> str:
    f = layout.token_file
    if f.exists():
        return f.read_text().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def prepare(data_dir: Path, *, catalog: Path | None, router_port: int, admin_port: int) -> ServerConfig:
    layout = UpLayout(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    init_catalog(layout, catalog or EXAMPLES)
    write_agent_config(layout)
    return ServerConfig(
        controller=ControllerConfig(
            repo=str(layout.catalog),
            data_dir=layout.controller_dir,
            local_agent_config=layout.agent_config,
            transports=("local",),
            reconciler=ReconcilerConfig(tick_interval=1.0, stop_grace=5.0),
        ),
        # A terminal's Ctrl-C should end `up` within seconds: in-flight requests get 5 s.
        router={"drain_timeout": 5.0},
        router_listen=Listen("127.0.0.1", router_port),
        admin_listen=Listen("127.0.0.1", admin_port),
        admin_token=admin_token(layout),
    )
