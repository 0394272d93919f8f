"""The SSH transport: one persistent connection and one long-lived agent per node.

Where it sits: the reconciler calls a verb for a node; this finds (or makes) that node's
connection and sends the request as one line to the agent's ``serve`` process, which answers
with one line. A call is a round trip (~1.5 ms), never an SSH session of its own (~170 ms).

What a caller may rely on:

- Host keys are checked against ``known_hosts`` and never auto-accepted: an unknown or changed key
  is ``HostKeyRejected`` with the key's ``SHA256:`` fingerprint.
- Every call has a timeout; so have the TCP connect, the banner, authentication and channel opens.
  A node that says nothing within the timeout has its connection dropped, so the next call
  reconnects instead of queueing behind a dead one.
- A connection that fails is retried on a later call, no sooner than an exponential backoff
  (``backoff_initial`` doubling up to ``backoff_max``); calls in between fail at once with the
  last error, so a dead node costs the reconciler nothing per tick.
- A call already sent is never re-sent after a failure: ``start`` is not idempotent, and only the
  reconciler, reading ``status``, can tell whether it happened.
- Closing the dispatcher drops the connections; engines keep running on their nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import paramiko

from llmgw.dispatch.base import AGENT_PATH, AgentVerbs, Answer, HelloAnswer, NodeTarget, local_agent
from llmgw.dispatch.channel import NoAnswer
from llmgw.dispatch.sshconn import AgentChannel, SshConnection
from llmgw.errors import AgentError, ConfigError, DispatchError, NodeUnreachable

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class NodeStats:
    """What happened on one node's connection since the dispatcher was made (for metrics and tests)."""

    connected: bool
    connects: int
    uploads: int
    agent_starts: int
    consecutive_failures: int
    locked: bool | None
    agent_path: str | None
    last_error: str | None


class _Node:
    def __init__(self, target: NodeTarget) -> None:
        self.target = target
        self.lock = asyncio.Lock()
        self.conn: SshConnection | None = None
        self.channel: AgentChannel | None = None
        self.connects = 0
        self.uploads = 0
        self.agent_starts = 0
        self.failures = 0
        self.next_attempt = 0.0
        self.last_error: DispatchError | None = None


class SshDispatcher(AgentVerbs):
    """The :class:`~llmgw.dispatch.base.Dispatcher` over SSH (paramiko).

    ``client_key``: the controller's private key. ``known_hosts``: OpenSSH format, re-read on every
    connect so ``llmgw node trust`` takes effect without a restart. ``connect_timeout`` bounds the
    TCP connect, the banner, authentication, each channel open and each SFTP step;
    ``call_timeout`` bounds each call (``stop`` adds its grace period). ``max_concurrent_connects``
    bounds connects in flight across nodes. ``python`` is the interpreter named in the remote
    command and ``agent_dir`` where the agent is uploaded (relative: under the login directory).
    ``clock`` (monotonic seconds) drives the backoff, so tests can move time.
    """

    def __init__(
        self,
        targets: Iterable[NodeTarget],
        *,
        client_key: str | Path,
        known_hosts: str | Path,
        connect_timeout: float = 10.0,
        call_timeout: float = 30.0,
        max_concurrent_connects: int = 16,
        backoff_initial: float = 0.5,
        backoff_max: float = 60.0,
        keepalive_interval: int = 15,
        python: str = "python3",
        agent_path: Path = AGENT_PATH,
        agent_dir: str = ".llmgw",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nodes = {t.id: _Node(t) for t in targets}
        self.client_key = Path(client_key)
        self.known_hosts = Path(known_hosts)
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.max_concurrent_connects = max_concurrent_connects
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.keepalive_interval = keepalive_interval
        self.python = python
        self.agent_path = agent_path
        self.agent_dir = agent_dir
        self._clock = clock
        self._pkey: paramiko.PKey | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._connects: asyncio.Semaphore | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Load the client key and make the worker threads; connections open on first use."""
        if self._executor is not None:
            return
        try:
            self._pkey = paramiko.PKey.from_path(self.client_key)
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise ConfigError(f"cannot load the SSH private key {self.client_key}: {exc}") from exc
        # Connects block in threads; more threads than connect slots keep the channel opens and
        # closes of other nodes moving while a full batch of connects waits on slow nodes.
        self._executor = ThreadPoolExecutor(self.max_concurrent_connects + 4, thread_name_prefix="llmgw-ssh")
        self._connects = asyncio.Semaphore(self.max_concurrent_connects)

    async def close(self) -> None:
        """Drop every connection (engines keep running) and stop the worker threads."""
        if self._executor is None:
            return
        await asyncio.gather(*(self._drop(node, "the dispatcher was closed") for node in self._nodes.values()))
        self._executor.shutdown(wait=False)
        self._executor = None

    async def set_targets(self, targets: Iterable[NodeTarget]) -> None:
        """Replace the node list; connections to nodes removed or changed are dropped."""
        new = {t.id: t for t in targets}
        for node_id, node in list(self._nodes.items()):
            if new.get(node_id) != node.target:
                await self._drop(node, "the node left the fleet or changed")
                del self._nodes[node_id]
        for node_id, target in new.items():
            self._nodes.setdefault(node_id, _Node(target))

    async def disconnect(self, node_id: str) -> None:
        """Drop one node's connection now; the next call reconnects."""
        await self._drop(self._node(node_id), "disconnected on request")

    def stats(self, node_id: str) -> NodeStats:
        node = self._node(node_id)
        conn = node.conn
        return NodeStats(
            connected=conn is not None and node.channel is not None and not node.channel.closed,
            connects=node.connects,
            uploads=node.uploads,
            agent_starts=node.agent_starts,
            consecutive_failures=node.failures,
            locked=None if conn is None else conn.locked,
            agent_path=None if conn is None else conn.agent_path,
            last_error=None if node.last_error is None else str(node.last_error),
        )

    # --- calls -----------------------------------------------------------------------------

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        """Send one request to the node's agent and return its answer (an inventory's with ``locked``)."""
        answer, channel = await self._call(node_id, verb, request, timeout)
        if verb == "inventory":
            # Only the connection knows whether the node pins our key to its agent, and the inventory
            # is what `llmgw nodes` shows: without this a node logged as locked read `"locked": false`.
            return {**answer, "locked": channel.connection.locked}
        return answer

    async def hello(self, node_id: str) -> HelloAnswer:
        """The agent's hello, plus ``locked`` and ``agent_path`` from this connection."""
        answer, channel = await self._call(node_id, "hello", {}, None)
        conn = channel.connection
        return {**answer, "locked": conn.locked, "agent_path": "" if conn.locked else conn.agent_path}  # type: ignore[typeddict-item]

    async def _call(
        self, node_id: str, verb: str, request: Answer, timeout: float | None
    ) -> tuple[Answer, AgentChannel]:
        node = self._node(node_id)
        channel = node.channel
        if channel is None or channel.closed:
            channel = await self._ensure(node)
        limit = self.call_timeout if timeout is None else timeout
        try:
            return await channel.call(verb, request, limit), channel
        except NoAnswer as exc:
            if exc.silent:
                await self._drop(node, f"no answer to {verb} within {limit:g}s", channel)
                raise NodeUnreachable(
                    f"{node_id}: {verb}: the node said nothing within {limit:g}s; connection dropped"
                ) from None
            raise NodeUnreachable(f"{node_id}: {verb}: no answer within {limit:g}s") from None

    def _node(self, node_id: str) -> _Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise DispatchError(f"{node_id}: no such node in this dispatcher") from None

    # --- connecting ------------------------------------------------------------------------

    async def _ensure(self, node: _Node) -> AgentChannel:
        if self._executor is None:
            raise NodeUnreachable(f"{node.target.id}: the dispatcher is not open")
        async with node.lock:
            if node.channel is not None and not node.channel.closed:
                return node.channel  # another caller connected while this one waited
            if node.conn is not None and node.conn.active():
                log.info("%s: the agent went away; starting it again on the open connection", node.target.id)
                try:
                    return await self._start_agent(node, node.conn)
                except NodeUnreachable as exc:
                    await self._drop(node, f"restarting the agent failed: {exc}")
            channel = await self._connect(node)
            if self._executor is None:  # closed while this connect was in flight: do not leak it
                await self._drop(node, "the dispatcher was closed")
                raise NodeUnreachable(f"{node.target.id}: the dispatcher was closed")
            return channel

    async def _connect(self, node: _Node) -> AgentChannel:
        now = self._clock()
        if node.last_error is not None and now < node.next_attempt:
            wait = node.next_attempt - now
            raise type(node.last_error)(f"{node.last_error} (next attempt in {wait:.1f}s)")
        assert self._connects is not None and self._pkey is not None
        conn = SshConnection(
            node.target, local_agent(self.agent_path), python=self.python, agent_dir=self.agent_dir
        )
        try:
            async with self._connects:
                await self._blocking(conn, self._open_blocking, conn, budget=self.connect_timeout * 4)
            node.connects += 1
            node.conn = conn
            channel = await self._start_agent(node, conn)
        except DispatchError as exc:
            node.failures += 1
            node.last_error = exc
            delay = min(self.backoff_max, self.backoff_initial * 2 ** (node.failures - 1))
            node.next_attempt = self._clock() + delay
            node.conn = None
            await self._run(conn.close)
            raise
        finally:
            node.uploads += conn.uploads
            conn.uploads = 0
        node.failures = 0
        node.last_error = None
        return channel

    def _open_blocking(self, conn: SshConnection) -> None:
        assert self._pkey is not None
        conn.connect(self._pkey, self.known_hosts, timeout=self.connect_timeout)
        conn.client.get_transport().set_keepalive(self.keepalive_interval)
        conn.install(force=False, timeout=self.connect_timeout)

    async def _start_agent(self, node: _Node, conn: SshConnection, *, may_upload: bool = True) -> AgentChannel:
        """Start ``serve`` on ``conn`` and check with ``hello`` that it is the agent we ship."""
        chan = await self._blocking(conn, conn.exec_agent, self.connect_timeout, budget=self.connect_timeout * 2)
        channel = AgentChannel(conn, chan, asyncio.get_running_loop())
        channel.start()
        node.agent_starts += 1
        expected = conn.agent.sha256
        try:
            hello = await channel.call("hello", {}, self.connect_timeout)
            problem = None if conn.locked or hello.get("agent_sha256") == expected else "is not the agent we ship"
        except NoAnswer:
            channel.close("the agent did not answer hello")
            raise NodeUnreachable(
                f"{node.target.id}: the agent did not answer hello within {self.connect_timeout:g}s"
            ) from None
        except NodeUnreachable as exc:
            channel.close("hello failed")
            if conn.locked or not conn.active():
                raise
            problem = f"does not run ({exc})"  # a torn or tampered file under our name
        except DispatchError:
            channel.close("hello failed")
            raise
        if problem is not None:
            channel.close("the agent is not the one we ship")
            if not may_upload:
                raise AgentError(f"{node.target.id}: {conn.agent_path} {problem}, right after uploading it")
            log.warning("%s: %s %s; uploading it again", node.target.id, conn.agent_path, problem)
            await self._blocking(conn, lambda: conn.install(force=True, timeout=self.connect_timeout))
            node.uploads += conn.uploads
            conn.uploads = 0
            return await self._start_agent(node, conn, may_upload=False)
        if conn.locked:
            log.info("%s: locked node, agent version %s", node.target.id, hello.get("agent_version"))
        node.channel = channel
        return channel

    async def _drop(self, node: _Node, reason: str, only: AgentChannel | None = None) -> None:
        """Close the node's channel and connection (``only``: unless they were replaced meanwhile)."""
        channel, conn = node.channel, node.conn
        if only is not None and channel is not only:
            return
        node.channel = None
        node.conn = None
        if channel is not None:
            channel.close(reason)
        if conn is not None:
            await self._run(conn.close)

    # --- threads ---------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, *args)

    async def _blocking(
        self, conn: SshConnection, fn: Callable[..., T], *args: Any, budget: float | None = None
    ) -> T:
        """Run blocking paramiko work on a worker thread, abandoning it (connection closed) after ``budget``."""
        budget = self.connect_timeout * 2 if budget is None else budget
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(future, budget)
        except TimeoutError:
            # Closing the connection makes whatever the thread waits on fail, so it ends soon.
            loop.run_in_executor(self._executor, conn.close)
            raise NodeUnreachable(f"{conn.target.id}: no progress within {budget:g}s") from None
