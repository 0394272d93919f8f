"""What a node says of its engines: alive or ended, how, and whether a worker listens."""


from __future__ import annotations

import ipaddress
import os
import time
from typing import Any, List, Optional, Tuple

from llmgw.agent.parts.args import RPC_SERVER, engine_kind
from llmgw.agent.parts.config import NodeConfig, _is_int
from llmgw.agent.parts.fetch import fetch_views
from llmgw.agent.parts.files import (
    group_members,
    tail_lines,
)
from llmgw.agent.parts.protocol import (
    JsonDict,
)
from llmgw.agent.parts.records import all_records, exit_info, prune_engine_records, record_alive


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
