"""Admission: a tenant's request is let through its limits, or refused, before any engine is
chosen. The rules are :mod:`llmgw.tenancy`'s; this stage holds the current :class:`Limits`
(counted in memory, or in Redis when the controller says so), asks them, and writes what a
budget caps into the body the engine gets.

Only a tenant's key is limited: a request without a key, or with a key no tenant names, passes
without a ticket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from llmgw.router import respond
from llmgw.router.config import RouterConfig
from llmgw.router.keys import ApiKey, KeyRing, with_key_tenants
from llmgw.router.paths import CHAT, EMBEDDINGS
from llmgw.router.routes import RouteCatalog, RouteModel
from llmgw.router.usage import with_fields
from llmgw.tenancy.admission import Limits
from llmgw.tenancy.asked import BadLimitField, asked_for, capped_fields, prompt_estimate, reserve_for
from llmgw.tenancy.memory import LocalLimits
from llmgw.tenancy.rules import Refusal
from llmgw.tenancy.shared import SharedLimits
from llmgw.tenancy.usage import Account

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, config: RouterConfig, *, registry: CollectorRegistry, clock: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._wall = wall
        # Tenants' limits, from the catalog (llmgw.yaml): counted here, or in Redis when configured.
        self.limits: Limits = LocalLimits()
        self._errors = Counter(
            "llmgw_router_limits_errors", "Calls to the Redis that shares tenants' limits that failed for another "
            "reason than Redis being away (a script error, a reply not understood), by error; the requests that "
            "needed them were refused with a 503", ["error"], registry=registry)
        self._unknown_tenant_keys: set[tuple[str, str]] = set()  # already warned about
        # Told of each request a tenant's limits refused (key name, model; "" before the body is
        # read): the usage ledger counts refusals, so a budget's owner sees what it turned away.
        self.on_refused: Callable[[str, str], None] | None = None

    # --- what the control plane says ------------------------------------------------------
    def set_tenants(self, routes: RouteCatalog, keys: KeyRing) -> None:
        self._warn_unknown_tenant_keys(routes, keys)
        # What each tenant used goes on: no fresh budgets.
        self.limits.set_tenants(with_key_tenants(routes.tenants, keys.keys))

    def set_spent(self, figures: Mapping[tuple[str, str], tuple[float, int]], *, routers: int) -> None:
        self.limits.set_spent(figures, routers=routers)

    def use_redis(self, url: str) -> Limits | None:
        """Count in the Redis at ``url``, or locally (""): the limits replaced, for the caller to
        close (what a shared one holds in Redis goes back), or None when nothing changed."""
        if url == self.limits.url:
            return None
        old = self.limits
        self.limits = self._shared(url) if url else LocalLimits(old.limiter)
        return old if old.url else None

    def _shared(self, url: str) -> SharedLimits:
        errors = self._errors
        return SharedLimits(url, limiter=self.limits.limiter, clock=self._clock, wall=self._wall,
                            on_error=lambda e: errors.labels(e).inc())

    async def close(self) -> None:
        limits, self.limits = self.limits, LocalLimits(self.limits.limiter)
        await limits.close()

    def _warn_unknown_tenant_keys(self, routes: RouteCatalog, keys: KeyRing) -> None:
        """A tenant naming a key this router does not have limits nobody: a typo would leave the
        real key unlimited, and git cannot know the key names (their hashes stay out of it)."""
        if keys.open:
            return
        names = {k.name for k in keys.keys}
        unknown = {(t.name, k) for t in routes.tenants for k in t.keys if k not in names}
        # Once per change: a standalone router gets the catalog again with every endpoint change.
        for tenant in sorted({t for t, _ in unknown - self._unknown_tenant_keys}):
            listed = ", ".join(sorted(k for t, k in unknown if t == tenant))
            log.warning("tenant %s names API key(s) this router does not have: %s (known: %s)", tenant, listed,
                        ", ".join(sorted(n for n in names if n)))
        self._unknown_tenant_keys = unknown

    # --- the request path -----------------------------------------------------------------
    def early(self, key: ApiKey | None, length: int | None) -> web.Response | None:
        """Cheap refusals first: a tenant already out of requests per minute, requests in flight
        or budget for every model is refused before its body is read or parsed (the body's size
        alone says the least it reserves), so a hostile tenant's big bodies cost the router
        nothing once it is over its limits. The same answer the full check would give."""
        limits = self.limits
        if key is None or limits.tenant(key.name) is None:
            return None
        if length is not None and length > self._config.body_limit:
            return None  # too large, whoever sends it: the 413 that follows says so
        least = prompt_estimate(length or 0)  # what any request with this body reserves at least
        refused = limits.precheck(key.name, least, self._wall())
        return None if refused is None else self._refused(key.name, "", refused)

    async def admit(self, key: ApiKey | None, chain: tuple[RouteModel, ...], *, path: str, raw: bytes,
                    body: dict) -> tuple[bytes, dict, Account] | web.Response:
        """The request's account (whose, its ticket, what it reserves) and its body as the engine
        gets it, or the refusal. A ticket must be released once the request is done."""
        ticket = None
        reserve = 0
        limits = self.limits
        if key is not None and limits.tenant(key.name) is not None:  # only a tenant's key is limited
            try:
                ask = asked_for(body)
            except BadLimitField as exc:
                return respond.bad_request(str(exc), "invalid_value")
            reserve = reserve_for(ask, raw)
            names = tuple(m.name for m in chain)
            admitted = await limits.admit(key.name, names, reserve, self._wall())
            if isinstance(admitted, Refusal):
                return self._refused(key.name, names[0] if names else "", admitted)
            ticket = admitted
            if ticket is not None and path != EMBEDDINGS:
                # What is reserved is what the engine may write: every completion-limit field an
                # engine may read is sent as the reserved limit (engines differ in which one they
                # read, and a 0 is "unset" to vLLM: the default is reserved and sent), and a budget
                # is a cap even for a request that sets none (tenancy.asked.capped_fields).
                fields = capped_fields(ask, chat=path == CHAT, cap_unasked=limits.caps_unasked(key.name, names))
                if fields:
                    raw = with_fields(raw, body, fields)
                    body = {**body, **fields}
        return raw, body, Account(key.name if key is not None else "", ticket, prompt_estimate(raw), reserve)


    def _refused(self, key: str, model: str, refused: Refusal) -> web.Response:
        if self.on_refused is not None:
            self.on_refused(key, model)
        return refusal(refused)


def refusal(refused: Refusal) -> web.Response:
    """A tenant's request refused, in OpenAI's format: 400 when waiting cannot help, 503 when the
    limits could not be checked (fail closed: N routers each on its own would be N times every
    limit), else 429 with Retry-After and the x-ratelimit headers."""
    if refused.unavailable:
        return respond.error(503, refused.message, kind="service_unavailable", code="limits_unavailable",
                             retry_after=1)
    if refused.fits_never:
        return respond.bad_request(refused.message, "exceeds_budget")
    return respond.rate_limited(refused.message, refused.retry_after, refused.headers, refused.kind)

