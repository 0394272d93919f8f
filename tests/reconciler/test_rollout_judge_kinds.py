"""Each figure measures one thing (issue 37), judged with the catalog's default checks (pure).

Seen from outside: a version failing 25 % of what it served was promoted once one client flooded
both groups with requests every version refuses (every engine 4xx counted as the replica's error,
diluting the difference); whole answers filed as time to first token hid a canary 28x slower to
its first token; a canary three times slower between tokens passed, the latency floor (25 ms)
being a whole token's time. Each case here is the stats a router would report for it, through
ReplicaStats.observe as the router calls it; and the good change is not rolled back for noise.
"""

from __future__ import annotations

import random

from llmgw.catalog import RolloutPolicy
from llmgw.contract import ReplicaStats
from llmgw.decide.rollout import judge

CHECKS = RolloutPolicy(strategy="canary").checks  # 2 % points, 2x, 2x, 20 requests


def group(*, served: int, errors: int = 0, refused: int = 0, ttft: float | None = 0.02, itl: float | None = 0.02,
          whole: int = 0, tpot: float = 0.02, rng: random.Random | None = None) -> ReplicaStats:
    """``served`` streams (``errors`` of them failed), ``whole`` whole answers, ``refused`` 4xx."""
    rng = rng or random.Random(37)
    s = ReplicaStats()
    for i in range(served):
        if i < errors:
            s.observe(error=True)
        else:
            jitter = rng.lognormvariate(0, 0.2)
            s.observe(error=False, ttft=None if ttft is None else ttft * jitter,
                      itl=None if itl is None else itl * rng.lognormvariate(0, 0.2))
    for _ in range(whole):
        s.observe(error=False, tpot=tpot * rng.lognormvariate(0, 0.2))
    for _ in range(refused):
        s.observe(error=False, refused=True)
    return s


def verdict(canary: ReplicaStats, stable: ReplicaStats) -> tuple[str, str]:
    a = judge(CHECKS, canary, stable, seconds=60, now=0)
    return a.verdict, a.reason


def test_a_flood_of_requests_every_version_refuses_does_not_hide_a_broken_version() -> None:
    # 25 % of what the canary served failed; one client's junk is 93 % of all traffic, alike on both.
    v, why = verdict(group(served=40, errors=10, refused=530), group(served=360, refused=4700))
    assert v == "fail" and "canary error rate 25.0 % > stable 0.0 %" in why, why
    # ...and the junk alone is no traffic: a step waits for requests the versions served.
    v, why = verdict(group(served=5, refused=900), group(served=360, refused=4700))
    assert v == "wait" and "canary 5" in why, why


def test_a_version_that_refuses_what_the_old_one_served_fails_on_its_own_count() -> None:
    v, why = verdict(group(served=60, refused=40), group(served=500))
    assert v == "fail" and "canary refused 40.0 % of requests (4xx) > stable 0.0 %" in why, why
    # Refusals alike on both sides are nobody's finding.
    assert verdict(group(served=60, refused=6), group(served=600, refused=60))[0] == "pass"


def test_long_whole_answers_do_not_hide_a_slow_first_token() -> None:
    # The canary's streams start 28x later; the stable group also serves 80 long whole answers.
    canary = group(served=40, ttft=0.517, whole=8, tpot=0.02)
    stable = group(served=360, ttft=0.018, whole=80, tpot=0.02)
    v, why = verdict(canary, stable)
    assert v == "fail" and "p95 time to first token" in why, why
    assert "time per output token" not in why  # whole answers judged apart, and alike here


def test_a_version_three_times_slower_between_tokens_is_caught() -> None:
    v, why = verdict(group(served=40, itl=0.060), group(served=360, itl=0.020))
    assert v == "fail" and "p95 inter-token latency" in why, why
    # Whole answers are judged per output token the same way.
    v, why = verdict(group(served=40, whole=40, tpot=0.060), group(served=360, whole=360, tpot=0.020))
    assert v == "fail" and "time per output token" in why, why


def test_a_pass_says_every_figure_it_judged() -> None:
    v, why = verdict(group(served=40, whole=10), group(served=360, whole=90))
    assert v == "pass", why
    for words in ("error rate", "refused", "time to first token", "inter-token latency", "decode",
                  "tokens/s", "time per output token"):
        assert words in why, (words, why)


def test_a_good_change_is_rarely_rolled_back_on_its_token_timings() -> None:
    # The same distributions on both sides (20 ms between tokens, jitter as a GPU shows it), the
    # default steps: rolled back in at most 1 % of 400 runs.
    rng = random.Random(3737)
    rolled = 0
    for _ in range(400):
        for pct in (10, 50):
            n = max(CHECKS.min_requests, 4 * pct)
            canary = group(served=n, whole=n // 4, rng=rng)
            stable = group(served=400 - n, whole=(400 - n) // 4, rng=rng)
            if verdict(canary, stable)[0] == "fail":
                rolled += 1
                break
    assert rolled <= 4, rolled
