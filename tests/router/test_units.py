"""The router's pure parts: selection, body rewriting, keys, queue scanning, the catalog view, usage."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmgw.catalog.model import Catalog
from llmgw.contract import Demand, catalog_view, endpoint_from_json
from llmgw.control.feed import Fanout, FeedHub, MergedUsage, Report
from llmgw.engines.health import LOAD_METRICS, parse_load
from llmgw.errors import ConfigError
from llmgw.router import KeyRing, Router, RouterConfig, catalog_from_view, hash_key
from llmgw.router.account import Accounting
from llmgw.router.changes import Changes
from llmgw.router.current import Current
from llmgw.router.demand import DemandBook
from llmgw.router.proxy import BadBody, parse_body, rewrite_model
from llmgw.router.routes import RouteModel
from llmgw.router.source import RouterUsage
from llmgw.router.table import EMPTY, build_table, choose, pick
from tests.router.conftest import endpoint
from tests.router.fake_controller import model


def table(*eps):  # noqa: ANN201, ANN002
    return build_table(list(eps), EMPTY)


# --- selection ------------------------------------------------------------------------------

def test_lowest_priority_value_first_then_least_outstanding() -> None:
    t = table(endpoint("m", "http://a", "a", priority=1), endpoint("m", "http://b", "b", priority=0),
              endpoint("m", "http://c", "c", priority=0))
    rng = random.Random(1)
    ups = t.upstreams
    ups["b"].inflight = 3
    assert pick(t.groups["m"], 0.0, rng).replica_id == "c"
    ups["c"].inflight = 5
    assert pick(t.groups["m"], 0.0, rng).replica_id == "b"
    # Outside load read from the engine's /metrics counts as well.
    ups["b"].external = 4
    assert pick(t.groups["m"], 0.0, rng).replica_id == "c"
    # Priority 1 only when priority 0 is exhausted (tried by this request).
    assert pick(t.groups["m"], 0.0, rng, exclude=(ups["b"], ups["c"])).replica_id == "a"
    assert pick(t.groups["m"], 0.0, rng, exclude=tuple(ups.values())) is None


def test_ties_are_broken_at_random_and_by_weight() -> None:
    t = table(*(endpoint("m", f"http://{n}", n) for n in "abc"))
    rng = random.Random(7)
    counts = Counter(pick(t.groups["m"], 0.0, rng).replica_id for _ in range(3000))
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 800
    w = table(endpoint("m", "http://a", "a", weight=3.0), endpoint("m", "http://b", "b", weight=1.0))
    counts = Counter(pick(w.groups["m"], 0.0, rng).replica_id for _ in range(4000))
    assert 2700 < counts["a"] < 3300
    # Weighted load: a replica with 3x the weight takes 3x the requests before it loses.
    w.upstreams["b"].inflight = 1
    w.upstreams["a"].inflight = 2
    assert pick(w.groups["m"], 0.0, rng).replica_id == "a"
    w.upstreams["a"].inflight = 4
    assert pick(w.groups["m"], 0.0, rng).replica_id == "b"


def test_the_choice_walks_the_fallback_chain_healthy_first() -> None:
    t = table(endpoint("big", "http://a", "a"), endpoint("small", "http://b", "b"))
    chain = (RouteModel("big", fallbacks=("small",)), RouteModel("small"))
    rng = random.Random(3)
    assert choose(t, chain, 0.0, rng) == (chain[0], t.upstreams["a"])
    # The primary failed a moment ago: a healthy fallback is chosen before the cooling primary...
    t.upstreams["a"].cooldown_until = 10.0
    assert choose(t, chain, 5.0, rng) == (chain[1], t.upstreams["b"])
    # ...and the cooling one when nothing healthy is left, then nothing once both were tried.
    assert choose(t, chain, 5.0, rng, (t.upstreams["b"],)) == (chain[0], t.upstreams["a"])
    assert choose(t, chain, 5.0, rng, (t.upstreams["a"], t.upstreams["b"])) is None
    assert choose(t, (RouteModel("ghost"),), 0.0, rng) is None  # no replica at all


def test_cooling_replicas_are_a_last_resort() -> None:
    t = table(endpoint("m", "http://a", "a"), endpoint("m", "http://b", "b", priority=5))
    a, b = t.upstreams["a"], t.upstreams["b"]
    a.cooldown_until = 10.0
    assert pick(t.groups["m"], 5.0, random.Random()) is b  # even a worse priority beats a cooling one
    assert pick(t.groups["m"], 11.0, random.Random()) is a  # cooled down
    b.cooldown_until = 20.0
    assert pick(t.groups["m"], 5.0, random.Random()) is a  # all cooling: the one that recovers first
    assert pick(t.groups["m"], 5.0, random.Random(), exclude=(a,)) is b


def test_a_new_table_keeps_counters_of_replicas_that_stay() -> None:
    first = table(endpoint("m", "http://a", "a"), endpoint("m", "http://b", "b"))
    first.upstreams["a"].inflight = 2
    second = build_table([endpoint("m", "http://a/", "a", weight=2.0), endpoint("m", "http://c", "c")], first)
    assert second.upstreams["a"] is first.upstreams["a"] and second.upstreams["a"].inflight == 2
    assert second.upstreams["a"].weight == 2.0
    assert set(second.upstreams) == {"a", "c"} and second.version == first.version + 1
    moved = build_table([endpoint("m", "http://elsewhere", "a")], second)
    assert moved.upstreams["a"] is not first.upstreams["a"]  # same id, new address: a fresh start


# --- the body -----------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b'{"model":"alias","messages":[{"role":"user","content":"hi"}]}',
    b'{"messages": [{"role": "user", "content": "model"}], "model": "alias", "stream": true}',
    b'{"model": "alias", "tools": [{"function": {"parameters": {"properties": {"model": {}}}}}]}',
    b'{"model" : "alias", "x": "\\u00e9"}',
    '{"model": "alias", "messages": [{"role": "user", "content": "caf\u00e9 \\"model\\""}]}'.encode(),
    b'{"messages": [], "model": "alias", "metadata": {"model": "alias"}}',
])
def test_model_rewrite_changes_only_the_top_level_model(raw: bytes) -> None:
    body, asked, _ = parse_body(raw)
    out = rewrite_model(raw, body, asked, "canonical/name-é")
    assert json.loads(out) == {**json.loads(raw), "model": "canonical/name-é"}


def test_model_rewrite_fast_path_keeps_the_bytes() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "model": "alias", "max_tokens": 3}'
    assert rewrite_model(raw, json.loads(raw), "alias", "real") == raw.replace(b'"alias"', b'"real"')
    assert rewrite_model(raw, json.loads(raw), "alias", "alias") is raw


@pytest.mark.parametrize(("raw", "code"), [
    (b"", "invalid_json"), (b"{", "invalid_json"), (b"\xff\xfe", "invalid_json"), (b"[]", "invalid_json"),
    (b"{}", "missing_model"), (b'{"model": 3}', "missing_model"), (b'{"model": ""}', "missing_model"),
])
def test_bodies_that_cannot_be_routed(raw: bytes, code: str) -> None:
    with pytest.raises(BadBody) as err:
        parse_body(raw)
    assert err.value.code == code


def test_stream_flag() -> None:
    assert parse_body(b'{"model": "m", "stream": true}')[2] is True
    assert parse_body(b'{"model": "m"}')[2] is False


# --- keys ---------------------------------------------------------------------------------------

def test_keys_are_matched_by_hash_and_scoped_to_models() -> None:
    ring = KeyRing.from_entries([{"name": "a", "sha256": hash_key("sk-a"), "models": ["alias-of-m"]},
                                 {"sha256": hash_key("sk-b").upper(), "models": ["*"]}])
    routes = catalog_from_view(catalog_view(Catalog(models=(model("m", aliases=("alias-of-m",)), model("n")))))
    a = ring.authenticate("Bearer sk-a")
    assert a is not None and a.name == "a"
    assert a.allows(routes.resolve("m")) and not a.allows(routes.resolve("n"))
    b = ring.authenticate("bearer  sk-b ")
    assert b is not None and b.name == "key-1" and b.allows(routes.resolve("n"))
    for header in (None, "", "Bearer", "Bearer ", "Basic sk-a", "Bearer sk-c", "sk-a"):
        assert ring.authenticate(header) is None
    assert KeyRing().open and not ring.open


def test_key_files(tmp_path: Path) -> None:
    good = tmp_path / "keys.yaml"
    good.write_text(f"api_keys:\n  - {{name: t, sha256: {hash_key('x')}, models: [m]}}\n")
    assert KeyRing.load(good).keys[0].models == frozenset({"m"})
    for text, why in (("- {sha256: abc}", "64 hex"), (f"- {{sha256: {'z' * 64}}}", "not hex"),
                      (f"- {{sha256: {'a' * 64}, models: m}}", "models must be a list"), ("42", "expected a list"),
                      ("[", "not valid")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=why):
            KeyRing.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing.load(tmp_path / "missing.yaml")


# --- engine queue depth -------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m {odd} label"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
"""


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_queue_scan_agrees_with_prometheus_clients_parser(engine: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    names = LOAD_METRICS[engine]
    text = VLLM_METRICS.replace("vllm:num_requests_running", names.running[0]).replace(
        "vllm:num_requests_waiting{", names.waiting[0] + "{")
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    reference = (round(sum(s.value for s in samples if s.name == names.running[0])),
                 round(sum(s.value for s in samples if s.name == names.waiting[0])))
    load = parse_load(text, engine)
    assert load is not None and (load.running, load.waiting) == reference == (5, 4)
    assert parse_load("# nothing here\n", engine) is None


# --- the catalog view and the snapshot wire shapes ---------------------------------------------

def test_catalog_view_round_trip() -> None:
    cat = Catalog(models=(model("a", aliases=("x", "y"), fallbacks=("b",), min=0, max=3),
                          model("b", task="embedding")), revision="abc123")
    view = json.loads(json.dumps(catalog_view(cat)))
    routes = catalog_from_view(view)
    assert routes.revision == "abc123"
    a = routes.resolve("y")
    assert a is not None and (a.name, a.aliases, a.fallbacks, a.min_replicas, a.max_replicas) == (
        "a", ("x", "y"), ("b",), 0, 3)
    assert routes.model("x") is None and routes.model("b").task == "embedding"
    with pytest.raises(ValueError, match="malformed"):
        catalog_from_view({"models": [{"aliases": []}]})
    with pytest.raises(ValueError, match="malformed"):
        catalog_from_view({"models": [{"name": 3}]})


def test_endpoint_json_round_trip_ignores_unknown_fields() -> None:
    ep = endpoint("m", "http://a", "m-g1", names=("m", "alias"))
    assert endpoint_from_json({**json.loads(json.dumps(ep.to_json())), "future": 1}) == ep
    with pytest.raises(ValueError):
        endpoint_from_json({"model": "m"})


# --- usage: demand and last use ----------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_demand_for_a_primary_lingers_until_it_has_a_replica() -> None:
    clock = Clock()
    woken: list[str] = []
    book = DemandBook(Changes(), clock=clock, linger=RouterConfig().wake_linger)
    book.wake = woken.append
    current = Current()
    usage = RouterUsage(current, Accounting(SimpleNamespace(limits=None), wall=clock), book)  # type: ignore[arg-type]
    book.want("big")
    book.want("big")
    assert woken == ["big"]  # at most once a second per model
    clock.now += 1.5
    book.want("big")
    assert woken == ["big", "big"]
    assert usage.demand() == {"big": Demand(held=1, inflight=0)}
    clock.now += 10
    assert usage.demand() == {"big": Demand(held=1, inflight=0)}
    current.table = build_table([endpoint("big", "http://a")], current.table)
    assert usage.demand() == {}  # a replica exists: the control plane has done its part
    current.table = build_table([], current.table)
    book.want("big")
    clock.now += 16
    assert usage.demand() == {}  # nobody asked again for wake_linger seconds


def test_hub_merges_reports_and_forgets_silent_routers() -> None:
    clock = Clock()
    hub = FeedHub(clock=clock, report_ttl=30)
    hub._reports["r1"] = Report(clock.now, {"a": 5.0, "b": 9.0}, {"m": Demand(held=1, inflight=2)}, {}, {}, {}, None)
    clock.now += 20
    hub._reports["r2"] = Report(clock.now, {"a": 7.0}, {"m": Demand(held=0, inflight=3), "n": Demand(inflight=1)},
                                {}, {}, {}, None)
    assert hub.last_used() == {"a": 7.0, "b": 9.0}
    assert hub.demand() == {"m": Demand(held=1, inflight=5), "n": Demand(held=0, inflight=1)}
    clock.now += 15
    # r1 is gone, its demand with it; the last use it said stays true (b was used at 9): forgotten,
    # replicas served through routers cut off from the controller read as unused, and were idled.
    assert hub.last_used() == {"a": 7.0, "b": 9.0} and set(hub.routers()) == {"r2"}
    merged = MergedUsage(hub, hub)
    assert merged.demand() == {"m": Demand(held=0, inflight=6), "n": Demand(held=0, inflight=2)}
    assert merged.last_used() == {"a": 7.0, "b": 9.0}
    # A time ahead of its report (forged, or a skewed clock) is kept only as far as the report's own
    # time: it would hold the replica "used" long after its router went quiet.
    hub._reports["r3"] = Report(clock.now, {"c": clock.now + 10 ** 9}, {}, {}, {}, {}, None)
    said_at = clock.now
    clock.now += 31
    assert hub.last_used()["c"] == said_at


def test_hub_publishes_only_changes_and_only_once_primed() -> None:
    hub = FeedHub()
    assert hub.snapshot() is None
    hub.set_endpoints([endpoint("m", "http://a")])
    assert hub.snapshot() is None  # no catalog yet: watchers get keepalives only
    cat = Catalog(models=(model("m"),))
    hub.set_catalog(cat)
    snap = hub.snapshot()
    assert snap is not None and snap["endpoints"][0]["replica_id"] == "m-g1"
    v = hub.version
    hub.set_catalog(Catalog(models=(model("m"),)))
    hub.set_endpoints([endpoint("m", "http://a")])
    assert hub.version == v  # the same content is not news


def test_in_process_wiring_hears_the_catalog_first_and_fans_out() -> None:
    from llmgw.compose.server import attach_router
    from llmgw.gitops.desired import RECONCILER, DesiredState

    desired = DesiredState(Catalog(models=(model("a"),)))
    seen: list[str] = []
    desired.subscribe(lambda c: seen.append("reconciler:" + ",".join(c.model_names)), order=RECONCILER)
    router, hub = Router(), FeedHub()
    woken: list[str] = []
    attach_router(router, desired, wake=woken.append)
    assert router.routes.resolve("a") is not None and router.wake == woken.append
    desired.subscribe(lambda _c: seen.append("router saw b: " + str(router.routes.resolve("b") is not None)),
                      order=RECONCILER)
    desired.set(Catalog(models=(model("b"),)))
    assert router.routes.resolve("a") is None and "router saw b: True" in seen
    fan = Fanout(router, hub)
    fan.set_catalog(Catalog(models=(model("c"),)))
    fan.set_endpoints([endpoint("c", "http://c")])
    assert router.table.has("c") and hub.snapshot()["endpoints"][0]["model"] == "c"


def test_a_cooling_replica_is_skipped_when_asked() -> None:
    t = table(endpoint("m", "http://a", "a"))
    t.upstreams["a"].cooldown_until = 10.0
    assert pick(t.groups["m"], 5.0, random.Random(), cooled=False) is None
    assert pick(t.groups["m"], 5.0, random.Random()) is t.upstreams["a"]
