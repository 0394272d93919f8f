"""A stand-in controller for router tests: the real FeedHub behind an admin-token check.

Runs in-process (``make_app``) or as its own process, so a test can SIGKILL it mid-load::

    python -m tests.router.fake_controller --port P --token T --state state.json

``state.json`` is ``{"models": [{"name", "aliases", "fallbacks", "task", "min", "max"}],
"endpoints": [Endpoint.to_json(), ...]}``. ``GET /test/usage`` shows what the routers reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from llmgw.catalog.model import Catalog, Model, ModelName, Profile, Scaling
from llmgw.contract import REPORT_PATH, WATCH_PATH, endpoint_from_json
from llmgw.control.feed import FeedHub

PROFILE = Profile(name="sim", priority=0, engine="sim", gpus=0)


def model(name: str, *, aliases: tuple[str, ...] = (), task: str = "chat", fallbacks: tuple[str, ...] = (),
          min: int = 0, max: int = 1) -> Model:  # noqa: A002 - the catalog's own field names
    return Model(name=ModelName(name), source=f"/models/{name}", size_gb=1.0, profiles=(PROFILE,),
                 aliases=tuple(aliases), task=task,  # type: ignore[arg-type]
                 scaling=Scaling(min=min, max=max), fallbacks=tuple(ModelName(f) for f in fallbacks))


def catalog_from_spec(spec: list[dict[str, Any]]) -> Catalog:
    return Catalog(models=tuple(model(m["name"], aliases=tuple(m.get("aliases", ())), task=m.get("task", "chat"),
                                      fallbacks=tuple(m.get("fallbacks", ())), min=m.get("min", 0),
                                      max=m.get("max", 1)) for m in spec))


def make_app(hub: FeedHub, token: str) -> web.Application:
    @web.middleware
    async def check_token(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith("/api/") and request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"error": {"message": "bad admin token"}}, status=401)
        return await handler(request)

    async def usage(_request: web.Request) -> web.Response:
        return web.json_response({
            "last_used": hub.last_used(), "routers": hub.routers(), "watchers": hub.watchers,
            "demand": {m: {"held": d.held, "inflight": d.inflight} for m, d in hub.demand().items()},
        })

    app = web.Application(middlewares=[check_token])
    app.router.add_get(WATCH_PATH, hub.watch)
    app.router.add_post(REPORT_PATH, hub.report)
    app.router.add_get("/test/usage", usage)
    return app


async def _main(port: int, token: str, state: str) -> None:
    with open(state, encoding="utf-8") as f:
        spec = json.load(f)
    hub = FeedHub(keepalive=1.0)
    hub.set_catalog(catalog_from_spec(spec["models"]))
    hub.set_endpoints([endpoint_from_json(e) for e in spec["endpoints"]])
    runner = web.AppRunner(make_app(hub, token), access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--state", required=True)
    a = p.parse_args()
    asyncio.run(_main(a.port, a.token, a.state))
    sys.exit(0)
