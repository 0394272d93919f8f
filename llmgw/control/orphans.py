"""Weights no model wants: listing is pure; collecting asks each node, which decides.

An orphan is a cache entry (a name `llmgw-<sha256 hex>`) whose hash matches no source in
the applied catalog. Foreign directories (an operator's copies, anything without the
cache name) are listed apart and are never collected. Deleting is the agent's decision
per path; a refusal is the guard doing its job, reported with the node's reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llmgw.catalog import Catalog
from llmgw.dispatch.base import Dispatcher
from llmgw.errors import DispatchError
from llmgw.inventory import Inventory


@dataclass(frozen=True)
class Orphan:
    node: str
    path: str
    name: str
    source: str | None
    bytes: int
    last_used: float | None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "path": self.path, "name": self.name, "source": self.source,
                "bytes": self.bytes, "last_used": self.last_used}


def list_orphans(catalog: Catalog, inventory: Inventory) -> tuple[list[Orphan], dict[str, list[str]]]:
    """(orphans, foreign directories per node) from the latest inventory."""
    wanted = catalog.wanted_cache_names()
    orphans: list[Orphan] = []
    foreign: dict[str, list[str]] = {}
    for node in sorted(inventory.nodes.values(), key=lambda n: n.id):
        if node.report is None:
            continue
        for w in node.report.weights:
            if w.name and w.name not in wanted:
                orphans.append(Orphan(node.id, w.path, w.name, w.source, w.bytes, w.last_used))
        if node.report.foreign:
            foreign[node.id] = list(node.report.foreign)
    return orphans, foreign


async def collect(dispatcher: Dispatcher, orphans: list[Orphan]) -> dict[str, Any]:
    """Ask each node to remove its orphans; per path, what the node answered."""
    by_node: dict[str, list[str]] = {}
    for o in orphans:
        by_node.setdefault(o.node, []).append(o.path)

    async def ask(node: str, paths: list[str]) -> list[dict[str, Any]]:
        try:
            answer = await dispatcher.remove_weights(node, paths)
        except DispatchError as exc:
            return [{"node": node, "path": p, "removed": False, "reason": f"node did not answer: {exc}"}
                    for p in paths]
        return [{"node": node, **r} for r in answer.get("results", [])]

    results = [r for rs in await asyncio.gather(*(ask(n, p) for n, p in by_node.items())) for r in rs]
    removed = sum(1 for r in results if r.get("removed"))
    asked = len(results)
    return {
        "asked": asked,
        "removed": removed,
        "refused": asked - removed,
        "summary": f"asked to remove {asked}, removed {removed}, refused {asked - removed}",
        "results": results,
    }
