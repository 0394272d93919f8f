"""The router: the OpenAI-compatible server clients talk to (DESIGN §6).

::

    client ──► auth ──► parse (model, stream) ──► resolve alias ──► pick replica ──► forward
                                                     │ none ready       │ failed before first byte
                                                     ▼                  ▼
                                         fallbacks, then hold      cool down, retry once elsewhere
                                         (wake the control plane)

:class:`Router` is the control plane's endpoint sink (``set_endpoints``), a catalog subscriber
(``set_catalog``) and its usage source (``last_used``, ``demand``). It never waits on the control
plane: a new table or catalog replaces the old reference in one step, and requests read
whichever is current. In the controller's process it is wired directly; as its own process
(:mod:`llmgw.router.main`) a :class:`~llmgw.router.follow.FeedClient` feeds it the same calls
from the controller's watch stream.

What counts as demand, and how held requests wait, is :mod:`llmgw.router.demand`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from llmgw.catalog import Catalog
from llmgw.contract import Demand, Endpoint, PromptCache, ReplicaStats
from llmgw.router import respond
from llmgw.router.answer import llama_timings, stream_error
from llmgw.router.changes import Changes
from llmgw.router.config import RouterConfig
from llmgw.router.demand import DemandBook
from llmgw.router.feed import route_catalog
from llmgw.router.keys import ApiKey, KeyRing
from llmgw.router.load import poll_loads
from llmgw.router.metrics import UNKNOWN, GaugeSnapshot, RouterMetrics, gauges
from llmgw.router.parse import (
    BadBody,
    BodyParser,
    BodyTooLarge,
    Buffers,
    BuffersFull,
    Hold,
    ParserBusy,
    TooManyBodies,
    read_body,
)
from llmgw.router.prefix import MAX_BLOCKS, PrefixIndex, PromptKey, prompt_key
from llmgw.router.proxy import CLIENT_GONE, Tap, forward_stream, forward_whole, rewrite_model
from llmgw.router.retry import RetryBudget, RetryTicket, Step, next_step
from llmgw.router.routes import RouteCatalog, RouteModel
from llmgw.router.table import EMPTY, EndpointTable, Upstream, build_table, choose
from llmgw.router.upstream import Origin, Reason, UpstreamFailed, UpstreamPool
from llmgw.router.usage import ask_for_usage, reported_usage, wants_usage, with_fields
from llmgw.serving import body_encoding_refused, connection_cap, listen
from llmgw.tasks import cancel_and_wait
from llmgw.tenancy.admission import Limits
from llmgw.tenancy.asked import (
    ANSWER_FIELDS,
    COMPLETION_FIELDS,
    BadLimitField,
    asked_for,
    capped_fields,
    prompt_estimate,
    reserve_for,
)
from llmgw.tenancy.memory import LocalLimits
from llmgw.tenancy.rules import Refusal
from llmgw.tenancy.shared import SharedLimits
from llmgw.tenancy.usage import NO_ACCOUNT, Account, Usage, UsageBook

log = logging.getLogger(__name__)

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
# Every top-level member of a request body the router reads or writes: a big body parsed in the
# worker comes back with these parsed and every other member as text (llmgw.router.parse). A
# member read or set here and missing from this list would be invisible, or written twice.
READS = frozenset({"model", "stream", "stream_options", "prompt", *COMPLETION_FIELDS, *ANSWER_FIELDS})
_PROMPT_KIND = {CHAT: "chat", COMPLETIONS: "prompt"}  # which prompt text the worker renders


class Router:
    """The OpenAI-compatible router. Construct, ``await start()``, ``await listen(host, port)``
    (or mount :meth:`app`), and ``await close()``.

    ``wake(model_name)`` is called when a request needs a model that has no ready replica (at
    most once a second per model): in the controller it is the reconciler's notify, in a
    standalone router the feed client's immediate report. It may be set after construction.
    """

    def __init__(self, *, wake: Callable[[str], None] | None = None, keys: KeyRing | None = None,
                 config: RouterConfig | None = None, registry: CollectorRegistry | None = None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.keys = keys or KeyRing()
        self.config = config = config or RouterConfig()
        self.registry = registry or CollectorRegistry()
        self.metrics = RouterMetrics(self.registry, self._gauges)
        self.table: EndpointTable = EMPTY
        self.routes = RouteCatalog()
        self.has_catalog = False
        self._chains: dict[str, tuple[RouteModel, ...]] = {}
        self._rng = rng or random.Random()
        self._clock = clock
        self._wall = wall
        self._changes = Changes()
        self._demand = DemandBook(self._changes, clock=clock, linger=config.wake_linger)
        self._demand.wake = wake
        self._last_used: dict[str, float] = {}
        # model -> [prompt blocks routed by prefix, of which held, engine prompt tokens, of which cached]
        self._cache_counts: dict[str, list[int]] = {}
        # model -> [prompt tokens, cached] from engine-wide counters (vLLM's /metrics): every router
        # reading one engine sees the same totals, so these stay out of the reports routers sum.
        self._polled_counts: dict[str, list[int]] = {}
        self._usage = UsageBook()  # per (key name, model served) since start, and by minute for the ledger
        # What this process measured of each replica since it started, for canary analysis: the
        # controller takes differences, so a restarted router is a new instance, never a reset.
        self.instance_id = uuid.uuid4().hex
        self._stats: dict[str, ReplicaStats] = {}
        # The same counts by minute, until the controller's ledger has them (llmgw.contract).
        self.usage_outbox = self._usage.outbox
        # Tenants' limits, from the catalog (llmgw.yaml): counted here, or in Redis when configured.
        self._limits: Limits = LocalLimits()
        self._limits_errors = Counter(
            "llmgw_router_limits_errors", "Calls to the Redis that shares tenants' limits that failed for another "
            "reason than Redis being away (a script error, a reply not understood), by error; the requests that "
            "needed them were refused with a 503", ["error"], registry=self.registry)
        self._unknown_tenant_keys: set[tuple[str, str]] = set()  # already warned about
        self._budget = RetryBudget()
        self._handlers: set[asyncio.Task[object]] = set()  # requests being routed, for the drain
        self._unrunnable: dict[str, str] = {}  # model -> why no node can run it (from placement)
        # Bytes of request bodies held by requests in flight, in all and per key (or client address)
        self._buffers = Buffers(limit=config.buffered_limit, share=config.key_buffered)
        self._parser = BodyParser(reads=READS, workers=config.parse_workers, wait=config.body_timeout,
                                  prompt_chars=config.prefix_block_chars * MAX_BLOCKS,
                                  per_sender=config.key_parse_bodies)
        self._retired: list[Origin] = []
        self._pool: UpstreamPool | None = None
        self._load_session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None

    @property
    def wake(self) -> Callable[[str], None] | None:
        return self._demand.wake

    @wake.setter
    def wake(self, fn: Callable[[str], None] | None) -> None:
        self._demand.wake = fn

    # --- the control plane's side --------------------------------------------------------
    def set_catalog(self, catalog: Catalog) -> None:
        """Catalog subscriber: the control plane subscribes it before the reconciler, so names
        change before replicas do (`llmgw.control.server.attach_router`)."""
        self.set_routes(route_catalog(catalog))

    def set_routes(self, routes: RouteCatalog) -> None:
        chains = {}
        for m in routes.models:
            fallbacks = (routes.model(f) for f in m.fallbacks)
            chains[m.name] = (m, *(f for f in fallbacks if f is not None))
        self._warn_unknown_tenant_keys(routes)
        self._limits.set_tenants(routes.tenants)  # what each tenant used goes on: no fresh budgets
        self.routes, self._chains, self.has_catalog = routes, chains, True
        self._changes.notify()

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], routers: int = 1) -> None:
        """What the controller's ledger says each budget used this period ((tenant, model or "") →
        (period start, tokens)), and how many routers share the limits: budgets go on from there
        (a router restarted mid-period does not hand a tenant a fresh one; degraded mode grants
        only this router's share of what is left)."""
        self._limits.set_spent(figures, routers=routers)

    def use_limits_redis(self, url: str) -> None:
        """Count tenants' limits in the Redis at ``url`` (as the controller says), or locally ("")."""
        if url == self._limits.url:
            return
        old = self._limits
        self._limits = self._shared_limits(url) if url else LocalLimits(old.limiter)
        if old.url:  # shared: what it holds in Redis goes back
            task = asyncio.get_running_loop().create_task(old.close())
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def _shared_limits(self, url: str) -> SharedLimits:
        errors = self._limits_errors
        return SharedLimits(url, limiter=self._limits.limiter, clock=self._clock, wall=self._wall,
                            on_error=lambda e: errors.labels(e).inc())

    def _warn_unknown_tenant_keys(self, routes: RouteCatalog) -> None:
        """A tenant naming a key this router does not have limits nobody: a typo would leave the
        real key unlimited, and git cannot know the key names (their hashes stay out of it)."""
        if self.keys.open:
            return
        names = {k.name for k in self.keys.keys}
        unknown = {(t.name, k) for t in routes.tenants for k in t.keys if k not in names}
        # Once per change: a standalone router gets the catalog again with every endpoint change.
        for tenant in sorted({t for t, _ in unknown - self._unknown_tenant_keys}):
            keys = ", ".join(sorted(k for t, k in unknown if t == tenant))
            log.warning("tenant %s names API key(s) this router does not have: %s (known: %s)", tenant, keys,
                        ", ".join(sorted(n for n in names if n)))
        self._unknown_tenant_keys = unknown

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Endpoint sink: replace the table with ``endpoints`` (ready replicas only) at once."""
        old = self.table
        self.table = build_table(endpoints, old)
        gone = set(old.upstreams) - set(self.table.upstreams)
        if gone:
            self.metrics.forget_replicas(gone)
            for rid in gone:
                self._last_used.pop(rid, None)
                self._stats.pop(rid, None)
                origin = old.upstreams[rid].origin
                origin.retired = True  # its connections close as they come back...
                self._retired.append(origin)  # ...and the idle ones at the next sweep
        for rid in self.table.upstreams:
            if rid not in self._stats:
                self._stats[rid] = ReplicaStats()
        self._changes.notify()

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        """Models no node can run, with the placement reason: answered at once, and held
        requests for them released with it (DESIGN §6)."""
        self._unrunnable = dict(reasons)
        self._changes.notify()

    def last_used(self) -> dict[str, float]:
        """Usage source: unix time each replica last had a request start or finish."""
        return dict(self._last_used)

    def demand(self) -> dict[str, Demand]:
        """Usage source: held and in-flight requests per model (see :mod:`llmgw.router.demand`)."""
        table = self.table
        inflight: dict[str, int] = {}
        for u in table.upstreams.values():
            if u.inflight:
                inflight[u.model] = inflight.get(u.model, 0) + u.inflight
        return self._demand.snapshot(inflight, table.has)

    def prompt_cache(self, *, polled: bool = True) -> dict[str, PromptCache]:
        """Usage source: per model, how prompts met cached prefixes since this router started.
        ``polled=False`` leaves out what was read from engines' own counters (a standalone router's
        report: the controller's router reads those engines too, and reports are summed)."""
        out = {m: PromptCache(*c) for m, c in self._cache_counts.items()}
        if polled:
            for m, (prompt, cached) in self._polled_counts.items():
                out[m] = out.get(m, PromptCache()) + PromptCache(prompt_tokens=prompt, cached_tokens=cached)
        return out

    def replica_stats(self) -> dict[str, dict[str, ReplicaStats]]:
        """Usage source: ``{instance_id: {replica id: stats}}``, what this router measured of each
        replica in the table since it started (cumulative), as copies: the live counters go on
        moving while the caller takes differences."""
        return {self.instance_id: {rid: ReplicaStats(s.requests, s.errors, list(s.ttft), list(s.itl))
                                   for rid, s in self._stats.items()}}

    def usage(self) -> dict[tuple[str, str], Usage]:
        """Tokens and requests per (API key name, model served) since this router started; the key
        is "" when the router is open (no keys configured)."""
        return self._usage.snapshot()

    def inflight(self) -> int:
        return sum(u.inflight for u in self.table.upstreams.values())

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the connection pool to engines and start reading their queue depths."""
        self._changes.bind(asyncio.get_running_loop())
        c = self.config
        self._pool = UpstreamPool(connect_timeout=c.connect_timeout, read_timeout=c.first_byte_timeout,
                                  keepalive_timeout=c.keepalive_timeout, max_idle=c.max_idle)
        self._load_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        if c.limits_redis:
            self._limits = self._shared_limits(c.limits_redis)
        self._poller = asyncio.create_task(self._background(), name="router-background")

    async def _background(self) -> None:
        """Engine queue depths, and idle upstream connections closed once past their keep-alive."""
        assert self._load_session is not None and self._pool is not None
        poller = asyncio.create_task(poll_loads(lambda: self.table, self._load_session, self.config.load_interval,
                                                self._engine_counts))
        try:
            while True:
                await asyncio.sleep(self.config.keepalive_timeout)
                retired, self._retired = self._retired, []
                for origin in (*retired, *(u.origin for u in self.table.upstreams.values())):
                    self._pool.sweep(origin)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve :meth:`app` on ``host:port``; returns the port (useful with 0)."""
        # The drain is ours (see drain()); aiohttp's own only cancels reading the request body.
        # Each proxied request holds two descriptors (client and engine): the router's clients
        # may use at most 40% of them, so engines, the admin API and git always have some.
        self._runner = await listen(self.app(), host, port, drain_timeout=1.0, max_connections=connection_cap(0.4))
        return int(self._runner.addresses[0][1])

    async def drain(self) -> None:
        """Stop accepting; in-flight requests get ``drain_timeout`` to finish, then are cancelled
        (and with them the engines' work). aiohttp's shutdown waits its timeout twice and does not
        cancel a handler waiting on an engine: a request in flight held `up`'s exit for 22 s."""
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=self.config.drain_timeout)
        for task in set(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=1.0)
        await self._runner.cleanup()
        self._runner = None

    async def close(self) -> None:
        await self.drain()
        await cancel_and_wait(self._poller)
        self._poller = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._load_session is not None:
            await self._load_session.close()
            self._load_session = None
        limits, self._limits = self._limits, LocalLimits(self._limits.limiter)
        await limits.close()
        await self._parser.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.body_limit)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(EMBEDDINGS, self.embeddings)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/health", self.health)
        # Last, so it only sees what no route above took: 404 and 405 in the OpenAI error format
        # (aiohttp's own are plain text, which OpenAI clients cannot read), at no cost per request.
        app.router.add_route("*", "/{tail:.*}", self.no_route)
        return app

    async def no_route(self, request: web.Request) -> web.Response:
        allowed = {CHAT: "POST", COMPLETIONS: "POST", EMBEDDINGS: "POST", "/v1/models": "GET", "/metrics": "GET",
                   "/health": "GET"}.get(request.path)
        if allowed is None and request.path.startswith("/v1/models/"):
            allowed = "GET"
        if allowed is not None:
            resp = respond.error(405, f"{request.method} is not allowed on {request.path}: use {allowed}.",
                                 code="method_not_allowed")
            resp.headers["Allow"] = allowed
            return resp
        return respond.error(404, f"There is no {request.path} here: this router serves /v1/models, "
                                  f"{CHAT}, {COMPLETIONS} and {EMBEDDINGS}.", code="unknown_url")

    # --- read-only endpoints -------------------------------------------------------------
    async def list_models(self, request: web.Request) -> web.Response:
        """Every model and alias in the catalog (those the key may use), with whether it is ready."""
        key, refused = self._authenticate(request)
        if refused is not None:
            return refused
        table = self.table
        data = [_model_entry(n, m, table.has(m.name)) for m in self.routes.models
                if key is None or key.allows(m) for n in m.names]
        return respond.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        key, refused = self._authenticate(request)
        if refused is not None:
            return refused
        name = request.match_info["model"]
        m = self.routes.resolve(name)
        if m is None or (key is not None and not key.allows(m)):
            return respond.not_found(name)
        return respond.json_response(_model_entry(name, m, self.table.has(m.name)))

    async def prometheus(self, _request: web.Request) -> web.Response:
        """The router's own series; no tenant or key names (those are :meth:`metrics_app`'s)."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def metrics_app(self, token: str) -> web.Application:
        """``/metrics`` with every series, usage per tenant and API key included, for a bearer of
        the admin ``token`` (`llmgw router --metrics-listen`): key names and what each spent are
        the operator's business, not every client's that reaches the router's port."""
        expected = token.encode()

        async def everything(request: web.Request) -> web.Response:
            header = request.headers.get("Authorization", "")
            given = header[7:].strip() if header[:7].lower() == "bearer " else ""
            # surrogateescape: a header's non-UTF-8 bytes arrive as surrogates (a 500 in encode())
            if not expected or not hmac.compare_digest(expected, given.encode("utf-8", "surrogateescape")):
                return web.json_response({"error": "missing or invalid admin token (Authorization: Bearer ...)"},
                                         status=401, headers={"WWW-Authenticate": "Bearer"})
            body = generate_latest(self.registry) + generate_latest(self.metrics.tenants)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application(client_max_size=1024)
        app.router.add_get("/metrics", everything)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        """200 once the router has a catalog to serve from (a load balancer's readiness check)."""
        body = {"status": "ok" if self.has_catalog else "waiting for a catalog",
                "models": len(self.routes.models), "endpoints": len(self.table.upstreams),
                "table_version": self.table.version, "inflight": self.inflight()}
        return respond.json_response(body, status=200 if self.has_catalog else 503)

    def _authenticate(self, request: web.Request) -> tuple[ApiKey | None, web.Response | None]:
        if self.keys.open:
            return None, None
        header = request.headers.get("Authorization")
        key = self.keys.authenticate(header)
        if key is None:
            why = "No API key was given" if not header else "The API key is not valid"
            return None, respond.unauthorized(f"{why}: send `Authorization: Bearer <key>` with a key "
                                              "configured for this router.")
        return key, None

    # --- generation ----------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, COMPLETIONS)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, EMBEDDINGS)

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        t0 = self._clock()
        key = None
        if self.keys.keys:
            key, refused = self._authenticate(request)
            if refused is not None:
                return self._refuse(refused, UNKNOWN, t0)
            refused = self._refuse_early(key, request.content_length)
            if refused is not None:
                return self._refuse(refused, UNKNOWN, t0)
        limit = self.config.body_limit
        length = request.content_length
        if length is not None and length > limit:
            return self._refuse(respond.too_large(limit), UNKNOWN, t0)
        refused_encoding = body_encoding_refused(request)
        if refused_encoding is not None:
            return self._refuse(respond.error(415, refused_encoding, code="unsupported_content_encoding"), UNKNOWN, t0)
        # A total over every request in flight, not only a cap per request (32 MB each times a
        # thousand slow uploads is 32 GB of a router's memory), and a share of it per key: counted
        # as bodies are read (the Content-Length up front), so concurrent uploads cannot all pass.
        hold = Hold(self._buffers, key.name if key is not None else f"address {request.remote}")
        try:
            try:
                hold.cover(length or 0)
                async with asyncio.timeout(self.config.body_timeout):
                    raw = await read_body(request.content, limit, hold)
            except BodyTooLarge:
                return self._refuse(respond.too_large(limit), UNKNOWN, t0)
            except TimeoutError:
                return self._refuse(respond.body_timeout(self.config.body_timeout), UNKNOWN, t0)
            except BuffersFull as exc:
                return self._refuse(self._buffers_full(exc), UNKNOWN, t0)
            except RequestPayloadError as exc:  # a broken chunked body: the client's, never a 500
                return self._refuse(respond.bad_request(f"The request body could not be read: {exc}"), UNKNOWN, t0)
            return await self._handle_body(request, path, raw, key, t0, who=hold.who)
        finally:
            hold.release()

    def _refuse_early(self, key: ApiKey | None, length: int | None) -> web.Response | None:
        """Cheap refusals first: a tenant already out of requests per minute, requests in flight
        or budget for every model is refused before its body is read or parsed (the body's size
        alone says the least it reserves), so a hostile tenant's big bodies cost the router
        nothing once it is over its limits. The same answer the full check would give."""
        limits = self._limits
        if key is None or limits.tenant(key.name) is None:
            return None
        if length is not None and length > self.config.body_limit:
            return None  # too large, whoever sends it: the 413 that follows says so
        least = prompt_estimate(length or 0)  # what any request with this body reserves at least
        refused = limits.precheck(key.name, least, self._wall())
        return None if refused is None else _refused(refused)

    def _buffers_full(self, exc: BuffersFull) -> web.Response:
        if exc.share:  # this key's own share: its to slow down, nobody else's
            return respond.rate_limited(str(exc), self.config.retry_after, {})
        return respond.unavailable(str(exc), self.config.retry_after)

    @property
    def _buffered(self) -> int:
        """Bytes of request bodies held by requests in flight."""
        return self._buffers.total

    async def _handle_body(self, request: web.Request, path: str, raw: bytes, key: ApiKey | None,
                           t0: float, *, who: str = "") -> web.StreamResponse:
        try:
            parsed = await self._parser.parse(raw, _PROMPT_KIND.get(path), who)
        except BadBody as exc:
            return self._refuse(respond.bad_request(str(exc), exc.code), UNKNOWN, t0)
        except TooManyBodies as exc:
            return self._refuse(respond.rate_limited(str(exc), self.config.retry_after, {}), UNKNOWN, t0)
        except ParserBusy as exc:
            return self._refuse(respond.unavailable(str(exc), self.config.retry_after), UNKNOWN, t0)
        body, asked, stream = parsed.body, parsed.model, parsed.stream
        model = self.routes.resolve(asked)
        if model is None:
            return self._refuse(respond.not_found(asked), UNKNOWN, t0)
        if key is not None and not key.allows(model):
            return self._refuse(respond.forbidden(
                f"The API key `{key.name}` may not use the model `{asked}`."), model.name, t0)
        if (path == EMBEDDINGS) != (model.task == "embedding"):
            right = EMBEDDINGS if model.task == "embedding" else f"{CHAT} or {COMPLETIONS}"
            return self._refuse(respond.bad_request(
                f"The model `{asked}` is a {model.task} model: use {right}, not {path}.", "wrong_endpoint"),
                model.name, t0)
        ticket = None
        reserve = 0
        limits = self._limits
        if key is not None and limits.tenant(key.name) is not None:  # only a tenant's key is limited
            try:
                ask = asked_for(body)
            except BadLimitField as exc:
                return self._refuse(respond.bad_request(str(exc), "invalid_value"), model.name, t0)
            reserve = reserve_for(ask, raw)
            chain = tuple(m.name for m in self._chains.get(model.name, (model,)))
            admitted = await limits.admit(key.name, chain, reserve, self._wall())
            if isinstance(admitted, Refusal):
                return self._refuse(_refused(admitted), model.name, t0)
            ticket = admitted
            if ticket is not None and path != EMBEDDINGS:
                # What is reserved is what the engine may write: every completion-limit field an
                # engine may read is sent as the reserved limit (engines differ in which one they
                # read, and a 0 is "unset" to vLLM: the default is reserved and sent), and a budget
                # is a cap even for a request that sets none (tenancy.asked.capped_fields).
                fields = capped_fields(ask, chat=path == CHAT, cap_unasked=limits.caps_unasked(key.name, chain))
                if fields:
                    raw = with_fields(raw, body, fields)
                    body = {**body, **fields}
        account = Account(key.name if key is not None else "", ticket, prompt_estimate(raw), reserve)
        try:
            return await self._route(request, path, raw, body, asked, model, stream and path != EMBEDDINGS, t0,
                                     account, parsed.prompt)
        finally:
            if ticket is not None:
                ticket.release()

    async def _route(self, request: web.Request, path: str, raw: bytes, body: dict, asked: str,
                     model: RouteModel, stream: bool, t0: float, account: Account,
                     prompt_text: str | None = None) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            with self._budget.ticket() as ticket:
                return await self._route_attempts(request, path, raw, body, asked, model, stream, t0, ticket, account,
                                                  prompt_text)
        finally:
            self._handlers.discard(task)

    async def _route_attempts(self, request: web.Request, path: str, raw: bytes, body: dict, asked: str,
                              model: RouteModel, stream: bool, t0: float, ticket: RetryTicket,
                              account: Account, prompt_text: str | None = None) -> web.StreamResponse:
        chain = self._chains.get(model.name, (model,))
        tried: tuple[Upstream, ...] = ()
        failure: UpstreamFailed | None = None
        deliveries = 0  # attempts that reached an engine (DESIGN §6: at most two, each engine once)
        prompt = self._prompt_key(body, path, chain, prompt_text)
        # Usage is counted from the engine's own report: a stream is asked for its usage event,
        # which is taken out again when the client did not want it (llmgw.router.usage).
        strip_usage = stream and not wants_usage(body)
        counted = False  # a retried request's blocks are counted once
        # Drawn once: a request and its retries stay on one version of a model with a canary.
        draw = self._rng.random()
        while True:
            table = self.table
            choice = choose(table, chain, self._clock(), self._rng, tried, prompt, self.config.prefix_imbalance,
                            draw=draw)
            if choice is None:
                if failure is not None:
                    return self._refuse(self._failed(model, chain, failure, len(tried)), model.name, t0)
                refused = await self._hold(model, chain)
                if refused is not None:
                    return self._refuse(refused, model.name, t0)
                current = self.routes.model(model.name)
                if current is None:
                    return self._refuse(respond.not_found(asked), UNKNOWN, t0)
                model, chain = current, self._chains.get(current.name, (current,))
                continue
            target, up = choice
            if prompt is not None and target.routing == "prefix":
                self._note_prompt(target.name, up, prompt, count=not counted)
                counted = True
            data = raw if target.name == asked else rewrite_model(raw, body, asked, target.name)
            # llama.cpp reports exact counts in its timings unasked; asked, it moves them into the
            # usage event the client would then lose (answer.llama_timings).
            ask = strip_usage and up.endpoint.engine != "llama.cpp"
            if ask:
                data = ask_for_usage(data, body if target.name == asked else {**body, "model": target.name})
            attempt = (request, up, path, data, target.name, stream, model.name, t0, account, ask)
            try:
                if target is model:
                    return await self._send(*attempt)
                self.metrics.fallback(model.name, target.name)
                if table.has(model.name):  # its replicas failed: no wake-up needed
                    return await self._send(*attempt)
                with self._demand.standing_in(model.name):
                    return await self._send(*attempt)
            except UpstreamFailed as exc:
                failure = exc
                tried += (up,)
                now = self._clock()
                if up.cooldown_until <= now:
                    log.warning("replica %s (%s) failed (%s); cooling down %.0f s", up.replica_id, up.url, exc,
                                self.config.cooldown)
                up.cooldown_until = now + self.config.cooldown
                up.failures += 1
                if exc.reason in (Reason.CONNECT, Reason.DISCONNECT):
                    up.forget_prompts()  # an engine that refuses or drops connections may be a new process
                deliveries += exc.reason != Reason.CONNECT
                step = next_step(exc.reason, deliveries=deliveries, attempts=len(tried), retries=self.config.retries)
                if step is Step.SPEND and not ticket.spend():
                    self.metrics.retry_denied(model.name)
                    step = Step.STOP
                if step is Step.STOP:
                    return self._refuse(self._failed(model, chain, failure, len(tried)), model.name, t0)
                self.metrics.retry(model.name, exc.reason)

    async def _send(self, request: web.Request, up: Upstream, path: str, data: bytes, served: str, stream: bool,
                    label: str, t0: float, account: Account = NO_ACCOUNT, strip_usage: bool = False,
                    ) -> web.StreamResponse:
        pool = self._pool
        assert pool is not None, "Router.start() was not awaited"
        rid = up.replica_id
        up.inflight += 1
        self._last_used[rid] = self._wall()
        status: int | None = None
        counted = self._answer_tap(served, account, up.endpoint.engine == "llama.cpp")
        whole = tapped = failed = broken = False
        ticket = account.ticket
        clock = self._clock
        # This attempt's own start: time the request waited for a replica is not the replica's.
        start = clock()
        first: float | None = None  # when a stream's first chunk came
        events = 0

        def tap(tail: bytes, n: int, complete: bool) -> None:
            nonlocal whole, tapped, events, broken
            whole, tapped, events = complete, True, n
            # A 200 stream whose engine failed after it began says so in an error event near its
            # end (vLLM's; answer.stream_error): searched for in the tail only, once per stream.
            broken = stream and stream_error(tail)
            counted(tail, n, complete)

        def gone() -> None:
            # The client went away before any answer was counted (a whole one not yet read, a
            # stream before its first chunk, or before its response began): the engine has the
            # prompt and may be writing, how much is not known, so the whole reservation is
            # charged (a stream that began counts what it got).
            if ticket is not None:
                ticket.settle(account.reserved)
            tap(b"", 0, False)
        try:
            if stream:
                metrics = self.metrics

                def on_first() -> None:
                    nonlocal first
                    first = clock()
                    metrics.first_token(label, first - t0)

                resp, status = await forward_stream(pool, up.origin, up.heads[path], data, served, request,
                                                    on_first, tap, strip_usage)
                if status == CLIENT_GONE and not tapped:
                    gone()
            else:
                resp = await forward_whole(pool, up.origin, up.heads[path], data, served, tap)
                status = resp.status
            if ticket is not None:  # an engine's error, or an answer without usage: its prompt counts
                ticket.charge_at_least(account.prompt_estimate)
            return resp
        except BaseException as exc:
            if isinstance(exc, UpstreamFailed):
                failed = True
                if exc.reason not in (Reason.CONNECT, Reason.STATUS) and ticket is not None:
                    # Sent, then cut off: the engine read the prompt. Charged unless a retry's
                    # answer settles what was really used.
                    ticket.charge_at_least(account.prompt_estimate)
            else:
                # Cancelled: the client went away, before the answer's end or (a client that
                # hangs up at the end marker) after it, which is an answer served.
                status = 200 if whole else CLIENT_GONE
                if not tapped:
                    gone()
            raise
        finally:
            up.inflight -= 1
            self._last_used[rid] = self._wall()
            end = clock()
            if status is not None:
                self.metrics.request(label, status, rid, end - t0)
            self._observe(rid, failed=failed, status=status, whole=whole, tapped=tapped, start=start,
                          first=first, end=end, events=events, broken=broken)

    def _observe(self, rid: str, *, failed: bool, status: int | None, whole: bool, tapped: bool, start: float,
                 first: float | None, end: float, events: int, broken: bool) -> None:
        """One attempt's outcome in its replica's :class:`ReplicaStats` (what a canary is judged by).

        An error: the attempt failed (any reason), the engine answered 4xx or 5xx, cut a stream
        (broke it, or ended it before its end marker) or said in the stream that it failed
        (``broken``: an error event, whether or not the client stayed to read the rest). A 429
        from the engine too: a version that refuses what the stable one serves is a broken
        version, and a fleet that is simply overloaded refuses in both groups alike, which the
        analysis compares; the router's own 429s (tenants' limits) never reach here, as they
        never reach a replica. Not counted at all: the client went away before the answer was
        whole (not the replica's doing), nor a replica no longer in the table. Latencies only for
        answers served (2xx), so fast refusals cannot make a broken version look fast (its error
        rate judges it): time to the first chunk of a stream (else the whole answer's time) from
        this attempt's start, and a stream's mean time between its content events.
        """
        stats = self._stats.get(rid)  # made with the table (set_endpoints): a replica gone is not counted
        if stats is None:
            return
        if broken:
            stats.observe(error=True)
            return
        if not failed:
            if status is None or (status == CLIENT_GONE and not whole):
                return
            if status == CLIENT_GONE or status < 300:  # a client that hung up at the end got its answer
                if tapped and not whole:  # the engine cut it short
                    stats.observe(error=True)
                    return
                ttft = (end if first is None else first) - start
                itl = (end - first) / (events - 1) if first is not None and events >= 2 else None
                stats.observe(error=False, ttft=ttft, itl=itl)
                return
            failed = status >= 400
        stats.observe(error=failed)

    # --- prefix affinity (llmgw.router.prefix) -------------------------------------------
    def _prompt_key(self, body: dict, path: str, chain: tuple[RouteModel, ...],
                    text: str | None = None) -> PromptKey | None:
        """The request's prompt key when any model it may go to is routed by prefix. ``text``: the
        prompt already rendered (a big body, by the parse worker), keyed as a plain prompt is."""
        if path == EMBEDDINGS or not any(m.routing == "prefix" for m in chain):
            return None
        if text is not None:
            return prompt_key({"prompt": text}, False, self.config.prefix_block_chars)
        return prompt_key(body, path == CHAT, self.config.prefix_block_chars)

    def _note_prompt(self, model: str, up: Upstream, prompt: PromptKey, *, count: bool) -> None:
        if up.prefixes is None:
            up.prefixes = PrefixIndex(self.config.prefix_index_blocks)
        held = up.prefixes.record(prompt.hashes)
        if not count:
            return
        counts = self._counts(model)
        counts[0] += len(prompt.hashes)
        counts[1] += held

    def _answer_tap(self, model: str, account: Account, llama: bool) -> Tap:
        """What is counted from an answer's end: usage per key and model, and (llama.cpp, which
        says in every answer how much of the prompt it took from its cache) prompt-cache hits."""
        def tap(tail: bytes, events: int, complete: bool) -> None:
            timings = llama_timings(tail) if llama and complete else None
            reported = None if not complete else reported_usage(tail) or (
                (timings.prompt, timings.predicted) if timings is not None else None)
            limits = self._limits
            # Cut short, or an engine that reports nothing: what was produced (router/usage.py).
            # By minute on the limits' clock (Redis's when shared), as admission is: a router whose
            # own clock is off would report its use in another budget period.
            self._usage.answered(account, model, complete=complete, reported=reported,
                                 streamed=events if tail else None, minute=int(self._wall() + limits.offset) // 60 * 60,
                                 tenant=limits.tenant(account.key) or "")
            if timings is not None:
                counts = self._counts(model)
                counts[2] += timings.prompt
                counts[3] += timings.cached
        return tap

    def _engine_counts(self, up: Upstream, queries: float, hits: float) -> None:
        """From the load poller: an engine's prefix-cache counters moved (vLLM)."""
        counts = self._polled_counts.setdefault(up.model, [0, 0])
        counts[0] += round(queries)
        counts[1] += round(min(hits, queries))

    def _counts(self, model: str) -> list[int]:
        counts = self._cache_counts.get(model)
        if counts is None:
            counts = self._cache_counts[model] = [0, 0, 0, 0]
        return counts

    def _refuse(self, resp: web.Response, label: str, t0: float) -> web.Response:
        self.metrics.request(label, resp.status, "", self._clock() - t0)
        return resp

    def _failed(self, model: RouteModel, chain: tuple[RouteModel, ...], failure: UpstreamFailed,
                attempts: int) -> web.Response:
        alts = "" if len(chain) == 1 else f" (fallbacks: {', '.join(m.name for m in chain[1:])})"
        msg = (f"The model `{model.name}`{alts} could not be served: {attempts} attempt(s) failed before an answer; "
               f"last: {failure}.")
        return respond.upstream_failed(msg, timeout=failure.timeout, retry_after=self.config.retry_after)

    # --- scale from zero -----------------------------------------------------------------
    async def _hold(self, model: RouteModel, chain: tuple[RouteModel, ...]) -> web.Response | None:
        """Wait until ``model`` or one of its fallbacks has a replica (or it left the catalog):
        None then, else the refusal to send."""
        tried = f" or its fallbacks ({', '.join(m.name for m in chain[1:])})" if len(chain) > 1 else ""
        retry = self.config.retry_after
        if not model.wakeable:
            return respond.unavailable(f"No ready replica of `{model.name}`{tried}, and it is switched off "
                                       "(scaling.max is 0).", retry)
        stuck = self._cannot_run(chain)
        if stuck is not None:
            return stuck
        if self._demand.held_total >= self.config.max_held:
            return respond.unavailable(f"No ready replica of `{model.name}`{tried}, and {self._demand.held_total} "
                                       "requests are already waiting for replicas to start.", retry)
        name = model.name

        def ready() -> bool:
            if self.routes.model(name) is None:
                return True  # left the catalog: the caller answers 404
            links = self._chains.get(name, chain)
            # Placement said it cannot be woken: the caller answers with the reason at once.
            return any(self.table.has(m.name) for m in links) or all(m.name in self._unrunnable for m in links)

        self.metrics.hold(name)
        start = self._clock()
        if await self._demand.hold(name, ready, self.config.hold_timeout):
            return None
        return respond.unavailable(
            f"No ready replica of `{name}`{tried}: waited {self._clock() - start:.0f} s for one to start "
            "and none became ready. Retry later.", retry)

    def _cannot_run(self, chain: tuple[RouteModel, ...]) -> web.Response | None:
        """503 now when neither the model nor any fallback can be placed on any node."""
        if not all(m.name in self._unrunnable for m in chain):
            return None
        reasons = "; ".join(f"`{m.name}`: {self._unrunnable[m.name]}" for m in chain)
        return respond.unavailable(f"No replica of `{chain[0].name}` can start: {reasons} "
                                   f"(llmgw explain {chain[0].name}).", self.config.retry_after)

    # --- metrics -------------------------------------------------------------------------
    def _gauges(self) -> GaugeSnapshot:
        tenant = self._limits.tenant
        usage = {(tenant(key) or "", key, model): u for (key, model), u in self._usage.totals.items()}
        snap = gauges(self.table, self._demand.held, self._clock(), self.prompt_cache(), usage)
        snap.limits_degraded = self._limits.degraded
        parser = self._parser
        snap.parsing, snap.parse_waiting, snap.parsed_off_loop = parser.parsing, parser.waiting, parser.offloaded
        return snap


def _refused(refused: Refusal) -> web.Response:
    """A tenant's request refused, in OpenAI's format: 400 when waiting cannot help, 503 when the
    limits could not be checked (fail closed: N routers each on its own would be N times every
    limit), else 429 with Retry-After and the x-ratelimit headers."""
    if refused.unavailable:
        return respond.error(503, refused.message, kind="service_unavailable", code="limits_unavailable",
                             retry_after=1)
    if refused.fits_never:
        return respond.bad_request(refused.message, "exceeds_budget")
    return respond.rate_limited(refused.message, refused.retry_after, refused.headers)


def _model_entry(name: str, model: RouteModel, ready: bool) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "root": model.name,
            "task": model.task, "ready": ready}
