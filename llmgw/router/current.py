"""What the control plane said last, as the request path reads it: the endpoint table, the
routed catalog with each model's fallback chain, and the models no node can run.

The control plane's calls (``Router.set_endpoints``, ``set_routes``, ``set_unrunnable``) replace
each field in one step; a request reads whichever is current and never waits for them.
"""

from __future__ import annotations

from llmgw.router.routes import RouteCatalog, RouteModel
from llmgw.router.table import EMPTY, EndpointTable


class Current:
    __slots__ = ("table", "routes", "chains", "unrunnable", "has_catalog")

    def __init__(self) -> None:
        self.table: EndpointTable = EMPTY
        self.routes = RouteCatalog()
        self.chains: dict[str, tuple[RouteModel, ...]] = {}  # model -> itself, then its fallbacks in order
        self.unrunnable: dict[str, str] = {}  # model -> why no node can run it (from placement)
        self.has_catalog = False

    def chain(self, model: RouteModel) -> tuple[RouteModel, ...]:
        """``model`` and its fallbacks, as the current catalog has them."""
        return self.chains.get(model.name, (model,))
