"""One replica's way through its states, one step of I/O per tick.

Each step is idempotent against the agent (a second `fetch` joins the first, a second
`start` of a live replica id answers its record, `stop` of a dead one is a no-op), so a
tick cut short by a crash is simply done again by the next controller.

A replica across nodes (DESIGN §5) is all or nothing. Its workers (ranks > 0) start first; the
head (rank 0) starts once every worker answers (a llama.cpp worker's rpc-server listens, the
others run), since a llama.cpp head needs its workers' addresses and dies without them. Any
shard failing fails the replica: every shard is stopped at once, head first so no client is
served by a head whose workers are going, and the replica starts again as a whole after its
backoff. Only the shards that load weights fetch them (a llama.cpp worker has none).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import aiohttp

from llmgw.catalog import Catalog, Model, Profile
from llmgw.decide import acceptance
from llmgw.decide.replica import Backoff, Replica, ReplicaState, ShardStatus, fingerprint, next_failure
from llmgw.dispatch.base import Answer, Dispatcher
from llmgw.engines.argv import RPC_SERVER, engine_args, holds_weights, shard_engine, shard_env, shard_peers
from llmgw.engines.argv import Shard as EngineShard
from llmgw.engines.health import ask, check_health, probe_ready
from llmgw.errors import DispatchError, EngineArgsError, StartRefused, StoreError
from llmgw.inventory import EngineRecord, Inventory, NodeState
from llmgw.inventory.model import EngineLabels
from llmgw.store.protocol import Store

if TYPE_CHECKING:
    from llmgw.reconciler.config import ReconcilerConfig

log = logging.getLogger(__name__)

S = ReplicaState
ORIGIN = "origin"
PEER_TTL = 3600.0  # seconds a fetch's token opens its peer's entry
MAX_DIGESTS = 4096  # cache entries whose chunk-list digest is kept (the oldest forgotten first)
FOLLOW_TTL = 86400.0  # a follower's: it reads for as long as the origin takes (the agent's most)
SERVING_STATES = frozenset({NodeState.READY, NodeState.CORDONED, NodeState.DRAINING})
DIST_PORT_BASE = 29500
MAX_FAILED_WATCHED = 4096


class Lifecycle:
    def __init__(
        self, dispatcher: Dispatcher, session: aiohttp.ClientSession, store: Store,
        config: ReconcilerConfig, clock: Callable[[], float],
    ) -> None:
        self.dispatcher = dispatcher
        self.session = session
        self.store = store
        self.config = config
        self.clock = clock
        # A failed replica → since when, and its nodes' settings digests when first seen failed: a
        # change (the owner fixed the node config) retries it at once instead of after its backoff.
        self._failed_on: dict[str, tuple[float, tuple[str | None, ...]]] = {}
        # Replica id -> node -> how its weights are coming: the source read, bytes done and in all
        # (None: not known yet), as the node's agent last said. Only while the replica fetches.
        self.fetches: dict[str, dict[str, dict[str, object]]] = {}
        # Who each node's fetch of an entry reads from (ORIGIN or a node), the peer it was handed,
        # the fetches each holder serves now, and the nodes seen to complete an entry (the
        # inventory says so too, a poll later).
        self._fetching_from: dict[tuple[str, str], str] = {}
        self._peer_of: dict[tuple[str, str], Answer | None] = {}
        self._serving: dict[tuple[str, str], int] = {}
        self._holders: dict[str, set[str]] = {}
        # Nodes whose config serves no peers -> when to ask again (an owner may add peer_port).
        self._serves_none: dict[str, float] = {}
        # Cache name -> the digest of its chunk list as a node that read the origin made it: in the
        # store, so a restarted controller (or the next leader) has holders serve at once.
        self._digests: dict[str, str] = {}
        try:
            self._digests = dict(store.weight_digests())
        except StoreError as exc:
            log.warning("the weights' chunk-list digests were not read from the store (%s): a node reads the "
                        "origin again for each entry", exc)

    # --- observation (no I/O) ------------------------------------------------------------
    def observe(self, r: Replica, inventory: Inventory, now: float) -> Replica:
        """A ready or starting replica whose engine the agent reports exited has failed."""
        if r.state not in (S.READY, S.STARTING):
            return r
        for shard in r.shards:
            if shard.pid is None:
                continue
            record = _engine(inventory, shard)
            node = inventory.node(shard.node)
            # When the node's report was asked for: a node whose last poll failed keeps its older
            # report, from before this engine started perhaps (the poll's own time said fresh, and
            # a loading engine was taken for gone when one SSH call timed out).
            asked = node.last_seen if node is not None and node.last_seen is not None else inventory.taken_at
            if record is None and node is not None and node.report is not None and node.unreachable_since is None \
                    and (asked is None or asked > r.state_since):
                # The node answers but knows no such engine: its state was wiped (a reboot,
                # a reinstalled agent) or it was stopped behind our back. Start it again.
                return self._failed(r, now, f"engine on {shard.node} is gone (pid {shard.pid})")
            if record is not None and not record.alive and record.pid == shard.pid:
                return self._failed(r, now, exit_message(shard.node, record.exit_code, record.log_tail))
            if record is not None and record.alive and record.pid == shard.pid and record.port_shared_with:
                # Clients would be answered by whatever else listens there: started again, elsewhere.
                return self._failed(r, now, f"port {record.port} on {shard.node} is shared with "
                                            f"{record.port_shared_with} socket(s) of another process (another "
                                            "engine bound it too): started again on another port")
        return r

    # --- one step ----------------------------------------------------------------------
    async def advance(self, r: Replica, catalog: Catalog, inventory: Inventory) -> Replica:
        now = self.clock()
        model = catalog.model(r.model)
        profile = model.profile(r.profile) if model else None
        try:
            if r.state == S.STOPPING:
                return await self._stop(r, now)
            if model is None or profile is None:
                return r  # decide() stops it; nothing to start for a model that left
            if r.state in (S.PENDING, S.FETCHING):
                return await self._fetch_then_start(r, model, profile, inventory, now)
            if r.state == S.STARTING and profile.sharded and r.shards[0].pid is None:
                return await self._start_head(r, model, profile, inventory, now)
            if r.state == S.STARTING:
                return await self._probe(r, model, now)
            if r.state == S.FAILED and any(s.pid is not None for s in r.shards):
                # At once, not at the retry: the other shards of a replica across nodes would
                # otherwise hold their nodes (and a head keep serving) for the whole backoff.
                r = await self._stop_failed(r)
            r = self._retry_if_settings_changed(r, inventory, now)
            if r.state == S.FAILED and r.retry_at is not None and now >= r.retry_at:
                await self._stop_shards(r)
                fresh = tuple(replace(s, pid=None, port=None, endpoint=None, state="pending") for s in r.shards)
                return r.moved(S.PENDING, now, shards=fresh, retry_at=None)
        except StartRefused as exc:
            # The node's owner said no (DESIGN §4): an event and the replica's error name what
            # was refused and the node setting that decides; retried with backoff, since the
            # node config may change without a commit.
            return self._failed(r, now, f"refused by the node ({exc.setting}): {exc}")
        except DispatchError as exc:
            # A node that does not answer is the inventory's business (unreachable, then
            # lost); here the step simply happens again next tick.
            log.info("replica %s: %s", r.id, exc)
            return replace(r, error=str(exc))
        return r

    async def _fetch_then_start(
        self, r: Replica, model: Model, profile: Profile, inventory: Inventory, now: float
    ) -> Replica:
        if model.cache_name is not None:
            waiting = []
            progress: dict[str, dict[str, object]] = {}
            for shard in r.shards:
                if not holds_weights(profile, shard.rank):
                    continue  # a llama.cpp worker: the head sends it its layers
                node = inventory.node(shard.node)
                if node and node.report and model.cache_name in node.report.held \
                        and (shard.node, model.cache_name) not in self._fetching_from:
                    continue  # (a fetch this controller started is asked once more: its answer ends it)
                answer, source = await self._fetch_on(shard.node, model, inventory)
                state = answer.get("state")
                if state == "failed":
                    self.fetches.pop(r.id, None)
                    return self._failed(r, now, f"fetch on {shard.node} failed: {answer.get('error')}")
                if state != "done":
                    waiting.append(shard.node)
                    progress[shard.node] = {"from": source, "bytes_done": answer.get("bytes_done", 0),
                                            "bytes_total": answer.get("bytes_total")}
            if waiting:
                self.fetches[r.id] = progress
                return r.moved(S.FETCHING, now, error=None)
        self.fetches.pop(r.id, None)
        return await self._start(r, model, profile, inventory, now)

    async def _fetch_on(self, node_id: str, model: Model, inventory: Inventory) -> tuple[Answer, str]:
        """Have ``node_id`` fetch the model's weights, and say from where (DESIGN, weights at scale):
        from a node of the fleet that holds the entry when one does (it serves the next ones, so
        the origin is read about once), else from the origin unless another node reads it from
        there now (then this one waits for that copy). A fetch under way is joined where it reads."""
        name = model.cache_name
        assert name is not None
        key = (node_id, name)
        started = self._fetching_from.get(key)
        if started is None:
            # Nodes that answer (a lost or fenced one would hold the fetch up for a call's timeout)
            # and hold the entry, by their last report or by a fetch seen done since.
            now = self.clock()
            answering = {n.id for n in inventory.nodes.values() if n.report is not None and n.state in SERVING_STATES
                         and n.report.peer_port is not None and self._serves_none.get(n.id, 0.0) <= now}
            held = {n.id for n in inventory.nodes.values() if n.report is not None and name in n.report.held}
            # Only with the digest of a node's own read of the origin can a reader check a holder's
            # list (after a restart: none, until one node reads the origin again).
            holders = sorted(((held | self._holders.get(name, set())) & answering) - {node_id}) \
                if name in self._digests else []
            # Another node reading the origin now is waited for only if it will serve its copy.
            busy = [n for (n, e), f in self._fetching_from.items()
                    if e == name and f == ORIGIN and n != node_id and n in answering]
            started, peer = ORIGIN, None
            if not holders and busy:
                # Followed as it reads: its chunks as they come, so this node is done moments after it.
                peer = await self._offer(busy[0], name, inventory, growing=True)
                if peer is None:
                    return {"state": "waiting"}, f"{busy[0]}'s copy, once it has it"
                started = busy[0]
                self._serving[(started, name)] = self._serving.get((started, name), 0) + 1
            for holder in sorted(holders, key=lambda h: (self._serving.get((h, name), 0), h)):
                peer = await self._offer(holder, name, inventory)
                if peer is not None:
                    started, self._serving[(holder, name)] = holder, self._serving.get((holder, name), 0) + 1
                    break
            self._fetching_from[key] = started
            self._peer_of[key] = peer
        given = self._peer_of.get(key)
        try:
            answer = await self.dispatcher.fetch(node_id, model.source, peer=given)
        except DispatchError:
            self._end_fetch(key, started)
            raise
        if answer.get("state") in ("done", "failed"):
            self._end_fetch(key, started)
            if answer.get("state") == "done":
                self._holders.setdefault(name, set()).add(node_id)
                digest = answer.get("chunks_sha256")
                if started == ORIGIN and isinstance(digest, str) and name not in self._digests:
                    # What every later reader of this entry checks its chunk list against: the list
                    # of a node that read the origin itself, never a serving peer's own word.
                    self._digests[name] = digest
                    for old in list(self._digests)[:max(0, len(self._digests) - MAX_DIGESTS)]:
                        del self._digests[old]
                    try:
                        self.store.set_weight_digests(self._digests)
                    except StoreError as exc:  # kept in memory: only a restart forgets it
                        log.warning("the digest of %s's chunk list was not stored (%s)", name, exc)
        if started == ORIGIN:
            return answer, model.source
        following = (given or {}).get("follow") is True
        return answer, f"node {started}" + (" (as it reads the origin)" if following else "")

    def _end_fetch(self, key: tuple[str, str], started: str) -> None:
        self._fetching_from.pop(key, None)
        self._peer_of.pop(key, None)
        if started != ORIGIN:
            self._serving[(started, key[1])] = max(0, self._serving.get((started, key[1]), 1) - 1)

    async def _offer(self, holder: str, name: str, inventory: Inventory, *, growing: bool = False) -> Answer | None:
        """A token for one fetch of entry ``name`` from ``holder``'s peer server; None when it serves
        none, or when no node read this entry from the origin under this controller's eyes (the digest
        a reader checks comes from that read, not from the holder). ``growing``: ``holder`` reads the
        origin now (this controller started it): followed, its word the origin's, as its digest would be."""
        known = self._digests.get(name)
        node = inventory.node(holder)
        report = node.report if node is not None else None
        if (known is None and not growing) or report is None or report.peer_port is None \
                or not report.fabric_address:
            return None
        # Where the reader connects is the controller's word (the holder's fabric address and peer
        # port from its inventory), not a URL the holder's answer names: the reader's token goes there.
        host = f"[{report.fabric_address}]" if ":" in report.fabric_address else report.fabric_address
        url = f"http://{host}:{report.peer_port}"
        token = secrets.token_urlsafe(32)
        # A follower cannot be handed the digest of a list not made yet: the node it follows signs
        # what it answers with a key only the two of them are given, each over its own SSH channel.
        mac_key = secrets.token_hex(32) if growing else None
        try:
            seed = await self.dispatcher.seed(holder, name, hashlib.sha256(token.encode()).hexdigest(),
                                              ttl=FOLLOW_TTL if growing else PEER_TTL, mac_key=mac_key)
        except DispatchError as exc:  # its agent refused (no peer_port) or cannot be reached
            log.info("%s does not serve %s to other nodes (%s): read from the origin", holder, name, exc)
            if isinstance(exc, StartRefused):  # a node config without peer_port: not asked for a while
                self._serves_none[holder] = self.clock() + 600.0
            return None
        if mac_key is not None:
            return {"url": url, "token": token, "follow": True, "mac_key": mac_key}
        if seed.get("chunks_sha256") != known:
            log.warning("%s holds %s with another chunk list than the node that read the origin: not read from it",
                        holder, name)
            return None
        return {"url": url, "token": token, "chunks_sha256": known}

    async def _start(self, r: Replica, model: Model, profile: Profile, inventory: Inventory,
                     now: float) -> Replica:
        """Start a single-node replica's engine, or a replica across nodes' workers (its head
        waits for them: :meth:`_start_head`)."""
        shards = list(r.shards)
        for i, shard in enumerate(shards):
            if profile.sharded and shard.rank == 0:
                continue
            try:
                shards[i] = await self._start_shard(r, model, profile, shard, inventory)
            except EngineArgsError as exc:
                return self._failed(r, now, str(exc), permanent=True)
        if not profile.sharded:
            self.store.add_event("replica-starting", r.id,
                                 f"{model.name}/{profile.name}: engine started on "
                                 + ", ".join(f"{s.node} pid {s.pid}" for s in shards))
        else:
            self.store.add_event("replica-starting", r.id,
                                 f"{model.name}/{profile.name}: workers started on "
                                 + ", ".join(f"{s.node} (rank {s.rank}) pid {s.pid}" for s in shards if s.rank)
                                 + f"; the head on {shards[0].node} starts once every worker answers")
        return r.moved(S.STARTING, now, shards=tuple(shards), error=None)

    async def _start_head(self, r: Replica, model: Model, profile: Profile, inventory: Inventory,
                          now: float) -> Replica:
        waiting = [f"{s.node} (rank {s.rank})" for s in r.shards[1:]
                   if not _answers(inventory, s, shard_engine(profile, s.rank))]
        if waiting:
            if now - r.state_since > self.config.start_timeout:
                return self._failed(r, now, f"workers did not answer within {self.config.start_timeout:g}s: "
                                    + ", ".join(waiting))
            return replace(r, error=f"waiting for workers: {', '.join(waiting)}")
        try:
            head = await self._start_shard(r, model, profile, r.shards[0], inventory)
        except EngineArgsError as exc:
            return self._failed(r, now, str(exc), permanent=True)
        self.store.add_event("replica-starting", r.id,
                             f"{model.name}/{profile.name}: every worker answers; head started on {head.node} "
                             f"pid {head.pid}")
        return replace(r, shards=(head, *r.shards[1:]), error=None)

    async def _start_shard(self, r: Replica, model: Model, profile: Profile, shard: ShardStatus,
                           inventory: Inventory) -> ShardStatus:
        """Start one rank; raises EngineArgsError when its argv cannot be built."""
        eshard = None
        if profile.sharded:
            head = r.shards[0]
            eshard = EngineShard(shard.rank, len(r.shards), _fabric_address(inventory, head.node),
                                 DIST_PORT_BASE + r.generation % 1000,
                                 workers=tuple(_hostport(s.endpoint) for s in r.shards[1:] if s.endpoint)
                                 if shard.rank == 0 else ())
        args = engine_args(model, profile, eshard)
        answer = await self.dispatcher.start(shard.node, {
            "replica_id": shard.agent_id,
            "engine": shard_engine(profile, shard.rank),
            "args": list(args),
            "env": {**shard_env(profile, eshard), **dict(profile.env)},  # the operator's word wins
            "gpus": list(shard.gpus),
            "port": None,
            "weights": model.weights_ref if holds_weights(profile, shard.rank) else None,
            "peers": list(shard_peers(profile, eshard)),
            # Enough to rebuild this replica's record from what the agents report: a controller with
            # no record of the engine (a new leader, an older copy of the data dir) adopts it. The
            # fingerprint of the spec it is started with, which is what it runs.
            "labels": EngineLabels(
                replica=r.id, model=model.name, profile=profile.name, rank=shard.rank, shards=len(r.shards),
                generation=r.generation, fingerprint=fingerprint(model, profile), canary=r.canary, revision=r.revision,
            ).to_labels(),
        })
        return replace(shard, pid=answer.get("pid"), port=answer.get("port"), endpoint=answer.get("endpoint"),
                       state="started")

    async def _probe(self, r: Replica, model: Model, now: float) -> Replica:
        endpoint = r.endpoint
        if not endpoint:
            return r.moved(S.PENDING, now)
        health = await check_health(self.session, endpoint, timeout=self.config.probe_timeout)
        # Ready means a real one-token answer: /health can say ok before the model serves.
        if health == "ok" and await probe_ready(self.session, endpoint, model.name, model.task,
                                                timeout=self.config.probe_timeout):
            # A new replica answers the model's acceptance prompts before any client is sent to
            # it (an adopted one served already): the wrong words pass every other check.
            if not r.adopted and model.rollout.acceptance:
                failed = await self._acceptance(endpoint, model)
                if failed is not None:
                    self.store.add_event("replica-acceptance-failed", r.id, f"{model.name}: {failed}")
                    return self._failed(r, now, failed)
            verb = "adopted" if r.adopted else "ready"
            self.store.add_event("replica-ready", r.id, f"{model.name} {verb} at {endpoint}")
            # The failure count stays: it is forgotten only once the replica has served a while.
            return r.moved(S.READY, now, error=None)
        if now - r.state_since > self.config.start_timeout:
            return self._failed(r, now, f"not ready within {self.config.start_timeout:g}s (health: {health})")
        return replace(r, error=None if health in ("ok", "loading") else f"health: {health}")

    async def _acceptance(self, endpoint: str, model: Model) -> str | None:
        """None when the replica answered every acceptance prompt as expected, else the first finding."""
        clock = self.clock
        for a in model.rollout.acceptance:
            path, body = acceptance.request_of(a, model.name, model.task)
            started = clock()
            answer, error = await ask(self.session, endpoint, path, body,
                                      timeout=max(self.config.probe_timeout, a.latency or 0.0))
            took = clock() - started
            if error is not None:
                return acceptance.finding(a, error, None)
            text = acceptance.answer_text(answer)
            if text is None:
                return acceptance.finding(a, "the answer has no text", None)
            problem = acceptance.judge(a, text, took)
            if problem is not None:
                return acceptance.finding(a, problem, text)
        return None

    async def _stop(self, r: Replica, now: float) -> Replica:
        await self._stop_shards(r)
        self.store.add_event("replica-stopped", r.id, f"{r.model}: {r.stop_reason or 'stopped'}")
        return r.moved(S.STOPPED, now)

    async def _stop_shards(self, r: Replica) -> bool:
        """Stop every shard, the head first (it serves clients and would fail them when its
        workers go); True when every node answered."""
        answered = True
        for shard in sorted(r.shards, key=lambda s: s.rank):
            answered = await self.stop_engine(shard.node, shard.agent_id) and answered
        return answered

    async def _stop_failed(self, r: Replica) -> Replica:
        """A failed replica's shards stopped now; a shard whose node did not answer keeps its pid,
        so it is asked again (and at the retry)."""
        shards = []
        for shard in sorted(r.shards, key=lambda s: s.rank):
            if await self.stop_engine(shard.node, shard.agent_id):
                shard = replace(shard, pid=None, port=None, endpoint=None, state="stopped")
            shards.append(shard)
        stopped = [f"{s.node} (rank {s.rank})" for s in shards if s.pid is None]
        if len(r.shards) > 1 and stopped:
            self.store.add_event("replica-shards-stopped", r.id,
                                 f"{r.model}: every shard stopped, head first: {', '.join(stopped)}")
        return replace(r, shards=tuple(shards))

    async def stop_engine(self, node_id: str, agent_id: str) -> bool:
        """Stop one engine; True when the node answered (the engine is gone either way)."""
        try:
            await self.dispatcher.stop(node_id, agent_id, grace_seconds=self.config.stop_grace)
        except DispatchError as exc:
            log.info("stop %s on %s: %s", agent_id, node_id, exc)
            return False
        return True

    def _retry_if_settings_changed(self, r: Replica, inventory: Inventory, now: float) -> Replica:
        """A failed replica waiting out its backoff is retried now (its count going on) when the
        config of a node it runs on changed since it failed: an owner who fixed what refused or broke
        the start (engines, sandbox_paths, env_allow, ...) should not wait up to the backoff's cap
        (seen: 32 s after the fix)."""
        if r.state != S.FAILED or r.retry_at is None or now >= r.retry_at \
                or r.failures >= self.config.crash_loop_after:
            # In a crash loop the backoff holds, whatever the node reports: a digest that changes
            # at every poll (a tool stamping the file) must not restart it every tick.
            self._failed_on.pop(r.id, None)
            return r
        nodes = sorted(set(r.nodes))
        seen = tuple(n.report.settings if (n := inventory.node(x)) is not None and n.report is not None else None
                     for x in nodes)
        since, then = self._failed_on.get(r.id, (None, ()))
        if since != r.state_since:  # failed again since: judged from this failure on
            while len(self._failed_on) >= MAX_FAILED_WATCHED:  # replicas stopped while failed
                del self._failed_on[next(iter(self._failed_on))]
            self._failed_on[r.id] = (r.state_since, seen)
            return r
        changed = [x for x, a, b in zip(nodes, then, seen, strict=True) if a is not None and b is not None and a != b]
        if not changed:
            return r
        del self._failed_on[r.id]
        self.store.add_event("replica-retry", r.id, f"{r.model}: the config of node {', '.join(changed)} changed since "
                             f"it failed: retried now, not in {r.retry_at - now:.0f}s")
        return replace(r, retry_at=now)  # the count goes on: a fix that did not fix it backs off as before

    def _failed(self, r: Replica, now: float, error: str, *, permanent: bool = False) -> Replica:
        c = self.config
        f = next_failure(r, now, Backoff(c.backoff_base, c.backoff_cap, c.crash_reset_after, c.crash_loop_after))
        message = (f"crash loop ({f.count} failures): " if f.crash_loop else "") + error
        after = f" after {f.ran:.0f}s ready, so the count starts again" if f.forgot else ""
        self.store.add_event("replica-failed", r.id,
                             f"{r.model}: {message}; failure {f.count}{after}; "
                             + ("not retried" if permanent else f"retry in {f.delay:g}s"))
        return r.moved(S.FAILED, now, error=message, failures=f.count,
                       retry_at=None if permanent else now + f.delay)


def _answers(inventory: Inventory, shard: ShardStatus, engine: str) -> bool:
    """A worker answers: its engine runs (the very process started), and an rpc-server's port
    accepts connections (the agent reads the kernel's listening sockets)."""
    record = _engine(inventory, shard)
    if record is None or not record.alive or record.pid != shard.pid:
        return False
    return record.listening or engine != RPC_SERVER


def _fabric_address(inventory: Inventory, node_id: str) -> str:
    """Where the other ranks reach ``node_id``: its agent's fabric_address, else its nodes.yaml
    address (an agent older than multi-node replicas)."""
    node = inventory.node(node_id)
    if node is None:
        return node_id
    if node.report is not None and node.report.fabric_address:
        return node.report.fabric_address
    return node.spec.address


def _hostport(endpoint: str) -> str:
    """``host:port`` of an engine endpoint (``tcp://10.0.0.12:8101`` → ``10.0.0.12:8101``)."""
    return endpoint.split("://", 1)[-1].rstrip("/")


def _engine(inventory: Inventory, shard: ShardStatus) -> EngineRecord | None:
    node = inventory.node(shard.node)
    if node is None or node.report is None:
        return None
    return next((e for e in node.report.engines if e.replica_id == shard.agent_id), None)


# The agent's own line in an engine's log: the argv it started, sandbox included (thousands of
# characters). Seen: a shared library missing beside llama-server was the last words of a
# 2,777-character message that was mostly bubblewrap's command line.
AGENT_LINE = "=== llmgw-agent"
EXIT_HINTS = {126: "the engine's executable cannot be run (its permissions, or the sandbox hides it)",
              127: "the engine's executable or a library it needs was not found (inside the sandbox: "
                   "its directory must be in sandbox_paths)"}
LINE_CHARS = 300


def exit_message(node: str, code: int | None, log_tail: tuple[str, ...] | list[str]) -> str:
    """Why an engine ended, its own last words first; never the agent's argv line."""
    own = [line.strip()[:LINE_CHARS] for line in log_tail if line.strip() and not line.startswith(AGENT_LINE)]
    said = " | ".join(own[-3:]) if own else "it wrote nothing to stderr"
    hint = f" ({EXIT_HINTS[code]})" if code in EXIT_HINTS else ""
    return f"engine on {node} exited with code {code}{hint}: {said}"
