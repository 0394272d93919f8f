"""Starting an engine: the request checked, a port chosen, the engine launched confined and recorded."""


from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from llmgw.agent.parts.args import RPC_SERVER, check_args, check_rpc_server_args, engine_kind
from llmgw.agent.parts.cache import inspect_entry
from llmgw.agent.parts.config import NodeConfig, _is_int, fabric_interface, ipv4_literal
from llmgw.agent.parts.files import (
    _ensure_dir,
    _inside,
    _locked,
    _remove_file,
    boot_id,
    write_json_atomic,
)
from llmgw.agent.parts.lease import fenced
from llmgw.agent.parts.protocol import (
    AGENT_VERSION,
    ENV_NAME_RE,
    LOG_ROTATE_BYTES,
    AgentError,
    JsonDict,
    Refused,
    _field,
    _optional,
)
from llmgw.agent.parts.records import (
    _engines_lock,
    _exit_path,
    _log_path,
    _record_path,
    _replica_id,
    all_records,
    load_record,
    record_alive,
)
from llmgw.agent.parts.sandbox import (
    Confinement,
    StartSpec,
    check_env,
    check_tmp_fits,
    check_visible,
    confinement,
    engine_area,
    engine_environment,
    ensure_run_dir,
    prepare_area,
    sandbox_argv,
)
from llmgw.agent.parts.spawn import spawn_detached


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
