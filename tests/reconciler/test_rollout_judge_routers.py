"""A canary step judged when one router may lie (issue 41): all routers' figures together, and each
router's alone. A router holding a stolen credential can report whatever it likes; it can hold a
change back (and is named when it does), never push one through over what the others measured.
Without I/O: decide.rollout's judge_routers and advance, and verify for a change without a canary."""

from __future__ import annotations

from llmgw.contract import ReplicaStats
from llmgw.decide.rollout import Phase, Windows, advance, by_router, judge, judge_routers, verify
from tests.reconciler.test_rollout_decide import CANARY, CHECKS, rollout, stats

HONEST, FORGED = "edge-1", "edge-2"  # routers, as the controller names them (by credential)


def windows(**routers: Windows) -> Windows:
    """All routers' figures together, and each one's."""
    canary, stable = ReplicaStats(), ReplicaStats()
    for w in routers.values():
        canary, stable = canary + w.canary, stable + w.stable
    return Windows(canary, stable, routers)


def step(w: Windows) -> tuple[Phase, str, list[tuple[str, str]]]:
    """A step judged at the end of its interval: the phase after it, its reason, its events."""
    s = advance(rollout(), CANARY, windows=w, canary_ready=True, canary_failed=None, now=31.0)
    return s.rollout.phase, s.rollout.reason, list(s.events)


def pooled_only(w: Windows) -> str:
    """The verdict before issue 41: every router's figures pooled."""
    return judge(CHECKS, w.canary, w.stable, seconds=31, now=31.0).verdict


def test_a_router_reporting_ten_times_as_many_good_requests_does_not_hide_another_routers_errors() -> None:
    w = windows(**{HONEST: Windows(stats(60, 18), stats(600)),  # 30 % of the canary's requests fail
                   FORGED: Windows(stats(600), stats(6000))})
    assert pooled_only(w) == "pass"  # diluted: 18 errors in 660 requests is within noise of 2 %
    phase, reason, events = step(w)
    assert phase == Phase.ROLLED_BACK
    assert reason.startswith(f"measured by router {HONEST}: canary error rate 30.0 % > stable 0.0 % + 2 % "
                             "over 31 s, 60 canary requests"), reason
    assert reason.endswith("; all routers' figures together pass")
    assert FORGED not in reason
    assert events == [("rollout-rolled-back", f"m: rolled back: {reason}")]


def test_a_router_reporting_fast_decode_does_not_hide_another_routers_slow_decode() -> None:
    # Twenty times as many (at ten, the honest router's slow tokens are still over 5 % of all).
    w = windows(**{HONEST: Windows(stats(60, itl=0.2), stats(600, itl=0.02)),
                   FORGED: Windows(stats(1200, itl=0.02), stats(6000, itl=0.02))})
    assert pooled_only(w) == "pass"
    phase, reason, _ = step(w)
    assert phase == Phase.ROLLED_BACK
    assert reason.startswith(f"measured by router {HONEST}: canary p95 inter-token latency 212 ms > 2 x stable 23 ms "
                             "(60 of 60 slower than 47 ms)"), reason


def test_a_router_reporting_a_dreadful_stable_group_does_not_make_a_bad_canary_pass() -> None:
    # The forged router sends the canary nothing; it makes the stable group look as bad (40 %).
    w = windows(**{HONEST: Windows(stats(60, 18), stats(600, 6)),
                   FORGED: Windows(ReplicaStats(), stats(6000, 2400))})
    assert pooled_only(w) == "pass"  # 30 % against a pooled stable 36 %
    phase, reason, _ = step(w)
    assert phase == Phase.ROLLED_BACK
    assert reason.startswith(f"measured by router {HONEST}: canary error rate 30.0 % > stable 1.0 % + 2 %"), reason


def test_a_router_reporting_errors_on_a_good_canary_holds_it_back_and_is_named() -> None:
    """The bound: a lying router can make a step fail, and the rollback names it."""
    good = Windows(stats(60), stats(600))
    for forged in (Windows(stats(100, 50), stats(100)),
                   Windows(stats(100, 50), ReplicaStats())):  # no stable group of its own: judged against all
        phase, reason, events = step(windows(**{HONEST: good, FORGED: forged}))
        assert phase == Phase.ROLLED_BACK
        # All routers' figures fail too; that headline stays, and the router whose own figures fail follows.
        assert reason.startswith("canary error rate 31.2 % > stable 0.0 % + 2 % over 31 s, 160 canary requests; "
                                 f"measured by router {FORGED}: canary error rate 50.0 %"), reason
        assert HONEST not in reason and FORGED in events[0][1]


def test_a_router_with_too_few_canary_requests_is_judged_only_with_the_others() -> None:
    # A router that saw a handful of canary requests fail is no evidence alone (noise at min_requests).
    w = windows(**{HONEST: Windows(stats(200), stats(2000)), FORGED: Windows(stats(10, 5), stats(100))})
    assert judge_routers(CHECKS, w, seconds=31, now=31.0).verdict == "pass"
    assert step(w)[0] == Phase.CANARY


def test_one_router_is_judged_exactly_as_before() -> None:
    """A single router (the controller's own, or one standalone): the verdict and the words are the
    pooled ones, with no router named."""
    for canary, stable in ((stats(60), stats(600)), (stats(60, 18), stats(600)), (stats(5), stats(600)),
                           (stats(60, ttft=0.5), stats(600))):
        one = windows(**{HONEST: Windows(canary, stable)})
        assert judge_routers(CHECKS, one, seconds=31, now=31.0) == judge(CHECKS, canary, stable, seconds=31, now=31.0)
        assert judge_routers(CHECKS, Windows(canary, stable), seconds=31, now=31.0) == \
            judge(CHECKS, canary, stable, seconds=31, now=31.0)


def test_routers_agreeing_pass_together() -> None:
    w = windows(**{HONEST: Windows(stats(60), stats(600)), FORGED: Windows(stats(80), stats(700)),
                   "edge-3": Windows(stats(30, 1), stats(300, 2))})
    a = judge_routers(CHECKS, w, seconds=31, now=31.0)
    assert a == judge(CHECKS, w.canary, w.stable, seconds=31, now=31.0) and a.verdict == "pass"
    assert by_router(w) == [(FORGED, 80, 700), (HONEST, 60, 600), ("edge-3", 30, 300)]


def test_a_change_without_a_canary_is_judged_per_router_against_the_old_versions_figures() -> None:
    before = stats(300).to_json()
    r = rollout(phase=Phase.PROMOTING, before=before, verifying=True, step_since=0.0)
    w = windows(**{HONEST: Windows(stats(60, 18), ReplicaStats()), FORGED: Windows(stats(600), ReplicaStats())})
    s = verify(r, CANARY, window=w, now=31.0)
    assert s.rollout.phase == Phase.ROLLED_BACK
    assert f"measured by router {HONEST}: canary error rate 30.0 %" in s.rollout.reason


def test_routers_each_too_small_to_judge_alone_are_not_outvoted_by_one_big_one() -> None:
    """helper-29's case: four honest routers each saw 15 canary requests fail (too few to judge
    one alone); one router reports 20,000 good ones. All but that router, together, fail the step,
    and the reason names the router whose figures hid it."""
    honest = {f"edge-{i}": Windows(stats(15, 15), stats(150)) for i in range(1, 5)}
    w = windows(**honest, forged=Windows(stats(20_000), stats(20_000)))
    assert pooled_only(w) == "pass"  # 60 errors in 20,060 requests
    phase, reason, _events = step(w)
    assert phase == Phase.ROLLED_BACK
    assert reason.startswith("without router forged's figures (20000 canary requests): canary error rate 100.0 %"), \
        reason
    # Without it the honest ones are judged as they would be alone together: the same failure.
    assert judge(CHECKS, windows(**honest).canary, windows(**honest).stable, seconds=31, now=31.0).verdict == "fail"
