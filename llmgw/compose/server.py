"""One process serving everything: the controller, the admin listener and the router.

Used by `llmgw controller --config FILE` and by `llmgw up`. A port already in use is a
ConfigError that names the listener, raised before anything is started.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw.access.oidc import OidcVerifier
from llmgw.admin.app import build_admin_app
from llmgw.control.config import Listen, ServerConfig
from llmgw.control.controller import Controller
from llmgw.control.usage import BookedLedger, BudgetBook, GatedLedger, UsageFlusher, UsageGateCollector
from llmgw.errors import ConfigError, StoreError
from llmgw.gitops.desired import ROUTER, DesiredState
from llmgw.serving import connection_cap, listen, raise_fd_limit, throttle_loop_errors

if TYPE_CHECKING:
    from llmgw.router.app import Router

log = logging.getLogger(__name__)


def attach_router(router: Router, desired: DesiredState, *, wake: Callable[[str], None]) -> None:
    """In-process wiring of the data plane to the control plane: the router hears of every catalog
    before the reconciler does (``order=ROUTER``, so a removed model stops taking traffic before
    its replicas stop) and wakes the control plane through ``wake``. The router is also the
    reconciler's endpoint sink, and its ``usage`` the usage source (through Fanout and MergedUsage)."""
    router.wake = wake
    desired.subscribe(router.set_catalog, order=ROUTER)


def check_free(listen: Listen, what: str) -> None:
    """Fail early and clearly when a listener's port is taken."""
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((listen.host, listen.port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{what} port {listen.port} on {listen.host} is already in use") from exc
            raise ConfigError(f"cannot listen on {listen.host}:{listen.port} for {what}: {exc}") from exc


@dataclass
class Running:
    controller: Controller
    router: Any
    runners: list[web.AppRunner]
    router_url: str
    admin_url: str
    usage: UsageFlusher | None = None

    async def close(self, *, stop_engines: bool = False) -> None:
        """Shutdown in the order that starts nothing and leaves nothing (DESIGN §6): stop
        accepting and let in-flight requests finish (bounded), stop the follower and the
        reconciler, then, for `up`, which owns its engines, stop them; the admin API answers
        until the end."""
        t0 = time.monotonic()
        try:
            log.info("stopping: %d requests in flight", self.router.requests_in_flight())
            await self.router.drain()
            log.info("router drained in %.1f s", time.monotonic() - t0)
            if self.usage is not None:
                await self.usage.close()  # the drained requests' tokens, into the ledger before it closes
            await self.controller.quiesce()
        finally:  # a failure above must not leave `up`'s engines running
            if stop_engines:
                await self.controller.stop_engines()
                log.info("engines stopped at %.1f s", time.monotonic() - t0)
        # Before the listeners drain: their routers' watches stay open until ended, and a standby
        # waited for the lead for as long (10 s) while nothing reconciled.
        await self.controller.hand_over()
        for runner in self.runners:
            await runner.cleanup()
        await self.controller.close()
        await self.router.close()
        log.info("stopped in %.1f s", time.monotonic() - t0)


async def start(cfg: ServerConfig, *, router_flag: str = "router listener",
                admin_flag: str = "admin listener", owns_engines: bool = False) -> Running:
    """Start every part and both listeners; the caller awaits its stop signal, then ``close()``.

    ``owns_engines``: a failed start stops the engines its reconciler started (`up`)."""
    if not cfg.admin_token:
        raise ConfigError("no admin token: set admin_token (or admin_token_file, or LLMGW_ADMIN_TOKEN)")
    check_free(cfg.admin_listen, admin_flag)
    check_free(cfg.router_listen, router_flag)
    raise_fd_limit()
    throttle_loop_errors()
    from llmgw.control.feed import Fanout, FeedHub, MergedUsage, ReportsCollector
    from llmgw.control.keys import KeyBook
    from llmgw.control.router_credentials import RouterCredentials
    from llmgw.router.app import Router
    from llmgw.router.config import RouterConfig
    from llmgw.router.exposure import open_warning
    from llmgw.router.keys import KeyRing

    keys = KeyRing.from_entries(cfg.api_keys, where="api_keys")
    exposed = open_warning(keys_open=keys.open, host=cfg.router_listen.host, port=cfg.router_listen.port)
    if exposed is not None:
        log.warning("%s", exposed)  # and a banner on the dashboard, below
    router = Router(keys=keys, config=RouterConfig(**cfg.router))
    # The hub serves routers running as their own processes: same endpoints, same catalog,
    # and their usage merged with the in-process router's.
    hub = FeedHub(local_routers=1)
    hub.budgets = book = BudgetBook()  # what each budget used this period, per the ledger: for every router
    hub.set_api_keys(cfg.api_keys)
    hub.set_limits_redis(str(cfg.router.get("limits_redis", "")))
    hub.configured_routers = int(cfg.router.get("limits_routers", 0) or 0)
    controller = Controller(cfg.controller, sink=Fanout(router, hub), usage=MergedUsage(router.usage, hub),
                            advertise=f"http://{cfg.admin_listen.host}:{cfg.admin_listen.port}")
    hub.standby = controller.standing_by  # a standby (shared store, another leads) sends routers on
    controller.role_listeners.append(hub.leadership_changed)
    # Usage per tenant and API key on the admin listener's /api/v1/metrics, behind its token; the
    # router's client port serves only its own series (llmgw.router.metrics).
    controller.registry.register(router.metrics.usage)
    controller.registry.register(ReportsCollector(hub, lambda: controller.reconciler.rollouts.meter.forgotten))
    controller.registry.register(UsageGateCollector(lambda: gated.gate))
    wake = lambda _model: controller.reconciler.notify()  # noqa: E731 - one-line adapter
    attach_router(router, controller.desired, wake=wake)
    hub.wake = wake
    controller.desired.subscribe(hub.set_catalog, order=ROUTER)
    controller.desired.subscribe(book.set_catalog, order=ROUTER)
    await router.start()
    await controller.start()
    store = controller.store
    # Standalone routers' usage behind the gate (issue 41): no more tokens than the engines counted,
    # as this process's router reads them; its own router's taken as it comes.
    def catalog_models() -> set[str] | None:
        catalog = controller.desired.catalog
        return None if catalog is None else {m.name for m in catalog.models}

    hub.ledger = gated = GatedLedger(BookedLedger(store, book), router.usage.engine_tokens, models=catalog_models,
                                     state=(store.usage_gate_state, store.set_usage_gate_state))
    controller.role_listeners.append(gated.reload)  # a new leader goes on from the figures its predecessor kept
    hub.read_engines = router.usage.engine_tokens_now
    # A restarted controller's own router starts from what the ledger says budgets used, before
    # it admits anything: without it, a restart handed every tenant a fresh budget.
    await book.load(store)

    def budgets() -> None:
        if not book.loaded:
            book.load_soon(store)  # a budget new in the catalog
        router.set_spent(book.figures(), hub.router_count())

    budgets()
    book.on_change = budgets  # a standalone router's report counts for this router at once

    said: set[str] = set()

    def tenant_keys(_catalog: object = None) -> None:
        """A tenant naming a key no API key has is said once, as an event (and in status while it lasts)."""
        nonlocal said
        now = set(controller.ops.key_warnings())
        for warning in sorted(now - said):
            store.add_event("tenant-key-missing", "catalog", warning)
        said = now

    def keys_changed(entries: list[dict[str, Any]]) -> None:
        router.set_keys(KeyRing.from_entries(entries, where="api keys"))
        hub.set_api_keys(entries)
        tenant_keys()

    controller.budgets = book
    credentials = RouterCredentials(store, on_revoke=hub.forget_router)
    credentials.reload()
    hub.credential_live = credentials.live_credential
    controller.router_credentials = credentials
    controller.router_reports = hub.router_reports
    controller.warners.append(hub.credential_warnings)
    controller.keys = keys_book = KeyBook(cfg.api_keys, store, on_change=keys_changed)
    keys_book.reload()
    controller.desired.subscribe(tenant_keys, order=ROUTER)
    tenant_keys()

    def after_flush() -> None:
        budgets()
        try:  # a key made (or a router credential revoked) through another controller on the same store
            keys_book.reload()
            credentials.reload()
        except StoreError as exc:
            log.warning("API keys not read from the store: %s", exc)

    usage = UsageFlusher(router.usage.outbox, gated.trusted, compact=store.compact_usage, after=after_flush)
    controller.watch(usage.health)
    usage.start()
    runners: list[web.AppRunner] = []
    try:
        admin_app = build_admin_app(controller, token=cfg.admin_token, webhook_secret=cfg.webhook_secret, hub=hub,
                                    oidc=OidcVerifier(cfg.oidc) if cfg.oidc is not None else None,
                                    routers=credentials.who,
                                    warnings=(exposed,) if exposed else ())
        runners.append(await listen(admin_app, cfg.admin_listen.host, cfg.admin_listen.port, drain_timeout=5.0,
                                    max_connections=connection_cap(0.1), openai_errors=False))
        await router.listen(cfg.router_listen.host, cfg.router_listen.port)
    except OSError as exc:
        # Taken since check_free (another `up` started at the same moment): the same error as its.
        await _undo_start(runners, usage, controller, router, stop_engines=owns_engines)
        if exc.errno == errno.EADDRINUSE:
            which = (admin_flag, cfg.admin_listen) if not runners else (router_flag, cfg.router_listen)
            raise ConfigError(f"{which[0]} port {which[1].port} on {which[1].host} is already in use") from exc
        raise
    except BaseException:
        await _undo_start(runners, usage, controller, router, stop_engines=owns_engines)
        raise
    return Running(controller, router, runners, f"http://{cfg.router_listen.host}:{cfg.router_listen.port}",
                   f"http://{cfg.admin_listen.host}:{cfg.admin_listen.port}", usage)


async def _undo_start(runners: list[web.AppRunner], usage: UsageFlusher, controller: Controller, router: Any, *,
                      stop_engines: bool) -> None:
    """A start that failed half-way: close what it opened; the engines too when the caller owns them
    (`up`: its reconciler may have started some already)."""
    try:
        if stop_engines:
            await controller.quiesce()
            await controller.stop_engines()
    finally:
        for runner in runners:
            await runner.cleanup()
        await usage.close()
        await controller.close()
        await router.close()


async def serve_forever(cfg: ServerConfig, *, stop: asyncio.Event,
                        on_ready: Callable[[Running], None] | None = None) -> None:
    """Serve until ``stop`` is set (a signal while starting is seen once started), then close."""
    running = await start(cfg)
    try:
        if on_ready is not None:
            on_ready(running)
        await stop.wait()
    finally:
        await running.close()
