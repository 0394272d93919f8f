"""The dashboard: server-rendered HTML from the same views the API serves, refreshing itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jinja2
from aiohttp import web

from llmgw.access.web import PRINCIPAL
from llmgw.admin import api, signin, usage, views
from llmgw.admin.labels import confinement_label, node_problems
from llmgw.health import UNHEALTHY_AFTER

if TYPE_CHECKING:
    from llmgw.control.ops import FleetOps

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _since(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    s = int(now - t)
    return f"{s}s ago" if s < 120 else f"{s // 60}m ago" if s < 7200 else f"{s // 3600}h ago"


# What the process that serves this page found wrong with its own set-up at start (an open router on
# every address): shown at the top of every page, since a log line alone is read too late.
WARNINGS: web.AppKey[tuple[str, ...]] = web.AppKey("warnings")

_ENV.filters["short"] = lambda sha: (sha or "")[:12]
# The CLI's words for it, so `llmgw nodes` and this page never describe a node differently.
_ENV.filters["confinement"] = confinement_label
_ENV.filters["problems"] = node_problems
_ENV.filters["pct"] = lambda v: "—" if v is None else f"{v * 100:.1f} %"
_ENV.filters["ms"] = lambda v: "—" if v is None else f"{v * 1000:.0f} ms"


async def dashboard(request: web.Request) -> web.Response:
    c = api.ctl(request)
    now = time.time()
    inventory = c.inventory()
    replicas = c.replicas()
    catalog = c.catalog
    unplaced = c.unplaced()
    page = _ENV.get_template("dashboard.html").render(
        # The refresh names its target: the bare path, never whatever query this request had.
        refresh=request.path,
        warnings=(*request.app.get(WARNINGS, ()), *c.warnings()),
        now=now,
        since=lambda t: _since(t, now),
        sync=c.sync_status.to_json(),
        leadership=c.leadership(),
        health=c.health().to_json(),
        principal=request.get(PRINCIPAL),
        csrf=signed[1].csrf if (signed := signin.session_of(request)) is not None else None,
        logout=signin.LOGOUT,
        unhealthy_after=UNHEALTHY_AFTER,
        nodes=views.nodes_view(inventory, replicas, now, c.drain_waits()),
        models=views.models_view(catalog, replicas, unplaced, c.prompt_cache(), c.engine_queue()),
        replicas=views.replicas_view(replicas, catalog, inventory, c.last_used(), now),
        rollouts=views.rollouts_view(c.rollouts()),
        events=list(reversed(c.events(limit=30))),
        audit=[r.to_json() for r in reversed(await asyncio.to_thread(c.audit_rows, last=30))],
        unplaced_reasons=_unplaced_reasons(c, unplaced),
        chart=await _usage_chart(c, now),
        budgets=c.budgets(),
        chart_w=usage.CHART_W, chart_h=usage.CHART_H, pad_l=usage.PAD_L, pad_b=usage.PAD_B,
        clock=lambda t: time.strftime("%m-%d %H:%M", time.gmtime(t)),
    )
    # No copy of the fleet's state in caches, and no address of this page sent to a link's target.
    return web.Response(text=page, content_type="text/html",
                        headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})


CHART_SPAN, CHART_STEP = 86400, 1800


async def _usage_chart(c: FleetOps, now: float) -> usage.Chart:
    """Tokens per tenant per half hour over the last day, from the ledger."""
    until = (int(now) // CHART_STEP + 1) * CHART_STEP  # the step under way is the last point
    since = until - CHART_SPAN
    series = await asyncio.to_thread(c.usage, since, until, by=("tenant",), step=CHART_STEP)
    return usage.tokens_chart(series, since, until, CHART_STEP)


def _unplaced_reasons(c, unplaced) -> dict[str, list[str]]:  # noqa: ANN001 - internal helper
    """Why each unplaced model cannot run, one line per profile: the closest candidates."""
    from llmgw.decide import holding
    from llmgw.placement import explain

    catalog = c.catalog
    out: dict[str, list[str]] = {}
    if catalog is None:
        return out
    inventory = c.inventory()
    placements = holding(inventory, c.replicas())  # counted as placement counts
    for name in unplaced:
        e = explain(catalog, inventory, placements, name)
        lines = [f"{x.profile} on {x.node}: {'; '.join(x.reasons)}" for x in e.candidates if not x.fits]
        out[name] = lines[:6] + ([f"… {len(lines) - 6} more"] if len(lines) > 6 else [])
    return out
