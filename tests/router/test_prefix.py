"""Prefix-affinity routing: the pure choice (affinity, the imbalance bound, churn, bounded memory),
the prompt rendering, what engines report, and the router on real ports in front of two real
simulated engines, with the real openai client."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.catalog.model import Catalog
from llmgw.contract import PromptCache, catalog_view
from llmgw.control.feed import FeedHub, MergedUsage
from llmgw.engines.health import parse_load
from llmgw.engines.testing import SimProcess
from llmgw.router import Router, RouterConfig, catalog_from_view
from llmgw.router.account import Accounting
from llmgw.router.answer import llama_timings
from llmgw.router.changes import Changes
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.prefix import PrefixIndex, prompt_key, render_chat, render_prompt
from llmgw.router.routes import RouteModel
from llmgw.router.source import RouterUsage
from llmgw.router.table import EMPTY, build_table, choose, pick_prefix
from tests.router.conftest import client, endpoint, serving, sim_metric
from tests.router.fake_controller import model

PREFIX = RouteModel("m", routing="prefix")
DOC = "The quarterly report covers revenue, costs and the outlook for every region. " * 40  # ~3 KB


def chat(system: str, question: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def key(system: str, question: str = "What changed?"):  # noqa: ANN201
    k = prompt_key(chat(system, question), chat=True)
    assert k is not None
    return k


def fleet(n: int = 3):  # noqa: ANN201
    return build_table([endpoint("m", f"http://r{i}", f"r{i}") for i in range(n)], EMPTY)


def send(t, prompt, **kw):  # noqa: ANN001, ANN003, ANN201 - what the router does per request
    _, up = choose(t, (PREFIX,), 0.0, random.Random(0), (), prompt, **kw)
    if up.prefixes is None:
        up.prefixes = PrefixIndex(10_000)
    held = up.prefixes.record(prompt.hashes)
    return up, held


# --- the key --------------------------------------------------------------------------------

def test_blocks_are_chained_so_a_shared_start_shares_exactly_its_blocks() -> None:
    a, b = key(DOC, "first question " * 10), key(DOC, "a different question " * 10)
    shared = next(i for i, (x, y) in enumerate(zip(a.hashes, b.hashes, strict=False)) if x != y)
    # Both render "system" + DOC + "user" + question: every block wholly inside the shared text matches.
    assert shared == (len("system\x1f" + DOC + "\x1fuser\x1f")) // 64
    # A change in the first character changes every block after it, not only the first.
    c = key("X" + DOC[1:], "first question " * 10)
    assert not set(a.hashes) & set(c.hashes)
    assert a.anchor == b.anchor != c.anchor  # the anchor is the first 1 KiB: the same for one document


def test_rendering_follows_what_the_engine_sees_and_never_raises() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    with_tools = render_chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert with_tools.index("lookup") < with_tools.index("hi")  # tools come first, as in chat templates
    parts = render_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]}]})
    assert "look" in parts and "data:image/png;base64,AAA" in parts
    for odd in ({"messages": "x"}, {"messages": [1, None]}, {"messages": [{"role": 5, "content": {"a": 1}}]},
                {}, {"messages": [{"role": "user", "content": [None, 3, {"text": 4}]}]}):
        assert isinstance(render_chat(odd), str)
    assert render_prompt({"prompt": "abc"}) == "abc"
    assert render_prompt({"prompt": ["first", "second"]}) == "first"
    assert render_prompt({"prompt": [1, 2, 3]}) == "1 2 3"
    assert render_prompt({"prompt": [[4, 5], [6]]}) == "4 5"
    assert render_prompt({"prompt": {"x": 1}}) == "" and render_prompt({"prompt": None}) == ""
    assert prompt_key({"prompt": "short"}, chat=False) is None  # under one block: no affinity at all
    lone = prompt_key({"messages": [{"role": "user", "content": "\ud83d" * 100}]}, chat=True)
    assert lone is not None  # half an emoji (a lone surrogate) is hashed, not an error


# --- the choice -------------------------------------------------------------------------------

def test_a_tenant_returns_to_the_replica_that_served_it() -> None:
    t = fleet()
    tenants = [f"Tenant {n} handbook. " * 60 for n in range(6)]
    home = {}
    for n, doc in enumerate(tenants):
        home[n], held = send(t, key(doc, "q0"))
        assert held == 0  # first time: nothing held anywhere
    assert len({u.replica_id for u in home.values()}) > 1  # new prompts spread (rendezvous)
    for round_ in range(1, 4):
        for n, doc in enumerate(tenants):
            up, held = send(t, key(doc, f"question {round_}"))
            assert up is home[n]
            assert held >= len(doc) // 64 - 1  # the whole document was held there


def test_above_the_imbalance_bound_load_wins_and_the_prefix_spreads() -> None:
    t = fleet(2)
    k = key(DOC)
    home, _ = send(t, k)
    other = next(u for u in t.upstreams.values() if u is not home)
    home.inflight = 4
    assert send(t, k, imbalance=4)[0] is home  # 4 more in flight than the idlest: still within the bound
    home.inflight = 5
    up, held = send(t, k, imbalance=4)
    assert up is other and held == 0  # beyond it: the idle replica, which now learns the prefix
    home.inflight = other.inflight = 0
    other.inflight = 1
    assert send(t, k)[0] is home  # both hold it now: the less loaded of the two
    # A weight scales load: a replica of weight 4 with 8 in flight is as loaded as one with 2.
    heavy = build_table([endpoint("m", "http://a", "a", weight=4.0), endpoint("m", "http://b", "b")], EMPTY)
    a, b = heavy.upstreams["a"], heavy.upstreams["b"]
    a.prefixes = PrefixIndex(100)
    a.prefixes.record(k.hashes)
    a.inflight = 24  # load 6
    assert send(heavy, k, imbalance=4)[0] is b
    b.prefixes = None  # (it learned the prompt just now)
    a.inflight = 16  # load 4, b idle: within the bound
    assert send(heavy, k, imbalance=4)[0] is a


def test_one_hot_prefix_cannot_pin_one_replica() -> None:
    t = fleet(3)
    k = key(DOC)
    for _ in range(60):  # 60 concurrent requests for one prompt: none finishes in between
        up, _ = send(t, k, imbalance=4)
        up.inflight += 1
    loads = sorted(u.inflight for u in t.upstreams.values())
    assert loads[-1] - loads[0] <= 5, loads


def test_an_unseen_prompt_goes_to_the_least_loaded_and_equal_loads_agree_across_routers() -> None:
    t = fleet(3)
    t.upstreams["r0"].inflight = 1
    t.upstreams["r1"].inflight = 1
    assert send(t, key(DOC))[0] is t.upstreams["r2"]  # no affinity: strictly the least loaded
    # Two routers (two tables, two processes' worth of state) place the same new prompt alike.
    first, second = fleet(3), fleet(3)
    for n in range(20):
        k = key(f"Another tenant {n}. " * 50)
        a = pick_prefix(first.groups["m"], 0.0, k, 4.0)
        b = pick_prefix(second.groups["m"], 0.0, k, 4.0)
        assert a is not None and b is not None and a.replica_id == b.replica_id


def test_churn_a_replica_that_leaves_or_restarts_forgets_what_it_held() -> None:
    eps = [endpoint("m", f"http://r{i}", f"r{i}") for i in range(2)]
    t = build_table(eps, EMPTY)
    k = key(DOC)
    home, _ = send(t, k)
    # The engine became ready again (a new process): the same replica id and URL, an empty cache.
    restarted = [replace(e, ready_since=100.0) if e.replica_id == home.replica_id else e for e in eps]
    t2 = build_table(restarted, t)
    assert t2.upstreams[home.replica_id] is home and home.inflight == 0
    assert home.prefixes is not None and home.prefixes.match(k.hashes) == 0
    # Gone from the table and back later: a new Upstream, with no index.
    t3 = build_table([e for e in restarted if e.replica_id != home.replica_id], t2)
    t4 = build_table(restarted, t3)
    assert t4.upstreams[home.replica_id].prefixes is None
    # Unchanged endpoints keep what they learned.
    up, held = send(t4, k)
    again = build_table(restarted, t4)
    assert again.upstreams[up.replica_id].prefixes.match(k.hashes) == len(k.hashes)


def test_cooling_and_tried_replicas_are_avoided_like_elsewhere() -> None:
    t = fleet(2)
    k = key(DOC)
    home, _ = send(t, k)
    other = next(u for u in t.upstreams.values() if u is not home)
    home.cooldown_until = 10.0
    assert choose(t, (PREFIX,), 5.0, random.Random(), (), k)[1] is other
    assert choose(t, (PREFIX,), 5.0, random.Random(), (other,), k)[1] is home  # cooling, but all that is left
    assert choose(t, (PREFIX,), 5.0, random.Random(), (other, home), k) is None


def test_the_index_is_bounded_and_keeps_shared_starts_longest() -> None:
    index = PrefixIndex(100)
    shared = key(DOC)  # ~48 blocks
    index.record(shared.hashes)
    for n in range(200):  # a flood of unrelated long prompts
        index.record(key(f"unrelated {n} " * 40).hashes)
        index.record(key(DOC, f"question {n}").hashes)  # the shared document keeps coming back
        assert len(index) <= 100
    assert index.match(shared.hashes) >= 40
    flood = PrefixIndex(10)
    for n in range(50):
        flood.record(key(f"x{n} " * 200).hashes)
    assert len(flood) == 10
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_least_outstanding_models_ignore_the_prompt() -> None:
    t = fleet(2)
    k = key(DOC)
    t.upstreams["r0"].inflight = 1
    plain = RouteModel("m")
    for _ in range(5):
        assert choose(t, (plain,), 0.0, random.Random(), (), k)[1] is t.upstreams["r1"]


# --- what the engines say -----------------------------------------------------------------------

def test_llama_timings_are_read_from_the_end_of_an_answer() -> None:
    whole = (b'{"choices":[{"message":{"content":"hi"}}],"timings":{"cache_n":1206,"prompt_n":16,'
             b'"prompt_ms":80.1,"predicted_n":4}}')
    assert prompt_cache(whole) == (1222, 1206)
    stream = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"choices":[{"finish_reason":"stop","delta":{}}],"timings":{"cache_n":0,"prompt_n":266}}\n\n'
              b"data: [DONE]\n\n")
    assert prompt_cache(stream) == (266, 0)
    assert prompt_cache(b'{"timings": {"prompt_n": 5}}') is None
    assert prompt_cache(b'{"content": "the word \\"timings\\" said by the model"}') is None
    assert prompt_cache(b"") is None
    t = llama_timings(whole)
    assert t is not None and (t.prompt, t.predicted) == (1222, 4)  # the usage llama.cpp reports unasked


def prompt_cache(tail: bytes) -> tuple[int, int] | None:
    """(prompt tokens, of which cached), as the router counts them from llama.cpp's timings."""
    t = llama_timings(tail)
    return None if t is None else (t.prompt, t.cached)


def test_vllm_prefix_cache_counters_are_read_with_the_load() -> None:
    text = ('vllm:num_requests_running{model_name="m"} 1.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
            '# HELP vllm:prefix_cache_queries_total x\nvllm:prefix_cache_queries_total{model_name="m"} 5000.0\n'
            'vllm:prefix_cache_hits_total{model_name="m"} 4200.0\n')
    load = parse_load(text, "vllm")
    assert load is not None and (load.prefix_queries, load.prefix_hits) == (5000.0, 4200.0)
    bare = parse_load('vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n', "vllm")
    assert bare is not None and bare.prefix_queries is None


# --- the catalog and the reports ---------------------------------------------------------------

def test_the_policy_travels_in_the_catalog_view_and_unknown_ones_are_served_as_the_default() -> None:
    cat = Catalog(models=(replace(model("a"), routing="prefix"), model("b")))
    view = catalog_view(cat)
    routes = catalog_from_view(view)
    assert routes.model("a").routing == "prefix" and routes.model("b").routing == "least-outstanding"
    view["models"][0]["routing"] = "some-future-policy"  # type: ignore[typeddict-item]
    assert catalog_from_view(view).model("a").routing == "least-outstanding"
    del view["models"][1]["routing"]  # type: ignore[misc]  # an older controller
    assert catalog_from_view(view).model("b").routing == "least-outstanding"


async def test_reports_carry_prompt_cache_counts_and_the_hub_sums_routers() -> None:
    hub = FeedHub()
    from aiohttp.test_utils import make_mocked_request  # noqa: PLC0415 - only this test needs it

    async def post(body: dict) -> int:
        import json  # noqa: PLC0415

        req = make_mocked_request("POST", "/api/v1/router/report", headers={"Content-Type": "application/json"})
        req._read_bytes = json.dumps(body).encode()  # type: ignore[attr-defined]
        return (await hub.report(req)).status

    assert await post({"router_id": "a", "prompt_cache": {"m": {"blocks": 10, "matched": 7, "prompt_tokens": 100,
                                                                "cached_tokens": 60}}}) == 200
    assert await post({"router_id": "b", "prompt_cache": {"m": {"blocks": 10, "matched": 1}}}) == 200
    assert hub.prompt_cache() == {"m": PromptCache(20, 8, 100, 60)}
    assert await post({"router_id": "c", "prompt_cache": {"m": {"blocks": -1}}}) == 400
    assert await post({"router_id": "c", "prompt_cache": {"m": {"blocks": "7"}}}) == 400
    assert hub.prompt_cache()["m"].estimated_hit_ratio == 0.4

    class One:
        def prompt_cache(self) -> dict:
            return {"m": PromptCache(5, 5, 0, 0), "n": PromptCache(1, 0, 0, 0)}

    merged = MergedUsage(One(), hub).prompt_cache()
    assert merged == {"m": PromptCache(25, 13, 100, 60), "n": PromptCache(1, 0, 0, 0)}


# --- through the router, on real ports ------------------------------------------------------------

@pytest.fixture
def two_sims(tmp_path):  # noqa: ANN001, ANN201 - each logs the `user` of every request it accepts
    logs = tmp_path / "a.log", tmp_path / "b.log"
    with SimProcess("m", "--request-log", str(logs[0])) as a, SimProcess("m", "--request-log", str(logs[1])) as b:
        yield (a, logs[0]), (b, logs[1])


async def until(check: Callable[[], object], timeout: float = 30.0) -> None:
    """Wait for ``check`` (a bound on a hang, not a claim about the machine's speed)."""
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


def _samples(text: str, name: str) -> dict[str, float]:
    return {s.labels.get("model", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


async def test_through_the_router_each_tenant_stays_on_one_engine(two_sims) -> None:  # noqa: ANN001
    (a, a_log), (b, b_log) = two_sims
    router = Router(config=RouterConfig(load_interval=0.2))
    router.set_catalog(Catalog(models=(replace(model("m"), routing="prefix"),)))
    router.set_endpoints([endpoint("m", a.endpoint, "a"), endpoint("m", b.endpoint, "b")])
    tenants = [f"You answer for tenant {n}. Their policy manual follows. " + f"Rule {n}. " * 200 for n in range(6)]
    ups = router.table.upstreams
    async with serving(router) as base, client(base) as c:
        # The first reading of each engine's counters is its history (llmgw.router.load.apply_load):
        # taken before any request, so every request below is counted from a later one.
        await until(lambda: all(ups[r].prefix_totals is not None for r in ("a", "b")))
        for round_ in range(3):
            for n, system in enumerate(tenants):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {round_}"}]
                if round_ == 1:  # streamed answers route the same way
                    async for _ in await c.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                                                   stream=True, user=f"tenant-{n}"):
                        pass
                else:
                    await c.chat.completions.create(model="m", messages=messages, max_tokens=2, user=f"tenant-{n}")
        # A load reading after the last request: the router holds each engine's final counters.
        final = {r: (sim_metric(sim.endpoint, "vllm:prefix_cache_queries_total"),
                     sim_metric(sim.endpoint, "vllm:prefix_cache_hits_total")) for r, sim in (("a", a), ("b", b))}
        await until(lambda: all(ups[r].prefix_totals == final[r] for r in final))
        async with aiohttp.ClientSession() as http, http.get(base + "/metrics") as r:
            metrics = await r.text()
    on_a, on_b = a_log.read_text().split(), b_log.read_text().split()
    assert len(on_a) + len(on_b) == 18 and on_a and on_b  # both engines used
    for n in range(6):
        t = f"tenant-{n}"
        assert (on_a.count(t), on_b.count(t)) in ((3, 0), (0, 3)), (t, on_a, on_b)  # each tenant on one engine
    blocks = _samples(metrics, "llmgw_router_prefix_blocks_total")["m"]
    matched = _samples(metrics, "llmgw_router_prefix_matched_blocks_total")["m"]
    assert matched / blocks > 0.6  # rounds 2 and 3 found their documents held
    # The engines' own counters (the simulator counts as vLLM does) agree: most prompt tokens cached.
    engine_prompt = _samples(metrics, "llmgw_router_engine_prompt_tokens_total")["m"]
    engine_cached = _samples(metrics, "llmgw_router_engine_cached_prompt_tokens_total")["m"]
    assert engine_prompt > 0 and engine_cached / engine_prompt > 0.5
    pc = router.usage.prompt_cache()["m"]
    assert (pc.blocks, pc.matched) == (blocks, matched)


async def test_least_outstanding_scatters_the_same_tenants(two_sims) -> None:  # noqa: ANN001
    """The peer: the same requests without prefix routing land on both engines per tenant."""
    (a, a_log), (b, b_log) = two_sims
    router = Router(config=RouterConfig(load_interval=0.2), rng=random.Random(7))
    router.set_catalog(Catalog(models=(model("m"),)))
    router.set_endpoints([endpoint("m", a.endpoint, "a"), endpoint("m", b.endpoint, "b")])
    async with serving(router) as base, client(base) as c:
        for _ in range(4):
            for n in range(6):
                await c.chat.completions.create(model="m", max_tokens=2, user=f"tenant-{n}", messages=[
                    {"role": "system", "content": f"Tenant {n} manual. " * 200}, {"role": "user", "content": "q"}])
    on_a, on_b = a_log.read_text().split(), b_log.read_text().split()
    split = sum(1 for n in range(6) if f"tenant-{n}" in on_a and f"tenant-{n}" in on_b)
    assert split >= 3, (on_a, on_b)
    assert router.usage.prompt_cache().get("m", PromptCache()).blocks == 0  # no index kept for this policy


def test_a_routing_change_is_one_field_in_the_diff_and_restarts_nothing() -> None:
    from llmgw.decide.replica import fingerprint
    from llmgw.plan.changes import catalog_changes

    before = Catalog(models=(model("m"),))
    after = Catalog(models=(replace(model("m"), routing="prefix"),))
    [change] = catalog_changes(before, after)
    assert [f.text() for f in change.fields] == ["routing: least-outstanding → prefix"]
    m0, m1 = before.models[0], after.models[0]
    assert fingerprint(m0, m0.profiles[0]) == fingerprint(m1, m1.profiles[0])  # the engines keep running


# --- found in review ---------------------------------------------------------------------------

def test_an_odd_engine_counter_neither_stops_the_poller_nor_poisons_the_counts() -> None:
    from llmgw.router.load import apply_load

    for bad in ("+Inf", "NaN", "-5"):
        text = ("vllm:num_requests_running 0\nvllm:num_requests_waiting 3\n"
                f"vllm:prefix_cache_queries_total {bad}\nvllm:prefix_cache_hits_total 1\n")
        load = parse_load(text, "vllm")
        assert load is not None and load.waiting == 3 and load.prefix_queries is None
    t = fleet(1)
    up = t.upstreams["r0"]
    up.prefixes = PrefixIndex(100)
    up.prefixes.record(key(DOC).hashes)
    seen = []

    def note(_u, q, h) -> None:  # noqa: ANN001
        seen.append((q, h))

    reading = parse_load("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                         "vllm:prefix_cache_queries_total 900\nvllm:prefix_cache_hits_total 800\n", "vllm")
    assert reading is not None
    apply_load(up, 0, reading, note)
    apply_load(up, 0, replace(reading, prefix_queries=1000.0, prefix_hits=850.0), note)
    assert seen == [(100.0, 50.0)]  # the first reading is history; then the change
    # The counters went down: a restarted engine, whose cache is empty.
    apply_load(up, 0, replace(reading, prefix_queries=10.0, prefix_hits=0.0), note)
    assert up.prefixes.match(key(DOC).hashes) == 0 and len(seen) == 1


def test_a_weight_zero_standby_does_not_take_new_prompts() -> None:
    t = build_table([endpoint("m", "http://a", "a"), endpoint("m", "http://s", "standby", weight=0.0)], EMPTY)
    for n in range(30):
        up, _ = send(t, key(f"Tenant {n} handbook. " * 40))
        assert up.replica_id == "a"


def test_a_routing_value_of_another_shape_is_served_as_the_default() -> None:
    view = catalog_view(Catalog(models=(model("a"),)))
    view["models"][0]["routing"] = {"policy": "prefix"}  # type: ignore[typeddict-item]
    assert catalog_from_view(view).model("a").routing == "least-outstanding"


def test_report_counts_are_bounded_and_consistent() -> None:
    with pytest.raises(ValueError):
        PromptCache.from_json({"blocks": 1, "matched": 10 ** 400})
    with pytest.raises(ValueError):
        PromptCache.from_json({"blocks": 1, "matched": 2})
    with pytest.raises(ValueError):
        PromptCache.from_json({"prompt_tokens": 1, "cached_tokens": 5})
    assert PromptCache.from_json({"blocks": 4, "matched": 3}).estimated_hit_ratio == 0.75


def test_rendering_stops_after_what_is_hashed() -> None:
    huge = {"messages": [{"role": "user", "content": "x" * 1000} for _ in range(20_000)]}  # 20 MB of prompt
    k = prompt_key(huge, chat=True)
    assert k is not None and len(k.hashes) == 512
    assert len(render_chat(huge)) < 64 * 512 + 2000  # the other 19.97 MB are never joined


def test_engine_wide_counters_stay_out_of_the_reports_routers_sum() -> None:
    books = Accounting(SimpleNamespace(limits=None), wall=lambda: 0.0)  # type: ignore[arg-type]
    usage = RouterUsage(Current(), books, DemandBook(Changes(), clock=lambda: 0.0, linger=15.0))
    books.engine_counts("m", 1000.0, 700.0)  # what the load poller adds for a vLLM engine
    assert usage.prompt_cache()["m"] == PromptCache(0, 0, 1000, 700)  # this router's own view
    assert "m" not in usage.prompt_cache(polled=False)  # its report: the controller reads the engine too


def test_a_conversation_draws_one_number_over_its_turns_and_conversations_spread() -> None:
    from llmgw.router.prefix import conversation_draw

    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a GPU?"}]
    later = opening + [{"role": "assistant", "content": "A processor."}, {"role": "user", "content": "And a TPU?"}]
    first = conversation_draw({"messages": opening}, True)
    assert first is not None and 0 <= first < 1 and conversation_draw({"messages": later}, True) == first
    draws = [conversation_draw({"messages": [opening[0], {"role": "user", "content": f"question {i}"}]}, True)
             for i in range(1000)]
    assert sum(d is not None and d < 0.1 for d in draws) in range(60, 141)  # ~100: a share of conversations
    assert conversation_draw({"prompt": "Once upon a time"}, False) == conversation_draw(
        {"prompt": "Once upon a time"}, False)
    assert conversation_draw({"messages": "nope"}, True) is None and conversation_draw({"prompt": ""}, False) is None
