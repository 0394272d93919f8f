"""What the operator sees, as plain data: the admin API serves it, the dashboard renders it.

Pure: each view takes the controller's state and the time and returns JSON-able dicts.
Both surfaces call these functions, so the dashboard can never show something the API
does not say.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.catalog import Catalog, Model, NodeId
from llmgw.contract import PromptCache
from llmgw.decide import Replica, ReplicaState, holding
from llmgw.inventory import Inventory, Node, NodeState
from llmgw.placement.capacity import NodeFree, free_capacity

GB = 1024**3


def _ago(t: float | None, now: float) -> float | None:
    return None if t is None else round(now - t, 1)


def node_view(node: Node, replicas: Sequence[Replica], now: float, *,
              free: Mapping[NodeId, NodeFree] | None = None, waits: Sequence[str] = ()) -> dict[str, Any]:
    """One node; ``free`` is the fleet's free capacity when the caller has it (:func:`nodes_view`)."""
    r = node.report
    gpus = r.gpus if r else ()
    if free is None:
        free = _free(Inventory({node.id: node}), replicas)
    local = [f for f in (r.filesystems if r else ()) if not f.shared]
    cache = r.cache_fs if r else None
    claimed = {s.agent_id for rep in replicas for s in rep.shards if s.node == node.id}
    return {
        "id": node.id,
        "address": node.spec.address,
        "port": node.spec.port,
        "transport": node.spec.transport,
        "pool": node.spec.pool,
        "state": node.state.value,
        "hostname": r.hostname if r else None,
        "labels": dict(node.spec.labels),
        "gpu_total": len(gpus),
        # Counted as placement counts (holding): our replicas not yet stopped and engines no
        # replica claims, e.g. another controller's (seen: shown free where nothing was placed).
        "gpu_free": len(free[node.id].free) if node.id in free else 0,
        "gpu_classes": sorted({g.gpu_class for g in gpus}),
        # nodes.yaml's gpus against the agent's report (placement counts the report): null when they agree.
        "gpu_disagreement": node.gpu_disagreement,
        "fabrics": [node.spec.fabric] if node.spec.fabric else [],
        "unhealthy_gpus": [f"gpu{g.index}: {', '.join(g.problems) or 'unhealthy'}" for g in gpus if not g.healthy],
        "memory_gb": round(r.memory_total_mb / 1024, 1) if r else None,
        # Shared filesystems are left out: their free space is not this node's to count.
        "disk_free_gb": round(cache.free_bytes / GB, 1) if cache and not cache.shared else None,
        "disk_total_gb": round(cache.total_bytes / GB, 1) if cache and not cache.shared else None,
        "local_filesystems": [f.mount_point for f in local],
        "shared_filesystems": [f.mount_point for f in (r.filesystems if r else ()) if f.shared],
        "weights_on_disk": [w.name for w in (r.weights if r else ()) if w.name],
        "last_seen_seconds_ago": _ago(node.last_seen, now),
        "agent_version": r.agent_version if r else None,
        # How the node confines engines (DESIGN §4): user and sandbox; null from an older agent.
        "confinement": dataclasses.asdict(r.confinement) if r and r.confinement else None,
        "env_allow": list(r.env_allow) if r else [],
        "locked": node.locked,
        "error": node.error,
        "replicas": len([rep for rep in replicas if node.id in rep.nodes and rep.state != ReplicaState.STOPPED]),
        # Fencing (DESIGN §4): who drives the node, and live engines no replica here claims (another
        # controller's, or stale ones about to be stopped), with who started them.
        "lease": dataclasses.asdict(r.lease) if r and r.lease else None,
        "unclaimed_engines": [
            {"id": e.replica_id, "model": e.label("llmgw.model"), "holder": e.holder, "epoch": e.epoch,
             "pid": e.pid, "gpus": list(e.gpus)}
            for e in (r.engines if r else ()) if e.alive and e.replica_id not in claimed],
        "drain_waits": list(waits),  # what a drain of this node waits for, in words
    }


def nodes_view(inventory: Inventory, replicas: Sequence[Replica], now: float,
               waits: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """``waits``: per draining node, what its drain waits for."""
    free = _free(inventory, replicas)
    return [node_view(n, replicas, now, free=free, waits=(waits or {}).get(n.id, ()))
            for n in sorted(inventory.nodes.values(), key=lambda n: n.id)]


def _free(inventory: Inventory, replicas: Sequence[Replica]) -> dict[NodeId, NodeFree]:
    return free_capacity(inventory, holding(inventory, replicas))


def model_view(model: Model, replicas: Sequence[Replica], unplaced: Mapping[str, int],
               prompt_cache: Mapping[str, PromptCache] | None = None,
               engine_queue: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    mine = [r for r in replicas if r.model == model.name]
    cache = (prompt_cache or {}).get(model.name, PromptCache())
    return {
        "name": model.name,
        "aliases": list(model.aliases),
        "task": model.task,
        "source": model.source,
        "size_gb": model.size_gb,
        "min_replicas": model.scaling.min,
        "max_replicas": model.scaling.max,
        "idle_after_seconds": model.scaling.idle_after,
        "ready_replicas": len([r for r in mine if r.state == ReplicaState.READY]),
        "total_replicas": len([r for r in mine if r.state.live]),
        "unplaced_replicas": unplaced.get(model.name, 0),
        "fallbacks": list(model.fallbacks),
        "routing": model.routing,
        # Since each router started; a ratio is null until there is something to divide.
        "prompt_cache": {**cache.to_json(), "estimated_hit_ratio": cache.estimated_hit_ratio,
                         "engine_hit_ratio": cache.engine_hit_ratio},
        "engine_queue": _model_queue(mine, engine_queue or {}),
        "profiles": [
            {"name": p.name, "priority": p.priority, "engine": p.engine, "gpus": p.gpus, "nodes": p.nodes,
             "gpu_class": list(p.gpu_class), "pool": p.pool, "fabric": p.fabric}
            for p in model.profiles_by_priority()
        ],
        "file": model.file,
    }


def _model_queue(mine: Sequence[Replica], queue: Mapping[str, tuple[int, int]]) -> dict[str, int] | None:
    """Running and waiting summed over the model's replicas whose engine reports them; null when
    none does (so "no figure" never reads as "idle")."""
    known = [queue[r.id] for r in mine if r.id in queue]
    if not known:
        return None
    return {"running": sum(q[0] for q in known), "waiting": sum(q[1] for q in known), "replicas": len(known)}


def models_view(catalog: Catalog | None, replicas: Sequence[Replica], unplaced: Mapping[str, int],
                prompt_cache: Mapping[str, PromptCache] | None = None,
                engine_queue: Mapping[str, tuple[int, int]] | None = None) -> list[dict]:
    if catalog is None:
        return []
    return [model_view(m, replicas, unplaced, prompt_cache, engine_queue)
            for m in sorted(catalog.models, key=lambda m: m.name)]


def replica_view(
    r: Replica, catalog: Catalog | None, inventory: Inventory, last_used: Mapping[str, float], now: float,
    fetches: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    node = inventory.node(r.nodes[0]) if r.nodes else None
    used = last_used.get(r.id)
    model = catalog.model(r.model) if catalog else None
    fetching = (fetches or {}).get(r.id) if r.state == ReplicaState.FETCHING else None
    return {
        "id": r.id,
        "model": r.model,
        "profile": r.profile,
        "state": r.state.value,
        "generation": r.generation,
        "pool": node.spec.pool if node else None,
        "fabric": node.spec.fabric if node else None,
        "endpoint": r.endpoint,
        "age_seconds": round(now - r.created_at, 1),
        # -1 until the router has reported any use of this replica.
        "idle_seconds": round(now - used, 1) if used is not None else -1,
        "error": r.error,
        "failures": r.failures,
        "replaces": r.replaces,
        "revision": r.revision,
        "in_catalog": bool(model),
        # Where its weights come from (the origin the catalog names; each node reads it itself),
        # and while it fetches, how far each node's fetch is.
        "weights": {"source": model.source if model else None,
                    "fetch": {n: dict(p) for n, p in sorted(fetching.items())} if fetching else None},
        "shards": [
            {"node": s.node, "rank": s.rank, "gpus": list(s.gpus), "state": s.state, "pid": s.pid, "port": s.port,
             "endpoint": s.endpoint}
            for s in r.shards
        ],
    }


def replicas_view(
    replicas: Sequence[Replica], catalog: Catalog | None, inventory: Inventory, last_used: Mapping[str, float],
    now: float, *, model: str | None = None, fetches: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    if model is not None and catalog is not None:
        resolved = catalog.resolve(model)
        model = resolved.name if resolved else model
    return [replica_view(r, catalog, inventory, last_used, now, fetches) for r in replicas
            if model is None or r.model == model]


def summary_view(
    catalog: Catalog | None, inventory: Inventory, replicas: Sequence[Replica], sync: dict[str, Any],
    unplaced: Mapping[str, int], rollouts: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """``rollouts``: the models whose last rollout is under way or did not go through (a finished
    one is history, not news for `llmgw status`)."""
    nodes = list(inventory.nodes.values())
    states: dict[str, int] = {}
    for n in nodes:
        states[n.state.value] = states.get(n.state.value, 0) + 1
    rstates: dict[str, int] = {}
    for r in replicas:
        rstates[r.state.value] = rstates.get(r.state.value, 0) + 1
    gpus = [g for n in nodes if n.report for g in n.report.gpus]
    return {
        "sync": sync,
        "models": len(catalog.models) if catalog else 0,
        "nodes": len(nodes),
        "nodes_by_state": states,
        "nodes_ready": states.get(NodeState.READY.value, 0),
        "gpus_total": len(gpus),
        "gpus_unhealthy": len([g for g in gpus if not g.healthy]),
        "replicas": len(replicas),
        "replicas_by_state": rstates,
        "replicas_ready": rstates.get(ReplicaState.READY.value, 0),
        "unplaced": dict(unplaced),
        "rollouts": [rollout_view(r) for r in rollouts if r.get("phase") != "done"],
    }


ROLLOUT_FIELDS = ("model", "phase", "strategy", "revision", "target", "stable", "serving_version", "step", "steps",
                  "percent", "interval", "started_at", "step_since", "ended_at", "reason", "canary", "borrowed",
                  "canary_failures", "history", "window")


def _figures(f: Mapping[str, Any]) -> dict[str, Any]:
    requests, errors = int(f.get("requests") or 0), int(f.get("errors") or 0)
    return {"requests": requests, "errors": errors, "error_rate": errors / requests if requests else None,
            "ttft_p95": f.get("ttft_p95"), "itl_p95": f.get("itl_p95")}


def rollout_view(r: Mapping[str, Any]) -> dict[str, Any]:
    """One model's last rollout (llmgw.reconciler.rollouts status), with each group's error rate.

    ``step`` counts from 1 as operators read it ("step 2 of 3"); ``percent`` is the canary's share
    of the model's traffic now (0 outside the canary phase); ``window``: the current step's
    requests so far and the routers they came from, most canary requests first (None outside one)."""
    out = {k: r.get(k) for k in ROLLOUT_FIELDS}
    out["step"] = int(r.get("step") or 0) + 1
    out["steps"] = list(r.get("steps") or [])
    out["history"] = list(r.get("history") or [])
    a = r.get("analysis")
    out["analysis"] = None if not a else {
        "at": a["at"], "seconds": a["seconds"], "verdict": a["verdict"], "reason": a["reason"],
        "canary": _figures(a["canary"]), "stable": _figures(a["stable"])}
    return out


def rollouts_view(rollouts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [rollout_view(r) for r in rollouts]


def weights_origin(model: Model, inventory: Inventory, fetches: Mapping[str, Mapping[str, Mapping[str, Any]]],
                   replicas: Sequence[Replica]) -> dict[str, Any]:
    """Where a model's weights come from: the source (the origin), the nodes that hold them, and
    each fetch under way with what it reads from (the origin or a node) and how far it is."""
    held = sorted(n.id for n in inventory.nodes.values() if n.report is not None and model.cache_name
                  and model.cache_name in n.report.held)
    mine = {r.id for r in replicas if r.model == model.name}
    under_way = {node: dict(p) for rid, by_node in fetches.items() if rid in mine for node, p in by_node.items()}
    if model.cache_name is None:
        text = f"weights: {model.source} (no fetch: the operator's own copy, or the simulator's)"
    else:
        parts = [f"weights: {model.source} (the origin)",
                 f"held by {', '.join(held)}" if held else "held by no node yet"]
        parts += [f"{node} fetching from {p.get('from')}" for node, p in sorted(under_way.items())]
        text = "; ".join(parts)
    return {"source": model.source, "held_by": held, "fetching": under_way, "text": text}
