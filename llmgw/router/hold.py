"""Scale from zero (DESIGN §6): a request for a model with no ready replica, nor a fallback with
one, waits here until one is ready, or is refused at once when waiting cannot help (switched
off, no node can run it, too many already waiting). What counts as demand, and how the wait is
woken, is :mod:`llmgw.router.demand`.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from llmgw.router import respond
from llmgw.router.config import RouterConfig
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.metrics import RouterMetrics
from llmgw.router.routes import RouteModel


class Holder:
    def __init__(self, *, current: Current, demand: DemandBook, metrics: RouterMetrics, config: RouterConfig,
                 clock: Callable[[], float]) -> None:
        self._current = current
        self._demand = demand
        self._metrics = metrics
        self._config = config
        self._clock = clock

    async def hold(self, model: RouteModel, chain: tuple[RouteModel, ...]) -> web.Response | None:
        """Wait until ``model`` or one of its fallbacks has a replica (or it left the catalog):
        None then, else the refusal to send."""
        tried = f" or its fallbacks ({', '.join(m.name for m in chain[1:])})" if len(chain) > 1 else ""
        retry = self._config.retry_after
        if not model.wakeable:
            return respond.unavailable(f"No ready replica of `{model.name}`{tried}, and it is switched off "
                                       "(scaling.max is 0).", retry)
        stuck = self.cannot_run(chain)
        if stuck is not None:
            return stuck
        if self._demand.held_total >= self._config.max_held:
            return respond.unavailable(f"No ready replica of `{model.name}`{tried}, and {self._demand.held_total} "
                                       "requests are already waiting for replicas to start.", retry)
        name = model.name
        current = self._current

        def ready() -> bool:
            if current.routes.model(name) is None:
                return True  # left the catalog: the caller answers 404
            links = current.chains.get(name, chain)
            # Placement said it cannot be woken: the caller answers with the reason at once.
            return any(current.table.has(m.name) for m in links) or all(m.name in current.unrunnable for m in links)

        self._metrics.hold(name)
        start = self._clock()
        if await self._demand.hold(name, ready, self._config.hold_timeout):
            return None
        return respond.unavailable(
            f"No ready replica of `{name}`{tried}: waited {self._clock() - start:.0f} s for one to start "
            "and none became ready. Retry later.", retry)

    def cannot_run(self, chain: tuple[RouteModel, ...]) -> web.Response | None:
        """503 now when neither the model nor any fallback can be placed on any node."""
        unrunnable = self._current.unrunnable
        if not all(m.name in unrunnable for m in chain):
            return None
        reasons = "; ".join(f"`{m.name}`: {unrunnable[m.name]}" for m in chain)
        return respond.unavailable(f"No replica of `{chain[0].name}` can start: {reasons} "
                                   f"(llmgw explain {chain[0].name}).", self._config.retry_after)
