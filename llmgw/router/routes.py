"""The part of the catalog the router needs to resolve a request: names, task, fallbacks, scaling, routing.

The router never holds a full :class:`~llmgw.catalog.Catalog`. In the controller's process and
in a standalone router alike it works from this view, built from the catalog by
:func:`llmgw.router.feed.catalog_view` and read back by :func:`llmgw.router.feed.catalog_from_view`,
so both modes resolve names through the same code and the watch stream carries exactly what
serving needs (no sources, nodes or profiles). Pure data; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.catalog.model import Tenant

ROUTING_POLICIES = frozenset({"least-outstanding", "prefix"})


@dataclass(frozen=True)
class RouteModel:
    """One model as the router sees it."""

    name: str
    aliases: tuple[str, ...] = ()
    task: str = "chat"
    fallbacks: tuple[str, ...] = ()
    min_replicas: int = 1
    max_replicas: int = 1
    routing: str = "least-outstanding"  # or "prefix": see llmgw.router.prefix

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a client may use, canonical name first."""
        return (self.name, *self.aliases)

    @property
    def wakeable(self) -> bool:
        """A model whose ``max`` is 0 is switched off: holding a request for it would only time out."""
        return self.max_replicas > 0


@dataclass(frozen=True)
class RouteCatalog:
    """Every model the router may serve, indexed by every name and alias."""

    models: tuple[RouteModel, ...] = ()
    revision: str | None = None
    tenants: tuple[Tenant, ...] = ()
    _index: dict[str, RouteModel] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, RouteModel] = {}
        for m in self.models:
            for n in m.names:
                # Validation made names unique; first wins if a hand-made view repeats one.
                index.setdefault(n, m)
        object.__setattr__(self, "_index", index)

    def resolve(self, name_or_alias: str) -> RouteModel | None:
        """The model a client means by ``name_or_alias``, or None (one dict lookup)."""
        return self._index.get(name_or_alias)

    def model(self, name: str) -> RouteModel | None:
        """The model whose canonical name is ``name``."""
        m = self._index.get(name)
        return m if m is not None and m.name == name else None
