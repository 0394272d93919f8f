"""A standalone router's link to the controller: follow the watch stream, send usage reports.

Serving must not depend on the controller being alive. The follower applies every snapshot it
receives to the router (catalog view first, then the endpoint table) and, when the stream
drops or the controller is away, just keeps reconnecting with capped, jittered backoff; the
router goes on serving from the last snapshot meanwhile. Requests to replicas that are still
up keep succeeding; a replica that died meanwhile is retried around and cooled down by the
router as usual.

Reports (last use per replica, demand per model, what the router measured of each replica for
canary analysis) go out every ``report_interval`` seconds, and
at once when the router holds a request or serves one by fallback (:meth:`FeedClient.report_soon`
is the router's ``wake`` callback), so a model at zero is woken without waiting for the tick.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
from collections.abc import Callable
from typing import Any

import aiohttp

from llmgw.contract import REPORT_PATH, WATCH_PATH, SpentFigures, endpoint_from_json, spent_from_json
from llmgw.errors import ConfigError, LlmgwError
from llmgw.router.app import Router
from llmgw.router.feed import catalog_from_view
from llmgw.router.keys import KeyRing
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class WatchRefused(LlmgwError):
    """The controller answered, but not with a stream or a 200 (a wrong token, a wrong URL)."""


def default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{random.randrange(16**4):04x}"


class FeedClient:
    """Follows ``controller`` for ``router``. ``start()`` begins, ``close()`` ends; no I/O before."""

    def __init__(self, router: Router, controller: str, admin_token: str, *, router_id: str | None = None,
                 report_interval: float = 2.0, stale_after: float = 30.0, backoff_max: float = 10.0,
                 follow_keys: bool = True, on_keys: Callable[[KeyRing], None] | None = None) -> None:
        self.router = router
        self.follow_keys = follow_keys  # False when the router has its own --api-keys file
        self.on_keys = on_keys  # told the keys of every snapshot that carries them (the router logs them)
        self.controller = controller.rstrip("/")
        self.router_id = router_id or default_router_id()
        self.report_interval = report_interval
        self.stale_after = stale_after  # no line (not even a keepalive) for this long: reconnect
        self.backoff_max = backoff_max
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._report_now: asyncio.Event | None = None
        self.connected = False
        self.snapshots = 0
        self.version: int | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._report_now = asyncio.Event()
        self._tasks = [asyncio.create_task(self._watch_forever(), name="router-watch"),
                       asyncio.create_task(self._report_forever(), name="router-report")]

    async def close(self) -> None:
        """Stop following; usage not yet acknowledged is sent once more first (drain the router
        before, so its last answers are in it). What the controller does not take is logged."""
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        if self._session is not None:
            outbox = self.router.usage_outbox
            for _ in range(2):  # the batch in flight, then what was counted since
                if not outbox.pending:
                    break
                try:
                    await self._report_once()
                except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused) as exc:
                    log.warning("usage of %d (minute, key, model) rows not reported at stop (%s)", outbox.pending,
                                exc)
                    break
            # Gone, said once: the controller stops waiting on this router for drains (else it
            # would count it as "may still send a withdrawn replica one" until its report aged).
            try:
                await self._report_once(leaving=True, timeout=2.0)
            except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused):
                pass  # a controller away: its drains end at drain_timeout, or when the report ages
            await self._session.close()
            self._session = None

    def report_soon(self, _model: str | None = None) -> None:
        """Send a report now (the router's ``wake`` callback)."""
        if self._report_now is not None:
            self._report_now.set()

    # --- watch -----------------------------------------------------------------------------
    async def _watch_forever(self) -> None:
        delay = 0.25
        outage_logged = False
        while True:
            try:
                await self._watch_once()
                reason = "the controller closed the stream"
            except WatchRefused as exc:
                reason = str(exc)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if self.connected or not outage_logged:
                log.warning("watch of %s lost (%s); serving from the last snapshot, reconnecting",
                            self.controller, reason)
                outage_logged = True
            if self.connected:
                delay = 0.25  # it was working: come back quickly
            self.connected = False
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.backoff_max)

    async def _watch_once(self) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.stale_after)
        async with self._session.get(self.controller + WATCH_PATH, headers=self._headers, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.read())[:200].decode("utf-8", "replace")
                raise WatchRefused(f"watch answered {resp.status}: {text}")
            if not self.connected:
                log.info("following %s", self.controller)
                # At once, not at the next interval: a controller that just restarted learns what
                # this router has in flight (it waits on that before stopping a replica) and its demand.
                self.report_soon()
            self.connected = True
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                start = 0
                while (end := buf.find(b"\n", start)) >= 0:
                    self._apply(bytes(buf[start:end]))
                    start = end + 1
                del buf[:start]

    def _apply(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            snap: dict[str, Any] = json.loads(line)
            if snap.get("keepalive"):
                return
            routes = catalog_from_view(snap["catalog"])
            endpoints = [endpoint_from_json(e) for e in snap["endpoints"]]
            unrunnable = snap.get("unrunnable") or {}
            if not (isinstance(unrunnable, dict) and all(isinstance(v, str) for v in unrunnable.values())):
                raise TypeError("unrunnable must map model names to reasons")
            keys = None
            if self.follow_keys and snap.get("api_keys") is not None:
                keys = KeyRing.from_entries(snap["api_keys"], where="the controller's api_keys")
            limits_redis = snap.get("limits_redis", "")
            if not isinstance(limits_redis, str):
                raise TypeError("limits_redis must be a redis:// URL")
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            log.warning("ignoring a malformed snapshot from %s (%s); keeping the last one", self.controller, exc)
            return
        try:
            spent = _spent(snap)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the budgets' figures in a snapshot from %s (%s)", self.controller, exc)
            spent = None
        if keys is not None:
            self.router.keys = keys
            if self.on_keys is not None:
                self.on_keys(keys)
        if self.router.config.limits_redis == "":  # a router given its own Redis keeps it
            self.router.use_limits_redis(limits_redis)
        self.router.set_routes(routes)
        if spent is not None:  # before any request is admitted under this catalog
            self.router.set_spent(*spent)
        self.router.set_endpoints(endpoints)
        self.router.set_unrunnable(unrunnable)
        self.version = snap.get("version")
        self.snapshots += 1

    # --- report ----------------------------------------------------------------------------
    async def _report_forever(self) -> None:
        assert self._report_now is not None
        failing = False
        while True:
            try:
                await asyncio.wait_for(self._report_now.wait(), self.report_interval)
            except TimeoutError:
                pass
            self._report_now.clear()
            try:
                await self._report_once()
                failing = False
            except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused) as exc:
                if not failing:
                    log.warning("usage report to %s failed (%s); will keep trying", self.controller, exc)
                failing = True
                await asyncio.sleep(min(self.report_interval, 1.0))  # no tight loop while it is away

    async def _report_once(self, *, leaving: bool = False, timeout: float = 5.0) -> None:
        assert self._session is not None
        payload: dict[str, Any] = {
            "router_id": self.router_id,
            "last_used": self.router.last_used(),
            "demand": {m: {"held": d.held, "inflight": d.inflight} for m, d in self.router.demand().items()},
            "prompt_cache": {m: c.to_json() for m, c in self.router.prompt_cache(polled=False).items()},
            # Cumulative since this router process started; the instance tells the controller
            # when it restarted (its counters began again), so differences never go negative.
            "replica_stats": {"instance": self.router.instance_id, "replicas": {
                rid: s.to_json() for rid, s in self.router.replica_stats()[self.router.instance_id].items()}},
            # What the controller waits for before it stops a withdrawn replica's engine: none of
            # this router's requests on it, and this router serving from the list without it.
            "in_flight": self.router.in_flight(),
            "report_interval": self.report_interval,  # silent for 3 of these: gone, for drains
        }
        if leaving:
            payload["leaving"] = True
        if type(self.version) is int:
            payload["applied_version"] = self.version
        outbox = self.router.usage_outbox
        batch = outbox.take()
        if batch is not None:
            payload["usage"] = batch.to_json()
        async with self._session.post(self.controller + REPORT_PATH, json=payload, headers=self._headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise WatchRefused(f"report answered {resp.status}")
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            try:
                spent = _spent(answer)
            except (ValueError, TypeError) as exc:  # the ack still counts: only the figures are left out
                log.warning("ignoring the budgets' figures in the controller's answer (%s)", exc)
                spent = None
            if spent is not None:
                self.router.set_spent(*spent)
        if batch is not None:
            acked = answer.get("usage_acked") if isinstance(answer, dict) else None
            rejected = answer.get("usage_rejected") if isinstance(answer, dict) else None
            if acked == batch.seq:
                outbox.acked(batch.seq)
            elif rejected == batch.seq:  # sending it again cannot help: dropped, and said so
                log.error("usage batch %d (%d rows) was refused by the controller and is dropped",
                          batch.seq, len(batch.rows))
                outbox.acked(batch.seq)


def _spent(d: dict[str, Any]) -> tuple[SpentFigures, int] | None:
    """What budgets used per the controller's ledger, and how many routers share the limits (None:
    an older controller that says neither); ValueError/TypeError when malformed."""
    if d.get("spent") is None:
        return None
    routers = d.get("routers", 1)
    if type(routers) is not int or not 1 <= routers <= 100_000:
        raise ValueError(f"routers must be a whole number from 1, got {routers!r}")
    return spent_from_json(d["spent"]), routers
