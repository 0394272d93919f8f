"""The router's side of the catalog view (`llmgw.contract`): decoding it into its routing table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.catalog import Catalog
from llmgw.contract import catalog_view, wire_str
from llmgw.router.routes import ROUTING_POLICIES, RouteCatalog, RouteModel


def catalog_from_view(view: Mapping[str, Any]) -> RouteCatalog:
    """The router's catalog from a view (in-process or off the wire); ValueError when malformed."""
    try:
        models = tuple(RouteModel(
            name=wire_str(m["name"]), aliases=tuple(wire_str(a) for a in m.get("aliases", ())),
            task=wire_str(m.get("task", "chat")),
            fallbacks=tuple(wire_str(f) for f in m.get("fallbacks", ())),
            min_replicas=int(m.get("scaling", {}).get("min", 1)), max_replicas=int(m.get("scaling", {}).get("max", 1)),
            routing=_routing(m.get("routing")),
        ) for m in view["models"])
        revision = view.get("revision")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed catalog view: {exc!r}") from exc
    return RouteCatalog(models, revision if isinstance(revision, str) else None)


def _routing(v: Any) -> str:
    # An older controller sends none; a newer one may name a policy this router does not know,
    # which it serves as the default rather than refusing the whole catalog.
    return v if isinstance(v, str) and v in ROUTING_POLICIES else "least-outstanding"


def route_catalog(catalog: Catalog) -> RouteCatalog:
    """In-process shortcut: the same view a standalone router receives."""
    return catalog_from_view(catalog_view(catalog))
