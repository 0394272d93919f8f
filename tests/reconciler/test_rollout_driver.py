"""RolloutDriver on a real store: rollouts begin on a version change, are judged from the routers'
cumulative measurements, promote or roll back, and survive a controller restart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw.catalog import Catalog
from llmgw.contract import ReplicaStats
from llmgw.decide.replica import ReplicaState
from llmgw.decide.rollout import Phase, model_version
from llmgw.decide.tick import Decisions
from llmgw.reconciler.rollouts import RolloutDriver, RolloutError, StatsMeter
from llmgw.state import Store
from tests.reconciler.test_decide import M
from tests.reconciler.test_decide import replica as make_replica
from tests.reconciler.test_rollout_decide import CANARY, NEW, REPLACE, scaled, stats

OLD = scaled(M, 2)
TARGET = scaled(NEW, 2)


def driver(store: Store) -> RolloutDriver:
    d = RolloutDriver(store, clock=lambda: 0.0)
    d.load()
    return d


def fleet(*reps):
    return {r.id: r for r in reps}


def kinds(store: Store) -> list[str]:
    return [e.kind for e in store.events() if e.kind.startswith("rollout")]


def test_a_version_change_starts_a_canary_and_the_tick_runs_the_stable_version(store: Store) -> None:
    d = driver(store)
    reps = fleet(make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1))
    plan = d.plan(Catalog(models=(OLD,), revision="a" * 40), reps, dict, now=1.0)
    assert plan.canaries == {} and plan.catalog.model("m") == OLD
    plan = d.plan(Catalog(models=(TARGET,), revision="b" * 40), reps, dict, now=2.0)
    assert set(plan.canaries) == {"m"} and plan.canaries["m"].spec == TARGET
    assert model_version(plan.catalog.model("m")) == model_version(OLD)  # stable replicas keep the old
    r = d.rollout("m")
    assert r is not None and r.phase == Phase.CANARY and r.revision == "b" * 40
    assert kinds(store) == ["rollout-started"]


def measured(canary: ReplicaStats, stable: ReplicaStats, source: str = "router-1"):
    return {source: {"m-g3": canary, "m-g1": stable, "m-g2": ReplicaStats()}}


def run_canary(store: Store, canary_stats, stable_stats, *, restart_at: float | None = None):
    d = driver(store)
    stable = [make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1)]
    d.plan(Catalog(models=(OLD,)), fleet(*stable), dict, now=0.0)
    d.plan(Catalog(models=(TARGET,)), fleet(*stable), dict, now=1.0)
    d.decided(Decisions(), {"m": "m-g3"}, now=1.0)
    canary = make_replica("m-g3", TARGET, gpu=2, canary=True)
    reps = fleet(*stable, canary)
    zero = ReplicaStats()
    d.plan(Catalog(models=(TARGET,)), reps, lambda: measured(zero, zero), now=2.0)  # ready: the window begins
    t = 2.0
    for i in range(1, 5):
        t += CANARY.interval / 2 + 1
        if restart_at is not None and t >= restart_at:
            d.save()
            d, restart_at = driver(store), None
        c, s = stats(i * 30, int(i * 30 * canary_stats)), stats(i * 300, int(i * 300 * stable_stats))
        d.plan(Catalog(models=(TARGET,)), reps, lambda c=c, s=s: measured(c, s), now=t)
        if d.rollout("m").phase != Phase.CANARY:
            break
    d.save()
    return d


def test_a_good_canary_passes_every_step_and_is_promoted(store: Store) -> None:
    d = run_canary(store, 0.0, 0.0)
    r = d.rollout("m")
    assert r.phase == Phase.PROMOTING and len(r.history) == 2 and all(": pass:" in h for h in r.history)
    assert kinds(store) == ["rollout-started", "rollout-step", "rollout-promoted"]
    assert d.records["m"].serving == TARGET


def test_a_canary_failing_a_third_of_its_requests_is_rolled_back_and_stays_so(store: Store) -> None:
    d = run_canary(store, 0.3, 0.0)
    r = d.rollout("m")
    assert r.phase == Phase.ROLLED_BACK and r.reason.startswith("canary error rate 3")
    assert kinds(store)[-1] == "rollout-rolled-back"
    assert d.records["m"].serving == OLD
    # The commit is still the desired state: nothing starts again, the model runs the old version.
    stable = fleet(make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1))
    plan = d.plan(Catalog(models=(TARGET,)), stable, dict, now=500.0)
    assert plan.canaries == {} and model_version(plan.catalog.model("m")) == model_version(OLD)
    assert "rolled-back" in plan.notes["m"]
    # After a restart too.
    plan = driver(store).plan(Catalog(models=(TARGET,)), stable, dict, now=600.0)
    assert plan.canaries == {} and model_version(plan.catalog.model("m")) == model_version(OLD)
    # A new commit to the model starts a new rollout.
    newer = replace(TARGET, profiles=(replace(TARGET.profiles[0], args=("--newer",)),))
    plan = d.plan(Catalog(models=(newer,)), stable, dict, now=700.0)
    assert plan.canaries["m"].spec == newer and d.rollout("m").phase == Phase.CANARY


def test_a_restart_mid_step_resumes_the_rollout_and_measures_the_window_again(store: Store) -> None:
    d = run_canary(store, 0.0, 0.0, restart_at=20.0)
    assert d.rollout("m").phase in (Phase.CANARY, Phase.PROMOTING)
    assert kinds(store).count("rollout-started") == 1


def test_operators_promote_or_abort(store: Store) -> None:
    d = driver(store)
    stable = fleet(make_replica("m-g1", OLD), make_replica("m-g2", OLD, gpu=1))
    d.plan(Catalog(models=(OLD,)), stable, dict, now=0.0)
    d.plan(Catalog(models=(TARGET,)), stable, dict, now=1.0)
    assert d.abort("m", "alice").phase == Phase.ABORTED
    with pytest.raises(RolloutError, match="no rollout in progress"):
        d.abort("m", "alice")
    with pytest.raises(RolloutError, match="no model 'x'"):
        d.promote("x", "alice")
    assert d.promote("m", "bob").phase == Phase.PROMOTING  # an aborted version may still be forced
    assert d.records["m"].serving == TARGET


def test_a_replace_strategy_promotes_at_once_and_finishes_when_every_replica_runs_it(store: Store) -> None:
    d = driver(store)
    old, new = scaled(M, 1, REPLACE), scaled(NEW, 1, REPLACE)
    d.plan(Catalog(models=(old,)), fleet(make_replica("m-g1", old)), dict, now=0.0)
    plan = d.plan(Catalog(models=(new,)), fleet(make_replica("m-g1", old)), dict, now=1.0)
    assert plan.catalog.model("m") == new and d.rollout("m").phase == Phase.PROMOTING
    d.plan(Catalog(models=(new,)), fleet(make_replica("m-g2", new, state=ReplicaState.STARTING)), dict, now=2.0)
    assert d.rollout("m").phase == Phase.PROMOTING  # not done before the new one serves
    d.plan(Catalog(models=(new,)), fleet(make_replica("m-g2", new)), dict, now=3.0)
    assert d.rollout("m").phase == Phase.DONE and kinds(store)[-1] == "rollout-done"


def test_the_meter_adds_what_routers_measured_across_their_restarts() -> None:
    meter = StatsMeter()
    meter.fold({"r1": {"x": stats(10)}}, ["x"])
    meter.fold({"r1": {"x": stats(15)}, "r2": {"x": stats(4)}}, ["x"])
    assert meter.total("x").requests == 19
    meter.fold({"r1": {"x": stats(3)}}, ["x"])  # r1 started again: counted from zero
    assert meter.total("x").requests == 22
    meter.fold({}, [])
    assert meter.total("x").requests == 0


def single_replica_change(store: Store, new_errors: float) -> RolloutDriver:
    """A model with one replica on a full fleet: no canary can run. Before the change the old
    replica served 300 requests without an error; after it, the new one serves, with
    ``new_errors`` of its requests failing."""
    from llmgw.decide.rollout_rule import ONLY_REPLICA

    d = driver(store)
    old, new = scaled(M, 1), scaled(NEW, 1)
    d.plan(Catalog(models=(old,), revision="a" * 40), fleet(make_replica("m-g1", old)), dict, now=0.0)
    lived = {"router-1": {"m-g1": stats(300)}}
    d.plan(Catalog(models=(new,), revision="b" * 40), fleet(make_replica("m-g1", old)), lambda: lived, now=1.0)
    d.decided(Decisions(no_canary_room={"m": ONLY_REPLICA}), {}, now=1.0)
    r = d.rollout("m")
    assert r.phase == Phase.PROMOTING and r.before is not None and ReplicaStats.from_json(r.before).requests == 300
    assert "judged once it serves against the old version's figures (300 requests)" in [
        e.message for e in store.events() if e.kind == "rollout-promoted"][-1]
    # The new replica serves alone: its window against the old version's figures begins.
    reps = fleet(make_replica("m-g2", new))
    d.plan(Catalog(models=(new,), revision="b" * 40), reps, lambda: {"router-1": {"m-g2": ReplicaStats()}}, now=2.0)
    assert d.rollout("m").verifying and d.rollout("m").phase == Phase.PROMOTING
    after = stats(60, int(60 * new_errors))
    d.plan(Catalog(models=(new,), revision="b" * 40), reps, lambda: {"router-1": {"m-g2": after}},
           now=2.0 + CANARY.interval + 1)
    return d


def test_a_single_replica_change_is_judged_after_it_against_the_old_versions_figures(store: Store) -> None:
    d = single_replica_change(store, 0.0)
    r = d.rollout("m")
    assert r.phase == Phase.DONE and r.reason == "judged after the change against the old version's figures"
    assert d.records["m"].serving.profiles == NEW.profiles


def test_a_single_replica_change_worse_than_the_old_version_is_reverted_by_itself(store: Store) -> None:
    # Seen: the README's own tour, a bad change on a single replica reached all traffic (50 % errors)
    # until it was reverted by hand.
    d = single_replica_change(store, 0.3)
    r = d.rollout("m")
    assert r.phase == Phase.ROLLED_BACK and "against the old version's figures: canary error rate 30" in r.reason
    assert d.records["m"].serving.profiles == M.profiles  # the version before: the replica is replaced back
    assert [e.message for e in store.events() if e.kind == "rollout-rolled-back"][-1].startswith(
        "m: reverted to the version before")
    # The tick runs the old version again (an ordinary replacement of the new replica).
    plan = d.plan(Catalog(models=(scaled(NEW, 1),), revision="b" * 40), fleet(make_replica("m-g2", scaled(NEW, 1))),
                  dict, now=500.0)
    assert plan.catalog.model("m").profiles == M.profiles
