"""The local transport: the same agent, run as a subprocess of the controller.

This is the embedded default for a single machine (``llmgw up``): no SSH, but the very same
agent file and the very same ``serve`` protocol, so what the reconciler sees does not depend on
how a node is reached. One ``serve`` process per local node, started on first use and again if
it dies; a call that gets no word from it within the timeout kills it (it is hung), and the next
call starts a fresh one. Engines belong to the agent's node, not to the ``serve`` process: they
keep running when the dispatcher closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from llmgw.dispatch.base import (
    AGENT_PATH,
    AgentVerbs,
    Answer,
    HelloAnswer,
    NodeTarget,
    decode_answer,
    encode_request,
)
from llmgw.dispatch.channel import NoAnswer, PendingCalls
from llmgw.errors import DispatchError, NodeUnreachable

log = logging.getLogger(__name__)
LINE_LIMIT = 64 * 1024 * 1024  # an inventory of a node with many weights is one long line
STDERR_TAIL = 2048


class _LocalAgent:
    """One ``serve`` subprocess and the calls waiting on it."""

    def __init__(self, node_id: str, proc: asyncio.subprocess.Process, config: tuple[int, ...] | None = None) -> None:
        self.node_id = node_id
        self.proc = proc
        self.config = config  # the node config's identity when it started (see _config_identity)
        self.pending = PendingCalls(node_id)
        self.stderr = bytearray()
        self.closed = False
        self._tasks = [
            asyncio.create_task(self._read(), name=f"llmgw-local-{node_id}-read"),
            asyncio.create_task(self._drain_stderr(), name=f"llmgw-local-{node_id}-stderr"),
        ]

    async def call(self, verb: str, request: Answer, timeout: float) -> Answer:
        request_id, future = self.pending.add()
        sent_at = self.pending.now()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(encode_request(request_id, verb, request))
            message = await asyncio.wait_for(self._drain_then(future), timeout)
        except TimeoutError:
            self.pending.discard(request_id)
            silent = self.pending.last_rx < sent_at and not self.pending.queued_behind(request_id)
            raise NoAnswer(silent) from None
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.pending.discard(request_id)
            raise NodeUnreachable(f"{self.node_id}: the local agent is gone: {exc}") from exc
        return decode_answer(self.node_id, verb, message)

    async def _drain_then(self, future: asyncio.Future[Answer]) -> Answer:
        assert self.proc.stdin is not None
        await self.proc.stdin.drain()
        return await future

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        reason = ""
        try:
            while line := await self.proc.stdout.readline():
                self.pending.feed([line.rstrip(b"\n")])
        except ValueError as exc:  # a line longer than LINE_LIMIT: the stream is unusable now
            reason = f": {exc}"
            self._kill()
        status = await self.proc.wait()
        await asyncio.sleep(0)  # let the stderr drain take the last of it
        tail = self.stderr.decode(errors="replace").strip()
        message = f"{self.node_id}: the local agent exited with status {status}{reason}"
        self._closed(NodeUnreachable(message + (f"; agent stderr: {tail[-500:]}" if tail else "")))

    async def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        while data := await self.proc.stderr.read(4096):
            self.stderr += data
            del self.stderr[:-STDERR_TAIL]

    def _closed(self, error: NodeUnreachable) -> None:
        if not self.closed:
            self.closed = True
            self.pending.fail_all(error)

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def close(self, reason: str, *, grace: float = 2.0) -> None:
        """EOF on the agent's stdin (it exits by itself), then a kill if it lingers."""
        self._closed(NodeUnreachable(f"{self.node_id}: {reason}"))
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self._kill()
            await self.proc.wait()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class LocalDispatcher(AgentVerbs):
    """The :class:`~llmgw.dispatch.base.Dispatcher` over local ``serve`` subprocesses.

    ``env`` adds variables to the agent's environment (the node config is passed with
    ``--config`` from ``NodeTarget.agent_config`` when set, else the agent finds its own).
    """

    def __init__(
        self,
        targets: Iterable[NodeTarget],
        *,
        python: str = sys.executable,
        agent_path: Path = AGENT_PATH,
        call_timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._targets = {t.id: t for t in targets}
        self.python = python
        self.agent_path = Path(agent_path)
        self.call_timeout = call_timeout
        self.env = dict(env or {})
        self._agents: dict[str, _LocalAgent] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._open = False

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        """Let every agent go; their engines keep running."""
        self._open = False
        agents, self._agents = self._agents, {}
        await asyncio.gather(*(a.close("the dispatcher was closed") for a in agents.values()))

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        agent = await self._agent(node_id)
        limit = self.call_timeout if timeout is None else timeout
        try:
            return await agent.call(verb, request, limit)
        except NoAnswer as exc:
            if exc.silent:
                await agent.close(f"no answer to {verb} within {limit:g}s", grace=0)
                raise NodeUnreachable(
                    f"{node_id}: {verb}: the agent said nothing within {limit:g}s; it was stopped"
                ) from None
            raise NodeUnreachable(f"{node_id}: {verb}: no answer within {limit:g}s") from None

    async def hello(self, node_id: str) -> HelloAnswer:
        answer = await self.call(node_id, "hello", {})
        return {**answer, "locked": False, "agent_path": str(self.agent_path)}  # type: ignore[typeddict-item]

    async def _agent(self, node_id: str) -> _LocalAgent:
        agent = self._agents.get(node_id)
        if agent is not None and not agent.closed and not self._config_changed(agent):
            return agent
        if not self._open:
            raise NodeUnreachable(f"{node_id}: the dispatcher is not open")
        try:
            target = self._targets[node_id]
        except KeyError:
            raise DispatchError(f"{node_id}: no such node in this dispatcher") from None
        async with self._locks.setdefault(node_id, asyncio.Lock()):
            agent = self._agents.get(node_id)
            if agent is not None and not agent.closed and self._config_changed(agent):
                # The node's owner changed its config (`llmgw models add PATH` lets it read a new
                # folder): a fresh agent reads it. Engines are the node's, not the agent's: they
                # run on. A call still in flight on the old one finishes first.
                log.info("%s: the node config changed; starting the local agent again", node_id)
                old = agent
                asyncio.get_running_loop().create_task(self._retire(old))
                agent = None
            if agent is None or agent.closed:
                agent = self._agents[node_id] = await self._spawn(target)
            return agent

    def _config_changed(self, agent: _LocalAgent) -> bool:
        target = self._targets.get(agent.node_id)
        return agent.config is not None and target is not None and _config_identity(target) != agent.config

    @staticmethod
    async def _retire(agent: _LocalAgent, *, wait: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + wait
        while len(agent.pending) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await agent.close("replaced after a change of the node config")

    async def _spawn(self, target: NodeTarget) -> _LocalAgent:
        config = _config_identity(target)  # before the agent reads it: a change meanwhile starts another
        argv = [self.python, str(self.agent_path)]
        if target.agent_config:
            argv += ["--config", target.agent_config]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                "serve",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **self.env},
                limit=LINE_LIMIT,
                start_new_session=True,  # a Ctrl-C aimed at the controller is not aimed at the node
            )
        except OSError as exc:
            raise NodeUnreachable(f"{target.id}: cannot start the local agent {argv}: {exc}") from exc
        log.info("%s: started the local agent (pid %d)", target.id, proc.pid)
        return _LocalAgent(target.id, proc, config)


def _config_identity(target: NodeTarget) -> tuple[int, ...] | None:
    """What tells one version of the node config file from the next (None: not known or not read)."""
    if not target.agent_config:
        return None
    try:
        st = os.stat(target.agent_config)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
