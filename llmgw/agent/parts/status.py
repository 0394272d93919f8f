"""What a node says of its engines: alive or ended, how, and whether a worker listens."""


from __future__ import annotations

import ipaddress
import time
from typing import Any, List

from llmgw.agent.parts.args import RPC_SERVER, engine_kind
from llmgw.agent.parts.config import NodeConfig, _is_int
from llmgw.agent.parts.fetch import fetch_views
from llmgw.agent.parts.files import (
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
    return [engine_view(cfg, r) for r in all_records(cfg)]


def engine_view(cfg: NodeConfig, record: JsonDict) -> JsonDict:
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
        == RPC_SERVER and _is_int(record.get("port")) and listening(cfg.fabric_address, record["port"]),
    }


TCP_LISTEN = "0A"


def listening(address: str, port: int) -> bool:
    """Whether a socket of this node listens on ``address``:``port``, from the kernel's tables (a
    connect would be taken by an rpc-server as a client, and it serves one client at a time)."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) <= 3 or fields[3] != TCP_LISTEN:
                continue
            local, _, hexport = fields[1].rpartition(":")
            if int(hexport, 16) == port and _proc_address(local) == wanted:
                return True
    return False


def _proc_address(hexaddr: str) -> Any:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    try:
        return ipaddress.ip_address(words)
    except ValueError:
        return None
