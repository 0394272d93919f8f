"""Progressive delivery in the router (issue 26): a model's traffic split by weight between its
stable and canary replicas, one version per request, and what the router measures of each
replica (the figures the controller judges a canary by).

The pure choice first, then a real Router in front of two real simulated engines, with the real
openai client as load.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import aiohttp
import openai
import pytest

from llmgw.catalog.model import Catalog
from llmgw.contract import Endpoint, ReplicaStats
from llmgw.engines.testing import SimProcess
from llmgw.router import Router, RouterConfig
from llmgw.router.prefix import PrefixIndex, prompt_key
from llmgw.router.routes import RouteModel
from llmgw.router.table import EMPTY, EndpointTable, build_table, choose
from tests.router.conftest import client, endpoint, serving, sim_metric
from tests.router.fake_controller import model

M = RouteModel("m")
PREFIX = RouteModel("m", routing="prefix")
HELLO = [{"role": "user", "content": "Hello"}]


def hello(i: int) -> list[dict[str, str]]:
    """A conversation's opening of its own: the canary's share is a share of conversations."""
    return [{"role": "user", "content": f"Hello, this is conversation {i}"}]


def canary(ep: Endpoint, percent: float) -> Endpoint:
    return replace(ep, canary=True, canary_percent=percent)


def split_table(percent: float = 25.0, *, stable: int = 2) -> EndpointTable:
    """``stable`` stable replicas s0.. and one canary c, every endpoint carrying the share."""
    eps = [replace(endpoint("m", f"http://s{i}", f"s{i}"), canary_percent=percent) for i in range(stable)]
    return build_table([*eps, canary(endpoint("m", "http://c", "c"), percent)], EMPTY)


def chosen(t: EndpointTable, draw: float, tried: tuple = (), chain: tuple[RouteModel, ...] = (M,)) -> str | None:
    choice = choose(t, chain, 0.0, random.Random(1), tried, draw=draw)
    return None if choice is None else choice[1].replica_id


# --- the choice -------------------------------------------------------------------------------

def test_a_draw_below_the_share_goes_to_the_canary_and_above_it_to_the_stable_replicas() -> None:
    t = split_table(25.0)
    assert chosen(t, 0.0) == "c"
    assert chosen(t, 0.2499) == "c"
    for draw in (0.25, 0.5, 0.999):
        assert chosen(t, draw) in ("s0", "s1")
    assert chosen(t, 1.0) in ("s0", "s1")  # the default draw: never the canary


def test_the_canary_is_not_chosen_by_load_when_the_draw_says_stable() -> None:
    t = split_table(25.0)
    for u in t.upstreams.values():
        if u.replica_id != "c":
            u.inflight = 50  # the stable replicas busy, the canary idle: least-outstanding would pick it
    assert {chosen(t, 0.9) for _ in range(50)} <= {"s0", "s1"}


def test_a_request_whose_track_is_exhausted_goes_to_the_other_track() -> None:
    t = split_table(25.0)
    c, s0, s1 = t.upstreams["c"], t.upstreams["s0"], t.upstreams["s1"]
    # Drawn canary, the canary already tried: the stable replicas serve it.
    assert chosen(t, 0.1, (c,)) in ("s0", "s1")
    # Drawn stable, both stable replicas tried: the canary is the last resort.
    assert chosen(t, 0.9, (s0, s1)) == "c"
    assert chosen(t, 0.9, (s0, s1, c)) is None
    # A canary cooling after a failure: a canary-drawn request goes to a healthy stable replica.
    c.cooldown_until = 10.0
    assert chosen(t, 0.1) in ("s0", "s1")


def test_a_stable_replica_cooling_is_skipped_for_the_other_stable_before_the_canary() -> None:
    t = split_table(25.0)
    t.upstreams["s0"].cooldown_until = 10.0
    assert chosen(t, 0.9) == "s1"
    t.upstreams["s1"].cooldown_until = 10.0
    assert chosen(t, 0.9) == "c"  # healthy anywhere beats cooling


def test_prefix_affinity_works_within_the_drawn_track() -> None:
    t = split_table(25.0, stable=2)
    k = prompt_key({"model": "m", "messages": [{"role": "system", "content": "A long shared document. " * 40}]},
                   chat=True)
    assert k is not None
    c = t.upstreams["c"]
    c.prefixes = PrefixIndex(10_000)
    c.prefixes.record(k.hashes)  # the canary holds the prompt...
    _, up = choose(t, (PREFIX,), 0.0, random.Random(0), (), k, draw=0.9)
    assert up.replica_id in ("s0", "s1")  # ...but a stable-drawn request stays on a stable replica
    up.prefixes = PrefixIndex(10_000)
    up.prefixes.record(k.hashes)
    for _ in range(10):  # and within the track affinity holds
        assert choose(t, (PREFIX,), 0.0, random.Random(), (), k, draw=0.9)[1] is up  # type: ignore[index]
    assert choose(t, (PREFIX,), 0.0, random.Random(), (), k, draw=0.1)[1] is c  # type: ignore[index]


@pytest.mark.parametrize("percent", [0.0, float("nan"), -5.0])
def test_a_canary_with_no_share_gets_no_split(percent: float) -> None:
    t = split_table(percent)
    assert "m" not in t.splits
    # No split: every replica is one pool, least-outstanding as usual (the canary is one of them).
    for u in t.upstreams.values():
        u.inflight = 0 if u.replica_id == "c" else 5
    assert chosen(t, 0.9) == "c"


def test_a_split_with_an_empty_track_sends_everything_to_what_exists() -> None:
    only_canary = build_table([canary(endpoint("m", "http://c", "c"), 25.0)], EMPTY)
    assert "m" not in only_canary.splits
    assert chosen(only_canary, 0.9) == "c"
    only_stable = build_table([replace(endpoint("m", "http://s", "s"), canary_percent=25.0)], EMPTY)
    assert "m" not in only_stable.splits
    assert chosen(only_stable, 0.1) == "s"


def test_a_share_of_100_sends_every_request_to_the_canary_first() -> None:
    t = split_table(100.0)
    assert chosen(t, 0.999) == "c"
    assert chosen(t, 0.999, (t.upstreams["c"],)) in ("s0", "s1")


def test_priorities_hold_within_each_track() -> None:
    eps = [replace(endpoint("m", "http://s0", "s0", priority=0), canary_percent=50.0),
           replace(endpoint("m", "http://s1", "s1", priority=1), canary_percent=50.0),
           canary(endpoint("m", "http://c0", "c0", priority=1), 50.0),
           canary(endpoint("m", "http://c1", "c1", priority=0), 50.0)]
    t = build_table(eps, EMPTY)
    assert chosen(t, 0.9) == "s0"
    assert chosen(t, 0.9, (t.upstreams["s0"],)) == "s1"
    assert chosen(t, 0.1) == "c1"
    assert chosen(t, 0.1, (t.upstreams["c1"],)) == "c0"


def test_a_fallback_keeps_its_own_split() -> None:
    eps = [endpoint("m", "http://m", "m0"), replace(endpoint("f", "http://f0", "f0"), canary_percent=30.0),
           canary(endpoint("f", "http://f1", "f1"), 30.0)]
    t = build_table(eps, EMPTY)
    assert set(t.splits) == {"f"}
    chain = (RouteModel("m", fallbacks=("f",)), RouteModel("f"))
    m0 = t.upstreams["m0"]
    assert chosen(t, 0.1, (m0,), chain) == "f1"
    assert chosen(t, 0.5, (m0,), chain) == "f0"


def test_the_split_follows_the_shares_over_many_draws() -> None:
    t = split_table(25.0)
    rng = random.Random(7)
    counts = Counter(chosen(t, rng.random()) for _ in range(4000))
    # Binomial(4000, 0.25): mean 1000, sd ~27; these bounds are ~7 sd away.
    assert 800 < counts["c"] < 1200, counts


# --- on real engines ----------------------------------------------------------------------------

def served_by(sim: SimProcess) -> int:
    """Generation requests the simulated engine accepted, by its own count."""
    return int(sim_metric(sim.endpoint, "llmgw_sim_requests_total"))


def split_router(stable: SimProcess, new: SimProcess, percent: float = 25.0) -> Router:
    router = Router(rng=random.Random(26), config=RouterConfig(cooldown=0.0))
    router.set_catalog(Catalog(models=(model("m"),)))
    router.set_endpoints([replace(endpoint("m", stable.endpoint, "stable"), canary_percent=percent),
                          canary(endpoint("m", new.endpoint, "canary"), percent)])
    return router


async def send_load(cl: openai.AsyncOpenAI, n: int) -> list[str]:
    """``n`` requests, half streamed and half whole, 8 at a time; each one's answer text."""
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> str:
        async with sem:
            if i % 2:
                stream = await cl.chat.completions.create(model="m", messages=hello(i), stream=True, max_tokens=6)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            whole = await cl.chat.completions.create(model="m", messages=hello(i), max_tokens=6)
            return whole.choices[0].message.content or ""

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.slow
async def test_two_engines_split_by_the_share_and_the_router_measures_each() -> None:
    with SimProcess("m") as stable, SimProcess("m") as new:
        router = split_router(stable, new)
        async with serving(router) as base, client(base) as cl:
            n = 200
            answers = await send_load(cl, n)
            assert all(answers)  # every request answered (the openai client raises on a failure)
            on_stable, on_canary = served_by(stable), served_by(new)
            # Each request served by exactly one engine, the canary's share near 25 %:
            # Binomial(200, 0.25) has mean 50 and sd ~6; 20..80 is 5 sd either way.
            assert on_stable + on_canary == n
            assert 20 <= on_canary <= 80, (on_stable, on_canary)

            stats = router.usage.replica_stats()
            assert list(stats) == [router.usage.instance_id]
            mine = stats[router.usage.instance_id]
            assert (mine["stable"].requests, mine["canary"].requests) == (on_stable, on_canary)
            assert mine["stable"].errors == mine["canary"].errors == 0
            for s in mine.values():
                # Every answer has its time, each in its own figure: a stream's first token, a
                # whole answer's time per output token.
                assert sum(s.ttft) + sum(s.tpot) == s.requests and sum(s.ttft) > 0 and sum(s.tpot) > 0
                assert sum(s.itl) > 0  # streams of 6 tokens: a time between tokens
                assert s.p95("ttft") is not None


@pytest.mark.slow
async def test_a_failing_canary_costs_clients_nothing_and_its_errors_are_counted() -> None:
    with SimProcess("m") as stable, SimProcess("m") as new:
        router = split_router(stable, new, percent=50.0)
        async with serving(router) as base, client(base) as cl:
            assert all(await send_load(cl, 20))
            before = router.usage.replica_stats()[router.usage.instance_id]
            new.stop()  # the canary's engine is gone: every attempt on it fails before the first byte
            n = 60
            answers = await send_load(cl, n)
            assert all(answers)  # the stable replica served every request the canary could not
            after = router.usage.replica_stats()[router.usage.instance_id]
            canary_delta = after["canary"] - before["canary"]
            stable_delta = after["stable"] - before["stable"]
            # Binomial(60, 0.5) draws the canary at least 10 times far beyond any doubt.
            assert canary_delta.requests >= 10
            assert canary_delta.errors == canary_delta.requests  # each failed attempt is an error
            assert sum(canary_delta.ttft) == 0  # failures carry no latency
            assert stable_delta.requests == n and stable_delta.errors == 0
            assert canary_delta.error_rate == 1.0 and stable_delta.error_rate == 0.0


@pytest.mark.slow
async def test_a_canary_failing_half_its_requests_is_counted_and_clients_see_only_its_share() -> None:
    with SimProcess("m") as stable, SimProcess("m", "--fail-rate", "0.5") as new:
        router = split_router(stable, new)
        async with serving(router) as base, client(base) as cl:
            n = 200
            sem = asyncio.Semaphore(8)

            async def one(i: int) -> bool:
                async with sem:
                    try:
                        if i % 2:
                            stream = await cl.chat.completions.create(model="m", messages=hello(i), stream=True,
                                                                      max_tokens=6)
                            async for _ in stream:
                                pass
                        else:
                            await cl.chat.completions.create(model="m", messages=hello(i), max_tokens=6)
                        return True
                    except openai.InternalServerError:
                        return False  # the engine's 500 is passed on (not retried: it may have generated)

            served = await asyncio.gather(*(one(i) for i in range(n)))
            failed_by_engine = int(sim_metric(new.endpoint, "llmgw_sim_requests_failed_total"))
            on_canary = served_by(new)
            mine = router.usage.replica_stats()[router.usage.instance_id]
            assert served.count(False) == failed_by_engine
            assert 20 <= on_canary <= 80, on_canary  # the canary's share of the load, as above
            # Its first request is served, then every second one fails (the simulator's exact count).
            assert failed_by_engine == (on_canary - 1) // 2
            assert (mine["canary"].requests, mine["canary"].errors) == (on_canary, failed_by_engine)
            assert (mine["stable"].requests, mine["stable"].errors) == (n - on_canary, 0)
            # Latencies of answers only (streams: their first token; whole: per output token).
            assert sum(mine["canary"].ttft) + sum(mine["canary"].tpot) == on_canary - failed_by_engine
            error_rate = mine["canary"].error_rate
            assert error_rate is not None and 0.4 < error_rate <= 0.5


@pytest.mark.slow
async def test_a_client_that_goes_away_mid_stream_costs_the_replica_nothing() -> None:
    with SimProcess("m", "--ttft", "0.05", "--tokens-per-second", "20") as sim:
        router = Router()
        router.set_catalog(Catalog(models=(model("m"),)))
        router.set_endpoints([endpoint("m", sim.endpoint, "r")])
        async with serving(router) as base, aiohttp.ClientSession() as session:
            body = {"model": "m", "messages": HELLO, "stream": True, "max_tokens": 200}
            async with session.post(base + "/v1/chat/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=15)) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the stream began; then the client hangs up
            while router.requests_in_flight() or not sim_metric(sim.endpoint, "llmgw_sim_requests_cancelled_total"):
                await asyncio.sleep(0.02)  # the router saw the client go and cut the engine's request
            assert router.usage.replica_stats()[router.usage.instance_id]["r"] == ReplicaStats()


async def test_stats_of_a_replica_that_leaves_the_table_are_dropped() -> None:
    router = Router()
    router.set_endpoints([endpoint("m", "http://a", "a"), endpoint("m", "http://b", "b")])
    assert set(router.usage.replica_stats()[router.usage.instance_id]) == {"a", "b"}
    router.set_endpoints([endpoint("m", "http://b", "b")])
    assert set(router.usage.replica_stats()[router.usage.instance_id]) == {"b"}
    # A new router process is a new instance: the controller never differences across a restart.
    assert Router().usage.instance_id != router.usage.instance_id


def test_replica_stats_are_copies() -> None:
    router = Router()
    router.set_endpoints([endpoint("m", "http://a", "a")])
    read = router.usage.replica_stats()[router.usage.instance_id]["a"]
    read.observe(error=True, ttft=0.1)
    assert router.usage.replica_stats()[router.usage.instance_id]["a"] == ReplicaStats()



def test_a_streams_timings_end_at_the_engines_end_marker_not_at_the_clients_last_read() -> None:
    # Seen: the end of a stream was taken after the last write to the client, so a client that
    # read slowly (a full socket buffer holds the router's writes back) made its replica's
    # inter-token latency look slow. The router now notes when the engine's end marker came
    # (proxy.forward_stream's on_end) and the replica is judged by that.
    from llmgw.router.account import Accounting

    books = Accounting(SimpleNamespace(limits=None), wall=lambda: 0.0)  # type: ignore[arg-type]
    books.replicas_changed(gone=(), present=("r",))
    # 11 content events from t=1.0 to the end marker at t=1.1; the client took until t=9.0.
    books.observe("r", failed=False, status=200, whole=True, tapped=True, start=0.9, first=1.0, last=1.1, end=9.0,
                  events=11, broken=False, outputs=11)
    # A whole answer of 40 tokens in 0.8 s: per output token, not a first token.
    books.observe("r", failed=False, status=200, whole=True, tapped=True, start=2.0, first=None, last=None, end=2.8,
                  events=0, broken=False, outputs=40)
    # A request the version refused: neither an error nor a latency.
    books.observe("r", failed=False, status=400, whole=False, tapped=True, start=3.0, first=None, last=None,
                  end=3.01, events=0, broken=False, outputs=None)
    stats = books.replica_stats()[books.instance_id]["r"]
    assert (stats.requests, stats.errors, stats.refused) == (3, 0, 1)
    assert stats.p95("itl") == pytest.approx(0.01, rel=0.25)  # (1.1 - 1.0) / 10, not (9.0 - 1.0) / 10
    assert stats.p95("ttft") == pytest.approx(0.1, rel=0.25)
    assert stats.p95("tpot") == pytest.approx(0.02, rel=0.25) and sum(stats.ttft) == 1


@pytest.mark.slow
async def test_a_conversations_turns_stay_on_one_version() -> None:
    # Seen: each turn drew its track afresh, so a conversation hopped between the canary and the
    # stable version (and between their prefix caches); a canary's share is now of conversations.
    with SimProcess("m") as stable, SimProcess("m") as new:
        router = split_router(stable, new, percent=30.0)
        async with serving(router) as base, client(base) as cl:
            on_canary = 0
            for c in range(40):
                messages = [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": f"Conversation {c}: tell me about GPUs."}]
                before = (served_by(stable), served_by(new))
                for turn in range(3):
                    answer = await cl.chat.completions.create(model="m", messages=messages, max_tokens=4)
                    messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                                 {"role": "user", "content": f"and then? ({turn})"}]
                after = (served_by(stable), served_by(new))
                moved = (after[0] - before[0], after[1] - before[1])
                assert moved in ((3, 0), (0, 3)), (c, moved)  # all three turns on one version
                on_canary += moved[1] == 3
            # Binomial(40, 0.3): mean 12, sd ~2.9; 3..21 is 3 sd either way.
            assert 3 <= on_canary <= 21, on_canary
