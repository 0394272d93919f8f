"""The admin listener: /api/v1 (token required), the git webhook (its own signature), the dashboard.

Separate from the router's listener on purpose: one serves inference to whoever holds an
API key, the other lets a caller cordon nodes and push commits, and they should not share
a port, a key or a firewall rule.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw.admin import api
from llmgw.admin.dashboard import WARNINGS, dashboard
from llmgw.admin.openapi import openapi_document
from llmgw.contract import REPORT_PATH, WATCH_PATH
from llmgw.control.feed import FeedHub
from llmgw.gitops.webhook import webhook_handler

if TYPE_CHECKING:
    from llmgw.control import Controller

PREFIX = "/api/v1"
WEBHOOK = f"{PREFIX}/hooks/git"
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


def _unauthorized() -> web.Response:
    return web.json_response({"error": "missing or invalid admin token (Authorization: Bearer ...)"},
                             status=401, headers={"WWW-Authenticate": "Bearer"})


SIGN_IN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>llmgw: sign in</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>llmgw dashboard</h1><p>{why}</p>
<p>Open the link <code>llmgw up</code> printed (<code>/?token=</code> and the admin token, whole: it is
43 characters), or add <code>?token=</code> and the token from the data dir's <code>admin.token</code>
(or the controller's admin token) to this page's address. The token is traded for a cookie and leaves
the address at once.</p></body></html>"""


def _browser_unauthorized(request: web.Request, why: str) -> web.Response:
    """A person at the dashboard is told how to get in, not shown a JSON error (seen: a link cut at
    80 columns opened as a raw 401)."""
    if request.path == DASHBOARD and "text/html" in request.headers.get("Accept", ""):
        return web.Response(status=401, text=SIGN_IN_PAGE.format(why=why), content_type="text/html",
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


def auth_middleware(token: str) -> Any:
    session = _session(token) if token else ""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == WEBHOOK:
            return await handler(request)  # signed by the git host, checked in the handler
        if request.path == DASHBOARD and "token" in request.query:
            return _sign_in(request, token)
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if given:
            ok = _token_ok(token, given)
        elif request.path == DASHBOARD and request.method in ("GET", "HEAD"):
            # A browser cannot send a bearer header, hence the cookie; and only here: a cookie
            # rides along on requests another page makes the browser send, so it authorizes
            # reading the dashboard and never a request that changes state (no CSRF to defend).
            ok = _token_ok(session, request.cookies.get(COOKIE, ""))
        else:
            ok = False
        if not ok:
            return _browser_unauthorized(request, "This browser is not signed in.")
        return await handler(request)

    return check


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
) -> web.Application:
    """The admin aiohttp app; with a ``hub``, also the watch stream standalone routers follow.
    ``warnings`` are shown as banners on the dashboard (an open router, llmgw.router.exposure)."""
    app = web.Application(middlewares=[json_errors, auth_middleware(token)], client_max_size=MAX_BODY)
    app[api.CONTROLLER] = controller.ops  # the admin surface sees the façade, not the parts
    app[WARNINGS] = warnings
    r = app.router
    r.add_get(f"{PREFIX}/summary", api.summary)
    r.add_get(f"{PREFIX}/sync", api.get_sync)
    r.add_post(f"{PREFIX}/sync", api.post_sync)
    r.add_get(f"{PREFIX}/nodes", api.nodes)
    r.add_post(PREFIX + "/nodes/{node}/state", api.node_state)
    r.add_post(PREFIX + "/nodes/{node}/takeover", api.takeover)
    r.add_get(f"{PREFIX}/models", api.models)
    r.add_post(f"{PREFIX}/models", api.add_model)
    r.add_delete(PREFIX + "/models/{name}", api.remove_model)
    r.add_get(f"{PREFIX}/replicas", api.replicas)
    r.add_get(f"{PREFIX}/keys", api.keys)
    r.add_post(f"{PREFIX}/keys", api.create_key)
    r.add_delete(PREFIX + "/keys/{name}", api.revoke_key)
    r.add_get(f"{PREFIX}/rollouts", api.rollouts)
    r.add_get(PREFIX + "/rollouts/{model}", api.rollout)
    r.add_post(PREFIX + "/rollouts/{model}/promote", api.rollout_promote)
    r.add_post(PREFIX + "/rollouts/{model}/abort", api.rollout_abort)
    r.add_get(f"{PREFIX}/explain-placement", api.explain_placement)
    r.add_get(f"{PREFIX}/weights/orphans", api.orphans)
    r.add_post(f"{PREFIX}/weights/collect", api.collect_weights)
    r.add_get(f"{PREFIX}/events", api.events)
    r.add_get(f"{PREFIX}/usage", api.usage)
    r.add_get(f"{PREFIX}/inventory", api.inventory_export)
    r.add_get(f"{PREFIX}/plan", api.plan)
    r.add_get(f"{PREFIX}/metrics", api.metrics)
    r.add_get(f"{PREFIX}/healthz", api.healthz)
    r.add_get(f"{PREFIX}/openapi.json", openapi)
    r.add_post(WEBHOOK, webhook_handler(webhook_secret, controller.ops.trigger_sync))
    r.add_get(DASHBOARD, dashboard)
    if hub is not None:
        r.add_get(WATCH_PATH, hub.watch)
        r.add_post(REPORT_PATH, hub.report)
    app[FEED] = hub is not None
    return app


FEED: web.AppKey[bool] = web.AppKey("feed")


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(feed=request.app[FEED]))
