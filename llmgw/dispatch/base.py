"""The seam between the control plane and the nodes: one protocol, several transports.

The reconciler decides; a :class:`Dispatcher` carries each decision to a node's agent and brings
the answer back. The verbs are the agent's verbs (DESIGN §4), one method each, so anything that
speaks this protocol can stand in for a node: SSH (``ssh.SshDispatcher``), a local subprocess
(``local.LocalDispatcher``), or the in-memory fake that tests and ``llmgw diff`` use
(``recording.RecordingDispatcher``).

Lifecycle: constructors open nothing; ``open()`` prepares, ``close()`` drops every connection
(engines keep running: an agent's engines never depend on the connection that started them).
Both are also available as ``async with dispatcher:``. The lifecycle method is ``open`` rather
than ``start`` because ``start`` is the agent verb that starts an engine.

Every failure is a :class:`~llmgw.errors.DispatchError`: ``NodeUnreachable`` (retry later),
``HostKeyRejected`` (an operator must act), ``AgentError`` (the agent refused this request).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import KW_ONLY, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, NewType, Protocol, TypedDict, runtime_checkable

from llmgw.errors import AgentError, ConfigError, StartRefused

NodeId = NewType("NodeId", str)
Answer = dict[str, Any]

AGENT_PATH = Path(__file__).resolve().parent.parent / "agent" / "llmgw_agent.py"
VERBS = ("hello", "inventory", "lease", "fetch", "seed", "start", "stop", "status", "remove-weights")


@dataclass(frozen=True)
class NodeTarget:
    """How to reach one node's agent.

    ``agent_config`` is the agent's config path on the node; ``None`` lets the agent find its own
    (env ``LLMGW_AGENT_CONFIG``, else ``/etc/llmgw/agent.json``), which is the normal case: the
    node's config belongs to the node, never to the controller.
    """

    id: str
    host: str
    _: KW_ONLY
    port: int = 22
    user: str = "root"
    transport: Literal["ssh", "local"] = "ssh"
    agent_config: str | None = None


class HelloAnswer(TypedDict, total=False):
    """``hello``: the agent's own answer plus what the dispatcher learnt while connecting."""

    agent_version: str
    agent_sha256: str
    hostname: str
    protocol: int
    locked: bool  # the node pins our key to its installed agent: nothing was or could be uploaded
    agent_path: str  # where the agent runs on the node ("" when locked: the node decides)


class StartRequest(TypedDict, total=False):
    """``start``: the engine is named, never given as a program; the node builds the argv."""

    replica_id: str
    engine: str
    args: list[str]
    env: dict[str, str]
    gpus: list[int]
    port: int | None
    weights: str | None
    labels: dict[str, str]
    # The replica's own peers (host:port): a rank's peer flags may name only these (DESIGN §4).
    peers: list[str]


@runtime_checkable
class Dispatcher(Protocol):
    """What the reconciler needs from the nodes. Every method may raise ``DispatchError``."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def hello(self, node_id: str) -> HelloAnswer: ...

    async def inventory(self, node_id: str) -> Answer: ...

    async def fetch(self, node_id: str, source: str, *, peer: Answer | None = None) -> Answer: ...

    async def seed(self, node_id: str, name: str, token_sha256: str, *, ttl: float,
                   mac_key: str | None = None) -> Answer: ...

    async def start(self, node_id: str, request: StartRequest | Answer) -> Answer: ...

    async def stop(self, node_id: str, replica_id: str, *, grace_seconds: float = 10) -> Answer: ...

    async def status(self, node_id: str) -> Answer: ...

    async def remove_weights(self, node_id: str, paths: list[str]) -> Answer: ...


class AgentVerbs:
    """The verb methods of :class:`Dispatcher`, written once over one abstract ``call``.

    A transport implements ``call(node_id, verb, request, timeout=...)`` and inherits the rest.
    ``stop`` waits for the engine up to ``grace_seconds`` on the node, so its timeout grows by that.
    """

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        raise NotImplementedError

    async def __aenter__(self) -> AgentVerbs:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def hello(self, node_id: str) -> HelloAnswer:
        return await self.call(node_id, "hello", {})  # type: ignore[return-value]

    async def inventory(self, node_id: str) -> Answer:
        return await self.call(node_id, "inventory", {})

    async def fetch(self, node_id: str, source: str, *, peer: Answer | None = None) -> Answer:
        request: Answer = {"source": source}
        if peer is not None:  # {url, token, chunks_sha256 | follow}: read from that node first (llmgw.agent.parts.peer)
            request["peer"] = peer
        return await self.call(node_id, "fetch", request)

    async def seed(self, node_id: str, name: str, token_sha256: str, *, ttl: float,
                   mac_key: str | None = None) -> Answer:
        request = {"name": name, "token_sha256": token_sha256, "ttl": ttl}
        if mac_key is not None:  # the key the holder signs a follower's lists with
            request["mac_key"] = mac_key
        return await self.call(node_id, "seed", request)

    async def start(self, node_id: str, request: StartRequest | Answer) -> Answer:
        return await self.call(node_id, "start", dict(request))

    async def stop(self, node_id: str, replica_id: str, *, grace_seconds: float = 10) -> Answer:
        request = {"replica_id": replica_id, "grace_seconds": grace_seconds}
        return await self.call(node_id, "stop", request, timeout=self.call_timeout + grace_seconds)

    async def status(self, node_id: str) -> Answer:
        return await self.call(node_id, "status", {})

    async def remove_weights(self, node_id: str, paths: list[str]) -> Answer:
        return await self.call(node_id, "remove-weights", {"paths": list(paths)})

    call_timeout: float = 30.0


@dataclass(frozen=True)
class AgentFile:
    """The agent this controller ships: its bytes and their sha256 (what ``hello`` must report)."""

    path: Path
    data: bytes
    sha256: str

    @property
    def remote_name(self) -> str:
        """Content-addressed, so a file of this name on a node is this exact agent or a tamper."""
        return f"llmgw_agent-{self.sha256[:12]}.py"


@cache
def _load_agent(path: Path, mtime_ns: int) -> AgentFile:  # noqa: ARG001 - part of the cache key
    data = path.read_bytes()
    return AgentFile(path=path, data=data, sha256=hashlib.sha256(data).hexdigest())


def local_agent(path: Path = AGENT_PATH) -> AgentFile:
    """The agent file next to this package, re-read when it changes on disk."""
    try:
        return _load_agent(path, path.stat().st_mtime_ns)
    except OSError as exc:
        raise ConfigError(f"the agent file {path} cannot be read (a broken install?): {exc}") from exc


def encode_request(request_id: int, verb: str, request: Answer) -> bytes:
    """One ``serve`` request line."""
    return json.dumps({"id": request_id, "verb": verb, "request": request}, separators=(",", ":")).encode() + b"\n"


def decode_answer(node_id: str, verb: str, message: Answer) -> Answer:
    """The answer of one ``serve`` reply, or ``AgentError`` carrying the agent's reason."""
    if "error" in message:
        refused = message.get("refused")
        if isinstance(refused, dict) and isinstance(refused.get("setting"), str):
            raise StartRefused(f"{node_id}: {verb}: {message['error']}", setting=refused["setting"])
        raise AgentError(f"{node_id}: {verb}: {message['error']}")
    answer = message.get("answer")
    if not isinstance(answer, dict):
        raise AgentError(f"{node_id}: {verb}: malformed answer {str(message)[:200]!r}")
    return answer
