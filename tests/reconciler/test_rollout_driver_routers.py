"""RolloutDriver on a real store when several routers measure a canary (issue 41): each router's
readings are kept apart through the window, a step is judged on each router's alone as well as on
all together, the rollback names the router whose figures failed it, and the status says who the
current window's requests came from."""

from __future__ import annotations

import pytest

from llmgw.catalog import Catalog
from llmgw.contract import ReplicaStats
from llmgw.decide.rollout import Phase
from llmgw.decide.tick import Decisions
from llmgw.reconciler import rollouts
from llmgw.reconciler.rollouts import RolloutDriver, StatsMeter
from llmgw.state import Store
from tests.reconciler.test_decide import replica as make_replica
from tests.reconciler.test_rollout_decide import CANARY, stats
from tests.reconciler.test_rollout_driver import OLD, TARGET, driver, fleet

# Router processes as the controller files their readings (llmgw.control.feed): NAME/instance.
HONEST, FORGED = "edge-1/3f9c", "edge-2/77aa"


def canary_ready(store: Store, readings: dict | None = None) -> tuple[RolloutDriver, dict]:
    """A canary rollout whose canary (m-g3) serves: its first window begins at t=2, with the
    routers' ``readings`` then."""
    d = driver(store)
    stable = [make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1)]
    d.plan(Catalog(models=(OLD,)), fleet(*stable), dict, now=0.0)
    d.plan(Catalog(models=(TARGET,)), fleet(*stable), dict, now=1.0)
    d.decided(Decisions(), {"m": "m-g3"}, now=1.0)
    reps = fleet(*stable, make_replica("m-g3", TARGET, gpu=2, canary=True))
    d.plan(Catalog(models=(TARGET,)), reps, lambda: readings or {}, now=2.0)
    assert d.rollout("m").step_since == 2.0
    return d, reps


def test_a_router_reporting_many_good_requests_cannot_outvote_one_that_saw_the_canary_fail(store: Store) -> None:
    d, reps = canary_ready(store)
    # Cumulative readings, as the routers report them: the honest router has seen the canary fail
    # 30 % of its requests; the forged one reports ten times as many, all good.
    readings = {HONEST: {"m-g3": stats(60, 18), "m-g1": stats(300), "m-g2": stats(300)},
                FORGED: {"m-g3": stats(600), "m-g1": stats(3000), "m-g2": stats(3000)}}
    d.plan(Catalog(models=(TARGET,)), reps, lambda: readings, now=10.0)  # mid-step: not judged yet
    (status,) = d.status()
    assert status["window"] == {
        "since": 2.0, "canary_requests": 660, "stable_requests": 6600, "routers_not_shown": 0,
        "routers": [{"router": "edge-2", "canary_requests": 600, "stable_requests": 6000, "processes": 1},
                    {"router": "edge-1", "canary_requests": 60, "stable_requests": 600, "processes": 1}]}
    # The same on the admin API (`llmgw rollout status`, the dashboard), in the shape its schema says.
    from llmgw.admin.openapi import openapi_document
    from llmgw.admin.views import rollout_view

    assert rollout_view(status)["window"] == status["window"]
    schema = openapi_document(feed=True)["components"]["schemas"]["Rollout"]["properties"]["window"]
    assert set(schema["required"]) == set(status["window"])
    assert set(schema["properties"]["routers"]["items"]["required"]) == set(status["window"]["routers"][0])
    d.plan(Catalog(models=(TARGET,)), reps, lambda: readings, now=2.0 + CANARY.interval + 1)
    r = d.rollout("m")
    assert r.phase == Phase.ROLLED_BACK
    (event,) = [e.message for e in store.events() if e.kind == "rollout-rolled-back"]
    assert event.startswith("m: rolled back: measured by router edge-1: canary error rate 30.0 % > stable 0.0 %")
    assert "edge-2" not in event and d.status()[0]["window"] is None


def test_a_window_counts_each_router_from_the_step_start_across_its_restarts(store: Store) -> None:
    # What a router measured before the window began is not the window's.
    d, reps = canary_ready(store, {HONEST: {"m-g3": stats(0), "m-g1": stats(500)}})

    def routers(readings: dict, now: float) -> list[tuple[str, int, int]]:
        d.plan(Catalog(models=(TARGET,)), reps, lambda: readings, now=now)
        return [(x["router"], x["canary_requests"], x["stable_requests"], x["processes"])
                for x in d.status()[0]["window"]["routers"]]

    assert routers({HONEST: {"m-g3": stats(40), "m-g1": stats(900)}, FORGED: {"m-g3": stats(5)}}, 3.0) == [
        ("edge-1", 40, 400, 1), ("edge-2", 5, 0, 1)]
    # The honest router started again (a new process, its counters from zero): what it measured since is added.
    assert routers({"edge-1/0b2d": {"m-g3": stats(10), "m-g1": stats(50)}, FORGED: {"m-g3": stats(5)}}, 4.0) == [
        ("edge-1", 50, 450, 2), ("edge-2", 5, 0, 1)]
    # The controller's own router (no credential: its process id) is a router of its own.
    assert routers({"c0ffee": {"m-g3": stats(7)}}, 5.0) == [("edge-1", 50, 450, 2), ("c0ffee", 7, 0, 1),
                                                            ("edge-2", 5, 0, 1)]


def test_a_router_sending_a_new_process_id_with_each_report_is_judged_and_named_as_one(store: Store) -> None:
    """Each of its processes alone is under min_requests (not judged alone, not named); together
    they are one router's figures, and that router is named when they fail the step."""
    d, reps = canary_ready(store)
    readings = {HONEST: {"m-g3": stats(60), "m-g1": stats(600)}}
    t = 2.0
    for i in range(5):
        t += 5
        readings[f"edge-2/p{i}"] = {"m-g3": stats(15, 15), "m-g1": stats(15)}
        d.plan(Catalog(models=(TARGET,)), reps, lambda: readings, now=t)
    (shown,) = [x for x in d.status()[0]["window"]["routers"] if x["router"] == "edge-2"]
    assert shown == {"router": "edge-2", "canary_requests": 75, "stable_requests": 75, "processes": 5}
    d.plan(Catalog(models=(TARGET,)), reps, lambda: readings, now=2.0 + CANARY.interval + 1)
    assert d.rollout("m").phase == Phase.ROLLED_BACK
    assert "; measured by router edge-2: canary error rate 100.0 %" in d.rollout("m").reason


def test_the_meter_keeps_each_routers_totals_and_forgets_them_as_it_forgets_the_router(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollouts, "MAX_SOURCES", 2)
    meter = StatsMeter()
    meter.fold({"a/1": {"x": stats(10)}, "b/1": {"x": stats(4), "y": stats(2)}}, ["x", "y"])
    meter.fold({"a/1": {"x": stats(15)}}, ["x", "y"])
    assert meter.by_source == {"a/1": {"x": stats(15)}, "b/1": {"x": stats(4), "y": stats(2)}}
    assert meter.total("x").requests == 19
    meter.fold({"c/1": {"x": stats(1)}}, ["x"])  # past 2 remembered: b/1, read least recently, goes
    assert set(meter.by_source) == {"a/1", "c/1"} and meter.forgotten == 1
    assert meter.total("x").requests == 20 and meter.total("y") == ReplicaStats()  # y is no longer watched
    meter.fold({}, [])
    assert meter.by_source == {}
