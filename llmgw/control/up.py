"""`llmgw up`: everything on one machine, from nothing, in one command.

Prepares a data dir on first run — a git repository holding a copy of the example catalog,
the local node's agent config (simulated GPUs, the sim engine), an admin token — and
builds the server config that runs the controller, router, admin API and dashboard in one
process. A second run finds all of it and comes back on the same state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog import RawFile, read_directory, validate_files
from llmgw.catalog.schema import SCHEMA_DIR
from llmgw.control.config import ControllerConfig, Listen, ServerConfig
from llmgw.control.datadir import hold_data_dir
from llmgw.errors import CatalogError, ConfigError, GitError
from llmgw.gitops.gitcli import run_git
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


def _git(cwd: Path, *args: str, check: bool = True) -> str | None:
    """git's output, through the one git boundary (llmgw.gitops.gitcli: timeout, redaction, no
    prompt); None when it failed and ``check`` is off (``git config --get`` of a missing key)."""
    try:
        return run_git(list(args), cwd=cwd, env=GIT_ENV).strip()
    except GitError as exc:
        if not check:
            return None
        raise ConfigError(f"git {args[0]} in {cwd} failed: {exc}") from None


@dataclass(frozen=True)
class Seed:
    """The catalog a data dir starts from: its files, as the controller would read them."""

    source: Path
    flag: str  # how the user named it, for messages: "--catalog X", or the bundled examples
    files: dict[str, RawFile]

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + self.files[path].data + b"\0")
        return digest.hexdigest()


SHOWN_PROBLEMS = 10


def read_seed(source: Path | None) -> Seed:
    """``source`` (default: the bundled examples) read and validated, or a ConfigError naming
    ``--catalog``: seeding an invalid catalog would start `up` with nothing to run and the reason
    only in its status, and one without a local node could not run at all."""
    flag = f"--catalog {source}" if source is not None else f"the bundled catalog {EXAMPLES}"
    root = source or EXAMPLES
    if not root.exists():
        raise ConfigError(f"{flag}: no such directory")
    if not root.is_dir():
        raise ConfigError(f"{flag}: not a directory (a catalog is a directory holding nodes.yaml and models/)")
    try:
        files = read_directory(root)
    except (CatalogError, OSError) as exc:
        raise ConfigError(f"{flag}: cannot read it: {exc}") from exc
    if "nodes.yaml" not in files and "nodes.yml" not in files:
        raise ConfigError(f"{flag}: not a catalog directory (no nodes.yaml)")
    result = validate_files(files)
    if not result.ok or result.catalog is None:
        problems = [f"  {root}/{p}" for p in result.problems[:SHOWN_PROBLEMS]]
        more = len(result.problems) - len(problems)
        raise ConfigError(f"{flag}: not a valid catalog (`llmgw validate {root}` shows every problem):\n"
                          + "\n".join(problems) + (f"\n  …and {more} more" if more > 0 else ""))
    if not any(n.transport == "local" for n in result.catalog.nodes):
        raise ConfigError(f"{flag}: nodes.yaml has no node with transport: local, for llmgw up to run its "
                          "engines on (examples/catalog/nodes.yaml has one to copy)")
    return Seed(root, flag, files)


SEED_SHA = "llmgw.seedsha256"  # git config in the data dir's catalog repository
SEED_SOURCE = "llmgw.seedsource"


def init_catalog(layout: UpLayout, seed: Seed) -> None:
    """A new git repository at ``layout.catalog`` holding ``seed``'s catalog files, in one commit.

    Built beside and renamed into place: a seeding cut short (a full disk, Ctrl-C) leaves no
    half-made repository that a later run would take for the data dir's catalog. Only the files
    the controller reads are copied, never following a symlink (none passed validation)."""
    tmp = layout.data_dir / f".catalog.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, raw in seed.files.items():
            text = raw.data.decode()
            # Point each file's schema comment at the installed schemas, so an editor opening the
            # copy still completes and checks it.
            text = re.sub(r"\$schema=\S*/(\w+\.schema\.json)",
                          lambda m: f"$schema={(SCHEMA_DIR / m.group(1)).as_uri()}", text)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        _git(tmp, "init", "-q", "-b", "main")
        # Pushes from the controller's commit writer (models added through the API) update the
        # checked-out tree, as long as it has no uncommitted edits.
        _git(tmp, "config", "receive.denyCurrentBranch", "updateInstead")
        # What this data dir started from: a later `--catalog` naming the same files is the same
        # start, anything else is not (see check_seed).
        _git(tmp, "config", SEED_SHA, seed.fingerprint)
        _git(tmp, "config", SEED_SOURCE, str(seed.source))
        _git(tmp, "add", "-A")
        _git(tmp, "commit", "-q", "-m", "Initial catalog (llmgw up)")
        os.rename(tmp, layout.catalog)
    except OSError as exc:  # a full disk, a read-only data dir
        raise ConfigError(f"--data-dir {layout.data_dir}: cannot write its catalog: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something above failed


def check_seed(layout: UpLayout, source: Path) -> None:
    """``--catalog`` given for a data dir that has its catalog: the same start, or an error.

    The data dir's catalog is a git repository with its own history since (the tour commits to
    it); `up` never replaces it. `--catalog` naming other files than those it started from was
    once silently ignored, so `up` served a catalog the user had not asked for."""
    if source.resolve() == layout.catalog.resolve():
        return
    seed = read_seed(source)
    if _git(layout.catalog, "config", "--get", SEED_SHA, check=False) == seed.fingerprint:
        return  # the same files this data dir started from: it goes on from its own catalog
    started = _git(layout.catalog, "config", "--get", SEED_SOURCE, check=False)
    raise ConfigError(
        f"--catalog {source}: the data dir {layout.data_dir} already has its catalog, {layout.catalog}"
        + (f" (started from {started}, with these files as they were then)" if started else "")
        + f", and --catalog only starts a new data dir. To run {source}: add --data-dir with a new "
        f"directory, or copy its files into {layout.catalog} and commit them; to go on with the data "
        "dir's catalog, leave out --catalog.")


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


def prepare(data_dir: Path, *, catalog: Path | None, router_port: int, admin_port: int,
            lock: bool = False) -> ServerConfig:
    """The data dir made ready (its catalog seeded on first run), and the config serving it.

    Every check comes before anything is written, so a refused `up` leaves nothing behind. With
    ``lock`` (`llmgw up` itself) the data dir is this process's from then on (DataDirInUse when
    another process runs on it), taken before anything is written."""
    layout = UpLayout(data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"--data-dir {data_dir}: not a directory")
    if (layout.catalog / ".git").exists():
        if catalog is not None:
            check_seed(layout, catalog)
        seed = None
    elif layout.catalog.exists():
        raise ConfigError(f"--data-dir {data_dir}: {layout.catalog} exists but is not a git repository (not "
                          "made by llmgw up); move it away, or use another --data-dir")
    else:
        seed = read_seed(catalog)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--data-dir {data_dir}: cannot create it: {exc.strerror or exc}") from exc
    if lock:
        hold_data_dir(layout.controller_dir)  # before anything is written: a second `up` must not touch it
    if seed is not None:
        init_catalog(layout, seed)
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
