"""A dispatcher that answers from an in-memory model of nodes and records every call.

It ships beside the real transports so that the reconciler's tests and ``llmgw diff`` drive the
very protocol the SSH and local dispatchers speak, without a node: each node is a
:class:`FakeNode` (GPUs, weights in its cache, running engines) whose state the verbs change the
way an agent would. Failures are scripted: a node can be made unreachable, or the next call of a
verb made to fail with a chosen error. ``calls`` keeps every call in order, failed ones included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from llmgw.catalog import cache_name
from llmgw.catalog.model import Engine
from llmgw.dispatch.base import VERBS, AgentVerbs, Answer, HelloAnswer
from llmgw.errors import AgentError, DispatchError, NodeUnreachable

FAKE_AGENT_VERSION = "fake"


def _gpu_view(gpu: Answer) -> Answer:
    """A declared GPU as the agent reports one where there is no driver."""
    return {"name": None, "uuid": None, "memory_used_gb": None, "declared": True, "healthy": True,
            "problems": [], **gpu}


@dataclass(frozen=True)
class Call:
    node_id: str
    verb: str
    request: Answer


@dataclass
class FakeNode:
    """The scripted state of one node; the verbs change it as a node's agent would."""

    hostname: str
    gpus: list[dict[str, Any]] = field(
        default_factory=lambda: [{"index": i, "class": "sim", "memory_gb": 24} for i in range(2)]
    )
    memory_mb: int = 65536
    cache_dir: str = "/var/cache/llmgw"
    filesystems: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)  # cache name → weight entry
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica id → engine entry
    foreign: list[str] = field(default_factory=list)
    # Every engine the catalog knows, spelt as it does (a hand-made list spelt "llamacpp": a default
    # fake node refused every llama.cpp start).
    engine_names: tuple[str, ...] = get_args(Engine)
    advertise_address: str = "127.0.0.1"
    port_range: tuple[int, int] = (8000, 8099)  # the fake hands out ports from here, never probing
    fetch_bytes: int = 1024
    reachable: bool = True
    locked: bool = False


class RecordingDispatcher(AgentVerbs):
    """The :class:`~llmgw.dispatch.base.Dispatcher` protocol over :class:`FakeNode` objects."""

    def __init__(
        self, nodes: Mapping[str, FakeNode] | Iterable[str] = (), *, clock: Callable[[], float] = time.time
    ) -> None:
        self._now = clock
        if isinstance(nodes, Mapping):
            self.nodes: dict[str, FakeNode] = dict(nodes)
        else:
            self.nodes = {node_id: FakeNode(hostname=node_id) for node_id in nodes}
        self.calls: list[Call] = []
        self._failures: dict[tuple[str, str], list[DispatchError]] = {}
        self._next_pid = 1000
        self.opened = False

    async def open(self) -> None:
        self.opened = True

    async def close(self) -> None:
        self.opened = False

    # --- scripting -------------------------------------------------------------------------

    def add_node(self, node_id: str, **fields: Any) -> FakeNode:
        node = self.nodes[node_id] = FakeNode(hostname=fields.pop("hostname", node_id), **fields)
        return node

    def fail_next(self, node_id: str, verb: str, error: DispatchError) -> None:
        """The next ``verb`` call to ``node_id`` raises ``error`` (queued: call again for more)."""
        if verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}")
        self._failures.setdefault((node_id, verb), []).append(error)

    def set_reachable(self, node_id: str, reachable: bool) -> None:
        self.nodes[node_id].reachable = reachable

    def calls_of(self, verb: str | None = None, node_id: str | None = None) -> list[Call]:
        return [c for c in self.calls if (verb is None or c.verb == verb) and (node_id is None or c.node_id == node_id)]

    # --- the protocol ----------------------------------------------------------------------

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        del timeout  # answers are immediate
        self.calls.append(Call(node_id, verb, dict(request)))
        node = self.nodes.get(node_id)
        if node is None:
            raise DispatchError(f"{node_id}: no such node in this dispatcher")
        if not node.reachable:
            raise NodeUnreachable(f"{node_id}: unreachable (scripted)")
        queued = self._failures.get((node_id, verb))
        if queued:
            raise queued.pop(0)
        handler = getattr(self, "_" + verb.replace("-", "_"), None)
        if handler is None:
            raise AgentError(f"{node_id}: {verb}: unknown verb")
        return handler(node, request)

    async def hello(self, node_id: str) -> HelloAnswer:
        return await self.call(node_id, "hello", {})  # type: ignore[return-value]

    def _hello(self, node: FakeNode, request: Answer) -> Answer:  # noqa: ARG002
        return {
            "agent_version": FAKE_AGENT_VERSION,
            "agent_sha256": "0" * 64,
            "hostname": node.hostname,
            "protocol": 1,
            "locked": node.locked,
            "agent_path": "",
        }

    def _inventory(self, node: FakeNode, request: Answer) -> Answer:  # noqa: ARG002
        return {
            "hostname": node.hostname,
            "agent_version": FAKE_AGENT_VERSION,
            "protocol": 1,
            "gpus": [_gpu_view(g) for g in node.gpus],
            "gpu_error": None,
            "memory_mb": {"total": node.memory_mb, "available": node.memory_mb},
            "filesystems": list(node.filesystems),
            "weights": list(node.weights.values()),
            "invalid_weights": [],
            "foreign": list(node.foreign),
            "engines": [self._engine_view(e) for e in node.engines.values()],
            "fetches": [],
            "locked": node.locked,  # as the SSH dispatcher adds it (the connection's finding)
        }

    def _fetch(self, node: FakeNode, request: Answer) -> Answer:
        source = request["source"]
        name = cache_name(source)
        path = f"{node.cache_dir}/{name}"
        entry = node.weights.setdefault(
            name,
            {"path": path, "name": name, "source": source, "bytes": node.fetch_bytes, "complete": True,
             "fetched_at": self._now(), "last_used": self._now()},
        )
        return {"name": name, "path": path, "source": source, "state": "done", "bytes_done": entry["bytes"],
                "bytes_total": entry["bytes"], "error": None, "operator_copy": False, "updated_at": self._now()}

    def _start(self, node: FakeNode, request: Answer) -> Answer:
        replica_id = request["replica_id"]
        if request.get("engine") not in node.engine_names:
            raise AgentError(f"{node.hostname}: start: engine {request.get('engine')!r} is not allowed on this node")
        if replica_id in node.engines:
            return self._start_answer(node.engines[replica_id], already_running=True)
        port = request.get("port") or self._free_port(node)
        self._next_pid += 1
        engine = {
            "replica_id": replica_id,
            "pid": self._next_pid,
            "port": port,
            "endpoint": f"http://{node.advertise_address}:{port}",
            "engine": request["engine"],
            "args": list(request.get("args", [])),
            "labels": dict(request.get("labels", {})),
            "weights": request.get("weights"),
            "gpus": list(request.get("gpus", [])),
            "started_at": self._now(),
            "log": f"/var/lib/llmgw/logs/engines/{replica_id}.log",
        }
        node.engines[replica_id] = engine
        return self._start_answer(engine, already_running=False)

    @staticmethod
    def _start_answer(engine: Answer, *, already_running: bool) -> Answer:
        keys = ("replica_id", "pid", "port", "endpoint", "log")
        return {**{k: engine[k] for k in keys}, "already_running": already_running}

    @staticmethod
    def _engine_view(engine: Answer) -> Answer:
        view = {k: v for k, v in engine.items() if k != "args"}
        return {**view, "alive": True, "exit_code": None, "ended_at": None, "log_tail": []}

    def _free_port(self, node: FakeNode) -> int:
        used = {e["port"] for e in node.engines.values()}
        for port in range(node.port_range[0], node.port_range[1] + 1):
            if port not in used:
                return port
        raise AgentError(f"{node.hostname}: start: no free port in {node.port_range[0]}-{node.port_range[1]}")

    def _stop(self, node: FakeNode, request: Answer) -> Answer:
        engine = node.engines.pop(request["replica_id"], None)
        return {"replica_id": request["replica_id"], "stopped": True, "was_running": engine is not None,
                "exit_code": None if engine is None else -15}

    def _status(self, node: FakeNode, request: Answer) -> Answer:  # noqa: ARG002
        return {"engines": [self._engine_view(e) for e in node.engines.values()], "fetches": []}

    def _remove_weights(self, node: FakeNode, request: Answer) -> Answer:
        in_use = {e.get("weights"): e["replica_id"] for e in node.engines.values()}
        by_path = {w["path"]: name for name, w in node.weights.items()}
        results = []
        for path in request["paths"]:
            name = by_path.get(path)
            if name is None:
                results.append({"path": path, "removed": False, "reason": "does not exist"})
            elif path in in_use:
                results.append({"path": path, "removed": False, "reason": f"in use by running engine {in_use[path]}"})
            else:
                del node.weights[name]
                results.append({"path": path, "removed": True})
        return {"results": results}
