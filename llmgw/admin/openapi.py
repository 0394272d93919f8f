"""The OpenAPI 3.0 document of the admin API, written beside the routes it describes.

`tests/admin` checks that every route in the app is in this document and the reverse,
and schemathesis checks every response against these schemas.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from llmgw import __version__


def _s(t: str, *, nullable: bool = False, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": t, **kw}
    if nullable:
        out["nullable"] = True
    return out


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _arr(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item}


STR, NSTR, NUM, NNUM, INT, BOOL = _s("string"), _s("string", nullable=True), _s("number"), \
    _s("number", nullable=True), _s("integer"), _s("boolean")

_USAGE_SUMS = {"requests": INT, "errors": INT, "prompt_tokens": INT, "completion_tokens": INT,
               "counted_from_stream": INT, "refused": INT, "total_tokens": INT}

SCHEMAS: dict[str, Any] = {
    "Usage": _obj({
        "since": NUM, "until": NUM, "by": _arr(STR), "where": _s("object"),
        "rows": _arr(_obj({"tenant": STR, "key": STR, "model": STR, **_USAGE_SUMS}, list(_USAGE_SUMS))),
        "total": _obj(_USAGE_SUMS), "step": INT,
        "series": _arr(_obj({"time": INT, "tenant": STR, **_USAGE_SUMS})),
        "budgets": _arr(_obj({"tenant": STR, "model": NSTR, "tokens": INT, "per": STR,
                              "used": {**INT, "nullable": True}, "left": {**INT, "nullable": True},
                              "resets_at": NUM, "refused": {**INT, "nullable": True}})),
    }, ["since", "until", "by", "where", "rows", "total"]),
    "Error": {"type": "object", "properties": {"error": STR}, "required": ["error"]},
    "Problem": _obj({"file": STR, "line": INT, "col": INT, "message": STR}),
    "Sync": _obj({
        "state": _s("string", enum=["pending", "synced", "rejected", "needs-confirmation", "fetch-failed",
                                    "branch-missing"]),
        "url": STR, "branch": STR, "applied_sha": NSTR, "applied_at": NNUM, "head_sha": NSTR, "fetched_at": NNUM,
        "last_error": NSTR,
        "rejected": {**_obj({"sha": STR, "author": STR, "subject": STR, "time": NUM,
                             "problems": _arr(_ref("Problem"))}), "nullable": True},
        "pending_confirmation": {**_obj({"sha": STR, "author": STR, "subject": STR, "reasons": _arr(STR)}),
                                 "nullable": True},
        "last_rewrite": {**_obj({"kind": _s("string", enum=["rewind", "force-push"]), "from_sha": STR,
                                 "to_sha": STR, "time": NUM}), "nullable": True},
    }),
    "Summary": _obj({
        "sync": _ref("Sync"), "models": INT, "nodes": INT, "nodes_by_state": _s("object"), "nodes_ready": INT,
        "gpus_total": INT, "gpus_unhealthy": INT, "replicas": INT, "replicas_by_state": _s("object"),
        "replicas_ready": INT, "unplaced": _s("object"), "rollouts": _arr(_ref("Rollout")),
        "warnings": _arr(STR), "health": _ref("Health"),
    }, ["sync", "models", "nodes", "nodes_by_state", "nodes_ready", "gpus_total", "gpus_unhealthy", "replicas",
        "replicas_by_state", "replicas_ready", "unplaced", "rollouts"]),
    "Health": _obj({
        "state": _s("string", enum=["ok", "degraded", "unhealthy"]), "fit": BOOL,
        "loops": _arr(_obj({"name": STR, "state": _s("string", enum=["ok", "degraded", "unhealthy"]),
                            "critical": BOOL, "last_ok": NNUM, "last_failure": NNUM, "consecutive_failures": INT,
                            "failures": INT, "last_error": NSTR})),
    }, ["state", "fit", "loops"]),
    "Node": _obj({
        "id": STR, "address": STR, "port": INT, "transport": STR, "pool": STR, "state": STR, "hostname": NSTR,
        "labels": _s("object"), "gpu_total": INT, "gpu_free": INT, "gpu_classes": _arr(STR), "fabrics": _arr(STR),
        "gpu_disagreement": NSTR, "unhealthy_gpus": _arr(STR), "memory_gb": NNUM, "disk_free_gb": NNUM,
        "disk_total_gb": NNUM,
        "local_filesystems": _arr(STR), "shared_filesystems": _arr(STR), "weights_on_disk": _arr(STR),
        "last_seen_seconds_ago": NNUM, "agent_version": NSTR, "locked": BOOL, "error": NSTR, "replicas": INT,
        "lease": {**_obj({"holder": NSTR, "epoch": INT, "expires": NNUM, "held": BOOL, "sibling": BOOL, "heard": NNUM,
                          "grace": NNUM}), "nullable": True},
        "unclaimed_engines": _arr(_obj({"id": STR, "model": NSTR, "holder": NSTR, "epoch": {**INT, "nullable": True},
                                        "pid": {**INT, "nullable": True}, "gpus": _arr(INT)})),
        "drain_waits": _arr(STR),
    }),
    "Takeover": _obj({"node": STR, "holder": STR, "epoch": INT, "stopped": _arr(STR), "already": BOOL}),
    "Model": _obj({
        "name": STR, "aliases": _arr(STR), "task": STR, "source": STR, "size_gb": NUM, "min_replicas": INT,
        "max_replicas": INT, "idle_after_seconds": NNUM, "ready_replicas": INT, "total_replicas": INT,
        "unplaced_replicas": INT, "fallbacks": _arr(STR), "routing": STR,
        "prompt_cache": _obj({"blocks": INT, "matched": INT, "prompt_tokens": INT, "cached_tokens": INT,
                              "estimated_hit_ratio": NNUM, "engine_hit_ratio": NNUM}),
        "engine_queue": {**_obj({"running": INT, "waiting": INT, "replicas": INT}), "nullable": True},
        "profiles": _arr(_s("object")), "file": STR,
    }),
    "Replica": _obj({
        "id": STR, "model": STR, "profile": STR, "state": STR, "generation": INT, "pool": NSTR, "fabric": NSTR,
        "endpoint": NSTR, "age_seconds": NUM, "idle_seconds": NUM, "error": NSTR, "failures": INT,
        "replaces": NSTR, "revision": NSTR, "in_catalog": BOOL,
        "weights": _obj({"source": NSTR, "fetch": _s("object", nullable=True)}),
        "shards": _arr(_obj({"node": STR, "rank": INT, "gpus": _arr(INT), "state": STR,
                             "pid": _s("integer", nullable=True), "port": _s("integer", nullable=True),
                             "endpoint": NSTR})),
    }),
    "Event": _obj({"id": INT, "time": NUM, "kind": STR, "subject": STR, "message": STR}),
    "Orphan": _obj({"node": STR, "path": STR, "name": STR, "source": NSTR, "bytes": INT, "last_used": NNUM}),
    "Orphans": _obj({"orphans": _arr(_ref("Orphan")), "foreign": _s("object"), "total_bytes": INT}),
    "Collect": _obj({"collect": BOOL, "asked": INT, "removed": INT, "refused": INT, "summary": STR,
                     "orphans": _arr(_ref("Orphan")), "results": _arr(_s("object"))}),
    "Explain": _obj({"model": STR, "placed": BOOL, "running": _arr(_s("object")),
                     "candidates": _arr(_obj({"profile": STR, "node": STR, "fits": BOOL, "reasons": _arr(STR)})),
                     "weights": _obj({"source": STR, "held_by": _arr(STR), "fetching": _s("object"), "text": STR}),
                     "text": _arr(STR)}),
    "Commit": _obj({"commit": STR, "message": STR}),
    "Figures": _obj({"requests": INT, "errors": INT, "error_rate": NNUM, "ttft_p95": NNUM, "itl_p95": NNUM}),
    "Rollout": _obj({
        "model": STR, "phase": _s("string", enum=["canary", "promoting", "done", "rolled-back", "aborted"]),
        "strategy": STR, "revision": NSTR, "target": STR, "stable": STR, "serving_version": STR, "step": INT,
        "steps": _arr(NUM), "percent": NUM, "interval": NNUM, "started_at": NUM, "step_since": NUM,
        "ended_at": NNUM, "reason": STR, "canary": NSTR, "borrowed": BOOL, "canary_failures": INT,
        "history": _arr(STR),
        "window": {**_obj({"since": NUM, "canary_requests": INT, "stable_requests": INT, "routers_not_shown": INT,
                           "routers": _arr(_obj({"router": STR, "canary_requests": INT, "stable_requests": INT,
                                                 "processes": INT}))}),
                   "nullable": True},
        "analysis": {**_obj({"at": NUM, "seconds": NUM, "verdict": _s("string", enum=["pass", "fail", "wait"]),
                             "reason": STR, "canary": _ref("Figures"), "stable": _ref("Figures")}),
                     "nullable": True},
    }),
}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERR = _ref("Error")
AUTH = {"401": _json(ERR, "missing or invalid admin token"),
        "403": _json(ERR, "the caller's role does not open this route (the answer names the role it needs)")}
LIVENESS = _obj({"status": _s("string", enum=["ok", "degraded", "unhealthy"]), "problems": _arr(STR)},
                ["status", "problems"])


def _op(summary: str, ok: dict[str, Any], *, errors: dict[str, str] | None = None, params: list | None = None,
        body: dict[str, Any] | None = None, ok_code: str = "200") -> dict[str, Any]:
    responses = {ok_code: ok, **AUTH, **{code: _json(ERR, why) for code, why in (errors or {}).items()}}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
    return op


def _q(name: str, schema: dict[str, Any], *, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema}


def _p(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": STR}


BAD = {"400": "malformed request"}


@cache
def openapi_document(*, feed: bool = True) -> dict[str, Any]:
    v = "/api/v1"
    paths = {
        f"{v}/summary": {"get": _op("Fleet summary", _json(_ref("Summary")))},
        f"{v}/sync": {
            "get": _op("Sync status with git", _json(_ref("Sync"))),
            "post": _op("Fetch now, or confirm a commit held by the prune guard", _json(_ref("Sync")),
                        errors={**BAD, "409": "nothing to confirm"},
                        body={"type": "object", "properties": {"allow_prune": BOOL}}),
        },
        f"{v}/nodes": {"get": _op("Nodes", _json(_arr(_ref("Node"))))},
        v + "/nodes/{node}/takeover": {"post": _op(
            "Take over a node's lease from another controller (fencing)", _json(_ref("Takeover")),
            errors={**BAD, "404": "unknown node", "502": "the node did not answer"}, params=[_p("node")],
            body={"type": "object", "properties": {"stop_foreign": BOOL}})},
        v + "/nodes/{node}/state": {"post": _op(
            "Cordon, uncordon or drain a node", _json(_ref("Node")), errors={**BAD, "404": "unknown node"},
            params=[_p("node")],
            body=_obj({"state": _s("string", enum=["cordon", "uncordon", "drain", "cordoned", "ready",
                                                   "draining"])}))},
        f"{v}/models": {
            "get": _op("Models", _json(_arr(_ref("Model")))),
            "post": _op("Add a model (a commit, pushed)", _json(_ref("Commit"), "committed"), ok_code="201",
                        errors={**BAD, "422": "the catalog would be invalid", "501": "cannot push: push to git",
                                "502": "git failed"},
                        body={"type": "object", "properties": {"definition": _s("object"), "yaml": STR}}),
        },
        v + "/models/{name}": {"delete": _op(
            "Remove a model (a commit, pushed)", _json(_ref("Commit")), params=[_p("name")],
            errors={"404": "unknown model", "422": "invalid", "501": "cannot push: push to git",
                    "502": "git failed"})},
        f"{v}/rollouts": {"get": _op("Each model's last rollout (canary analysis, phase, reason)",
                                     _json(_arr(_ref("Rollout"))))},
        v + "/rollouts/{model}": {"get": _op("One model's last rollout", _json(_ref("Rollout")),
                                             errors={"404": "unknown model, or no rollout"}, params=[_p("model")])},
        v + "/rollouts/{model}/promote": {"post": _op(
            "Promote the canary now (analysis skipped), or a rolled-back version", _json(_ref("Rollout")),
            errors={"404": "unknown model", "409": "nothing to promote"}, params=[_p("model")])},
        v + "/rollouts/{model}/abort": {"post": _op(
            "Abort the rollout in progress: the model goes back to the version it ran", _json(_ref("Rollout")),
            errors={"404": "unknown model", "409": "no rollout in progress"}, params=[_p("model")])},
        f"{v}/replicas": {"get": _op("Replicas", _json(_arr(_ref("Replica"))), params=[_q("model", STR)])},
        f"{v}/keys": {
            "get": _op("API keys: the controller config's and those made here (names and models, never a digest)",
                       _json(_arr(_obj({"name": STR, "models": _arr(STR), "source": STR, "created_at": NNUM}))),
                       errors={"409": "this controller serves no router"}),
            "post": _op("Make an API key: the key is in this answer only (only its sha256 is kept)",
                        _json(_obj({"name": STR, "key": STR, "models": _arr(STR)}), "made"), ok_code="201",
                        errors={**BAD, "409": "a key of that name exists"},
                        body=_obj({"name": STR, "models": _arr(STR)}, ["name"])),
        },
        v + "/keys/{name}": {"delete": _op(
            "Revoke an API key made here (routers refuse it from their next request)",
            _json(_obj({"name": STR, "revoked": BOOL})), params=[_p("name")],
            errors={"404": "no such key", "409": "a key of the controller config"})},
        f"{v}/audit": {"get": _op(
            "The audit trail: every change and refused attempt, hash-chained", _json(_arr(_obj({
                "id": INT, "time": NUM, "who": STR, "role": STR, "source": STR, "action": STR, "result": STR,
                "revision": STR, "prev": STR, "hash": STR}))), errors=BAD,
            params=[_q("since", NUM), _q("after", INT), _q("limit", INT)])},
        f"{v}/audit/verify": {"get": _op("The audit chain recomputed: ok, or the first row that breaks it",
                                         _json(_obj({"ok": BOOL, "rows": INT, "broken_at": _s("integer", nullable=True),
                                                     "why": NSTR})))},
        f"{v}/whoami": {"get": _op("Who the request's credential names, and its role",
                                   _json(_obj({"name": STR, "role": STR, "via": STR})))},
        f"{v}/routers": {
            "get": _op("Router credentials, and what each router's last report moves (demand, in-flight holds)",
                       _json(_arr(_obj({"name": STR, "created_at": NNUM, "report": {**_obj({
                           "seconds_ago": NUM, "demand": _s("object"), "in_flight": INT, "replicas_used": INT}),
                           "nullable": True}}))),
                       errors={"409": "this controller serves no router feed"}),
            "post": _op("Make a router credential (it opens the router watch and report only); in this answer only",
                        _json(_obj({"name": STR, "credential": STR}), "made"), ok_code="201",
                        errors={**BAD, "409": "a credential of that name exists"},
                        body=_obj({"name": STR}, ["name"])),
        },
        v + "/routers/{name}": {"delete": _op(
            "Revoke a router credential (its watch ends, its reports count no more)",
            _json(_obj({"name": STR, "revoked": BOOL})), params=[_p("name")],
            errors={"404": "no such router credential", "409": "this controller serves no router feed"})},
        f"{v}/explain-placement": {"get": _op(
            "Why a model runs where it runs, or cannot run", _json(_ref("Explain")),
            errors={**BAD, "404": "unknown model"}, params=[_q("model", STR, required=True)])},
        f"{v}/weights/orphans": {"get": _op("Cache entries no model wants", _json(_ref("Orphans")))},
        f"{v}/weights/collect": {"post": _op(
            "Ask nodes to remove orphans (only with collect: true)", _json(_ref("Collect")),
            errors={**BAD, "409": "no catalog applied"},
            body={"type": "object", "properties": {"collect": BOOL}})},
        f"{v}/events": {"get": _op("Events, oldest first", _json(_arr(_ref("Event"))), errors=BAD, params=[
            _q("after", _s("integer", minimum=0)), _q("limit", _s("integer", minimum=1, maximum=1000))])},
        f"{v}/usage": {"get": _op(
            "Tokens and requests per tenant, key and model over a time range (the usage ledger)",
            _json(_ref("Usage")), errors=BAD, params=[
                _q("since", STR), _q("until", STR), _q("by", STR), _q("step", STR), _q("tenant", STR),
                _q("key", STR), _q("model", STR)])},
        f"{v}/inventory": {"get": _op("The fleet snapshot `llmgw diff --snapshot` reads", _json(_obj({
            "taken_at": NNUM, "inventory": _s("object"), "replicas": _arr(_s("object"))})))},
        f"{v}/plan": {"get": _op("Dry run of a fetched revision against the live fleet", _json(_obj({
            "base": STR, "head": STR, "summary": STR, "rollouts_summary": NSTR, "changed": BOOL,
            "changes": _arr(_s("object")),
            "problems": _arr(_ref("Problem")), "plan": {"type": "object", "nullable": True}})),
            errors={"404": "unknown revision", "409": "nothing fetched yet"}, params=[_q("rev", STR)])},
        f"{v}/metrics": {"get": _op("Fleet metrics (Prometheus text)", {
            "description": "OK", "content": {"text/plain": {"schema": STR}}})},
        f"{v}/healthz": {"get": {"summary": "Liveness: 503 once a critical controller loop keeps failing",
                                 "responses": {"200": _json(LIVENESS), **AUTH,
                                               "503": _json(LIVENESS, "a critical loop failed three turns in a row")}}},
        f"{v}/openapi.json": {"get": _op("This document", _json(_s("object")))},
        f"{v}/hooks/git": {"post": {
            "summary": "Git host webhook (HMAC-SHA256 signature, no token)", "security": [],
            "responses": {"202": _json(_obj({"status": STR})), "401": _json(ERR, "bad or missing signature"),
                          "413": _json(ERR, "too large")}}},
    }
    if feed:
        paths[f"{v}/router/watch"] = {"get": _op(
            "Watch stream for standalone routers: one JSON snapshot per line, resent on every change", {
                "description": "a long-lived stream of JSON lines",
                "content": {"application/x-ndjson": {"schema": STR}}})}
        paths[f"{v}/router/report"] = {"post": _op(
            "A standalone router's usage report (last use per replica, demand and prompt-cache counts per model)",
            _json(_obj({"ok": BOOL, "version": INT, "usage_acked": INT}, ["ok", "version"])), errors=BAD,
            body=_obj({"router_id": STR, "last_used": _s("object"), "demand": _s("object"),
                       "prompt_cache": _s("object"), "usage": _s("object")}, ["router_id"]))}
    return {
        "openapi": "3.0.3",
        "info": {"title": "llmgw admin API", "version": __version__},
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
