"""llmgw.health: what a loop's outcomes add up to (the states status and /healthz show)."""

from __future__ import annotations

from llmgw.health import UNHEALTHY_AFTER, Health, Tracker


def test_a_loop_is_degraded_at_its_first_failure_unhealthy_after_some_in_a_row_and_ok_after_a_good_turn() -> None:
    t = Tracker("reconcile")
    t.ok(10.0)
    assert t.health.state == "ok" and t.health.last_ok == 10.0
    t.failed(11.0, RuntimeError("boom"))
    assert t.health.state == "degraded" and t.health.last_error == "RuntimeError: boom"
    for n in range(2, UNHEALTHY_AFTER + 1):
        t.failed(11.0 + n, KeyError("k"))
    h = t.health
    assert (h.state, h.consecutive_failures, h.failures) == ("unhealthy", UNHEALTHY_AFTER, UNHEALTHY_AFTER)
    assert h.last_ok == 10.0
    assert h.last_error == "KeyError: 'k'"
    t.ok(20.0)
    assert (t.health.state, t.health.consecutive_failures, t.health.failures) == ("ok", 0, UNHEALTHY_AFTER)


def test_only_a_critical_loop_makes_the_controller_unfit_and_every_failing_loop_is_said() -> None:
    remote, tick = Tracker("git-sync", critical=False), Tracker("reconcile")
    for _ in range(UNHEALTHY_AFTER):
        remote.failed(1.0, "fetch: could not read from remote")
    health = Health.of([remote, tick])
    assert health.state == "unhealthy" and health.fit  # the remote's trouble, not the process's
    assert health.problems() == [f"git-sync unhealthy: failed {UNHEALTHY_AFTER} times in a row: "
                                 "fetch: could not read from remote"]
    for _ in range(UNHEALTHY_AFTER):
        tick.failed(2.0, ValueError("bad"))
    assert not Health.of([remote, tick]).fit
    assert Health.of([]).state == "ok" and Health.of([]).fit


def test_a_token_in_an_error_never_reaches_what_the_health_shows() -> None:
    t = Tracker("git-sync", critical=False)
    t.failed(1.0, "fetch: fatal: unable to access 'https://oauth2:glpat-SECRET@git.example/c.git/'")
    assert "SECRET" not in (t.health.last_error or "") and "git.example" in (t.health.last_error or "")
    assert "SECRET" not in str(Health.of([t]).to_json())
