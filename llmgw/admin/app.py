"""The admin listener: /api/v1 (token required), the git webhook (its own signature), the dashboard.

Separate from the router's listener on purpose: one serves inference to whoever holds an
API key, the other lets a caller cordon nodes and push commits, and they should not share
a port, a key or a firewall rule.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llmgw.admin import api
from llmgw.admin.dashboard import dashboard
from llmgw.admin.openapi import openapi_document
from llmgw.gitops.webhook import webhook_handler
from llmgw.router.feed import REPORT_PATH, WATCH_PATH, FeedHub

if TYPE_CHECKING:
    from llmgw.control import Controller

PREFIX = "/api/v1"
WEBHOOK = f"{PREFIX}/hooks/git"
COOKIE = "llmgw_admin_token"
MAX_BODY = 2 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _token_ok(expected: str, given: str) -> bool:
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


def auth_middleware(token: str) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == WEBHOOK:
            return await handler(request)  # signed by the git host, checked in the handler
        header = request.headers.get("Authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if request.path == "/" and not given:
            # A browser cannot send a bearer header: the dashboard takes ?token= once and
            # keeps it in an HttpOnly cookie.
            given = request.query.get("token") or request.cookies.get(COOKIE, "")
        if not _token_ok(token, given):
            return web.json_response({"error": "missing or invalid admin token (Authorization: Bearer ...)"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        response = await handler(request)
        if request.path == "/" and request.query.get("token"):
            response.set_cookie(COOKIE, given, httponly=True, samesite="Strict")
        return response

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
) -> web.Application:
    """The admin aiohttp app; with a ``hub``, also the watch stream standalone routers follow."""
    app = web.Application(middlewares=[json_errors, auth_middleware(token)], client_max_size=MAX_BODY)
    app[api.CONTROLLER] = controller
    r = app.router
    r.add_get(f"{PREFIX}/summary", api.summary)
    r.add_get(f"{PREFIX}/sync", api.get_sync)
    r.add_post(f"{PREFIX}/sync", api.post_sync)
    r.add_get(f"{PREFIX}/nodes", api.nodes)
    r.add_post(PREFIX + "/nodes/{node}/state", api.node_state)
    r.add_get(f"{PREFIX}/models", api.models)
    r.add_post(f"{PREFIX}/models", api.add_model)
    r.add_delete(PREFIX + "/models/{name}", api.remove_model)
    r.add_get(f"{PREFIX}/replicas", api.replicas)
    r.add_get(f"{PREFIX}/explain-placement", api.explain_placement)
    r.add_get(f"{PREFIX}/weights/orphans", api.orphans)
    r.add_post(f"{PREFIX}/weights/collect", api.collect_weights)
    r.add_get(f"{PREFIX}/events", api.events)
    r.add_get(f"{PREFIX}/inventory", api.inventory_export)
    r.add_get(f"{PREFIX}/plan", api.plan)
    r.add_get(f"{PREFIX}/metrics", api.metrics)
    r.add_get(f"{PREFIX}/healthz", api.healthz)
    r.add_get(f"{PREFIX}/openapi.json", openapi)
    r.add_post(WEBHOOK, webhook_handler(webhook_secret, controller.follower.trigger))
    r.add_get("/", dashboard)
    if hub is not None:
        r.add_get(WATCH_PATH, hub.watch)
        r.add_post(REPORT_PATH, hub.report)
    app[FEED] = hub is not None
    return app


FEED: web.AppKey[bool] = web.AppKey("feed")


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(feed=request.app[FEED]))
