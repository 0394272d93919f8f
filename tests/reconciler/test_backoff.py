"""next_failure(): how many failures in a row, how long until the next start, a crash loop, and
when a replica that served long enough starts its count afresh (the boundary included)."""

from __future__ import annotations

from dataclasses import replace

from llmgw.decide.replica import Backoff, ReplicaState, next_failure
from tests.reconciler.test_decide import replica

POLICY = Backoff(base=2.0, cap=120.0, reset_after=600.0, crash_loop_after=5)


def test_the_delay_doubles_up_to_its_cap_and_the_fifth_failure_is_a_crash_loop() -> None:
    r = replica("m-g1", state=ReplicaState.STARTING)
    seen = []
    for n in range(8):
        f = next_failure(replace(r, failures=n), 100.0, POLICY)
        seen.append((f.count, f.delay, f.crash_loop))
    assert seen == [(1, 2.0, False), (2, 4.0, False), (3, 8.0, False), (4, 16.0, False), (5, 32.0, True),
                    (6, 64.0, True), (7, 120.0, True), (8, 120.0, True)]


def test_a_replica_that_served_reset_after_seconds_starts_its_count_afresh() -> None:
    served = replica("m-g1", state=ReplicaState.READY, ready_since=1000.0, failures=4)
    at_boundary = next_failure(served, 1600.0, POLICY)
    assert (at_boundary.count, at_boundary.forgot, at_boundary.ran) == (1, True, 600.0)
    just_before = next_failure(served, 1599.9, POLICY)
    assert (just_before.count, just_before.forgot, just_before.crash_loop) == (5, False, True)


def test_only_time_serving_counts() -> None:
    # Starting for an hour is not serving: the count goes on.
    starting = replica("m-g1", state=ReplicaState.STARTING, ready_since=0.0, failures=2)
    f = next_failure(starting, 10_000.0, POLICY)
    assert (f.count, f.forgot, f.ran) == (3, False, 0.0)
    # A first failure has nothing to forget.
    fresh = replica("m-g1", state=ReplicaState.READY, ready_since=0.0, failures=0)
    assert next_failure(fresh, 10_000.0, POLICY).forgot is False
