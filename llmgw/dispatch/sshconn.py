"""The blocking half of the SSH transport: one paramiko connection and the agent process on it.

Everything here blocks and runs on the dispatcher's worker threads, never on the event loop.
:class:`SshConnection` connects with the host key checked against known_hosts (never accepted
on first sight), installs the agent when the node lacks this exact one, and opens the channel
the ``serve`` process lives on. :class:`AgentChannel` then moves lines between that channel and
the event loop with a reader, a stderr drain and a writer thread, so a slow or hung node can
block a thread but never the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paramiko

from llmgw.dispatch.base import AgentFile, Answer, NodeTarget, decode_answer, encode_request
from llmgw.dispatch.channel import NoAnswer, PendingCalls, split_lines
from llmgw.dispatch.trust import fingerprint, known_hosts_name
from llmgw.errors import HostKeyRejected, NodeUnreachable

log = logging.getLogger(__name__)

# What paramiko and the socket layer raise when a connection or a channel fails.
SSH_ERRORS: tuple[type[BaseException], ...] = (paramiko.SSHException, paramiko.SFTPError, EOFError, OSError)
STDERR_TAIL = 2048


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, name: str, key: paramiko.PKey) -> None:
        super().__init__(name)
        self.name = name
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    """RejectPolicy that keeps the offending key, so the refusal can name its fingerprint."""

    def missing_host_key(
        self,
        client: paramiko.SSHClient,  # noqa: ARG002 - paramiko's signature
        hostname: str,
        key: paramiko.PKey,
    ) -> None:
        raise _UnknownHostKey(hostname, key)


class SshConnection:
    """One SSH connection to one node. Constructing it does no I/O; ``connect`` does."""

    def __init__(
        self, target: NodeTarget, agent: AgentFile, *, python: str = "python3", agent_dir: str = ".llmgw"
    ) -> None:
        self.target = target
        self.agent = agent
        self.python = python
        self.agent_dir = agent_dir  # relative paths are under the login directory
        self.client = paramiko.SSHClient()
        self.locked = False
        self.agent_path = f"{agent_dir}/{agent.remote_name}"
        self.uploads = 0

    def connect(self, pkey: paramiko.PKey, known_hosts: Path, *, timeout: float) -> None:
        """Connect and authenticate; the host key must already be in ``known_hosts``."""
        t = self.target
        name = known_hosts_name(t.host, t.port)
        try:
            if known_hosts.exists():
                self.client.load_host_keys(str(known_hosts))
            self.client.set_missing_host_key_policy(_RejectUnknown())
            self.client.connect(
                t.host,
                t.port,
                username=t.user,
                pkey=pkey,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                allow_agent=False,
                look_for_keys=False,
            )
        except _UnknownHostKey as exc:
            raise HostKeyRejected(
                f"{t.id}: host key {fingerprint(exc.key)} ({exc.key.get_name()}) of {name} is not in "
                f"{known_hosts}; if that is the node's key, run `llmgw node trust {t.host}:{t.port}`"
            ) from exc
        except paramiko.BadHostKeyException as exc:
            raise HostKeyRejected(
                f"{t.id}: the host key of {name} changed: it presents {fingerprint(exc.key)}, {known_hosts} "
                f"has {fingerprint(exc.expected_key)}; a reinstalled node must be trusted again, "
                "anything else may be an attack"
            ) from exc
        except paramiko.AuthenticationException as exc:
            raise NodeUnreachable(f"{t.id}: {name} refused our key for user {t.user}: {exc}") from exc
        except SSH_ERRORS as exc:
            raise NodeUnreachable(f"{t.id}: cannot connect to {name}: {_describe(exc)}") from exc

    def install(self, *, force: bool, timeout: float) -> None:
        """Make sure the node has this agent; a node that refuses SFTP is taken as locked.

        The remote name carries the agent's hash, so an existing file of that name is this agent
        (``hello`` confirms it); ``force`` uploads anyway (``hello`` said otherwise). The upload goes
        to a temporary name renamed into place, so two controllers uploading at once, or a
        connection lost halfway, never leave a torn agent under the real name.
        """
        try:
            sftp = self._open_sftp(timeout)
        except SSH_ERRORS as exc:
            # A node pinning our key to a forced command runs that command for the sftp subsystem
            # too, so SFTP cannot even start: that is what a locked node looks like from here.
            log.info("%s: SFTP refused (%s): treating the node as locked", self.target.id, _describe(exc))
            self.locked = True
            return
        try:
            directory = self.agent_dir
            if not directory.startswith("/"):
                directory = f"{sftp.normalize('.')}/{directory}"
            self.agent_path = f"{directory}/{self.agent.remote_name}"
            if not force and _exists(sftp, self.agent_path):
                return
            if not _exists(sftp, directory):
                try:
                    sftp.mkdir(directory, 0o700)
                except OSError:
                    if not _exists(sftp, directory):  # not made by a concurrent upload either
                        raise
            tmp = f"{directory}/.{self.agent.remote_name}.{secrets.token_hex(6)}.tmp"
            try:
                with sftp.open(tmp, "wb") as f:
                    f.set_pipelined(True)  # one round trip for the whole file, not one per 32 KiB
                    f.write(self.agent.data)
                sftp.posix_rename(tmp, self.agent_path)
            except SSH_ERRORS:
                _quietly(sftp.remove, tmp)
                raise
            self.uploads += 1
            log.info("%s: uploaded the agent to %s", self.target.id, self.agent_path)
        except SSH_ERRORS as exc:
            raise NodeUnreachable(f"{self.target.id}: cannot install the agent: {_describe(exc)}") from exc
        finally:
            sftp.close()

    def _open_sftp(self, timeout: float) -> paramiko.SFTPClient:
        transport = self._transport()
        chan = transport.open_session(timeout=timeout)
        chan.settimeout(timeout)  # SFTPClient has no timeout of its own: a hung reply must not hang us
        chan.invoke_subsystem("sftp")
        return paramiko.SFTPClient(chan)

    def command(self) -> str:
        """The remote command: fixed tokens, each quoted. A locked node ignores all but ``serve``."""
        argv = [self.python, self.agent_path]
        if self.target.agent_config:
            argv += ["--config", self.target.agent_config]
        return shlex.join([*argv, "serve"])

    def exec_agent(self, timeout: float) -> paramiko.Channel:
        """Open a channel and start ``serve`` on it."""
        try:
            chan = self._transport().open_session(timeout=timeout)
            chan.exec_command(self.command())
            return chan
        except SSH_ERRORS as exc:
            raise NodeUnreachable(f"{self.target.id}: cannot start the agent: {_describe(exc)}") from exc

    def _transport(self) -> paramiko.Transport:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise paramiko.SSHException("the connection is closed")
        return transport

    def active(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def close(self) -> None:
        self.client.close()


class AgentChannel:
    """One ``serve`` process on one SSH channel, with calls multiplexed by id.

    Three daemon threads serve it: a reader turns answer lines into resolved futures (through
    ``call_soon_threadsafe``), a drain keeps the tail of stderr for error messages, and a writer
    sends request lines, so a node that stops reading cannot stall the event loop on a full window.
    """

    def __init__(
        self,
        connection: SshConnection,
        chan: paramiko.Channel,
        loop: asyncio.AbstractEventLoop,
        *,
        on_closed: Callable[[AgentChannel], Any] | None = None,
    ) -> None:
        self.connection = connection
        self.node_id = connection.target.id
        self._chan = chan
        self._loop = loop
        self._on_closed = on_closed
        self.pending = PendingCalls(self.node_id)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._stderr = bytearray()
        self._stderr_done = threading.Event()
        self.closed = False

    def start(self) -> None:
        for target, name in ((self._read, "read"), (self._drain_stderr, "stderr"), (self._write, "write")):
            threading.Thread(target=target, name=f"llmgw-ssh-{self.node_id}-{name}", daemon=True).start()

    async def call(self, verb: str, request: Answer, timeout: float) -> Answer:
        """Send one request and wait for its answer; ``NoAnswer`` when ``timeout`` passes first."""
        request_id, future = self.pending.add()
        sent_at = self.pending.now()
        self._outbox.put(encode_request(request_id, verb, request))
        try:
            message = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self.pending.discard(request_id)
            silent = self.pending.last_rx < sent_at and not self.pending.queued_behind(request_id)
            raise NoAnswer(silent) from None
        return decode_answer(self.node_id, verb, message)

    def close(self, reason: str = "the dispatcher closed the connection") -> None:
        """Fail what is waiting and let the agent go (EOF on its stdin). Loop thread only."""
        if not self.closed:
            self._closed(NodeUnreachable(f"{self.node_id}: {reason}"))
        self._outbox.put(None)

    # --- threads ---------------------------------------------------------------------------

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _read(self) -> None:
        buffer = bytearray()
        reason = ""
        try:
            while data := self._chan.recv(65536):
                if lines := split_lines(buffer, data):
                    self._to_loop(self.pending.feed, lines)
        except SSH_ERRORS as exc:
            reason = _describe(exc)
        self._chan.status_event.wait(1.0)
        self._stderr_done.wait(1.0)
        status = self._chan.exit_status if self._chan.exit_status_ready() else None
        tail = self._stderr.decode(errors="replace").strip()
        if status is None or status == -1:
            message = f"{self.node_id}: the connection to the agent was lost{': ' + reason if reason else ''}"
        else:
            message = f"{self.node_id}: the agent exited with status {status}"
        if tail:
            message += f"; agent stderr: {tail[-500:]}"
        self._to_loop(self._closed, NodeUnreachable(message))

    def _drain_stderr(self) -> None:
        try:
            while data := self._chan.recv_stderr(4096):
                self._stderr += data
                del self._stderr[:-STDERR_TAIL]
        except SSH_ERRORS:
            pass
        self._stderr_done.set()

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._chan.sendall(data)
            except SSH_ERRORS as exc:
                log.debug("%s: send failed: %s", self.node_id, _describe(exc))
                return  # the reader sees the channel close and fails what is waiting
        _quietly(self._chan.shutdown_write)

    def _closed(self, error: NodeUnreachable) -> None:
        if self.closed:
            return
        self.closed = True
        self.pending.fail_all(error)
        if self._on_closed is not None:
            self._on_closed(self)


def _exists(sftp: paramiko.SFTPClient, path: str) -> bool:
    try:
        sftp.stat(path)
    except FileNotFoundError:
        return False
    return True


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except SSH_ERRORS:
        pass


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
