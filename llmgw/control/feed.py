"""The controller's end of the watch stream that standalone routers follow (`llmgw.contract`).

:class:`FeedHub` is the reconciler's endpoint sink and a catalog subscriber (``order=ROUTER``),
keeps the latest snapshot, streams it to every watcher, and merges the routers' reports into one
usage source (latest last-use per replica, demand summed over routers, each router process's
per-replica measurements for canary analysis, a router's report forgotten once it is older than
``report_ttl``). A report with held requests wakes the reconciler at once.
Authentication is the admin listener's business: mount :meth:`FeedHub.watch` and
:meth:`FeedHub.report` behind its token check.

Until it has both a catalog and a first endpoint list the hub sends only keepalives: a
controller that just restarted and has not adopted its engines yet must not tell every router
that nothing is ready.

With a :class:`~llmgw.control.usage.BudgetBook` (``budgets``), every snapshot and every answer
to a report also says what each budget used this period per the ledger (``"spent"``), and how
many routers share the limits (``"routers"``: those heard from, and the controller's own), so a
router starts from what was spent and, with Redis away, grants only its share of what is left.

Several controllers on one store (DESIGN §5): only the leader serves the watch and the report. With
``standby`` set (a callable saying whether this controller stands by, and the leader's advertised
admin URL as known), a standby answers both with 503 ``{"error": {"message", "type": "standby"},
"leader": url | null}``, and a watch stream open when its controller stops leading ends (at the
next change or keepalive, or at once on :meth:`FeedHub.leadership_changed`), so the router asks
again and is sent to the leader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw import jsonbody
from llmgw.access.roles import Principal
from llmgw.access.web import PRINCIPAL
from llmgw.bounded import remember
from llmgw.catalog import Catalog
from llmgw.contract import (
    KEEPALIVE,
    CatalogView,
    Demand,
    Endpoint,
    PromptCache,
    ReplicaStats,
    UsageBatch,
    UsageLedger,
    catalog_view,
    spent_to_json,
    wire_str,
)
from llmgw.control.usage import BudgetBook, UsageDeferred
from llmgw.errors import StoreError
from llmgw.router.changes import Changes
from llmgw.serving import read_plain

log = logging.getLogger(__name__)

# The standby answer's shape (llmgw.contract, issue 36): status and error type.
STANDBY_STATUS = 503
STANDBY_TYPE = "standby"


MAX_REPORTED_MODELS = 10_000
MAX_REPORTED_REPLICAS = 10_000
# Routers reporting at once. Each one counts in how routers share tenants' limits while Redis is
# away (a share of what is left per router) and keeps per-replica figures here: a flood of made-up
# router ids shrank every real router's share and evicted their canary baselines (issue 39).
MAX_ROUTERS = 256
# A router that holds a credential and was sent a version on its watch stream this long ago says
# it still serves from an older one: believed no longer (it holds no drain for that, issue 41). A
# router applies a snapshot as it reads it; one that says otherwise for seconds is lying or broken.
BEHIND_GRACE = 10.0
MAX_RESEND_ASKED = 4096  # router processes whose gap in the ledger was asked for
MAX_USED_BEFORE = 65_536  # replicas whose last use is kept after the routers that said it went quiet
READ_FOR_EVERY = 1.0  # seconds: how often one router's held batches may have engines read at once


@dataclass(frozen=True)
class Report:
    """One router's last report, and when it came."""

    at: float
    last_used: dict[str, float]  # per replica
    demand: dict[str, Demand]  # per model
    prompt_cache: dict[str, PromptCache]  # per model
    # {instance: {replica id: stats}}, empty or one; a credential's instance is "ROUTER/instance"
    replica_stats: dict[str, dict[str, ReplicaStats]]
    in_flight: dict[str, int]  # per replica, withdrawn ones included until their requests end
    applied: int | None  # the snapshot version it serves from; None: a router from before drains
    interval: float | None = None  # how often it reports; silent for 3 of these, it holds no drain up

    def behind(self, version: int, now: float) -> bool:
        """Whether this router may still be serving from a list older than ``version``: it said
        so, and is not silent for long (a router killed without a word must not hold up drains
        until its report ages out)."""
        if self.applied is None or self.applied >= version or self.interval is None:
            return False
        return now - self.at <= 3 * self.interval + 1.0


class FeedHub:
    """The controller's side of the watch stream; see the module docstring."""

    def __init__(self, *, wake: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time,
                 report_ttl: float = 30.0, keepalive: float = 10.0, local_routers: int = 0) -> None:
        self.wake = wake
        self.clock = clock
        self.report_ttl = report_ttl
        self.keepalive = keepalive
        self.version = int(clock() * 1000)
        self._catalog: CatalogView | None = None
        self._endpoints: list[dict[str, Any]] | None = None
        self._api_keys: list[dict[str, Any]] | None = None
        self._limits_redis = ""
        self._unrunnable: dict[str, str] = {}
        self._line: bytes | None = None
        self._changes = Changes()
        self._reports: dict[str, Report] = {}
        self._used_before: dict[str, float] = {}  # per replica, last use said by routers no longer heard from
        # Per router instance: the store's last batch when this controller asked for the ones after it.
        self._resend_asked: dict[str, int] = {}
        # Replicas taken out of the endpoint list, with the version that took them out: until
        # every router serves from that version, one may still send them a request.
        self._withdrawn: dict[str, int] = {}
        self.ledger: UsageLedger | None = None  # the controller's store; without it no batch is acknowledged
        # Reads the engines of some models now: a batch the last reading does not cover is tried
        # once more on a fresh one before it waits (llmgw.control.usage.GatedLedger).
        self.read_engines: Callable[[Collection[str]], Awaitable[None]] | None = None
        self._read_for: dict[str, float] = {}  # per router, when a batch of its last had engines read for it
        self.budgets: BudgetBook | None = None  # what budgets used this period, for the routers
        self.local_routers = local_routers  # routers in the controller's own process
        self.configured_routers = 0  # router.limits_routers: the count every router is told (0: learned)
        self._most_routers = 1  # the most routers heard from at once (the learned count)
        self.refused_routers = 0  # reports from a new router id refused at MAX_ROUTERS
        self.malformed_reports = 0  # reports refused as malformed or past a bound (400)
        self._line_budgets = -1  # the book's version the line was built with
        self.watchers = 0
        # Routers that reach this controller with the admin token rather than a credential of
        # their own (issue 41): said in status until they move to one (llmgw routers create).
        self.admin_token_routers: dict[str, float] = {}
        self.credential_live: Callable[[str], bool] = lambda _digest: True  # by the credential's sha256
        # None: this controller leads alone. Else () -> (standing by?, the leader's admin URL).
        self.standby: Callable[[], tuple[bool, str | None]] | None = None
        # Per credential-holding router: each version written to its watch stream -> when first
        # (the newest few), and the routers whose claim to be behind was not believed, and when.
        self._delivered: dict[str, dict[int, float]] = {}
        self.behind_unbelieved: dict[str, float] = {}

    # --- the control plane's side -------------------------------------------------------
    def set_catalog(self, catalog: Catalog) -> None:
        """Catalog subscriber (subscribe with ``order=ROUTER``)."""
        view = catalog_view(catalog)
        if view != self._catalog:
            self._catalog = view
            self._publish()

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Endpoint sink: the ready replicas."""
        eps = [e.to_json() for e in endpoints]
        if eps != self._endpoints:
            before = {e["replica_id"] for e in self._endpoints or ()}
            self._endpoints = eps
            self._publish()
            now = {e["replica_id"] for e in eps}
            for rid in before - now:
                self._withdrawn[rid] = self.version
            for rid in now:
                self._withdrawn.pop(rid, None)
            self._behind(self._live_reports())  # forgets what no router is behind on

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        """Models no node can run, with the reason: routers answer them at once."""
        if dict(reasons) != self._unrunnable:
            self._unrunnable = dict(reasons)
            self._publish()

    def set_api_keys(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """The controller config's API keys (``{"name", "sha256", "models"}`` each), for every router."""
        keys = [{"name": e.get("name"), "sha256": e["sha256"], "models": list(e.get("models", ["*"])),
                 **({"tenant": e["tenant"]} if e.get("tenant") else {})} for e in entries]
        if keys != self._api_keys:
            self._api_keys = keys
            self._publish()

    def set_limits_redis(self, url: str) -> None:
        """The Redis every router counts tenants' limits in (the controller config's router.limits_redis)."""
        if url != self._limits_redis:
            self._limits_redis = url
            self._publish()

    def snapshot(self) -> dict[str, Any] | None:
        """The snapshot watchers get, or None until both a catalog and endpoints were given."""
        if self._catalog is None or self._endpoints is None:
            return None
        snap = {"version": self.version, "catalog": self._catalog, "endpoints": self._endpoints}
        if self._api_keys is not None:
            snap["api_keys"] = self._api_keys
        if self._unrunnable:
            snap["unrunnable"] = self._unrunnable
        if self._limits_redis:
            snap["limits_redis"] = self._limits_redis
        snap.update(self.spent())
        return snap

    def spent(self) -> dict[str, Any]:
        """What budgets used this period and how many routers share the limits (empty without a book)."""
        if self.budgets is None:
            return {}
        return {"spent": spent_to_json(self.budgets.figures()), "routers": self.router_count()}

    def router_count(self) -> int:
        """Routers sharing the limits, the one count every router divides a budget's rest by while
        Redis is away: the configured one, else the most heard from at once (within ``report_ttl``,
        the controller's own included) since this controller started. Never the count of the moment
        (seen: routers that heard 3 and 4 at different times granted 12 % past a budget), and never
        lower because a router went quiet (it may be cut off, granting)."""
        if self.configured_routers:
            return self.configured_routers
        self._most_routers = max(self._most_routers, len(self.routers()) + self.local_routers)
        return self._most_routers

    def _publish(self) -> None:
        self.version += 1
        self._build_line()
        self._changes.notify()

    def _build_line(self) -> None:
        snap = self.snapshot()
        self._line_budgets = self.budgets.version if self.budgets is not None else -1
        self._line = None if snap is None else json.dumps(snap, separators=(",", ":")).encode() + b"\n"

    # --- usage: the reconciler's side ---------------------------------------------------
    def last_used(self) -> dict[str, float]:
        """When each replica was last used, per every router heard from: those whose reports aged
        out included (their times stay true; forgotten, a replica serving through routers cut off
        from this controller for report_ttl read as never used since it was ready, and was idled)."""
        live = self._live_reports()
        out = dict(self._used_before)
        for r in live:
            for rid, t in r.last_used.items():
                if t > out.get(rid, 0.0):
                    out[rid] = t
        return out

    def demand(self) -> dict[str, Demand]:
        held: dict[str, int] = {}
        inflight: dict[str, int] = {}
        for r in self._live_reports():
            for model, d in r.demand.items():
                held[model] = held.get(model, 0) + d.held
                inflight[model] = inflight.get(model, 0) + d.inflight
        return {m: Demand(held=held[m], inflight=inflight[m]) for m in held}

    def prompt_cache(self) -> dict[str, PromptCache]:
        """Summed over the routers heard from (each counts since it started)."""
        out: dict[str, PromptCache] = {}
        for r in self._live_reports():
            for model, c in r.prompt_cache.items():
                out[model] = out.get(model, PromptCache()) + c
        return out

    def replica_stats(self) -> dict[str, dict[str, ReplicaStats]]:
        """Per router process heard from within ``report_ttl``, per replica: what it measured since
        it started (cumulative, as last reported). A router holding a credential is filed under
        ``NAME/instance`` whatever instance it names; one on the admin token under its own."""
        out: dict[str, dict[str, ReplicaStats]] = {}
        for r in self._live_reports():
            out.update(r.replica_stats)
        return out

    def in_flight_by_replica(self) -> dict[str, int]:
        """Requests the routers heard from have in flight per replica, summed; a replica withdrawn
        from the endpoint list counts one more for each router not yet serving without it (its
        last report, recent, says an older version: it may still send one)."""
        out: dict[str, int] = {}
        reports = self._live_reports()
        for r in reports:
            for rid, n in r.in_flight.items():
                out[rid] = out.get(rid, 0) + n
        for rid, behind in self._behind(reports).items():
            out[rid] = out.get(rid, 0) + behind
        return out

    def _behind(self, reports: list[Report]) -> dict[str, int]:
        """Per withdrawn replica, the routers not yet serving without it; a replica no router is
        behind on is forgotten (bounded by the routers' lag, not by every replica ever withdrawn).
        A credential's router that was sent that version more than BEHIND_GRACE ago is not
        believed behind (it would hold every drain to its timeout with a word)."""
        now = self.clock()
        out = {}
        for rid, version in list(self._withdrawn.items()):
            behind = sum(1 for name, r in self._reports.items() if r in reports and r.behind(version, now)
                          and self._believed_behind(name, version, now))
            if behind:
                out[rid] = behind
            else:
                del self._withdrawn[rid]
        return out

    def _believed_behind(self, router: str, version: int, now: float) -> bool:
        delivered = self._delivered.get(router)
        if delivered is None:
            return True  # no stream of its own this controller wrote to (the admin token's routers)
        sent = min((at for v, at in delivered.items() if v >= version), default=None)
        if sent is None or now - sent <= BEHIND_GRACE:
            return True
        if router not in self.behind_unbelieved:
            log.warning("router %s says it serves from a version older than %d, sent to it %.0f s ago: not believed "
                        "(it holds no drain for that)", router, version, now - sent)
        self.behind_unbelieved[router] = now
        return False

    def _delivered_now(self, router: str) -> None:
        """A snapshot of this version was written to ``router``'s watch stream now."""
        sent = self._delivered.setdefault(router, {})
        sent.setdefault(self.version, self.clock())
        for old in sorted(sent)[:-64]:  # the newest versions are the ones drains wait on
            del sent[old]

    def engine_queue(self) -> dict[str, tuple[int, int]]:
        """Nothing: standalone routers do not report it; the controller's own router reads every
        replica's engine (the engine counts every client's requests, so one reading is the figure)."""
        return {}

    reads_engines = False

    def routers(self) -> dict[str, float]:
        """Routers heard from within ``report_ttl``, with the time of their last report."""
        self._live_reports()
        return {rid: r.at for rid, r in self._reports.items()}

    def _live_reports(self) -> list[Report]:
        cutoff = self.clock() - self.report_ttl
        for rid in [rid for rid, r in self._reports.items() if r.at < cutoff]:
            gone = self._reports.pop(rid)  # a router that stopped reporting is gone: its demand with it
            for replica, said in gone.last_used.items():
                # Not past its report's time: a time ahead (a forged one, a skewed clock) kept here
                # would hold the replica "used" long after its router went quiet.
                t = min(said, gone.at)
                if t > self._used_before.get(replica, 0.0):
                    remember(self._used_before, replica, t, MAX_USED_BEFORE)  # most recently used last
        return list(self._reports.values())

    # --- leading or standing by (DESIGN §5) ------------------------------------------------
    def _standing_by(self) -> tuple[bool, str | None]:
        return (False, None) if self.standby is None else self.standby()

    def leadership_changed(self) -> None:
        """Wake every open watch, so one served by a controller that stopped leading ends now."""
        self._changes.notify()

    def standby_answer(self) -> web.Response | None:
        """The 503 a standby answers routers with (naming the leader), or None when leading."""
        standing_by, leader = self._standing_by()
        if not standing_by:
            return None
        message = (f"this controller is standing by; the leader ({leader}) serves this" if leader
                   else "this controller is standing by, and no leader is known yet; try again shortly")
        return web.json_response({"error": {"message": message, "type": STANDBY_TYPE}, "leader": leader},
                                 status=STANDBY_STATUS)

    # --- HTTP handlers (mounted by the admin API behind its token check) -----------------
    async def watch(self, request: web.Request) -> web.StreamResponse:
        """``GET /api/v1/router/watch``: JSON lines, a snapshot at once and on every change."""
        refused = self.standby_answer()
        if refused is not None:
            return refused
        self._changes.bind(asyncio.get_running_loop())
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        self.watchers += 1
        sent: bytes | None = None
        try:
            if self._line is not None and self.budgets is not None and self.budgets.version != self._line_budgets:
                # A router (re)connecting starts from the figures as they are now, not as they
                # were at the last change of the catalog or endpoints (it alone: those connected
                # get theirs with each report).
                current, snap = self._line, self.snapshot()
                if snap is not None:
                    await resp.write(json.dumps(snap, separators=(",", ":")).encode() + b"\n")
                    sent = current  # a change published meanwhile is sent below
            principal = request.get(PRINCIPAL)
            credential = principal.credential if principal is not None and principal.router is not None else None
            router = principal.router if principal is not None and credential is not None else None
            if router is not None and sent is not None:
                self._delivered_now(router)  # (written above: a stream it stopped reading holds nothing up)
            while True:
                event = self._changes.event
                if self._standing_by()[0]:
                    break  # no longer the leader: the router asks again and is sent there
                if credential is not None and not self.credential_live(credential):
                    break  # its credential was revoked: the stream it holds ends with it
                line = self._line
                if line is not None and line is not sent:
                    if router is not None:
                        # Before the write: a router that stops reading its stream blocks the write,
                        # and must not be believed behind for it.
                        self._delivered_now(router)
                    await resp.write(line)
                    sent = line
                try:
                    await asyncio.wait_for(event.wait(), self.keepalive)
                except TimeoutError:
                    await resp.write(KEEPALIVE)
        except ConnectionResetError:
            return resp  # the router went away; it will reconnect
        finally:
            self.watchers -= 1
        return resp

    def forget_router(self, name: str) -> None:
        """A revoked router: its report (demand, in-flight holds, stats) counts no more, and its
        watch stream ends at the next wake."""
        self._reports.pop(name, None)
        self._delivered.pop(name, None)
        self._changes.notify()

    def router_reports(self) -> dict[str, Any]:
        """Per router, what its last report moves now: demand, in-flight holds, when it came."""
        now = self.clock()
        return {rid: {"seconds_ago": round(now - r.at, 1),
                      "demand": {m: {"held": d.held, "inflight": d.inflight} for m, d in r.demand.items()},
                      "in_flight": sum(r.in_flight.values()), "replicas_used": len(r.last_used),
                      "behind_unbelieved": now - self.behind_unbelieved.get(rid, -1e18) <= self.report_ttl}
                for rid, r in self._reports.items() if now - r.at <= self.report_ttl}

    def credential_warnings(self) -> list[str]:
        """Routers that hold the admin token: each could drain nodes or push commits if its host fell."""
        now = self.clock()
        quiet = [rid for rid, at in self.admin_token_routers.items() if now - at > self.report_ttl]
        for rid in quiet:
            del self.admin_token_routers[rid]
        if not self.admin_token_routers:
            return []
        return [f"router(s) {', '.join(sorted(self.admin_token_routers))} reach this controller with the admin "
                "token: give each a router credential (llmgw routers create NAME), which opens only the watch "
                "and the report"]

    async def report(self, request: web.Request) -> web.Response:
        """``POST /api/v1/router/report``: one router's last-use times and demand."""
        refused = self.standby_answer()
        if refused is not None:
            return refused
        try:
            data = jsonbody.loads(await read_plain(request), what="The router report")  # nesting bounded
            router_id = wire_str(data["router_id"])
            principal = request.get(PRINCIPAL)
            if principal is not None and principal.router is not None:
                # A credential names its router: its reports are that router's whatever the body
                # says, so one router cannot speak (or hold drains) for another.
                router_id = principal.router
            elif principal is not None:
                self.admin_token_routers[router_id] = self.clock()
            for key, cap in (("last_used", MAX_REPORTED_REPLICAS), ("demand", MAX_REPORTED_MODELS)):
                if len(data.get(key) or ()) > cap:  # before parsing them: a report costs what is bounded
                    raise ValueError(f"{len(data[key])} entries in one report's {key} (at most {cap})")
            used = {wire_str(k): float(v) for k, v in (data.get("last_used") or {}).items()}
            dem = {wire_str(m): Demand(held=int(d.get("held", 0)), inflight=int(d.get("inflight", 0)))
                   for m, d in (data.get("demand") or {}).items()}
            cache = {wire_str(m): PromptCache.from_json(c) for m, c in (data.get("prompt_cache") or {}).items()}
            if len(cache) > MAX_REPORTED_MODELS:
                raise ValueError(f"{len(cache)} models in one report (at most {MAX_REPORTED_MODELS})")
            stats = _replica_stats(data.get("replica_stats"))
            in_flight = _in_flight(data.get("in_flight"))
            applied = data.get("applied_version")
            if applied is not None and type(applied) is not int:
                raise TypeError(f"applied_version must be a whole number, got {applied!r}")
            interval = data.get("report_interval")
            if interval is not None and (type(interval) not in (int, float) or not 0 < interval <= 3600):
                raise ValueError(f"report_interval must be seconds from 0 to 3600, got {interval!r}")
            leaving = data.get("leaving", False) is True
        except KeyError as exc:
            # The admin API's error shape ({"error": "..."}), not the OpenAI one: this is an admin route.
            self.malformed_reports += 1
            return web.json_response({"error": f"malformed router report: {exc.args[0]} is missing"}, status=400)
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            self.malformed_reports += 1
            return web.json_response({"error": f"malformed router report: {exc}"}, status=400)
        if router_id not in self._reports and len(self._live_reports()) >= MAX_ROUTERS:
            self.refused_routers += 1
            if self.refused_routers & (self.refused_routers - 1) == 0:  # said at 1, 2, 4, 8…: a flood is no log flood
                    log.warning("router report from %s refused: %d routers report already (at most %d); %d refused so "
                            "far", router_id, MAX_ROUTERS, MAX_ROUTERS, self.refused_routers)
            return web.json_response({"error": f"too many routers report to this controller (at most {MAX_ROUTERS} "
                                               "at once); this one is not counted"}, status=429)
        # The usage on its own: a batch the controller cannot take must not cost the router its
        # demand and last use (scale from zero, idle decisions), nor come back for ever.
        batch, rejected = None, None
        if isinstance(data, dict) and data.get("usage") is not None:
            try:
                batch, problems = UsageBatch.parse(data["usage"])
                if problems:
                    log.error("usage ledger: %d of %d rows from router %s were refused and are lost (%s)",
                              len(problems), len(problems) + len(batch.rows), router_id, problems[0])
            except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
                seq = data["usage"].get("seq") if isinstance(data["usage"], dict) else None
                rejected = seq if type(seq) is int else None
                log.error("usage ledger: a batch from router %s was refused and is lost (%s)", router_id,
                          f"missing {exc.args[0]}" if isinstance(exc, KeyError) else exc)
        if principal is not None and principal.router is not None:
            if not self.credential_live(principal.credential):
                # Revoked while this report was read: it must not come back after forget_router.
                return web.json_response({"error": "this router's credential was revoked"}, status=401)
            if batch is not None:
                # A credential's batches are its router's: it cannot write (or move the sequence
                # of) another router process's usage by naming that process's instance.
                batch = dataclasses.replace(batch, instance=f"{principal.router}/{batch.instance}")
            # Its measurements too: a canary is judged on each router's figures alone as well as
            # on all together, and a rollback names the router whose figures failed it; a router
            # naming another's process must neither write into that router's window nor be
            # named as it (a router name holds no "/": "edge-2/edge-1/x" is edge-2's).
            stats = {f"{principal.router}/{instance}": s for instance, s in stats.items()}
        # A router stopping in order holds no drain up from now on (nothing in flight, no list it
        # may still send from); its figures stay until they age out, as anyone's (canary windows).
        self._reports[router_id] = Report(self.clock(), used, dem, cache, stats, {} if leaving else in_flight,
                                          None if leaving else applied,
                                          None if interval is None else float(interval))
        if self.wake is not None:
            for model, d in dem.items():
                if d.held > 0:
                    self.wake(model)
        answer: dict[str, Any] = {"ok": True, "version": self.version}
        if rejected is not None:
            answer["usage_rejected"] = rejected
        if batch is not None and self.ledger is not None:
            # Recorded now or before: either way the router may drop it. Not recorded (the
            # store failed): no ack, and the router sends the same batch again.
            try:
                known = self.ledger.usage_seq(batch.instance)
                if batch.seq > known + 1 and self._resend_asked.get(batch.instance) != known:
                    # The store lacks this router's batches known+1 .. seq-1: restored from an older
                    # copy, after they were acknowledged. Asked once per gap (a batch refused as
                    # malformed is a gap too, and is not sent better the second time).
                    self._resend_asked.pop(batch.instance, None)
                    self._resend_asked[batch.instance] = known
                    for old in list(self._resend_asked)[:max(0, len(self._resend_asked) - MAX_RESEND_ASKED)]:
                        del self._resend_asked[old]  # one per router process: a flood of made-up ones is bounded
                    answer["usage_resend_from"] = known + 1
                    log.warning("usage ledger: router %s's batches %d to %d are not in the store (restored from "
                                "an older copy?); asked for them again", router_id, known + 1, batch.seq - 1)
                else:
                    await self._record(batch, router_id, principal)
                    answer["usage_acked"] = batch.seq
            except UsageDeferred:
                # Not acknowledged: the router sends it again with its next report (and, leaving,
                # waits a little for this answer to change rather than drop it).
                answer["usage_waiting"] = batch.seq
            except StoreError as exc:
                log.warning("usage ledger: could not record a batch from %s (%s)", router_id, exc)
        answer.update(self.spent())  # with its own batch in them
        return web.json_response(answer)

    async def _record(self, batch: UsageBatch, router_id: str, principal: Principal | None) -> None:
        """Record ``batch`` in the ledger, or :class:`UsageDeferred` when it waits for the engines'
        counts. A batch that starts to wait has its models' engines read at once and is tried
        again (an honest router's batch often comes before the next reading); once per batch, and
        for one router at most once a READ_FOR_EVERY, so a router whose batches never fit cannot
        make the controller read engines on every report."""
        assert self.ledger is not None
        try:
            self.ledger.record_usage(batch)
        except UsageDeferred as waiting:
            now = self.clock()
            if (self.read_engines is None or not waiting.first
                    or now - self._read_for.get(router_id, -READ_FOR_EVERY) < READ_FOR_EVERY):
                raise
            remember(self._read_for, router_id, now, MAX_ROUTERS)
            await self.read_engines(waiting.models)
            # Read again after the wait: a controller that stopped leading meanwhile, or a credential
            # revoked meanwhile, records nothing (the router sends it to whoever leads).
            if self._standing_by()[0] or (principal is not None and principal.router is not None
                                          and not self.credential_live(principal.credential)):
                raise
            self.ledger.record_usage(batch)


def _in_flight(d: Any) -> dict[str, int]:
    """A report's ``in_flight`` (``{replica id: requests}``); nothing when absent (an older router)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise TypeError(f"in_flight must be an object, got {type(d).__name__}")
    if len(d) > MAX_REPORTED_REPLICAS:
        raise ValueError(f"{len(d)} replicas in one report's in_flight (at most {MAX_REPORTED_REPLICAS})")
    out = {}
    for rid, n in d.items():
        if type(n) is not int or not 0 <= n < 2 ** 31:
            raise ValueError(f"in_flight of {rid!r} must be a whole number of requests, got {n!r}")
        out[wire_str(rid)] = n
    return out


def _replica_stats(d: Any) -> dict[str, dict[str, ReplicaStats]]:
    """A report's ``replica_stats`` (``{"instance": id, "replicas": {replica id: stats}}``) as
    ``{instance: {replica id: stats}}``; nothing when absent (an older router). Malformed: the
    whole report is refused with a 400, as a malformed ``prompt_cache`` is, so the router's log
    says so instead of canary analysis silently going without its figures."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise TypeError(f"replica_stats must be an object, got {type(d).__name__}")
    instance = d.get("instance")
    if not isinstance(instance, str) or not instance:
        raise ValueError(f"replica_stats.instance must be a string naming the router process, got {instance!r}")
    replicas = d.get("replicas") or {}
    if not isinstance(replicas, dict):
        raise TypeError(f"replica_stats.replicas must be an object, got {type(replicas).__name__}")
    if len(replicas) > MAX_REPORTED_REPLICAS:  # before parsing them: a report costs what is bounded
        raise ValueError(f"{len(replicas)} replicas in one report's replica_stats (at most {MAX_REPORTED_REPLICAS})")
    out = {}
    for rid, s in replicas.items():
        try:
            out[wire_str(rid)] = ReplicaStats.from_json(s)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"replica_stats of {rid!r}: {exc}") from exc
    return {instance: out}


class Fanout:
    """One endpoint sink and catalog subscriber feeding several (an in-process router and a hub)."""

    def __init__(self, *targets: Any) -> None:
        self.targets = targets

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        for t in self.targets:
            t.set_endpoints(endpoints)

    def set_catalog(self, catalog: Catalog) -> None:
        for t in self.targets:
            t.set_catalog(catalog)

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        for t in self.targets:
            t.set_unrunnable(reasons)


class MergedUsage:
    """Several usage sources as one (an in-process router plus a hub of standalone ones)."""

    def __init__(self, *sources: Any) -> None:
        self.sources = sources

    def last_used(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.sources:
            for rid, t in s.last_used().items():
                out[rid] = max(t, out.get(rid, 0.0))
        return out

    def demand(self) -> dict[str, Demand]:
        out: dict[str, Demand] = {}
        for s in self.sources:
            for m, d in s.demand().items():
                o = out.get(m, Demand())
                out[m] = Demand(held=o.held + d.held, inflight=o.inflight + d.inflight)
        return out

    def prompt_cache(self) -> dict[str, PromptCache]:
        out: dict[str, PromptCache] = {}
        for s in self.sources:
            for m, c in s.prompt_cache().items():
                out[m] = out.get(m, PromptCache()) + c
        return out

    def engine_queue(self) -> dict[str, tuple[int, int]]:
        """The first source's reading of each replica: an engine's own count is every client's,
        so readings are not summed."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.sources:
            for rid, q in s.engine_queue().items():
                out.setdefault(rid, q)
        return out

    @property
    def reads_engines(self) -> bool:
        return any(s.reads_engines for s in self.sources)

    def in_flight_by_replica(self) -> dict[str, int]:
        """Summed over the sources (each router counts its own requests)."""
        out: dict[str, int] = {}
        for s in self.sources:
            for rid, n in s.in_flight_by_replica().items():
                out[rid] = out.get(rid, 0) + n
        return out

    def replica_stats(self) -> dict[str, dict[str, ReplicaStats]]:
        """Every source's router processes (instances are unique: each router makes its own id);
        a source without the method contributes nothing."""
        out: dict[str, dict[str, ReplicaStats]] = {}
        for s in self.sources:
            read = getattr(s, "replica_stats", None)
            if read is not None:
                for instance, replicas in read().items():
                    out[instance] = dict(replicas)
        return out


class ReportsCollector:
    """What the controller dropped of routers' reports (issue 39: bounded, and said): reports
    refused, by why, and routers' readings forgotten past what is remembered."""

    def __init__(self, hub: FeedHub, forgotten: Callable[[], int]) -> None:
        self._hub = hub
        self._forgotten = forgotten

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily("llmgw_controller_router_reports_refused",
                                      "Router reports refused: from a router past the most that may report at once "
                                      "(too_many_routers), or malformed or past a bound (malformed).",
                                      labels=("reason",))
        refused.add_metric(("too_many_routers",), self._hub.refused_routers)
        refused.add_metric(("malformed",), self._hub.malformed_reports)
        yield refused
        now = self._hub.clock()
        yield GaugeMetricFamily("llmgw_controller_routers_behind_unbelieved",
                                "Routers that said they serve from an older endpoint list than the one sent to "
                                f"them over {BEHIND_GRACE:g} s before (not believed: they hold no drain for it).",
                                value=sum(1 for at in self._hub.behind_unbelieved.values()
                                          if now - at <= self._hub.report_ttl))
        yield CounterMetricFamily("llmgw_controller_router_readings_forgotten",
                                  "Router processes whose last canary reading was forgotten, past the most "
                                  "remembered (a router sending a new process id with each report?).",
                                  value=self._forgotten())
