"""DesiredState.set: the router is told before the reconciler, and a router that fails to take a
catalog keeps the reconciler on the one before (it would stop replicas the router still sends to),
counted and said; the next catalog is told to all again."""

from __future__ import annotations

from llmgw.catalog import Catalog
from llmgw.gitops.desired import RECONCILER, ROUTER, DesiredState


def test_a_router_that_fails_keeps_the_reconciler_on_the_catalog_before_and_it_is_said() -> None:
    told: list[tuple[str, Catalog]] = []
    broken = [True]

    def router(c: Catalog) -> None:
        if broken[0]:
            raise RuntimeError("bad view")
        told.append(("router", c))

    desired = DesiredState()
    desired.subscribe(lambda c: told.append(("reconciler", c)), order=RECONCILER)
    desired.subscribe(router, order=ROUTER)
    desired.subscribe(lambda c: told.append(("other router view", c)), order=ROUTER)
    first = Catalog()
    desired.set(first)
    assert told == [("other router view", first)]  # its own order still told; the reconciler not
    assert desired.problem is not None
    health = desired.health.health
    assert health.failures == health.consecutive_failures == 1 and health.state == "degraded"
    assert "RuntimeError: bad view" in (health.last_error or "")
    assert "RuntimeError: bad view" in desired.problem and "were not told" in desired.problem
    broken[0] = False
    second = Catalog()
    desired.set(second)
    assert told[1:] == [("router", second), ("other router view", second), ("reconciler", second)]
    assert desired.problem is None
    assert desired.health.health.consecutive_failures == 0 and desired.health.health.state == "ok"
