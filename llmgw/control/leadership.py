"""Which of several controllers sharing one PostgreSQL store leads (DESIGN §5 "High availability").

Each controller runs one :class:`Leadership` on the store's lease: a standby tries to take it
every ``retry`` seconds; the leader renews it every ``renew`` seconds and keeps a local monotonic
deadline (the grant's TTL counted from just before the call, less ``margin``). A leader that has
not renewed by that deadline stops acting (``on_standby``) even if the store call is still hanging:
past it another controller may hold the lease, and two leaders would both drive the nodes. A
graceful :meth:`Leadership.close` releases the lease so a standby takes over on its next try
instead of waiting the TTL out.

With the defaults (TTL 4 s, renew every 1 s, standbys trying every 0.5 s) a leader killed with
``kill -9`` is replaced within TTL + retry = 4.5 s, plus the new leader's start.

The leader's advertised admin URL travels in its holder id (``<host>-<pid>-<nonce>@<url>``):
the lease row already names the holder, so a standby reading :meth:`Store.leadership` learns
where to send routers and operators without another table. Store calls block, so they run on a
thread of this object's own (one at a time: a hung call delays the next, never runs beside it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.errors import StoreError
from llmgw.health import Tracker, describe
from llmgw.store.protocol import Store
from llmgw.store.records import Leadership as LeaseState
from llmgw.store.records import LeaseGrant

log = logging.getLogger(__name__)

T = TypeVar("T")

LEADER = "leader"
STANDBY = "standby"


@dataclass(frozen=True)
class LeadershipConfig:
    """The lease's timing. ``margin`` is how long before the lease can lapse on the database a
    leader that could not renew stops acting (room for stopping its reconciler)."""

    ttl: float = 4.0
    renew: float = 1.0
    retry: float = 0.5
    margin: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.renew < self.ttl - self.margin or self.margin <= 0 or self.retry <= 0:
            raise ValueError(f"lease timing: need 0 < renew < ttl - margin, margin > 0, retry > 0; got {self}")


def holder_id(url: str | None) -> str:
    """A holder id unique to this process (and this call), carrying the advertised admin URL."""
    base = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return f"{base}@{url}" if url else base


def advertised_url(holder: str | None) -> str | None:
    """The admin URL a holder id carries (:func:`holder_id`), or None."""
    if not holder:
        return None
    _, sep, url = holder.partition("@")
    return url or None if sep else None


class Leadership:
    """The lease loop of one controller. ``on_lead(epoch)`` runs when it takes the lease,
    ``on_standby()`` when it loses it (or could not renew in time); neither runs on ``close()``.
    The constructor does no I/O; ``start()`` starts the loop, ``close()`` stops it and releases."""

    def __init__(self, store: Store, *, url: str | None, on_lead: Callable[[int], Awaitable[None]],
                 on_standby: Callable[[], Awaitable[None]], config: LeadershipConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.url = url
        self.holder = holder_id(url)
        self.config = config or LeadershipConfig()
        self._on_lead = on_lead
        self._on_standby = on_standby
        self._clock = clock
        self._epoch: int | None = None
        self._deadline = 0.0
        self.seen: LeaseState | None = None  # the last leadership read from the store
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        # Each lease call is a turn (its times on the wall clock: they are shown, not compared).
        self.health = Tracker("leadership")

    # --- what others read (no I/O) ------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """True while this controller holds the lease and its local deadline has not passed."""
        return self._epoch is not None and self._clock() < self._deadline

    @property
    def epoch(self) -> int | None:
        return self._epoch if self.leading else None

    @property
    def role(self) -> str:
        return LEADER if self.leading else STANDBY

    @property
    def leader_url(self) -> str | None:
        """The leader's advertised admin URL, as last known (this controller's own when leading)."""
        if self.leading:
            return self.url
        seen = self._seen_other()
        return advertised_url(seen.leader) if seen is not None else None

    def _seen_other(self) -> LeaseState | None:
        """The leadership last read, unless it is this controller's own lease, lapsed (a stalled
        leader resumed): naming itself would send routers back to a controller that refuses them
        until it reads the store again."""
        return self.seen if self.seen is not None and self.seen.leader != self.holder else None

    def summary(self) -> dict[str, object]:
        seen = self.seen if self.leading else self._seen_other()
        return {"role": self.role, "holder": self.holder,
                "leader": self.holder if self.leading else (seen.leader if seen else None),
                "leader_url": self.leader_url,
                "epoch": self.epoch if self.leading else (seen.epoch if seen else None),
                "last_takeover": seen.taken if seen else None}

    # --- the loop -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-lease")
        self._task = asyncio.create_task(self._run(), name="llmgw-leadership")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        epoch, self._epoch = self._epoch, None
        if epoch is not None and self._pool is not None:
            try:  # a standby takes over at once rather than after the TTL
                await asyncio.wait_for(self._call(self.store.release_lease, self.holder, epoch),
                                       timeout=self.config.ttl)
            except (StoreError, TimeoutError) as exc:
                log.warning("could not release the leader lease (it lapses in %.1f s): %s", self.config.ttl, exc)
        pool, self._pool = self._pool, None
        if pool is not None:  # no store call runs after close() (the caller closes the store next)
            try:
                await asyncio.wait_for(asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True),
                                       timeout=self.config.ttl)
            except TimeoutError:
                log.warning("a leader lease call still hangs after close()")

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def _run(self) -> None:
        while True:
            try:
                await self._stand_by()
                await self._lead()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave a leader acting unchecked
                log.exception("leadership loop failed; standing by")
                self.health.failed(time.time(), exc)
                await self._step_down()
                await asyncio.sleep(self.config.retry)

    async def _stand_by(self) -> None:
        """Until this controller takes the lease (with a deadline still ahead)."""
        cfg = self.config
        while True:
            started = self._clock()
            try:
                grant = await asyncio.wait_for(self._call(self.store.acquire_lease, self.holder, ttl=cfg.ttl),
                                               timeout=cfg.ttl)
                self.health.ok(time.time())
                if grant is not None and self._take(grant, started):
                    return
                self.seen = await asyncio.wait_for(self._call(self.store.leadership), timeout=cfg.ttl)
            except (StoreError, TimeoutError) as exc:
                log.warning("leader lease: store call failed while standing by: %s", exc)
                self.health.failed(time.time(), f"standing by: {describe(exc)}")
            await asyncio.sleep(cfg.retry)

    def _take(self, grant: LeaseGrant, started: float) -> bool:
        deadline = grant.deadline(started, margin=self.config.margin)
        if deadline <= self._clock():
            return False  # granted too late to act on; it lapses by itself
        self._epoch, self._deadline = grant.epoch, deadline
        return True

    async def _lead(self) -> None:
        cfg = self.config
        epoch = self._epoch
        assert epoch is not None
        log.info("leading at epoch %d as %s", epoch, self.holder)
        try:
            self.seen = await asyncio.wait_for(self._call(self.store.leadership), timeout=cfg.renew)
        except (StoreError, TimeoutError):
            pass
        await self._on_lead(epoch)
        last = self._clock()
        while True:
            await asyncio.sleep(max(0.0, min(last + cfg.renew, self._deadline) - self._clock()))
            started = last = self._clock()
            remaining = self._deadline - started
            if remaining <= 0:
                log.warning("leader lease: not renewed by the deadline; standing by")
                break
            try:
                grant = await asyncio.wait_for(
                    self._call(self.store.renew_lease, self.holder, epoch, ttl=cfg.ttl), timeout=remaining)
            except TimeoutError:
                log.warning("leader lease: renewal did not answer by the deadline; standing by")
                self.health.failed(time.time(), "renewal did not answer by the lease's deadline")
                break
            except StoreError as exc:
                log.warning("leader lease: renewal failed (retrying until the deadline): %s", exc)
                self.health.failed(time.time(), f"renewal: {describe(exc)}")
                last = self._clock() - cfg.renew + cfg.retry
                continue
            self.health.ok(time.time())
            if grant is None:
                log.warning("leader lease: lost (epoch %d); standing by", epoch)
                break
            self._deadline = grant.deadline(started, margin=cfg.margin)
        await self._step_down()

    async def _step_down(self) -> None:
        was = self._epoch
        self._epoch = None
        if was is not None:
            await self._on_standby()


class LeadershipCollector(Collector):
    """/metrics: this controller's role, the leader it knows of, the epoch and the last takeover.
    ``view`` is :meth:`Controller.leadership_view` (no I/O: the lease loop's last reading)."""

    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self._view = view

    def collect(self) -> Iterator[Metric]:
        v = self._view()
        leader = GaugeMetricFamily("llmgw_controller_leader",
                                   "1 while this controller leads (alone on its store, or by the lease), else 0",
                                   labels=["holder", "leader", "leader_url"])
        leader.add_metric([str(v.get("holder") or ""), str(v.get("leader") or ""), str(v.get("leader_url") or "")],
                          1.0 if v.get("role") == LEADER else 0.0)
        yield leader
        seen = GaugeMetricFamily("llmgw_controller_seen_seconds",
                                 "Seconds since each controller on the shared store last checked in, by role",
                                 labels=["holder", "url", "role"])
        for c in v.get("controllers") or []:
            seen.add_metric([str(c["holder"]), str(c.get("url") or ""), str(c["role"])], float(c["seen_s_ago"]))
        yield seen
        if v.get("epoch") is not None:
            yield GaugeMetricFamily("llmgw_controller_lease_epoch",
                                    "The leader lease's epoch (the fencing token), as last read", value=v["epoch"])
        if v.get("last_takeover") is not None:
            yield GaugeMetricFamily("llmgw_controller_last_takeover_timestamp_seconds",
                                    "When the current leader took the lease (the database's clock)",
                                    value=v["last_takeover"])
