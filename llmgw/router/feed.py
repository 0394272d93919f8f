"""The router's side of the catalog view (`llmgw.contract`): decoding it into its routing table."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from llmgw.catalog import Catalog
from llmgw.catalog.model import Budget, Limits, Tenant
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
        tenants = tuple(_tenant(t) for t in view.get("tenants") or ())
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"malformed catalog view: {exc!r}") from exc
    return RouteCatalog(models, revision if isinstance(revision, str) else None, tenants)


def _tenant(t: Mapping[str, Any]) -> Tenant:
    return Tenant(name=wire_str(t["name"]), keys=tuple(wire_str(k) for k in t["keys"]),
                  limits=_limits(t.get("limits")),
                  models=tuple(sorted((wire_str(m), _limits(lim)) for m, lim in (t.get("models") or {}).items())))


def _limits(d: Mapping[str, Any] | None) -> Limits:
    d = d or {}

    def count(name: str) -> int | None:
        v = d.get(name)
        if v is not None and (type(v) is not int or not 1 <= v <= 10 ** 12):
            raise ValueError(f"{name} must be a whole number from 1 to 10**12, got {v!r}")
        return v

    b = d.get("budget")
    budget = None
    if b is not None:
        tokens, per, reset = b["tokens"], b["per"], b.get("reset", "00:00")
        if (type(tokens) is not int or not 1 <= tokens <= 10 ** 15 or per not in ("day", "month")
                or not _HHMM.match(str(reset))):
            raise ValueError(f"malformed budget: {b!r}")
        budget = Budget(tokens=tokens, per=per, reset=reset)
    return Limits(requests_per_minute=count("requests_per_minute"), tokens_per_minute=count("tokens_per_minute"),
                  concurrent=count("concurrent"), budget=budget)


_HHMM = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")


def _routing(v: Any) -> str:
    # An older controller sends none; a newer one may name a policy this router does not know,
    # which it serves as the default rather than refusing the whole catalog.
    return v if isinstance(v, str) and v in ROUTING_POLICIES else "least-outstanding"


def route_catalog(catalog: Catalog) -> RouteCatalog:
    """In-process shortcut: the same view a standalone router receives."""
    return catalog_from_view(catalog_view(catalog))
