"""The admin API handlers under /api/v1: the one surface the CLI and the dashboard share.

Every error is JSON ``{"error": "..."}`` with the right status; a body that is not the
JSON object a route expects is 400, never 500.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw import jsonbody
from llmgw.access.web import PRINCIPAL
from llmgw.admin import views
from llmgw.admin.usage import UsageQueryError, usage_view
from llmgw.admin.usage import parse_query as usage_query
from llmgw.control.keys import KeyRefused
from llmgw.control.orphans import list_orphans
from llmgw.decide import holding
from llmgw.errors import CatalogError, DispatchError, GitError, LlmgwError, PushRejected
from llmgw.inventory import NodeState
from llmgw.placement import explain
from llmgw.reconciler.rollouts import RolloutError
from llmgw.serving import read_plain

if TYPE_CHECKING:
    from llmgw.control.ops import FleetOps

CONTROLLER: web.AppKey[FleetOps] = web.AppKey("controller")

MAX_LIMIT = 1000


def error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def ctl(request: web.Request) -> FleetOps:
    return request.app[CONTROLLER]


async def json_body(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's JSON object, or a 400 response saying what is wrong with it."""
    raw = await read_plain(request)  # a compressed body is a 415, one that cannot be read a 400
    if not raw.strip():
        return {}
    try:
        data = jsonbody.loads(raw, what="the body")  # nesting bounded: a 976-deep body was a traceback later
    except jsonbody.JSONBodyError as exc:
        return error(400, str(exc))
    if not isinstance(data, dict):
        return error(400, "the body must be a JSON object")
    return data


def _int_param(request: web.Request, name: str, default: int, *, low: int = 0, high: int = 2**62) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be an integer"}),
                                 content_type="application/json") from None
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be between {low} and {high}"}),
                                 content_type="application/json")
    return value


def standby(request: web.Request) -> web.Response | None:
    """503 naming the leader when this controller stands by (several controllers on one store,
    DESIGN §5): a change to the fleet is the leader's to make, and two controllers acting on one
    fleet would undo each other. None when this controller leads."""
    standing_by, leader = ctl(request).standing_by()
    if not standing_by:
        return None
    where = f"the leader at {leader}" if leader else "the leader (none known yet: try again in a few seconds)"
    return error(503, f"this controller is standing by; send changes to {where}", role="standby", leader=leader)


# --- reads ------------------------------------------------------------------------------
async def summary(request: web.Request) -> web.Response:
    c = ctl(request)
    return web.json_response({**views.summary_view(
        c.catalog, c.inventory(), c.replicas(), c.sync_status.to_json(),
        c.unplaced(), c.rollouts()), "leadership": c.leadership(), "warnings": c.warnings(),
        "health": c.health().to_json()})


async def get_sync(request: web.Request) -> web.Response:
    return web.json_response(ctl(request).sync_status.to_json())


async def nodes(request: web.Request) -> web.Response:
    c = ctl(request)
    return web.json_response(views.nodes_view(c.inventory(), c.replicas(), time.time(), c.drain_waits()))


async def models(request: web.Request) -> web.Response:
    c = ctl(request)
    return web.json_response(views.models_view(c.catalog, c.replicas(), c.unplaced(), c.prompt_cache(),
                                                        c.engine_queue()))


async def replicas(request: web.Request) -> web.Response:
    c = ctl(request)
    return web.json_response(views.replicas_view(
        c.replicas(), c.catalog, c.inventory(), c.last_used(),
        time.time(), model=request.query.get("model"), fetches=c.fetches()))


async def explain_placement(request: web.Request) -> web.Response:
    c = ctl(request)
    name = request.query.get("model")
    if not name:
        return error(400, "the model query parameter is required")
    catalog = c.catalog
    model = catalog.resolve(name) if catalog is not None else None
    if catalog is None or model is None:
        return error(404, f'model "{name}" is not in the catalog')
    replicas = c.replicas()
    inventory = c.inventory()
    e = explain(catalog, inventory, holding(inventory, replicas), name)  # counted as placement counts
    # Placed is not running: a node may have refused the start (its env allow-list, its
    # sandbox), and that reason is the answer to "why does it not run".
    errors = [{"replica": r.id, "state": r.state.value, "error": r.error}
              for r in replicas if r.model == model.name and r.error]
    weights = views.weights_origin(model, inventory, c.fetches(), replicas)
    return web.json_response({
        "weights": weights,
        "errors": errors,
        "model": e.model,
        "placed": bool(e.running),
        "running": [{"profile": p.profile, "shards": [{"node": s.node, "rank": s.rank, "gpus": list(s.gpus)}
                                                      for s in p.shards]} for p in e.running],
        "candidates": [{"profile": x.profile, "node": x.node, "fits": x.fits, "reasons": list(x.reasons)}
                       for x in e.candidates],
        "text": e.lines() + [weights["text"]]
        + [f"replica {x['replica']} ({x['state']}): {x['error']}" for x in errors],
    })


async def events(request: web.Request) -> web.Response:
    after = _int_param(request, "after", 0)
    limit = _int_param(request, "limit", 200, low=1, high=MAX_LIMIT)
    return web.json_response([e.to_json() for e in ctl(request).events(after=after, limit=limit)])


async def usage(request: web.Request) -> web.Response:
    """The ledger: ``since``/``until`` (default the last 24 h), ``by`` (tenant,key,model), an
    optional ``step`` for a series per tenant, and filters ``tenant``, ``key``, ``model``."""
    try:
        q = usage_query(request.query, time.time())
    except UsageQueryError as exc:
        return error(400, str(exc))
    c = ctl(request)
    rows = await asyncio.to_thread(c.usage, q.since, q.until, by=q.by, where=q.where)
    series = None
    if q.step:
        series = await asyncio.to_thread(c.usage, q.since, q.until, by=("tenant",), step=q.step, where=q.where)
    return web.json_response({**usage_view(q, rows, series), "budgets": c.budgets()})


async def orphans(request: web.Request) -> web.Response:
    c = ctl(request)
    if c.catalog is None:
        return web.json_response({"orphans": [], "foreign": {}, "total_bytes": 0})
    found, foreign = list_orphans(c.catalog, c.inventory())
    return web.json_response({"orphans": [o.to_json() for o in found], "foreign": foreign,
                              "total_bytes": sum(o.bytes for o in found)})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(ctl(request).registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    """Liveness: 503 once a critical loop (a reconcile tick, leadership, the usage ledger) has
    failed llmgw.health.UNHEALTHY_AFTER turns in a row; a restart is what may mend a stuck process.
    A git remote that is down does not make it 503: the last good catalog is still in force."""
    health = ctl(request).health()
    body = {"status": health.state, "problems": health.problems()}
    return web.json_response(body, status=200 if health.fit else 503)


# --- actions ----------------------------------------------------------------------------
async def post_sync(request: web.Request) -> web.Response:
    # A standby's follower does not run: a sync here would apply a commit to the shared store
    # beside the leader's follower, the race that keeps followers to the leader.
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    allow = body.get("allow_prune", False)
    if not isinstance(allow, bool):
        return error(400, "allow_prune must be true or false")
    c = ctl(request)
    if allow:
        if c.sync_status.pending is None:
            return error(409, "no commit is waiting for confirmation")
        try:
            status = await c.sync(confirm=True)
        except LlmgwError as exc:
            return error(409, str(exc))
    else:
        status = await c.sync()
    return web.json_response(status.to_json())


STATE_ACTIONS = {"cordon": NodeState.CORDONED, "cordoned": NodeState.CORDONED, "drain": NodeState.DRAINING,
                 "draining": NodeState.DRAINING, "uncordon": NodeState.READY, "ready": NodeState.READY}


async def node_state(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    c = ctl(request)
    node_id = request.match_info["node"]
    want = body.get("state")
    if not isinstance(want, str) or want not in STATE_ACTIONS:
        return error(400, "state must be one of: cordon, uncordon, drain (or cordoned, ready, draining)")
    if c.inventory().node(node_id) is None:
        return error(404, f'node "{node_id}" is not in the fleet')
    c.set_node_state(node_id, STATE_ACTIONS[want])
    node = c.inventory().node(node_id)
    assert node is not None
    return web.json_response(views.node_view(node, c.replicas(), time.time()))


async def takeover(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    stop_foreign = body.get("stop_foreign", False)
    if not isinstance(stop_foreign, bool):
        return error(400, "stop_foreign must be true or false")
    c = ctl(request)
    node_id = request.match_info["node"]
    if c.inventory().node(node_id) is None:
        return error(404, f'node "{node_id}" is not in the fleet')
    try:
        return web.json_response(await c.takeover(node_id, stop_foreign=stop_foreign))
    except DispatchError as exc:
        return error(502, f"node {node_id} did not grant the lease: {exc}")


def _actor(request: web.Request) -> str:
    """Who did it, for events and commit authors: a person signed in at the provider is who the
    token says, whatever a header claims; on the shared admin token (break-glass, scripts) the
    name the client gives (``--actor``) is all there is to go on."""
    principal = request.get(PRINCIPAL)
    if principal is not None and principal.via == "oidc":
        return principal.name
    said = request.headers.get("X-Llmgw-Actor", "").strip()[:200]
    return said or (principal.name if principal is not None else "llmgw admin API")


async def add_model(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    definition: Any = body.get("yaml") if "yaml" in body else body.get("definition")
    if not isinstance(definition, str | dict):
        return error(400, 'send {"definition": {...model...}} or {"yaml": "...model file..."}')
    return await _write(request, lambda c: c.add_model(definition, _actor(request)), status=201)


async def remove_model(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    name = request.match_info["name"]
    c = ctl(request)
    if c.catalog is None or c.catalog.model(name) is None:
        return error(404, f'model "{name}" is not in the catalog')
    return await _write(request, lambda c: c.remove_model(name, _actor(request)), status=200)


async def _write(request: web.Request, change: Any, *, status: int) -> web.Response:
    c = ctl(request)
    try:
        sha = await asyncio.to_thread(change, c)
    except PushRejected as exc:
        return error(501, str(exc))
    except CatalogError as exc:
        return error(422, str(exc), problems=[p.to_json() for p in exc.problems])
    except GitError as exc:
        return error(502, f"git: {exc}")
    c.trigger_sync()
    return web.json_response({"commit": sha, "message": "committed and pushed; the controller applies it "
                              "on its next fetch"}, status=status)


# --- API keys ---------------------------------------------------------------------------
async def keys(request: web.Request) -> web.Response:
    try:
        return web.json_response(ctl(request).keys())
    except KeyRefused as exc:
        return error(exc.status, str(exc))


async def create_key(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    name, models, tenant = body.get("name"), body.get("models", ["*"]), body.get("tenant")
    if not isinstance(name, str) or not isinstance(models, list) or not isinstance(tenant, str | None):
        return error(400, 'send {"name": "...", "models": ["model", ...], "tenant": "..."} (models: ["*"] for '
                          'every model; tenant optional)')
    try:
        made = ctl(request).create_key(name, models, _actor(request), tenant)
    except KeyRefused as exc:
        return error(exc.status, str(exc))
    # The only time the key is said: only its hash is kept.
    return web.json_response({"name": made.name, "key": made.key, "models": list(made.models),
                              "tenant": made.tenant}, status=201, headers={"Cache-Control": "no-store"})


async def revoke_key(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    name = request.match_info["name"]
    try:
        ctl(request).revoke_key(name, _actor(request))
    except KeyRefused as exc:
        return error(exc.status, str(exc))
    return web.json_response({"name": name, "revoked": True})


async def whoami(request: web.Request) -> web.Response:
    """Who this request's credential names, and its role (`llmgw login` checks a token with it)."""
    p = request[PRINCIPAL]
    return web.json_response({"name": p.name, "role": p.role_label, "via": p.via})


# --- the audit trail ------------------------------------------------------------------------
async def audit(request: web.Request) -> web.Response:
    """The audit rows (``since``: seconds since the epoch; ``after``: an id; ``limit``, at most 10,000)."""
    try:
        since = float(request.query.get("since", "0"))
        after = int(request.query.get("after", "0"))
        limit = int(request.query.get("limit", "1000"))
    except ValueError:
        return error(400, "since is seconds since the epoch, after an id and limit a count")
    if not (0 <= limit <= 10_000 and after >= 0 and math.isfinite(since)):
        return error(400, "limit is 0 to 10000, after an id from 0, since a time")
    rows = await asyncio.to_thread(ctl(request).audit_rows, since=since, after=after, limit=limit)
    return web.json_response([r.to_json() for r in rows])


async def audit_verify(request: web.Request) -> web.Response:
    verdict = await asyncio.to_thread(ctl(request).audit_verify)
    return web.json_response(verdict.to_json())


# --- router credentials -------------------------------------------------------------------
async def routers(request: web.Request) -> web.Response:
    """Each router credential, and what each router's last report moves (its demand, holds)."""
    try:
        return web.json_response(ctl(request).routers())
    except KeyRefused as exc:
        return error(exc.status, str(exc))


async def create_router(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    name = body.get("name")
    if not isinstance(name, str):
        return error(400, 'send {"name": "..."}: the router this credential is for')
    try:
        made = ctl(request).create_router(name, _actor(request))
    except KeyRefused as exc:
        return error(exc.status, str(exc))
    # The only time the credential is said: only its hash is kept.
    return web.json_response({"name": made.name, "credential": made.credential}, status=201,
                             headers={"Cache-Control": "no-store"})


async def revoke_router(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    name = request.match_info["name"]
    try:
        ctl(request).revoke_router(name, _actor(request))
    except KeyRefused as exc:
        return error(exc.status, str(exc))
    return web.json_response({"name": name, "revoked": True})


# --- rollouts ---------------------------------------------------------------------------
async def rollouts(request: web.Request) -> web.Response:
    return web.json_response(views.rollouts_view(ctl(request).rollouts()))


def _rolled_model(request: web.Request) -> str | web.Response:
    """The model a rollout route names (an alias too), or a 404 saying it is not in the catalog."""
    name = request.match_info["model"]
    catalog = ctl(request).catalog
    model = catalog.resolve(name) if catalog is not None else None
    if model is None:
        return error(404, f'model "{name}" is not in the catalog')
    return model.name


async def rollout(request: web.Request) -> web.Response:
    name = _rolled_model(request)
    if isinstance(name, web.Response):
        return name
    found = ctl(request).rollout(name)
    if found is None:
        return error(404, f'model "{name}" has had no rollout (it runs the version the catalog has)')
    return web.json_response(views.rollout_view(found))


async def rollout_promote(request: web.Request) -> web.Response:
    return await _rollout_action(request, "promote")


async def rollout_abort(request: web.Request) -> web.Response:
    return await _rollout_action(request, "abort")


async def _rollout_action(request: web.Request, verb: str) -> web.Response:
    if (refused := standby(request)) is not None:
        return refused
    name = _rolled_model(request)
    if isinstance(name, web.Response):
        return name
    c = ctl(request)
    act = c.rollout_promote if verb == "promote" else c.rollout_abort
    try:
        done = act(name, _actor(request))
    except RolloutError as exc:
        # Known model, nothing to act on (no canary, already done): the state conflicts, 409.
        return error(409, str(exc))
    return web.json_response(views.rollout_view(done))


async def collect_weights(request: web.Request) -> web.Response:
    if (refused := standby(request)) is not None:  # even a dry run polls the nodes
        return refused
    body = await json_body(request)
    if isinstance(body, web.Response):
        return body
    do = body.get("collect", False)
    if not isinstance(do, bool):
        return error(400, "collect must be true or false")
    c = ctl(request)
    if c.catalog is None:
        return error(409, "no catalog is applied yet; nothing can be called an orphan")
    inventory = await c.poll()  # judge on what the nodes hold now
    found, _ = list_orphans(c.catalog, inventory)
    if not do:
        return web.json_response({"collect": False, "asked": 0, "removed": 0, "refused": 0,
                                  "summary": f"would ask to remove {len(found)} (pass collect: true to do it)",
                                  "orphans": [o.to_json() for o in found], "results": []})
    result = await c.collect(found)
    return web.json_response({"collect": True, **result, "orphans": [o.to_json() for o in found]})


async def inventory_export(request: web.Request) -> web.Response:
    """The fleet as `llmgw inventory export` writes it: the input of `llmgw diff --snapshot`."""
    return web.json_response(ctl(request).snapshot().to_json())


async def plan(request: web.Request) -> web.Response:
    """The dry run of a revision the controller has fetched, against the live fleet."""
    from llmgw.plan import build_report, render_json

    c = ctl(request)
    rev = request.query.get("rev") or c.sync_status.head_sha
    applied = c.sync_status.applied_sha
    if not rev:
        return error(409, "nothing fetched yet")
    if not _is_sha_or_ref(rev) or not await c.has_revision(rev):
        return error(404, f"revision {rev!r} is not in the controller's mirror (push it, then POST /api/v1/sync)")
    try:
        head_files = await c.read_revision(rev)
        base_files = await c.read_revision(applied) if applied else None
    except GitError as exc:
        return error(404, str(exc))
    report = build_report((applied or "none")[:12], base_files, rev[:12], head_files, c.snapshot(), now=time.time(),
                          fleet_note="live fleet")
    return web.json_response(render_json(report))


def _is_sha_or_ref(rev: str) -> bool:
    # Only plain names reach git: no option-like or revision-expression text from a URL.
    return bool(rev) and not rev.startswith("-") and all(ch.isalnum() or ch in "._/-" for ch in rev) and len(rev) < 200
