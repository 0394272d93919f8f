"""One dispatcher for a mixed fleet: SSH nodes and the local node behind the same verbs."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from llmgw.catalog import NodeSpec
from llmgw.dispatch.base import AgentVerbs, Answer, NodeTarget
from llmgw.dispatch.local import LocalDispatcher
from llmgw.dispatch.ssh import SshDispatcher
from llmgw.errors import ConfigError, NodeUnreachable


def target_of(spec: NodeSpec) -> NodeTarget:
    return NodeTarget(spec.id, spec.address, port=spec.port, user=spec.user, transport=spec.transport,
                      agent_config=spec.agent_config)


class FleetDispatcher(AgentVerbs):
    """Routes each call to the transport its node is declared with in nodes.yaml."""

    def __init__(
        self,
        *,
        ssh_key: Path | None,
        known_hosts: Path | None,
        local_agent_config: Path | None = None,
        call_timeout: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.ssh_key = ssh_key
        self.known_hosts = known_hosts
        self.local_agent_config = local_agent_config
        self.call_timeout = call_timeout
        self.connect_timeout = connect_timeout
        self._ssh: SshDispatcher | None = None
        self._local: LocalDispatcher | None = None
        self._route: dict[str, AgentVerbs] = {}
        self._local_ids: set[str] = set()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        for d in (self._ssh, self._local):
            if d is not None:
                await d.close()
        self._ssh = self._local = None
        self._route = {}

    async def set_nodes(self, specs: Iterable[NodeSpec]) -> None:
        targets = [target_of(s) for s in specs]
        ssh = [t for t in targets if t.transport == "ssh"]
        local = [t for t in targets if t.transport == "local"]
        route: dict[str, AgentVerbs] = {}
        if ssh:
            if self._ssh is None:
                if self.ssh_key is None or self.known_hosts is None:
                    raise ConfigError("nodes.yaml has SSH nodes but no ssh_key/known_hosts is configured")
                self._ssh = SshDispatcher(ssh, client_key=self.ssh_key, known_hosts=self.known_hosts,
                                          call_timeout=self.call_timeout, connect_timeout=self.connect_timeout)
                await self._ssh.open()
            else:
                await self._ssh.set_targets(ssh)
            route.update((t.id, self._ssh) for t in ssh)
        if local:
            if self._local is not None and {t.id for t in local} != self._local_ids:
                await self._local.close()
                self._local = None
            if self._local is None:
                env = {"LLMGW_AGENT_CONFIG": str(self.local_agent_config)} if self.local_agent_config else {}
                self._local = LocalDispatcher(local, call_timeout=self.call_timeout, env={**os.environ, **env})
                await self._local.open()
                self._local_ids = {t.id for t in local}
            route.update((t.id, self._local) for t in local)
        self._route = route

    async def call(self, node_id: str, verb: str, request: Answer, *, timeout: float | None = None) -> Answer:
        d = self._route.get(node_id)
        if d is None:
            raise NodeUnreachable(f"{node_id}: not a node of the fleet")
        return await d.call(node_id, verb, request, timeout=timeout)
