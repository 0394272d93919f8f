"""The rules every bench keeps (DESIGN §8, issue 29), checked without running the heavy peers:
each offers ``--quick``; its exit status is its verdict (several exited 0 whatever it was); the
order of a round rotates; and the soak counts as "left" only what its client hung up on (a
stream the router cut before the client's third event was counted as left). Issue 35: a verdict
fails for the right reason, so a goal whose figures are missing is not met, and a placement
pass is judged on what it placed, not only on how fast it was."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

BENCH = Path(__file__).resolve().parent.parent / "bench"
BENCHES = sorted(p.name for p in BENCH.glob("*_bench.py"))


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bench", BENCHES)
def test_every_bench_offers_quick(bench: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH / bench), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["placement_bench.py", "--quick"],
                                  ["sim_bench.py", "--quick", "--rounds", "1"],
                                  ["gitops_bench.py", "--quick"]], ids=["placement", "sim", "gitops"])
def test_a_bench_exits_with_its_verdict(argv: list[str]) -> None:
    """Benches cheap enough to run here: the last line is the JSON verdict, and the exit status
    says the same (1 when not met). Required, never skipped: sim_bench needs wrk and taskset,
    which CI installs (.ci/run)."""
    if argv[0] == "sim_bench.py" and not (shutil.which("wrk") and shutil.which("taskset")):
        pytest.fail("sim_bench needs wrk and taskset: apt-get install -y wrk util-linux")
    out = subprocess.run([sys.executable, str(BENCH / argv[0]), *argv[1:]], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip(), (out.returncode, out.stderr[-2000:])
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"bench", "goal", "met"} <= verdict.keys()
    assert out.returncode == (0 if verdict["met"] is True else 1), (out.returncode, verdict, out.stderr[-2000:])


# --- verdicts that fail for the right reason (issue 35) ------------------------------------------

def run_placement(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                  decide: Callable[..., Any]) -> tuple[int, dict]:
    """placement_bench --quick with ``decide`` for the pass, on a clock where every pass takes 1 ms:
    its verdict then hangs on what was placed alone, however fast this machine is."""
    bench = load("placement_bench")
    monkeypatch.setattr(bench, "decide", decide)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=itertools.count(0.0, 0.001).__next__))
    code = bench.main(["--quick"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_placement_bench_is_met_when_every_replica_with_room_is_placed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from llmgw.decide.tick import decide

    code, verdict = run_placement(monkeypatch, capsys, decide)
    assert (code, verdict["met"]) == (0, True), verdict
    # 100 nodes cannot hold the catalog (800 GPUs of 2,250): that fleet ends full, not short.
    assert verdict["placed_100_nodes"] < verdict["replicas_wanted"] and verdict["free_gpus_100_nodes"] == 0
    assert verdict["placed_1000_nodes"] == verdict["placed_10000_nodes"] == verdict["replicas_wanted"]


def test_a_placement_pass_that_places_nothing_meets_no_goal(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing to place is the fastest pass there is: without the count it met every goal."""
    from llmgw.decide.tick import Decisions

    code, verdict = run_placement(monkeypatch, capsys, lambda *_a, **_k: Decisions())
    assert (code, verdict["met"]) == (1, False)
    assert verdict["placed_1000_nodes"] == 0 and verdict["placeable_left_out_1000_nodes"] == verdict["replicas_wanted"]
    assert verdict["placeable_left_out_100_nodes"] == verdict["replicas_wanted"]  # 800 GPUs free
    assert verdict["steady_replicas"] == 0


def test_a_replica_dropped_without_a_word_where_there_is_room_fails_the_placement_bench(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The pass is checked against the catalog, not against what it says it left unplaced."""
    from llmgw.decide.tick import decide

    def one_short(*args: Any, **kwargs: Any) -> Any:
        d = decide(*args, **kwargs)
        return dataclasses.replace(d, create=d.create[:-1]) if not args[2] else d  # from an empty fleet only

    code, verdict = run_placement(monkeypatch, capsys, one_short)
    assert (code, verdict["met"]) == (1, False)
    assert verdict["placed_1000_nodes"] == verdict["replicas_wanted"] - 1
    assert verdict["placeable_left_out_1000_nodes"] == 1 and verdict["placeable_left_out_10000_nodes"] == 1


def conversations(one: tuple[float, float], two: tuple[float, float] | None = None) -> dict[str, object]:
    """prefix_bench's mean TTFT figures of the conversations, (prefix, least-outstanding) per client count."""
    out: dict[str, object] = {}
    for n, pair in ((1, one), (2, two)):
        if pair is not None:
            out[f"conversations_{n}c_prefix_mean_ttft_s"] = pair[0]
            out[f"conversations_{n}c_least_outstanding_mean_ttft_s"] = pair[1]
    return out


ONE_CLIENT = "conversations, 1 client: prefix mean TTFT (turns 2+) >= 3x lower than least-outstanding"
TWO_CLIENTS = "conversations, 2 clients: prefix mean TTFT (turns 2+) no higher than least-outstanding"
UNIQUE = "unique: prefix mean TTFT within 1.1x of least-outstanding"


def test_a_prefix_goal_without_its_figures_is_not_met() -> None:
    """A check whose ratio was missing used to be dropped, so the goals left decided alone."""
    judge = load("prefix_bench").judge
    assert judge(conversations((0.1, 0.5), (0.2, 0.3)), ["conversations"], [1, 2]) == (
        {ONE_CLIENT: True, TWO_CLIENTS: True}, [])
    # The two-client run never happened (--clients 1): its goal is not met, and named.
    out = conversations((0.1, 0.5))
    assert judge(out, ["conversations"], [1]) == ({ONE_CLIENT: True, TWO_CLIENTS: False}, [TWO_CLIENTS])
    assert out["conversations_2c_mean_speedup_vs_least_outstanding"] is None
    # A prefix TTFT of 0 (nothing measured) has no ratio either.
    assert judge(conversations((0.0, 0.5), (0.2, 0.3)), ["conversations"], [1, 2]) == (
        {ONE_CLIENT: False, TWO_CLIENTS: True}, [ONE_CLIENT])
    # Every workload run brings its goals: figures of the unique prompts missing fail the verdict.
    assert judge(conversations((0.1, 0.5), (0.2, 0.3)), ["conversations", "unique"], [1, 2]) == (
        {ONE_CLIENT: True, TWO_CLIENTS: True, UNIQUE: False}, [UNIQUE])


def test_the_router_bench_order_rotates() -> None:
    router_bench = load("router_bench")
    targets = [router_bench.Target(name, 0, Path("x")) for name in ("direct", "llmgw", "bare", "litellm")]
    orders = [[t.name for t in router_bench.rotated(targets, r)] for r in range(4)]
    for position in range(4):
        assert sorted(order[position] for order in orders) == sorted(t.name for t in targets)


def router_round(litellm_rps: float) -> dict[str, dict]:
    """One round of router_bench's figures in which llmgw meets every goal against LiteLLM's rate."""
    def target(rps: float, c1_ms: float | None = None) -> dict:
        fig = {"c32_rps": rps, "c32_p50_ms": 5.0, "c32_p99_ms": 9.0, "errors": 0}
        if c1_ms is not None:
            fig.update(c1_p50_ms=c1_ms, c1_p99_ms=c1_ms * 2, c1_rps=1000 / c1_ms, ttfb_ms=c1_ms)
        return fig

    return {"direct": target(9000, 0.1), "llmgw": target(4000, 0.5), "bare": target(4200),
            "litellm": target(litellm_rps, 30.0), "llmgw-prefix": target(3500), "bare-long": target(3600),
            "litellm-long": target(litellm_rps)}


def test_a_round_where_the_peer_served_nothing_leaves_the_router_goal_unmet(capsys: pytest.CaptureFixture[str]) -> None:
    """Dropping that round (as the first rewrite did) let the peer's one lucky round decide."""
    router_bench = load("router_bench")
    assert router_bench.report([router_round(50), router_round(50), router_round(50)], "installed", True, 1.0) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["met"] is True
    assert router_bench.report([router_round(0), router_round(50), router_round(0)], "installed", True, 1.0) == 1
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["met"] is False and verdict["llmgw_vs_litellm_rps"] is None


# --- the soak's tally ----------------------------------------------------------------------------

def test_an_error_the_killed_engine_does_not_explain_fails_the_soak(tmp_path: Path) -> None:
    soak = load("soak_bench")
    tally = soak.Tally()
    tally.stopped_at, tally.killed_at = 100.0, 100.5
    tally.answered_errors = [(100.2, "on-the-killed-engine"), (101.0, "cut-at-the-kill"), (99.0, "logged-there"),
                             (200.0, "refused-long-after")]
    log = tmp_path / "killed.log"
    log.write_text("logged-there\n")
    assert soak.unexplained_errors(tally, log) == ["refused-long-after"]
    # Nothing killed (the warm-up): every error is unexplained.
    calm = soak.Tally()
    calm.answered_errors = [(1.0, "a")]
    assert soak.unexplained_errors(calm, tmp_path / "none.log") == ["a"]


class Always:
    """A random source whose every draw says "this client leaves"."""

    def random(self) -> float:
        return 0.0


async def serve(events: int, done: bool) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(events):
            await out.write(f'data: {{"choices": [{{"delta": {{"content": "{i}"}}}}]}}\n\n'.encode())
        if done:
            await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def one_streaming_client(events: int, done: bool, tmp: Path) -> tuple[int, int, int]:
    """(sent, left, lost) of the soak's streaming client, which always means to leave after its
    third event, against a server streaming ``events`` events (then ``[DONE]`` if ``done``)."""
    soak = load("soak_bench")
    runner, url = await serve(events, done)
    try:
        tally = soak.Tally()
        client = soak.Soak(url, url, "token", tally, "t", tmp)
        async with aiohttp.ClientSession() as session:
            while tally.sent == 0:  # one request: the client checks its deadline before each
                client.stop_at = time.monotonic() + 1e-6
                await client.stream_client(session, Always())
        return tally.sent, tally.left, tally.lost
    finally:
        await runner.cleanup()


def test_a_stream_cut_before_the_client_leaves_is_lost_not_left(tmp_path: Path) -> None:
    sent, left, lost = asyncio.run(one_streaming_client(1, False, tmp_path))
    assert (left, lost) == (0, sent)


def test_a_stream_the_client_hangs_up_on_is_left(tmp_path: Path) -> None:
    sent, left, lost = asyncio.run(one_streaming_client(10, True, tmp_path))
    assert (left, lost) == (sent, 0)


def test_usage_bench_abort_checks_are_not_met_with_nothing_aborted() -> None:
    judge = load("usage_bench").judge
    acc = {"tokens_ledger_vs_clients_diff": 0, "tokens_ledger_vs_engines_diff": 0, "aborted": 40,
           "aborted_tokens_client_read": 100, "aborted_tokens_ledger": 110, "aborted_tokens_engine_wrote": 120,
           "aborted_counted_from_stream": 0, "capped_overshoot": 0, "one_reservation": 50,
           "refused_429": {"alpha": 0, "beta": 0, "capped": 3}, "errors": 0, "usage_leaks": 0}
    cost = {"cost_errors": 0, "redis_calls_per_request": 0.01, "on_vs_off": 0.95}
    assert all(judge(acc, cost).values())
    nothing_cut = judge({**acc, "aborted": 0, "aborted_tokens_client_read": 0, "aborted_tokens_ledger": 0,
                         "aborted_tokens_engine_wrote": 0}, cost)
    assert [k for k, ok in nothing_cut.items() if not ok] == [
        "aborted: client read <= ledger <= engine wrote", "aborted: each charged the engine's own count"]
    estimated = judge({**acc, "aborted_counted_from_stream": 3}, cost)
    assert estimated["aborted: each charged the engine's own count"] is False
    no_redis = judge(acc, {**cost, "redis_calls_per_request": 0})
    assert no_redis["cost run: Redis on the path (limits on)"] is False


def test_ha_bench_verdict_fails_on_a_slow_graceful_stop_lost_usage_or_a_missing_figure() -> None:
    ha = load("ha_bench")
    zero = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    usage = {"clients": {"requests": 10, "prompt_tokens": 30, "completion_tokens": 80},
             "ledger": {"requests": 10, "prompt_tokens": 30, "completion_tokens": 80}, "lost": zero, "doubled": zero}

    def rnd(how: str, takeover: float | None) -> dict:
        return {"how": how, "takeover_s": takeover, "led_s": takeover, "node_leases_s": 4.0, "engines_restarted": 0}

    pg = {"rounds": [rnd("kill", 4.1), rnd("kill", 4.6), rnd("kill", 4.0), rnd("graceful", 0.4)],
          "failed_total": 0, "usage": usage}
    sqlite = {"rounds": [rnd("restore", 2.6)], "failed_total": 0, "usage": usage}
    good = ha.figures(pg, sqlite, kills=3, graceful=1, restores=1)
    checks, missing = ha.judge(good)
    assert all(checks.values()) and missing == []
    slow = ha.figures({**pg, "rounds": [*pg["rounds"][:3], rnd("graceful", 10.3)]}, sqlite, kills=3, graceful=1,
                      restores=1)
    assert [k for k, ok in ha.judge(slow)[0].items() if not ok] == ["pg graceful: takeover p99 <= 1.0 s"]
    lost = {**usage, "lost": {**zero, "requests": 152}}
    assert ha.judge(ha.figures(pg, {**sqlite, "usage": lost}, kills=3, graceful=1, restores=1))[0][
        "sqlite restore: 0 usage lost"] is False
    unseen = ha.figures({**pg, "rounds": [rnd("kill", None), *pg["rounds"][1:]]}, None, kills=3, graceful=1,
                        restores=1)
    checks, missing = ha.judge(unseen)
    assert "pg_kill_takeover_p99_s" in missing and "sqlite_failed_requests" in missing
    assert checks["pg kill -9: takeover p99 <= 6.0 s"] is False
    assert ha.judge(ha.figures(pg, sqlite, kills=10, graceful=1, restores=1))[0][
        "pg: >= 10 kill -9 rounds measured"] is False


def test_sim_bench_without_wrk_still_ends_with_its_verdict_not_met(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("sim_bench")
    monkeypatch.setattr(bench.shutil, "which", lambda _name: None)
    assert bench.main(["--quick"]) == 1
    verdict = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert verdict["met"] is False and verdict["not_measured"]


def _bad(change: str, *, hostile: bool = False, canary: dict[str, int] | None = None,
         replace: dict[str, int] | None = None, outcome: str = "rollout-rolled-back") -> dict[str, Any]:
    zero = {"failed": 0, "slow": 0, "wrong": 0, "requests": 100}
    return {"change": change, "hostile": hostile, "canary": {**zero, **(canary or {})},
            "replace": {**zero, **(replace or {})}, "canary_outcome": outcome, "canary_reason": "r",
            "rollback_to_left_s": 0.1, "commit_to_rollback_s": 4.0}


def test_rollout_bench_verdict_per_kind_wrong_answers_and_false_rollbacks() -> None:
    """Issue 37: a wrong answer a canary client got, a kind the canary let through, or one good
    change rolled back fails the bench; the wrong kind is judged on answers, not on failures."""
    rb = load("rollout_bench")
    good = [{"canary_failed": 0, "canary_outcome": "rollout-done", "canary_reason": ""} for _ in range(20)]
    res = {"bad": [_bad("fail", hostile=True, replace={"failed": 40}),
                   _bad("wrong", replace={"wrong": 30}),
                   _bad("decode", canary={"slow": 1}, replace={"slow": 50})], "good": good}
    s = rb.summarize(res)
    assert s["fail hostile"]["met"] and s["wrong"]["met"] and s["decode"]["met"]
    assert s["false_rollback_rate"] == 0.0 and s["good_promoted_every_run"]
    res["bad"][1] = _bad("wrong", canary={"wrong": 1}, replace={"wrong": 30})  # one client heard the canary
    assert not rb.summarize(res)["wrong"]["met"]
    res["bad"][2] = _bad("decode", canary={"slow": 20}, replace={"slow": 50}, outcome="rollout-done")  # promoted
    s = rb.summarize(res)
    assert not s["decode"]["met"] and not s["decode"]["rolled_back_every_run"]
    good[3] = {"canary_failed": 0, "canary_outcome": "rollout-rolled-back", "canary_reason": "noise"}
    s = rb.summarize({**res, "good": good})
    assert s["false_rollback_rate"] == 0.05 and not s["good_promoted_every_run"] and s["good_rolled_back"] == ["noise"]


def test_rollout_bench_good_change_with_hostile_clients_must_be_made_and_clean() -> None:
    """Issue 37: the good change made while the hostile clients send junk is promoted with 0 failed
    legitimate requests; none made at all is not met either."""
    rb = load("rollout_bench")
    good = [{"canary_failed": 0, "canary_outcome": "rollout-done", "canary_reason": "", "hostile": i == 0}
            for i in range(20)]
    res = {"bad": [_bad("fail", hostile=True, replace={"failed": 40})], "good": good}
    s = rb.summarize(res)
    assert s["good_hostile_runs"] == 1 and s["good_hostile_met"]
    assert not rb.summarize({**res, "good": [{**g, "hostile": False} for g in good]})["good_hostile_met"]
    good[0] = {**good[0], "canary_failed": 2}  # a legitimate client failed beside the hostile ones
    assert not rb.summarize(res)["good_hostile_met"]
    good[0] = {**good[0], "canary_failed": 0, "canary_outcome": "rollout-rolled-back", "canary_reason": "junk"}
    s = rb.summarize(res)
    assert not s["good_hostile_met"] and s["false_rollback_rate"] == 0.05


def test_rollout_bench_knows_a_wrong_answer_as_the_simulator_writes_it() -> None:
    rb = load("rollout_bench")
    from tests.e2e.rollout_fleet import Outcome

    asked = (("user", "hello #1"),)
    right = rb.sim_text(asked, rb.LOAD_TOKENS)
    other = rb.sim_text(asked, rb.LOAD_TOKENS, "other")
    assert right != other
    assert rb.wrong(Outcome(0, 1, None, other, asked)) and not rb.wrong(Outcome(0, 1, None, right, asked))


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")
def test_budget_bench_quick_holds_each_budget_and_says_so_last() -> None:
    """Not a speed: whether a budget holds with Redis away (routers restarted) and emptied."""
    out = subprocess.run([sys.executable, str(BENCH / "budget_bench.py"), "--quick"], capture_output=True, text=True,
                         timeout=240)
    verdict = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and verdict["met"], out.stdout[-2000:] + out.stderr[-2000:]
    for case in ("away", "emptied"):
        c = verdict[case]
        assert c["served"] <= c["budget"] + c["routers"] * verdict["reservation"], c
    assert verdict["away"]["during"][-1] == 0  # a router restarted while Redis is away grants nothing
