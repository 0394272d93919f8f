"""A standalone router's link to the controller: follow the watch stream, send usage reports.

Serving must not depend on the controller being alive. The follower applies every snapshot it
receives to the router (catalog view first, then the endpoint table) and, when the stream
drops or the controller is away, just keeps reconnecting with capped, jittered backoff; the
router goes on serving from the last snapshot meanwhile. Requests to replicas that are still
up keep succeeding; a replica that died meanwhile is retried around and cooled down by the
router as usual.

Several controllers (DESIGN §5 "High availability"): the router is given every one's address and
follows whichever leads. A standby answers with 503 naming the leader (``llmgw.contract``); whom
to try next, and how long to wait first, is :class:`llmgw.router.leader.Leadership`'s choice (a
hint outside the configured list is never contacted: the admin token goes nowhere else). Reports
go to the controller followed. A usage batch stays in the router's outbox until a leader answers
that its store has it (``usage_acked``), and goes again with the same number to whichever leads
next, so a batch sent to a leader that died is neither lost nor counted twice. ``/metrics`` says
which controller is followed (by its position in the list: the client port's metrics are public,
the admin addresses are not theirs to know) and how many times the router switched.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.contract import (
    LEADER_KEY,
    MAX_LEADER_URL,
    REPORT_PATH,
    STANDBY_STATUS,
    STANDBY_TYPE,
    WATCH_PATH,
    SpentFigures,
    endpoint_from_json,
    spent_from_json,
)
from llmgw.errors import ConfigError, LlmgwError
from llmgw.router.app import Router
from llmgw.router.feed import catalog_from_view
from llmgw.router.keys import KeyRing
from llmgw.router.leader import Leadership, Outcome
from llmgw.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Leaving, a batch the controller holds for its engines' counts is sent again every LEAVE_RETRY
# seconds for up to LEAVE_WAIT (a stop waits that much longer at worst), LEAVE_REPORTS reports in all.
LEAVE_WAIT = 10.0
LEAVE_RETRY = 0.25
LEAVE_REPORTS = 60
LEAVE_UNMOVED = 4  # reports in a row neither taken nor held after which a stopping router gives up


class WatchRefused(LlmgwError):
    """The controller answered, but not with a stream or a 200 (a wrong token, a wrong URL)."""


class StandingBy(WatchRefused):
    """The controller answered as a standby; ``leader`` is the admin URL it named (None: none)."""

    def __init__(self, url: str, leader: str | None) -> None:
        super().__init__(f"{url} stands by (leader: {leader or 'none known to it'})")
        self.leader = leader


def standby_leader(status: int, raw: bytes) -> tuple[bool, str | None]:
    """Whether an answer is a standby's (``llmgw.contract``), and the leader it named (None: none,
    or not an http(s) address). Another 503 (a proxy's, an overloaded server's) is not one."""
    if status != STANDBY_STATUS:
        return False, None
    try:
        body = json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        return False, None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or error.get("type") != STANDBY_TYPE:
        return False, None
    leader = body.get(LEADER_KEY)
    if isinstance(leader, str) and 0 < len(leader) <= MAX_LEADER_URL and leader.startswith(("http://", "https://")):
        return True, leader
    return True, None


def default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{random.randrange(16**4):04x}"


class FeedClient:
    """Follows the leader of ``controllers`` (one URL, or every controller's) for ``router``.
    ``start()`` begins, ``close()`` ends; no I/O before."""

    def __init__(self, router: Router, controllers: str | Sequence[str], admin_token: str, *,
                 router_id: str | None = None, report_interval: float = 2.0, stale_after: float = 30.0,
                 backoff_max: float = 10.0, follow_keys: bool = True,
                 on_keys: Callable[[KeyRing], None] | None = None, rng: random.Random | None = None) -> None:
        self.router = router
        self.follow_keys = follow_keys  # False when the router has its own --api-keys file
        self.on_keys = on_keys  # told the keys of every snapshot that carries them (the router logs them)
        self.leadership = Leadership([controllers] if isinstance(controllers, str) else controllers,
                                     backoff_max=backoff_max, rng=rng)
        self.router_id = router_id or default_router_id()
        self.report_interval = report_interval
        self.stale_after = stale_after  # no line (not even a keepalive) for this long: reconnect
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._report_now: asyncio.Event | None = None
        self.connected = False
        self.snapshots = 0
        self.version: int | None = None
        self._version_from = ""  # the controller that sent the snapshot ``version`` numbers
        self.attempts = 0  # watch requests made (each controller tried counts one)
        self._ignored_hints: set[str] = set()
        self._collector: _FollowCollector | None = None

    @property
    def controllers(self) -> tuple[str, ...]:
        return self.leadership.controllers

    @property
    def controller(self) -> str:
        """The controller followed (while the watch is open), else the one being tried: where
        reports go."""
        return self.leadership.url

    @property
    def leader_switches(self) -> int:
        return self.leadership.switches

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._report_now = asyncio.Event()
        self._collector = _FollowCollector(self)
        self.router.registry.register(self._collector)
        self._tasks = [asyncio.create_task(self._watch_forever(), name="router-watch"),
                       asyncio.create_task(self._report_forever(), name="router-report")]

    async def close(self) -> None:
        """Stop following; usage not yet acknowledged is sent first (drain the router before, so
        its last answers are in it), to the controller followed and, if it does not take it, to
        each other one in turn (one of them may lead by now); a batch a controller holds for its
        engines' counts is sent again for up to LEAVE_WAIT. What none takes is logged."""
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        if self._collector is not None:
            self.router.registry.unregister(self._collector)
            self._collector = None
        if self._session is not None:
            outbox = self.router.usage.outbox
            took = None
            # The batch in flight, then what was counted since; a batch the controller holds for
            # its engines' counts (``usage_waiting``: a reading comes about every second) is sent
            # again for up to LEAVE_WAIT rather than lost with this process.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LEAVE_WAIT
            sent: tuple[str, bool] | None = None
            unmoved = 0  # reports in a row that neither took nor held the batch
            for _ in range(LEAVE_REPORTS):
                if not outbox.pending or loop.time() >= deadline:
                    break
                carried = outbox.take()
                sent = await self._report_anywhere(took, deadline)
                if sent is None:
                    break
                took, waits = sent
                unmoved = 0 if waits or outbox.take() is not carried else unmoved + 1
                if unmoved >= LEAVE_UNMOVED:
                    break  # an older controller that never says, or a store that stays away
                if waits or unmoved:
                    await asyncio.sleep(LEAVE_RETRY)  # held, or its store failed once (a locked database)
            # Gone, said once: the controller stops waiting on this router for drains (else it
            # would count it as "may still send a withdrawn replica one" until its report aged).
            try:
                await self._report_once(took or self.controller, leaving=True, timeout=2.0)
            except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused):
                pass  # a controller away: its drains end at drain_timeout, or when the report ages
            if outbox.pending and sent is not None:  # (none took it: said by _report_anywhere)
                log.warning("usage of %d (minute, key, model) rows not acknowledged at stop: lost to the ledger",
                            outbox.pending)
            await self._session.close()
            self._session = None

    async def _report_anywhere(self, first: str | None, deadline: float) -> tuple[str, bool] | None:
        """One report to ``first`` (the controller followed when None), else to each other in
        turn, each given what is left until ``deadline`` (loop time, at most 5 s each): the URL
        that took it and whether the batch it carried waits there, or None (logged) when none did."""
        first = first or self.controller
        problems = []
        loop = asyncio.get_running_loop()
        for url in (first, *(u for u in self.controllers if u != first)):
            if (left := deadline - loop.time()) <= 0:
                problems.append("no time left")
                break
            try:
                return url, await self._report_once(url, timeout=min(5.0, left))
            except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused) as exc:
                problems.append(str(exc) if isinstance(exc, WatchRefused) else f"{url}: {type(exc).__name__}: {exc}")
        log.warning("usage of %d (minute, key, model) rows not reported at stop (%s)",
                    self.router.usage.outbox.pending, "; ".join(problems))
        return None

    def report_soon(self, _model: str | None = None) -> None:
        """Send a report now (the router's ``wake`` callback)."""
        if self._report_now is not None:
            self._report_now.set()

    # --- watch -----------------------------------------------------------------------------
    async def _watch_forever(self) -> None:
        outage_logged = False
        several = len(self.controllers) > 1
        while True:
            url = self.controller
            outcome, hint = Outcome.FAILED, None
            try:
                await self._watch_once(url)
                reason = "the controller closed the stream"
            except StandingBy as exc:
                reason, outcome, hint = str(exc), Outcome.STANDBY, exc.leader
            except WatchRefused as exc:
                reason = str(exc)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if self.connected:
                outcome = Outcome.FOLLOWED
                log.warning("watch of %s lost (%s); serving from the last snapshot, %s", url, reason,
                            "looking for the leader" if several else "reconnecting")
                outage_logged = True
            elif not outage_logged:
                log.warning("cannot follow %s (%s); %s", url, reason,
                            "trying the other controllers" if several else "retrying")
                outage_logged = True
            else:
                log.debug("cannot follow %s (%s)", url, reason)
            self.connected = False
            step = self.leadership.after(outcome, hint=hint)
            if step.ignored_hint is not None and step.ignored_hint not in self._ignored_hints:
                self._ignored_hints.add(step.ignored_hint)  # said once per name: a standby repeats it
                log.warning("%s names %s as the leader, which is not one of the controllers this router was "
                            "given (%s); not contacting it", url, step.ignored_hint, ", ".join(self.controllers))
            await asyncio.sleep(step.wait)

    async def _watch_once(self, url: str) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=self.stale_after)
        self.attempts += 1
        async with self._session.get(url + WATCH_PATH, headers=self._headers, timeout=timeout) as resp:
            if resp.status != 200:
                raw = await resp.content.read(4096)
                standby, leader = standby_leader(resp.status, raw)
                if standby:
                    raise StandingBy(url, leader)
                text = raw[:200].decode("utf-8", "replace")
                raise WatchRefused(f"watch of {url} answered {resp.status}: {text}")
            before = self.leadership.connected()
            if before is not None:
                log.warning("following %s, the leader now (leader switch %d; followed %s before)", url,
                            self.leadership.switches, before)
            else:
                log.info("following %s", url)
            # At once, not at the next interval: a controller that just restarted (or began to
            # lead) learns what this router has in flight (it waits on that before stopping a
            # replica) and its demand, and gets the usage batch a leader that died did not take.
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
                keys = KeyRing.from_entries(snap["api_keys"], where="the controller's api_keys", strict=False)
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
            self.router.set_keys(keys)
            if self.on_keys is not None:
                self.on_keys(keys)
        if self.router.config.limits_redis == "":  # a router given its own Redis keeps it
            self.router.use_limits_redis(limits_redis)
        self.router.set_routes(routes)
        if spent is not None:  # before any request is admitted under this catalog
            self.router.set_spent(*spent)
        self.router.set_endpoints(endpoints)
        self.router.set_unrunnable(unrunnable)
        if self._version_from != self.controller:
            self.report_soon()  # the first list from this controller: say at once that it is applied
        self.version = snap.get("version")
        self._version_from = self.controller
        self.snapshots += 1

    # --- report ----------------------------------------------------------------------------
    async def _report_forever(self) -> None:
        assert self._report_now is not None
        failing = False
        while True:
            try:
                # Not wait_for: on Python 3.11 it swallows a cancel that comes as the event is set
                # (report_soon just before close()), and this loop never ended.
                async with asyncio.timeout(self.report_interval):
                    await self._report_now.wait()
            except TimeoutError:
                pass
            self._report_now.clear()
            url = self.controller
            try:
                await self._report_once(url)
                failing = False
            except (aiohttp.ClientError, TimeoutError, OSError, WatchRefused) as exc:
                if not failing:
                    log.warning("usage report to %s failed (%s); its usage is kept and sent again%s", url,
                                exc, " to the controller that leads" if len(self.controllers) > 1 else "")
                failing = True
                await asyncio.sleep(min(self.report_interval, 1.0))  # no tight loop while it is away

    async def _report_once(self, url: str | None = None, *, leaving: bool = False, timeout: float = 5.0) -> bool:
        """One report to ``url`` (default: the controller followed). The usage batch it carries
        stays in the outbox unless the answer acknowledges (or refuses) its number; True when the
        controller said it holds that batch for its engines' counts."""
        assert self._session is not None
        url = url or self.controller
        usage = self.router.usage
        payload: dict[str, Any] = {
            "router_id": self.router_id,
            "last_used": usage.last_used(),
            "demand": {m: {"held": d.held, "inflight": d.inflight} for m, d in usage.demand().items()},
            "prompt_cache": {m: c.to_json() for m, c in usage.prompt_cache(polled=False).items()},
            # Cumulative since this router process started; the instance tells the controller
            # when it restarted (its counters began again), so differences never go negative.
            "replica_stats": {"instance": usage.instance_id, "replicas": {
                rid: s.to_json() for rid, s in usage.replica_stats()[usage.instance_id].items()}},
            # What the controller waits for before it stops a withdrawn replica's engine: none of
            # this router's requests on it, and this router serving from the list without it.
            "in_flight": usage.in_flight_by_replica(),
            "report_interval": self.report_interval,  # silent for 3 of these: gone, for drains
        }
        if leaving:
            payload["leaving"] = True
        if type(self.version) is int:
            # A version is one controller's count: to another one (a new leader) this router says
            # it serves from a list that one did not send, so it is behind any drain it starts.
            payload["applied_version"] = self.version if self._version_from == url else 0
        outbox = usage.outbox
        batch = outbox.take()
        if batch is not None:
            payload["usage"] = batch.to_json()
        async with self._session.post(url + REPORT_PATH, json=payload, headers=self._headers,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            raw = await resp.read()
            if resp.status != 200:
                standby, leader = standby_leader(resp.status, raw[:4096])
                if standby:
                    raise StandingBy(url, leader)
                raise WatchRefused(f"report to {url} answered {resp.status}")
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
            resend = answer.get("usage_resend_from") if isinstance(answer, dict) else None
            if acked == batch.seq:
                outbox.acked(batch.seq)
            elif type(resend) is int and 0 < resend <= batch.seq:
                kept = outbox.kept_from()
                if resend < batch.seq and (kept is None or kept > resend):
                    log.error("usage batches %d to %d are no longer kept here and are lost to the controller's "
                              "ledger (its store was restored from an older copy)", resend,
                              (kept or batch.seq) - 1)
                outbox.resend_from(resend)
            elif rejected == batch.seq:  # sending it again cannot help: dropped, and said so
                log.error("usage batch %d (%d rows) was refused by the controller and is dropped",
                          batch.seq, len(batch.rows))
                outbox.acked(batch.seq)
            return isinstance(answer, dict) and answer.get("usage_waiting") == batch.seq
        return False


def _spent(d: dict[str, Any]) -> tuple[SpentFigures, int] | None:
    """What budgets used per the controller's ledger, and how many routers share the limits (None:
    an older controller that says neither); ValueError/TypeError when malformed."""
    if d.get("spent") is None:
        return None
    routers = d.get("routers", 1)
    if type(routers) is not int or not 1 <= routers <= 100_000:
        raise ValueError(f"routers must be a whole number from 1, got {routers!r}")
    return spent_from_json(d["spent"]), routers


class _FollowCollector:
    """The follower's series, read at scrape time: which controller it follows (by position in
    the configured list: the client port's /metrics is public, the admin addresses are not) and
    how often it switched."""

    def __init__(self, feed: FeedClient) -> None:
        self._feed = feed

    def collect(self) -> Iterator[Metric]:
        feed = self._feed
        followed = feed.leadership.followed if feed.connected else None
        following = GaugeMetricFamily(
            "llmgw_router_controller_following", "1 for the controller whose watch stream the router follows, "
            "by its position (from 1) in the router's --url list; all 0 while it follows none (serving from the "
            "last snapshot).", labels=("controller",))
        for i in range(len(feed.controllers)):
            following.add_metric((str(i + 1),), 1.0 if i == followed else 0.0)
        yield following
        yield CounterMetricFamily("llmgw_router_leader_switches", "Times the router began following a controller "
                                  "other than the one it followed before (a new leader).",
                                  value=feed.leader_switches)
