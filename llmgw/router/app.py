"""The router: the OpenAI-compatible server clients talk to (DESIGN §6).

A generation request goes through small stages, each in its own module::

    authenticate ──► admit early ──► intake ──► resolve ──► admit ──► choose, send, retry ──► account
    (auth.py)        (admit.py)      (intake.py: (routes)    (admit.py: (attempts.py, send.py;  (account.py)
                                      read, parse)            tenants)   hold.py: scale from zero)

What differs per engine is :mod:`llmgw.router.engines`, looked up once per replica.

:class:`Router` wires the stages and is the control plane's endpoint sink (``set_endpoints``) and a
catalog subscriber (``set_catalog``); what the control plane reads back (last use, demand, in
flight, canary readings, usage rows) is ``Router.usage``, a :class:`~llmgw.router.source.RouterUsage`. It never
waits on the control plane: a new table or catalog replaces the old reference in one step
(:mod:`llmgw.router.current`), and requests read whichever is current. In the controller's
process it is wired directly; as its own process (:mod:`llmgw.router.main`) a
:class:`~llmgw.router.follow.FeedClient` feeds it the same calls from the controller's watch stream.

What counts as demand, and how held requests wait, is :mod:`llmgw.router.demand`.
"""

from __future__ import annotations

import asyncio
import hmac
import random
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw.catalog import Catalog
from llmgw.contract import Endpoint
from llmgw.router import respond
from llmgw.router.account import Accounting
from llmgw.router.admit import Admission
from llmgw.router.attempts import Attempts, refuse
from llmgw.router.auth import authenticate
from llmgw.router.changes import Changes
from llmgw.router.config import RouterConfig
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.feed import route_catalog
from llmgw.router.hold import Holder
from llmgw.router.intake import READS as READS  # where callers have found it
from llmgw.router.intake import Intake
from llmgw.router.keys import ApiKey, KeyRing
from llmgw.router.load import LoadReader
from llmgw.router.metrics import UNKNOWN, GaugeSnapshot, RouterMetrics, gauges
from llmgw.router.parse import Parsed
from llmgw.router.paths import CHAT, COMPLETIONS, EMBEDDINGS
from llmgw.router.retry import RetryBudget
from llmgw.router.routes import RouteCatalog, RouteModel
from llmgw.router.send import Routed, Sender
from llmgw.router.source import RouterUsage
from llmgw.router.table import EndpointTable, Upstream, build_table
from llmgw.router.upstream import Origin, UpstreamPool
from llmgw.serving import connection_cap, listen
from llmgw.tasks import cancel_and_wait

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "READS", "Router"]


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
        self.metrics = metrics = RouterMetrics(self.registry, self._gauges)
        self._clock = clock
        self._current = current = Current()
        self._changes = Changes()
        self._demand = DemandBook(self._changes, clock=clock, linger=config.wake_linger)
        self._demand.wake = wake
        self._admission = Admission(config, registry=self.registry, clock=clock, wall=wall)
        self._intake = Intake(config)
        self._accounting = accounting = Accounting(self._admission, wall=wall)
        self._admission.on_refused = accounting.refused
        # What the control plane reads back (UsageSource), the usage rows for its ledger included.
        self.usage = RouterUsage(current, accounting, self._demand)
        self._sender = Sender(accounting, metrics=metrics, clock=clock, wall=wall)
        holder = Holder(current=current, demand=self._demand, metrics=metrics, config=config, clock=clock)
        self._attempts = Attempts(current=current, sender=self._sender, holder=holder, accounting=accounting,
                                  demand=self._demand, metrics=metrics, config=config, rng=rng or random.Random(),
                                  clock=clock)
        self._budget = RetryBudget()
        self._handlers: set[asyncio.Task[object]] = set()  # requests being routed, for the drain
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

    @property
    def table(self) -> EndpointTable:
        return self._current.table

    @property
    def routes(self) -> RouteCatalog:
        return self._current.routes

    def set_catalog(self, catalog: Catalog) -> None:
        """Catalog subscriber: the control plane subscribes it before the reconciler, so names
        change before replicas do (`llmgw.compose.server.attach_router`)."""
        self.set_routes(route_catalog(catalog))

    def set_keys(self, keys: KeyRing) -> None:
        """The keys to check from now on (a key made or revoked takes effect at the next request);
        tenants are matched to keys by name, so they are matched again."""
        self.keys = keys
        if self._current.has_catalog:
            self._admission.set_tenants(self._current.routes, keys)

    def set_routes(self, routes: RouteCatalog) -> None:
        chains = {}
        for m in routes.models:
            fallbacks = (routes.model(f) for f in m.fallbacks)
            chains[m.name] = (m, *(f for f in fallbacks if f is not None))
        self._admission.set_tenants(routes, self.keys)
        current = self._current
        current.routes, current.chains, current.has_catalog = routes, chains, True
        self._changes.notify()

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], routers: int = 1) -> None:
        """What the controller's ledger says each budget used this period ((tenant, model or "") →
        (period start, tokens)), and how many routers share the limits: budgets go on from there
        (a router restarted mid-period does not hand a tenant a fresh one; degraded mode grants
        only this router's share of what is left)."""
        self._admission.set_spent(figures, routers=routers)

    def use_limits_redis(self, url: str) -> None:
        """Count tenants' limits in the Redis at ``url`` (as the controller says), or locally ("")."""
        old = self._admission.use_redis(url)
        if old is not None:  # shared: what it holds in Redis goes back
            task = asyncio.get_running_loop().create_task(old.close())
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Endpoint sink: replace the table with ``endpoints`` (ready replicas only) at once."""
        current = self._current
        old = current.table
        current.table = build_table(endpoints, old)
        gone = set(old.upstreams) - set(current.table.upstreams)
        self.usage.withdrawn(old.upstreams[rid] for rid in gone)
        if gone:
            self.metrics.forget_replicas(gone)
            for rid in gone:
                origin = old.upstreams[rid].origin
                origin.retired = True  # its connections close as they come back...
                self._retired.append(origin)  # ...and the idle ones at the next sweep
        self._accounting.replicas_changed(gone=gone, present=current.table.upstreams)
        self._changes.notify()

    def set_unrunnable(self, reasons: Mapping[str, str]) -> None:
        """Models no node can run, with the placement reason: answered at once, and held
        requests for them released with it (DESIGN §6)."""
        self._current.unrunnable = dict(reasons)
        self._changes.notify()

    def requests_in_flight(self) -> int:
        """This router's requests on replicas in the table right now (/health and the drain's log say it)."""
        return sum(u.inflight for u in self.table.upstreams.values())

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the connection pool to engines and start reading their queue depths."""
        self._changes.bind(asyncio.get_running_loop())
        c = self.config
        self._pool = self._sender.pool = UpstreamPool(
            connect_timeout=c.connect_timeout, read_timeout=c.first_byte_timeout,
            keepalive_timeout=c.keepalive_timeout, max_idle=c.max_idle)
        self._load_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        if c.limits_redis:
            self._admission.use_redis(c.limits_redis)
        self._poller = asyncio.create_task(self._background(), name="router-background")

    async def _background(self) -> None:
        """Engine queue depths, and idle upstream connections closed once past their keep-alive."""
        assert self._load_session is not None and self._pool is not None
        books = self._accounting

        def engine_counts(up: Upstream, queries: float, hits: float) -> None:  # a vLLM engine's prefix-cache counters
            books.engine_counts(up.model, queries, hits)

        odd = self.metrics.odd_loads
        loads = LoadReader(lambda: self.table, self._load_session, engine_counts,
                           odd=lambda u: odd.labels(u.model).inc())
        self.usage.read_engines_now = loads.read_now
        poller = asyncio.create_task(loads.run(self.config.load_interval))
        try:
            while True:
                await asyncio.sleep(self.config.keepalive_timeout)
                retired, self._retired = self._retired, []
                for origin in (*retired, *(u.origin for u in self.table.upstreams.values())):
                    self._pool.sweep(origin)
        finally:
            self.usage.read_engines_now = None
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
            self._pool = self._sender.pool = None
        if self._load_session is not None:
            await self._load_session.close()
            self._load_session = None
        await self._admission.close()
        await self._intake.close()

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
        key, refused = authenticate(self.keys, request)
        if refused is not None:
            return refused
        table = self.table
        data = [_model_entry(n, m, table.has(m.name)) for m in self.routes.models
                if key is None or key.allows(m) for n in m.names]
        return respond.json_response({"object": "list", "data": data})

    async def get_model(self, request: web.Request) -> web.Response:
        key, refused = authenticate(self.keys, request)
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
        ready = self._current.has_catalog
        body = {"status": "ok" if ready else "waiting for a catalog",
                "models": len(self.routes.models), "endpoints": len(self.table.upstreams),
                "table_version": self.table.version, "inflight": self.requests_in_flight()}
        return respond.json_response(body, status=200 if ready else 503)

    # --- generation: the stages in order ------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, COMPLETIONS)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, EMBEDDINGS)

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        """Authenticate, refuse what the head says is refused, read the body (intake)."""
        t0 = self._clock()
        key = None
        if self.keys.keys:
            key, refused = authenticate(self.keys, request)
            if refused is None:
                refused = self._admission.early(key, request.content_length)
            if refused is not None:
                return self._refuse(refused, UNKNOWN, t0)
        intake = self._intake
        length = request.content_length
        refused = intake.refuse_early(request, length)
        if refused is not None:
            return self._refuse(refused, UNKNOWN, t0)
        hold = intake.hold(request, key)
        try:
            # Told apart by the value's type, not web.Response's: an ABC, whose isinstance costs calls.
            taken = await intake.take(request, hold, length, path)
            if not isinstance(taken, tuple):
                return self._refuse(taken, UNKNOWN, t0)
            return await self._handle_body(request, path, taken, key, t0=t0)
        finally:
            hold.release()

    async def _handle_body(self, request: web.Request, path: str, taken: tuple[bytes, Parsed], key: ApiKey | None,
                           *, t0: float) -> web.StreamResponse:
        """Resolve the model, check the key may use it on this path, admit; then choose, send and
        retry (:mod:`llmgw.router.attempts`), tracked for the drain."""
        raw, parsed = taken
        body, asked = parsed.body, parsed.model
        current = self._current
        model = current.routes.resolve(asked)
        if model is None:
            return self._refuse(respond.not_found(asked), UNKNOWN, t0)
        refused = _not_for(key, model, asked=asked, path=path)
        if refused is not None:
            return self._refuse(refused, model.name, t0)
        admitted = await self._admission.admit(key, current.chain(model), path=path, raw=raw, body=body)
        if not isinstance(admitted, tuple):
            return self._refuse(admitted, model.name, t0)
        raw, body, account = admitted
        routed = Routed(request=request, path=path, raw=raw, body=body, asked=asked, model=model,
                        stream=parsed.stream and path != EMBEDDINGS, t0=t0, account=account,
                        prompt_text=parsed.prompt)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            with self._budget.ticket() as ticket:
                return await self._attempts.run(routed, ticket)
        finally:
            self._handlers.discard(task)
            if account.ticket is not None:
                account.ticket.release()

    def _refuse(self, resp: web.Response, label: str, t0: float) -> web.Response:
        return refuse(self.metrics, resp, label, self._clock() - t0)

    # --- metrics -------------------------------------------------------------------------
    def _gauges(self) -> GaugeSnapshot:
        snap = gauges(self.table, self._demand.held, self._clock(), self.usage.prompt_cache(),
                      self._accounting.usage_by_tenant())
        snap.limits_degraded = self._admission.limits.degraded
        parser = self._intake.parser
        snap.parsing, snap.parse_waiting, snap.parsed_off_loop = parser.parsing, parser.waiting, parser.offloaded
        snap.buffered = self._intake.buffers.total
        return snap


def _not_for(key: ApiKey | None, model: RouteModel, *, asked: str, path: str) -> web.Response | None:
    """The refusal when the key may not use ``model``, or ``path`` is not the model's task's."""
    if key is not None and not key.allows(model):
        return respond.forbidden(f"The API key `{key.name}` may not use the model `{asked}`.")
    if (path == EMBEDDINGS) != (model.task == "embedding"):
        right = EMBEDDINGS if model.task == "embedding" else f"{CHAT} or {COMPLETIONS}"
        return respond.bad_request(f"The model `{asked}` is a {model.task} model: use {right}, not {path}.",
                                   "wrong_endpoint")
    return None


def _model_entry(name: str, model: RouteModel, ready: bool) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "root": model.name,
            "task": model.task, "ready": ready}
