"""Rollouts without I/O: the canary's judgement, its steps, and where decide() puts canaries and
replacements (beside the old ones, or instead of them on a full fleet)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.catalog import CanaryChecks, Catalog, RolloutPolicy, Scaling
from llmgw.contract import ReplicaStats
from llmgw.decide.replica import ReplicaState
from llmgw.decide.rollout import Phase, Rollout, Windows, advance, judge
from llmgw.decide.tick import CanaryWant, decide
from tests.placement.fleet import inventory, node
from tests.reconciler.test_decide import M, replica

CHECKS = CanaryChecks(error_rate=2.0, ttft_p95=2.0, itl_p95=2.0, min_requests=20)
CANARY = RolloutPolicy(strategy="canary", steps=(10.0, 50.0), interval=30.0, checks=CHECKS)


def stats(requests: int, errors: int = 0, *, ttft: float = 0.1, itl: float | None = 0.02) -> ReplicaStats:
    s = ReplicaStats()
    for i in range(requests):
        s.observe(error=i < errors, ttft=ttft, itl=itl)
    return s


def test_a_step_waits_for_traffic_before_judging() -> None:
    a = judge(CHECKS, stats(5), stats(100), seconds=30, now=1.0)
    assert a.verdict == "wait" and "canary 5, stable 100 of 20 requests served" in a.reason


def test_an_error_rate_above_the_stables_fails_with_the_figures_in_words() -> None:
    a = judge(CHECKS, stats(140, 17), stats(500, 0), seconds=60, now=1.0)
    assert a.verdict == "fail"
    assert a.reason.startswith("canary error rate 12.1 % > stable 0.0 % + 2 %")
    assert "over 60 s, 140 canary requests" in a.reason


def test_errors_the_stable_group_makes_as_often_are_not_the_canarys() -> None:
    # Clients sending bad requests fail on both versions alike.
    a = judge(CHECKS, stats(100, 10), stats(400, 36), seconds=60, now=1.0)
    assert a.verdict == "pass", a.reason


def test_a_canary_five_times_slower_fails_on_time_to_first_token() -> None:
    a = judge(CHECKS, stats(50, ttft=0.5), stats(200, ttft=0.1), seconds=60, now=1.0)
    assert a.verdict == "fail" and "p95 time to first token" in a.reason and "2 x stable" in a.reason


def test_a_slower_inter_token_latency_fails_and_whole_answers_are_not_compared_on_it() -> None:
    a = judge(CHECKS, stats(50, itl=0.2), stats(200, itl=0.02), seconds=60, now=1.0)
    assert a.verdict == "fail" and "inter-token latency" in a.reason
    a = judge(CHECKS, stats(50, itl=None), stats(200, itl=0.02), seconds=60, now=1.0)
    assert a.verdict == "pass"


def rollout(**kw) -> Rollout:
    return Rollout(**{"model": "m", "target": "new", "stable": "old", "strategy": "canary", "phase": Phase.CANARY,
                      "started_at": 0.0, "step_since": 0.0, "canary": "m-g9", **kw})


def test_steps_advance_after_their_interval_then_promote() -> None:
    good = Windows(stats(30), stats(300))
    r = rollout()
    assert advance(r, CANARY, windows=good, canary_ready=True, canary_failed=None, now=10.0).rollout == r
    s = advance(r, CANARY, windows=good, canary_ready=True, canary_failed=None, now=31.0)
    assert s.rollout.step == 1 and s.rollout.step_since == 31.0 and s.new_step
    assert s.rollout.percent(CANARY) == 50.0 and s.events[0][0] == "rollout-step"
    s = advance(s.rollout, CANARY, windows=good, canary_ready=True, canary_failed=None, now=62.0)
    assert s.rollout.phase == Phase.PROMOTING and s.events[0][0] == "rollout-promoted"
    assert len(s.rollout.history) == 2 and s.rollout.percent(CANARY) == 0.0


def test_a_failed_check_rolls_back_with_its_reason() -> None:
    s = advance(rollout(), CANARY, windows=Windows(stats(40, 20), stats(300)), canary_ready=True,
                canary_failed=None, now=31.0)
    assert s.rollout.phase == Phase.ROLLED_BACK and s.rollout.canary is None
    assert "canary error rate 50.0 %" in s.rollout.reason and s.events[0][0] == "rollout-rolled-back"


def test_a_canary_that_cannot_start_rolls_back_and_time_loading_is_not_judged() -> None:
    s = advance(rollout(), CANARY, windows=Windows(), canary_ready=False, canary_failed=None, now=500.0)
    assert s.rollout.phase == Phase.CANARY and s.rollout.step_since == 500.0
    s = advance(rollout(), CANARY, windows=Windows(), canary_ready=False, canary_failed="exited with code 1",
                now=500.0)
    assert s.rollout.phase == Phase.ROLLED_BACK and s.rollout.reason == "canary failed: exited with code 1"


def test_rollout_records_round_trip() -> None:
    s = advance(rollout(), CANARY, windows=Windows(stats(30), stats(300)), canary_ready=True, canary_failed=None,
                now=31.0)
    assert Rollout.from_json(s.rollout.to_json()) == s.rollout


# --- decide(): canaries and replacements --------------------------------------------------------
NEW = replace(M, profiles=(replace(M.profiles[0], args=("--new",)),))


def scaled(m, n: int, policy: RolloutPolicy = CANARY):
    return replace(m, scaling=Scaling(min=n, max=n), rollout=policy)


def run(models, inv, reps, *, canaries=None, notes=None):
    return decide(Catalog(models=tuple(models)), inv, reps, last_used={}, demand={}, now=100.0,
                  canaries=canaries, canary_notes=notes)


def test_a_canary_is_placed_beside_the_stable_replicas_when_there_is_room() -> None:
    old = scaled(M, 2)
    reps = [replica("m-g1", old), replica("m-g2", old, gpu=1)]
    d = run([old], inventory(node("a", gpus=3)), reps, canaries={"m": CanaryWant(spec=scaled(NEW, 2))})
    assert d.stop == ()
    assert [(c.canary, c.placement.shards[0].gpus) for c in d.create] == [(True, (2,))]


def test_stable_replicas_are_not_replaced_while_the_canary_is_judged() -> None:
    old = scaled(M, 2)
    canary = replica("m-g3", scaled(NEW, 2), gpu=2, canary=True)
    reps = [replica("m-g1", old), replica("m-g2", old, gpu=1), canary]
    d = run([old], inventory(node("a", gpus=3)), reps, canaries={"m": CanaryWant(spec=scaled(NEW, 2))})
    assert d.stop == () and d.create == ()


def test_with_no_room_a_stable_replica_makes_room_for_the_canary_and_is_not_put_back() -> None:
    old = scaled(M, 2)
    reps = [replica("m-g1", old), replica("m-g2", old, gpu=1)]
    want = CanaryWant(spec=scaled(NEW, 2))
    d = run([old], inventory(node("a", gpus=2)), reps, canaries={"m": want})
    assert len(d.stop) == 1 and "making room for the canary" in d.stop[0][1] and d.borrowed == ("m",)
    assert d.create == ()
    # Next tick: the stable replica is stopping; nothing takes its GPU but the canary.
    stopping = [replace(r, state=ReplicaState.STOPPING) if r.id == d.stop[0][0] else r for r in reps]
    d2 = run([old], inventory(node("a", gpus=2)), stopping, canaries={"m": replace(want, borrowed=True)})
    assert d2.create == () and d2.stop == ()
    left = [r for r in stopping if r.state != ReplicaState.STOPPING]
    d3 = run([old], inventory(node("a", gpus=2)), left, canaries={"m": replace(want, borrowed=True)})
    assert [c.canary for c in d3.create] == [True]


def test_the_only_replica_is_not_stopped_for_a_canary() -> None:
    old = scaled(M, 1)
    d = run([old], inventory(node("a", gpus=1)), [replica("m-g1", old)], canaries={"m": CanaryWant(spec=NEW)})
    assert d.stop == () and d.create == ()
    assert d.no_canary_room == {"m": "no room for a canary beside the only replica"}


def test_a_canary_of_a_rollout_that_ended_is_stopped_not_replaced() -> None:
    old = scaled(M, 1)
    reps = [replica("m-g1", old), replica("m-g2", scaled(NEW, 1), gpu=1, canary=True)]
    d = run([old], inventory(node("a", gpus=2)), reps, notes={"m": "rollout rolled-back: canary error rate 30 %"})
    assert d.stop == (("m-g2", "rollout rolled-back: canary error rate 30 %"),)
    assert d.create == ()


REPLACE = RolloutPolicy(strategy="replace", max_surge=1, max_unavailable=1)


def test_a_change_is_replaced_max_surge_at_a_time() -> None:
    old = scaled(M, 3, REPLACE)
    reps = [replica(f"m-g{i}", old, gpu=i) for i in range(3)]
    d = run([scaled(NEW, 3, REPLACE)], inventory(node("a", gpus=8)), reps)
    assert [c.replaces for c in d.create] == ["m-g0"] and d.stop == ()
    surge2 = replace(REPLACE, max_surge=2)
    d = run([scaled(NEW, 3, surge2)], inventory(node("a", gpus=8)), reps)
    assert [c.replaces for c in d.create] == ["m-g0", "m-g1"]


def test_on_a_full_fleet_old_replicas_stop_first_max_unavailable_at_a_time() -> None:
    old = scaled(M, 3, REPLACE)
    reps = [replica(f"m-g{i}", old, gpu=i) for i in range(3)]
    new = scaled(NEW, 3, REPLACE)
    d = run([new], inventory(node("a", gpus=3)), reps)
    assert d.create == () and len(d.stop) == 1 and "max_unavailable 1" in d.stop[0][1]
    assert "no room" in d.unavailable_first["m"]
    # While that one is missing no other old replica stops.
    left = reps[1:]
    d = run([new], inventory(node("a", gpus=3)), left)
    # Its GPU takes a new-version replica (which takes over from the next old one once it serves).
    assert d.stop == () and len(d.create) == 1 and d.create[0].placement.shards[0].gpus == (0,)
    two = replace(REPLACE, max_unavailable=2)
    d = run([scaled(NEW, 3, two)], inventory(node("a", gpus=3)), reps)
    assert len(d.stop) == 2


def test_an_old_replica_is_not_stopped_for_a_version_that_would_not_fit_in_its_place() -> None:
    old = scaled(M, 2, REPLACE)
    reps = [replica("m-g0", old), replica("m-g1", old, gpu=1)]
    huge = scaled(replace(NEW, profiles=(replace(NEW.profiles[0], gpus=4),)), 2, REPLACE)
    d = run([huge], inventory(node("a", gpus=2)), reps)
    assert d.stop == () and "does not fit" in d.unavailable_first["m"]


def test_a_replica_stopped_first_for_its_replacement_is_not_a_prune() -> None:
    from llmgw.plan.guard import judge_prune

    old = scaled(M, 1, REPLACE)
    reps = (replica("m-g0", old),)
    d = run([scaled(NEW, 1, REPLACE)], inventory(node("a", gpus=1)), list(reps))
    assert d.for_rollout == {"m-g0"} and d.stop[0][0] == "m-g0"
    verdict = judge_prune(Catalog(models=(old,)), Catalog(models=(scaled(NEW, 1, REPLACE),)),
                          inventory(node("a", gpus=1)), reps, now=100.0)
    assert not verdict.held and verdict.replicas_stopped == 0


def test_no_step_waits_for_traffic_forever() -> None:
    quiet = Windows(stats(3), stats(300))
    r = rollout()  # its step began at 0; the interval is 30 s, so traffic_timeout defaults to 15 min
    assert CANARY.traffic_wait == 900.0
    waiting = advance(r, CANARY, windows=quiet, canary_ready=True, canary_failed=None, now=899.0)
    assert waiting.rollout.phase == Phase.CANARY and waiting.events == ()
    # The default: rolled back, unjudged (no change goes out without a judgement), saying why.
    s = advance(r, CANARY, windows=quiet, canary_ready=True, canary_failed=None, now=900.0)
    assert s.rollout.phase == Phase.ROLLED_BACK and s.events[0][0] == "rollout-rolled-back"
    assert "saw too few requests to judge within 900 s" in s.rollout.reason
    assert "canary 3, stable 300" in s.rollout.reason and "no traffic" in s.rollout.history[-1]
    promote = replace(CANARY, on_no_traffic="promote", traffic_timeout=60.0)
    s = advance(r, promote, windows=quiet, canary_ready=True, canary_failed=None, now=61.0)
    assert s.rollout.phase == Phase.PROMOTING and "promoted unjudged" in s.events[0][1]
    wait = replace(CANARY, on_no_traffic="wait", traffic_timeout=60.0)
    s = advance(r, wait, windows=quiet, canary_ready=True, canary_failed=None, now=61.0)
    assert s.rollout.phase == Phase.CANARY and s.events[0][0] == "rollout-no-traffic"
    again = advance(s.rollout, wait, windows=quiet, canary_ready=True, canary_failed=None, now=120.0)
    assert again.events == () and again.rollout.history == s.rollout.history  # said once
