"""The node config: loaded once per call, trusted (it belongs to the node, never to the controller)."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from llmgw.agent.parts.protocol import DEFAULT_ENV_ALLOW, ENV_NAME_RE, SANDBOX_MODES, AgentError, JsonDict, Refused

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
