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
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmgw.catalog import RawFile, read_directory, validate_files
from llmgw.catalog.schema import SCHEMA_DIR
from llmgw.control.config import ControllerConfig, Listen, ServerConfig
from llmgw.control.datadir import hold_data_dir
from llmgw.control.local_engines import found_engines, install_prefix, nvidia_gpus
from llmgw.control.own_model import OwnModel, catalog_entry, describe, engine_for, entry_yaml
from llmgw.errors import CatalogError, ConfigError, GitError
from llmgw.gitops.gitcli import run_git
from llmgw.gitops.writer import model_file_name
from llmgw.reconciler import ReconcilerConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "catalog"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the llmgw checkout or site-packages
TOKEN_FILE = "admin.token"
ENGINE_PORTS = (39000, 39199)  # the first block; each data dir has its own (engine_ports)
PORT_BLOCKS = 40  # blocks of 200 from 39000: two `up`s on one machine rarely pick from one


def engine_ports(data_dir: Path) -> tuple[int, int]:
    """This data dir's engine ports. Two `up`s on one machine with one range picked the same port
    before either engine bound it, and engines that bind with SO_REUSEPORT (vLLM, llama.cpp's
    server) then shared it: a model answered by another's engine. The agent says when a port is
    shared and the controller starts that replica elsewhere; a block per data dir makes it rare."""
    block = zlib.crc32(str(data_dir.resolve()).encode()) % PORT_BLOCKS
    first = ENGINE_PORTS[0] + block * (ENGINE_PORTS[1] - ENGINE_PORTS[0] + 1)
    return first, first + ENGINE_PORTS[1] - ENGINE_PORTS[0]
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

    @property
    def node_settings(self) -> Path:
        """The local node's settings a person changes: `up` writes it once, never again."""
        return self.node_dir / "settings.yaml"

    @property
    def served(self) -> Path:
        """The folders of the models `up --model` / `models add PATH` serve (written by `up`)."""
        return self.node_dir / "served.json"


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


SETTINGS_TEMPLATE = """\
# The local node's own settings, kept by `llmgw up` (it writes this file once and never again;
# node/agent.json is made from it at each start and rewritten each time). Every key is optional:
#
# engines:          {llama.cpp: /opt/llama/bin/llama-server}   engines by name (found ones: llama-server
#                   from scripts/build-llama-server or PATH, vllm from scripts/build-vllm-cpu or PATH)
# model_dirs:       [/srv/models]      weights served where they lie (`llmgw up --model` adds its own)
# local_sources:    [/srv/exports]     directories file:// sources may be copied from
# sandbox_paths:    [/opt/cuda]        directories engines may read (everything else is hidden)
# engine_env:       {OMP_NUM_THREADS: "4"}
"""
SETTINGS_LISTS = ("model_dirs", "local_sources", "sandbox_paths")
SETTINGS_MAPS = ("engines", "engine_env")


def node_settings(layout: UpLayout) -> dict[str, Any]:
    """``node/settings.yaml`` read and checked (written with its commented template when absent)."""
    f = layout.node_settings
    if not f.exists():
        return {}
    try:
        data = yaml.safe_load(f.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{f}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{f}: a mapping of settings is expected, not {type(data).__name__}")
    for key, value in data.items():
        if key in SETTINGS_LISTS:
            if not isinstance(value, list) or not all(isinstance(v, str) and v.startswith("/") for v in value):
                raise ConfigError(f"{f}: {key}: a list of absolute paths is expected")
        elif key in SETTINGS_MAPS:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"{f}: {key}: a mapping is expected")
            if key == "engine_env" and not all(isinstance(v, str) for v in value.values()):
                raise ConfigError(f"{f}: engine_env: every value must be a string (quote numbers)")
        else:
            raise ConfigError(f"{f}: unknown setting {key!r} (known: {', '.join(SETTINGS_LISTS + SETTINGS_MAPS)})")
    return data


def served_folders(layout: UpLayout) -> list[str]:
    try:
        data = json.loads(layout.served.read_text())
    except (OSError, ValueError):
        return []
    return [d for d in data.get("model_dirs", []) if isinstance(d, str)] if isinstance(data, dict) else []


def serve_folder(layout: UpLayout, folder: Path) -> None:
    """Let the local node read models in ``folder`` (kept across runs in node/served.json)."""
    folders = served_folders(layout)
    if str(folder) not in folders:
        _write_atomically(layout.served, json.dumps({"model_dirs": [*folders, str(folder)]}, indent=2) + "\n")


def local_engines(layout: UpLayout) -> dict[str, Any]:
    """Engine name → argv or path on the local node: the simulator, the engines found here, and
    the person's own (settings.yaml, which wins)."""
    engines: dict[str, Any] = {"sim": [sys.executable, "-m", "llmgw.engines.sim"]}
    engines.update({name: str(e.executable) for name, e in found_engines().items()})
    engines.update(node_settings(layout).get("engines") or {})
    return engines


def write_agent_config(layout: UpLayout) -> None:
    """The local node's agent config, made from what this machine has and node/settings.yaml."""
    spec = local_node_spec(layout.catalog)
    gpus = spec.get("gpus") or {}
    settings = node_settings(layout)
    found = found_engines()
    config: dict[str, Any] = {
        "cache_dir": str(layout.node_dir / "cache"),
        "model_dirs": list(dict.fromkeys([*served_folders(layout), *settings.get("model_dirs", [])])),
        "state_dir": str(layout.node_dir / "state"),
        "port_range": list(engine_ports(layout.data_dir)),
        "advertise_address": "127.0.0.1",
        "engines": local_engines(layout),
        # Declared, not detected: this machine may have no GPU, and the sim needs none (where
        # nvidia-smi answers, the agent reports the real ones instead).
        "gpus": [{"index": i, "class": gpus.get("class", "sim"), "memory_gb": gpus.get("memory_gb", 24)}
                 for i in range(int(gpus.get("count", 0)))],
    }
    if settings.get("local_sources"):
        config["local_sources"] = settings["local_sources"]
    needed = [Path(p) for p in (sys.prefix, sys.base_prefix, PACKAGE_ROOT)]
    needed += [p for e in found.values() for p in e.exposes]
    needed += [Path(p) for p in settings.get("sandbox_paths", [])]
    # The person's own engines come with their install directory, as found ones do.
    for argv in (settings.get("engines") or {}).values():
        exe = argv[0] if isinstance(argv, list) and argv else argv
        if isinstance(exe, str) and exe.startswith("/") and Path(exe).exists():
            needed += install_prefix(Path(exe))
    config.update(local_confinement(needed))
    env = {k: v for e in found.values() for k, v in e.env}
    env.update(settings.get("engine_env") or {})
    if env:
        config["engine_env"] = env
    # The controller's data (its database, the admin token) lives beside the node here: hidden
    # from engines as a whole; the node's own cache and state are bound back one entry at a time.
    config["sandbox_hide"] = [str(layout.data_dir.resolve())]
    for d in (layout.node_dir / "cache", layout.node_dir / "state"):
        d.mkdir(parents=True, exist_ok=True)
    if not layout.node_settings.exists():
        layout.node_settings.write_text(SETTINGS_TEMPLATE)
    # Whole or not at all: a running local agent is started again when this file changes.
    _write_atomically(layout.agent_config, json.dumps(config, indent=2))


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def admin_token(layout: UpLayout) -> str:
    f = layout.token_file
    if f.exists():
        return f.read_text().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


@dataclass(frozen=True)
class ModelToServe:
    """A person's model, checked, with its catalog file: what `up --model` commits."""

    model: OwnModel
    engine: str
    file: str  # in the catalog
    text: str


def model_to_serve(layout: UpLayout, path: Path, catalog_dir: Path, *, name: str | None = None) -> ModelToServe:
    """``path`` described, its engine chosen among this node's, its catalog file written out for
    the local node of the catalog in ``catalog_dir`` (nothing is written yet: errors come first)."""
    own = describe(path, name=name)
    _not_too_wide(own.folder, layout)
    engine = engine_for(own, local_engines(layout))
    entry = catalog_entry(own, engine, gpus=nvidia_gpus(), pool=local_node_spec(catalog_dir).get("pool"))
    return ModelToServe(own, engine, model_file_name(own.name), entry_yaml(own, entry))


def _not_too_wide(allowed: Path, layout: UpLayout) -> None:
    """A model's directory becomes readable by engines (and nameable as weights by any catalog
    entry): never the root, a home directory, nor one holding this data dir (its store, its admin
    token)."""
    data = layout.data_dir.resolve()
    homes = {Path.home().resolve(), Path("/root"), Path("/home")}
    if allowed == Path("/") or allowed in homes or allowed.parent == Path("/home") \
            or data == allowed or allowed in data.parents:
        raise ConfigError(f"--model {allowed}: engines would be let read all of {allowed} (the model is a "
                          "directory there, or its parts lie there); move the model into a directory of its own")


def check_served(files: dict[str, RawFile], served: ModelToServe) -> bool:
    """Whether the catalog ``files`` already serve this model (True: nothing to commit), or a
    ConfigError when its name is another model's or the catalog would be invalid with it."""
    result = validate_files(files)
    existing = result.catalog.resolve(served.model.name) if result.catalog else None
    if existing is not None:
        if existing.source == served.model.source:
            return True  # a second `up --model` of the same file
        raise ConfigError(f"--model {served.model.path}: the catalog already has a model named "
                          f"{served.model.name!r} ({existing.source}); give this one another with --name")
    data = served.text.encode()
    merged = {**files, served.file: RawFile(served.file, data, len(data))}
    after = validate_files(merged)
    if not after.ok:
        raise ConfigError(f"--model {served.model.path}: the catalog would not be valid with it:\n"
                          + "\n".join(f"  {p}" for p in after.problems[:SHOWN_PROBLEMS]))
    return False


def commit_served(layout: UpLayout, served: ModelToServe) -> bool:
    """The model's file committed to the data dir's catalog, and its folder readable by the
    local node; False when the catalog served it already."""
    if check_served(read_directory(layout.catalog), served):
        serve_folder(layout, served.model.folder)
        return False
    serve_folder(layout, served.model.folder)
    target = layout.catalog / served.file
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(served.text)
    _git(layout.catalog, "add", "--", served.file)
    _git(layout.catalog, "commit", "-q", "-m", f"Serve {served.model.name} (llmgw up --model)",
         "-m", f"From {served.model.path}, on {served.engine}.", "--", served.file)
    return True


def prepare(data_dir: Path, *, catalog: Path | None, router_port: int, admin_port: int,
            lock: bool = False, model: Path | None = None, name: str | None = None) -> ServerConfig:
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
    to_serve = None
    if model is not None:
        to_serve = model_to_serve(layout, model, seed.source if seed else layout.catalog, name=name)
        check_served(seed.files if seed else read_directory(layout.catalog), to_serve)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--data-dir {data_dir}: cannot create it: {exc.strerror or exc}") from exc
    if lock:
        hold_data_dir(layout.controller_dir)  # before anything is written: a second `up` must not touch it
    if seed is not None:
        init_catalog(layout, seed)
    if to_serve is not None:
        commit_served(layout, to_serve)
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
