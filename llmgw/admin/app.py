"""The admin listener: /api/v1 (token required), the git webhook (its own signature), the dashboard.

Separate from the router's listener on purpose: one serves inference to whoever holds an
API key, the other lets a caller cordon nodes and push commits, and they should not share
a port, a key or a firewall rule.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw.access.oidc import OidcVerifier, Refused, is_jwt
from llmgw.access.roles import ADMINISTER, OPERATE, READ, ROUTERS, Need, Principal, Role
from llmgw.access.web import PRINCIPAL
from llmgw.admin import api, signin
from llmgw.admin.dashboard import WARNINGS, dashboard
from llmgw.admin.openapi import openapi_document
from llmgw.contract import REPORT_PATH, WATCH_PATH
from llmgw.control.feed import FeedHub
from llmgw.gitops.webhook import webhook_handler

if TYPE_CHECKING:
    from llmgw.control import Controller

log = logging.getLogger(__name__)

PREFIX = "/api/v1"
WEBHOOK = f"{PREFIX}/hooks/git"
ROUTER_PATHS = f"{PREFIX}/router/"
PUBLIC = frozenset({WEBHOOK, signin.LOGIN, signin.CALLBACK})
DASHBOARD = "/"
COOKIE = "llmgw_dashboard"
MAX_BODY = 2 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _token_ok(expected: str, given: str) -> bool:
    # surrogateescape: aiohttp hands a header's non-UTF-8 bytes over as surrogates, which a plain
    # encode() refuses with a traceback (a 500) instead of a 401.
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogateescape"))


def _session(token: str) -> str:
    """The dashboard cookie's value: derived from the admin token, not the token itself.

    A cookie that leaked (a shared browser profile, a proxy log) then opens the dashboard's
    read-only page and nothing else: it is no bearer token for the API. Changing the admin
    token ends every session.
    """
    return hmac.new(token.encode(), b"llmgw dashboard session", hashlib.sha256).hexdigest()


def _unauthorized(why: str = "missing or invalid admin token (Authorization: Bearer ...)") -> web.Response:
    return web.json_response({"error": why}, status=401, headers={"WWW-Authenticate": "Bearer"})


SIGN_IN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>llmgw: sign in</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>llmgw dashboard</h1><p>{why}</p>{sso}
<p>Open the link <code>llmgw up</code> printed (<code>/?token=</code> and the admin token, whole: it is
43 characters), or add <code>?token=</code> and the token from the data dir's <code>admin.token</code>
(or the controller's admin token) to this page's address. The token is traded for a cookie and leaves
the address at once.</p></body></html>"""


def _browser_unauthorized(request: web.Request, why: str) -> web.Response:
    """A person at the dashboard is told how to get in, not shown a JSON error (seen: a link cut at
    80 columns opened as a raw 401)."""
    if request.path == DASHBOARD and "text/html" in request.headers.get("Accept", ""):
        sso = (f'<p><a href="{signin.LOGIN}"><b>Sign in with your organisation</b></a> (the identity provider '
               'this controller trusts), or with the admin token:</p>') if request.app.get(signin.VERIFIER) else ""
        return web.Response(status=401, text=SIGN_IN_PAGE.format(why=why, sso=sso), content_type="text/html",
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
    return _unauthorized()


def _sign_in(request: web.Request, token: str) -> web.Response:
    """``/?token=T``: trade the token for a cookie and 303 to the same page without it.

    The redirect is what keeps the token out of the address bar, the history and the page's
    own refresh; the cookie is HttpOnly (no script reads it), SameSite=Strict (no other
    site's page sends it) and Secure when the dashboard is served over https. A wrong token
    sets nothing.
    """
    if request.method not in ("GET", "HEAD") or not _token_ok(token, request.query.get("token", "")):
        return _browser_unauthorized(request, "That token is not this controller's (a link cut short?).")
    target = request.rel_url.with_query([(k, v) for k, v in request.query.items() if k != "token"])
    response = web.Response(status=303, headers={
        "Location": str(target), "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})
    response.set_cookie(COOKIE, _session(token), path="/", httponly=True, samesite="Strict",
                        secure=request.secure or None)
    return response


POLICY: web.AppKey[dict[tuple[str, str], Need]] = web.AppKey("policy")


def _refused(principal: Principal, need: Need) -> web.Response:
    return web.json_response({"error": principal.refusal(need), "needs": need.describe(),
                              "role": principal.role_label}, status=403)


def _need(request: web.Request) -> Need:
    """What the matched route needs; a path no route has (its 404, 405) needs only a reader."""
    info = request.match_info
    resource = info.route.resource
    if resource is None or isinstance(info.http_exception, web.HTTPException):
        return READ
    method = "GET" if request.method == "HEAD" else request.method
    # A route without a policy cannot be built (build_admin_app); were one added behind its back,
    # only an admin passes.
    return request.app[POLICY].get((method, resource.canonical), ADMINISTER)


def auth_middleware(token: str, oidc: OidcVerifier | None = None,
                    routers: Callable[[str], Principal | None] | None = None) -> Any:
    """Who is calling (the admin token, a provider's token, the dashboard's cookie), and whether
    their role opens the route: 401 for no one, 403 naming the role the route needs."""
    session = _session(token) if token else ""

    async def who(request: web.Request) -> Principal | web.Response:
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if given:
            if _token_ok(token, given):
                return Principal("admin-token", Role.ADMIN, via="admin-token")
            if routers is not None and (router := routers(given)) is not None:
                return router
            if oidc is not None and is_jwt(given):
                try:
                    return await oidc.principal(given)
                except Refused as exc:
                    return _unauthorized(f"the identity provider's token is refused: {exc}")
            return _unauthorized()
        signed = signin.session_of(request)
        if signed is not None:
            # A person's session (signed in at the provider): what their role opens, and a POST
            # only with the session's CSRF token (a cookie rides along on what another site's
            # page makes the browser send; the token does not).
            if request.method not in ("GET", "HEAD") and request.path != signin.LOGOUT \
                    and not signin.post_allowed(request, signed[1]):
                return web.json_response({"error": "this request lacks the session's CSRF token (X-CSRF-Token)"},
                                         status=403)
            return signed[1].principal
        if request.path == DASHBOARD and request.method in ("GET", "HEAD") and _token_ok(
                session, request.cookies.get(COOKIE, "")):
            # A browser cannot send a bearer header, hence the cookie; and only here: a cookie
            # rides along on requests another page makes the browser send, so it authorizes
            # reading the dashboard and never a request that changes state (no CSRF to defend).
            return Principal("admin-token", Role.VIEWER, via="dashboard")
        return _browser_unauthorized(request, "This browser is not signed in.")

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC:
            response = await handler(request)  # the webhook checks its signature; sign-in is for those not signed in
            if request.path == WEBHOOK:
                await _audit(request, Principal("git-webhook", None, via="webhook"), response.status)
            return response
        if request.path == DASHBOARD and "token" in request.query:
            return _sign_in(request, token)
        principal = await who(request)
        if isinstance(principal, web.Response):
            await _audit(request, None, principal.status)
            return principal
        need = _need(request)
        if not principal.may(need):
            refused = _refused(principal, need)
            await _audit(request, principal, refused.status, principal.refusal(need))
            return refused
        request[PRINCIPAL] = principal
        response = await handler(request)
        await _audit(request, principal, response.status)
        return response

    return check


async def _audit(request: web.Request, principal: Principal | None, status: int, why: str = "") -> None:
    """Every call that changes something, and every refused attempt at one, on the audit chain:
    who, their role, from where, what, the answer. A router's watch and report are not operators'
    acts (their effect shows in `llmgw routers list`)."""
    if request.method in ("GET", "HEAD", "OPTIONS") or request.path.startswith(ROUTER_PATHS):
        return
    ops = request.app[api.CONTROLLER]
    who, role = (principal.name, principal.role_label) if principal is not None else ("unauthenticated", "none")
    try:
        await ops.audit(who=who, role=role, source=request.remote or "", action=f"{request.method} {request.path}",
                        result=f"{status} {why}".strip())
    except Exception:  # noqa: BLE001 - the act is done: a store that cannot record it is logged, not a 500
        log.exception("audit: could not record %s %s by %s", request.method, request.path, who)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413) as JSON, like every other error here."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json" or exc.status < 400:
            raise
        return web.json_response({"error": exc.reason if exc.text is None or exc.text.startswith(str(exc.status))
                                  else exc.text}, status=exc.status, headers={
                                      k: v for k, v in exc.headers.items() if k.lower() == "allow"})


def build_admin_app(
    controller: Controller,
    *,
    token: str,
    webhook_secret: str = "",
    hub: FeedHub | None = None,
    warnings: tuple[str, ...] = (),
    oidc: OidcVerifier | None = None,
    routers: Callable[[str], Principal | None] | None = None,
) -> web.Application:
    """The admin aiohttp app; with a ``hub``, also the watch stream standalone routers follow.
    ``warnings`` are shown as banners on the dashboard (an open router, llmgw.router.exposure)."""
    app = web.Application(middlewares=[json_errors, auth_middleware(token, oidc, routers)], client_max_size=MAX_BODY)
    app[api.CONTROLLER] = controller.ops  # the admin surface sees the façade, not the parts
    app[WARNINGS] = warnings
    policy: dict[tuple[str, str], Need] = {}
    app[POLICY] = policy

    def add(method: str, path: str, handler: Handler, need: Need) -> None:
        # One place adds a route, and it takes what the route needs: none is open by omission.
        if method == "GET":
            app.router.add_get(path, handler)  # and HEAD, which needs what GET does (_need)
        else:
            app.router.add_route(method, path, handler)
        policy[(method, path)] = need

    add("GET", f"{PREFIX}/summary", api.summary, READ)
    add("GET", f"{PREFIX}/whoami", api.whoami, READ)
    add("GET", f"{PREFIX}/audit", api.audit, READ)
    add("GET", f"{PREFIX}/audit/verify", api.audit_verify, READ)
    add("GET", f"{PREFIX}/sync", api.get_sync, READ)
    add("POST", f"{PREFIX}/sync", api.post_sync, OPERATE)
    add("GET", f"{PREFIX}/nodes", api.nodes, READ)
    add("POST", PREFIX + "/nodes/{node}/state", api.node_state, OPERATE)
    add("POST", PREFIX + "/nodes/{node}/takeover", api.takeover, ADMINISTER)
    add("GET", f"{PREFIX}/models", api.models, READ)
    add("POST", f"{PREFIX}/models", api.add_model, ADMINISTER)  # a commit to the catalog
    add("DELETE", PREFIX + "/models/{name}", api.remove_model, ADMINISTER)
    add("GET", f"{PREFIX}/replicas", api.replicas, READ)
    add("GET", f"{PREFIX}/keys", api.keys, READ)  # names and tenants; no key's secret or digest
    add("POST", f"{PREFIX}/keys", api.create_key, ADMINISTER)
    add("DELETE", PREFIX + "/keys/{name}", api.revoke_key, ADMINISTER)
    add("GET", f"{PREFIX}/rollouts", api.rollouts, READ)
    add("GET", PREFIX + "/rollouts/{model}", api.rollout, READ)
    add("POST", PREFIX + "/rollouts/{model}/promote", api.rollout_promote, OPERATE)
    add("POST", PREFIX + "/rollouts/{model}/abort", api.rollout_abort, OPERATE)
    add("GET", f"{PREFIX}/explain-placement", api.explain_placement, READ)
    add("GET", f"{PREFIX}/weights/orphans", api.orphans, READ)
    add("POST", f"{PREFIX}/weights/collect", api.collect_weights, OPERATE)
    add("GET", f"{PREFIX}/events", api.events, READ)
    add("GET", f"{PREFIX}/usage", api.usage, READ)
    add("GET", f"{PREFIX}/inventory", api.inventory_export, READ)
    add("GET", f"{PREFIX}/plan", api.plan, READ)
    add("GET", f"{PREFIX}/metrics", api.metrics, READ)
    add("GET", f"{PREFIX}/healthz", api.healthz, READ)
    add("GET", f"{PREFIX}/openapi.json", openapi, READ)
    app.router.add_post(WEBHOOK, webhook_handler(webhook_secret, controller.ops.trigger_sync))  # its own signature
    add("GET", DASHBOARD, dashboard, READ)
    add("GET", f"{PREFIX}/routers", api.routers, READ)
    add("POST", f"{PREFIX}/routers", api.create_router, ADMINISTER)
    add("DELETE", PREFIX + "/routers/{name}", api.revoke_router, ADMINISTER)
    if hub is not None:
        add("GET", WATCH_PATH, hub.watch, ROUTERS)
        add("POST", REPORT_PATH, hub.report, ROUTERS)
    if oidc is not None:
        signin.add_routes(app, oidc)
        add("POST", signin.LOGOUT, signin.logout, READ)
    unguarded = [f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.resource is not None
                 and r.resource.canonical not in PUBLIC and r.method != "HEAD"
                 and (r.method, r.resource.canonical) not in policy]
    if unguarded:
        raise RuntimeError(f"admin routes without a role: {', '.join(unguarded)}")
    app[FEED] = hub is not None
    return app


FEED: web.AppKey[bool] = web.AppKey("feed")


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(feed=request.app[FEED]))
