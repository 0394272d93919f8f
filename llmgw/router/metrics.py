"""The router's Prometheus metrics, kept cheap enough for the request path.

prometheus-client looks a label set up on every ``.labels(...)`` call; here each child is
looked up once and cached in a dict keyed by the label tuple, so a request pays one dict hit
and one increment per metric. Gauges that the router already knows (in flight, held, ready
replicas) are not updated per request at all: a collector reads them at scrape time.

Two registries: :attr:`RouterMetrics.registry` holds the router's own series (requests, latency,
replicas, queues), served on the client port's ``/metrics`` to anyone; :attr:`RouterMetrics.tenants`
holds the series labelled with tenant and API key names, which name customers and their usage,
and is served only behind the admin token (the admin listener's ``/api/v1/metrics`` in the
controller's process, ``llmgw router --metrics-listen`` for a router of its own).

Label sets of replicas that left the table are removed, so a fleet that scales up and down
for weeks does not accumulate series (and memory) for replicas long gone. Client-supplied
model names that resolve to nothing are counted under ``model="unknown"`` for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

if TYPE_CHECKING:
    from llmgw.contract import PromptCache
    from llmgw.router.table import EndpointTable
    from llmgw.tenancy.usage import Usage

UNKNOWN = "unknown"


class RouterMetrics:
    """Counters and histograms of one router, registered in ``registry``; the usage per tenant
    and key in :attr:`tenants` (see the module's docstring)."""

    def __init__(self, registry: CollectorRegistry, gauges: Callable[[], GaugeSnapshot]) -> None:
        self.registry = registry
        self.tenants = CollectorRegistry()
        self.usage = _UsageCollector(gauges)  # also registered in the controller's registry, in its process
        self.tenants.register(self.usage)
        self.requests = Counter("llmgw_router_requests", "Requests answered, by model asked for, status and "
                                "replica that served (empty when none did).", ("model", "status", "replica"),
                                registry=registry)
        self.latency = Histogram("llmgw_router_request_duration_seconds", "Time from request to the end of the "
                                 "response, by model asked for.", ("model",), buckets=LATENCY_BUCKETS,
                                 registry=registry)
        self.ttft = Histogram("llmgw_router_time_to_first_token_seconds", "Streamed requests: time from request "
                              "to the first chunk sent to the client.", ("model",), buckets=TTFT_BUCKETS,
                              registry=registry)
        self.fallbacks = Counter("llmgw_router_fallbacks", "Requests served by a fallback model.",
                                 ("model", "fallback"), registry=registry)
        self.retries = Counter("llmgw_router_retries", "Attempts retried on another replica, by reason.",
                               ("model", "reason"), registry=registry)
        self.retries_denied = Counter("llmgw_router_retries_denied", "Retries not made because the retry budget "
                                      "(a share of live requests) was spent.", ("model",), registry=registry)
        self.held = Counter("llmgw_router_held", "Requests held for want of a ready replica (scale from zero).",
                            ("model",), registry=registry)
        self.odd_loads = Counter("llmgw_router_load_readings_refused", "Engine load readings (/metrics) that "
                                 "could not be applied, by model: the replica keeps its last figure.", ("model",),
                                 registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}
        registry.register(_GaugeCollector(gauges))

    # Each method costs one dict lookup once warm.
    def request(self, model: str, status: int, replica: str, seconds: float) -> None:
        key: tuple[str | int, ...] = ("r", model, status, replica)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(model, str(status), replica)
        child.inc()
        key = ("l", model)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.latency.labels(model)
        child.observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        key = ("t", model)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.ttft.labels(model)
        child.observe(seconds)

    def fallback(self, model: str, fallback: str) -> None:
        self._counter(self.fallbacks, "f", model, fallback)

    def retry(self, model: str, reason: str) -> None:
        self._counter(self.retries, "x", model, reason)

    def retry_denied(self, model: str) -> None:
        self._counter(self.retries_denied, "d", model)

    def hold(self, model: str) -> None:
        self._counter(self.held, "h", model)

    def _counter(self, metric: Counter, tag: str, *labels: str) -> None:
        key = (tag, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        child.inc()

    def forget_replicas(self, replica_ids: set[str]) -> None:
        """Drop the series of replicas that left the table."""
        for key in [k for k in self._children if k[0] == "r" and k[3] in replica_ids]:
            del self._children[key]
            self.requests.remove(key[1], str(key[2]), key[3])


class GaugeSnapshot:
    """What the collector reports at scrape time; filled by the router."""

    __slots__ = ("inflight", "engine_load", "held", "ready", "cooling", "table_version", "prompt_cache", "usage",
                 "limits_degraded", "parsing", "parse_waiting", "parsed_off_loop", "buffered")

    def __init__(self) -> None:
        self.prompt_cache: Mapping[str, PromptCache] = {}
        self.usage: Mapping[tuple[str, str, str], Usage] = {}  # (tenant, key, model)
        self.limits_degraded = False
        self.parsing = 0  # big request bodies in the parse worker
        self.parse_waiting = 0  # and waiting for it
        self.parsed_off_loop = 0  # since start
        self.buffered = 0  # bytes of request bodies held by requests in flight
        self.inflight: dict[tuple[str, str], int] = {}  # (model, replica) → requests
        self.engine_load: dict[tuple[str, str], tuple[int, int]] = {}  # (model, replica) → (running, waiting)
        self.held: dict[str, int] = {}
        self.ready: dict[str, int] = {}
        self.cooling: dict[str, int] = {}
        self.table_version = 0


def gauges(table: EndpointTable, held: Mapping[str, int], now: float,
           prompt_cache: Mapping[str, PromptCache], usage: Mapping[tuple[str, str, str], Usage]) -> GaugeSnapshot:
    """The gauges of ``table``, the held requests, prompt-cache and usage counts, read at scrape time."""
    snap = GaugeSnapshot()
    snap.prompt_cache = prompt_cache
    snap.usage = dict(usage)
    for model, groups in table.groups.items():
        ups = [u for g in groups for u in g]
        snap.ready[model] = len(ups)
        snap.cooling[model] = sum(1 for u in ups if u.cooldown_until > now)
        for u in ups:
            snap.inflight[(model, u.replica_id)] = u.inflight
            if u.engine_load is not None:
                snap.engine_load[(model, u.replica_id)] = u.engine_load
    snap.held = dict(held)
    snap.table_version = table.version
    return snap


class _GaugeCollector(Collector):
    def __init__(self, read: Callable[[], GaugeSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        inflight = GaugeMetricFamily("llmgw_router_inflight", "Requests in flight, by model and replica.",
                                     labels=("model", "replica"))
        for (model, replica), n in sorted(snap.inflight.items()):
            inflight.add_metric((model, replica), n)
        yield inflight
        engine = GaugeMetricFamily("llmgw_router_engine_requests", "Requests on each replica's engine as its own "
                                   "/metrics last said (vLLM, SGLang, the simulator): running and waiting (its "
                                   "queue), every client's, not only this router's.",
                                   labels=("model", "replica", "state"))
        for (model, replica), (running, waiting) in sorted(snap.engine_load.items()):
            engine.add_metric((model, replica, "running"), running)
            engine.add_metric((model, replica, "waiting"), waiting)
        yield engine
        held = GaugeMetricFamily("llmgw_router_held_now", "Requests waiting for a replica right now.",
                                 labels=("model",))
        for model, n in sorted(snap.held.items()):
            held.add_metric((model,), n)
        yield held
        ready = GaugeMetricFamily("llmgw_router_ready_replicas", "Replicas in the endpoint table.",
                                  labels=("model",))
        for model, n in sorted(snap.ready.items()):
            ready.add_metric((model,), n)
        yield ready
        cooling = GaugeMetricFamily("llmgw_router_cooling_replicas", "Replicas skipped after a recent failure.",
                                    labels=("model",))
        for model, n in sorted(snap.cooling.items()):
            cooling.add_metric((model,), n)
        yield cooling
        yield GaugeMetricFamily("llmgw_router_table_version", "Endpoint tables received since start.",
                                value=snap.table_version)
        for name, attr, doc in _PROMPT_CACHE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("model",))
            for model, c in sorted(snap.prompt_cache.items()):
                family.add_metric((model,), getattr(c, attr))
            yield family
        yield GaugeMetricFamily("llmgw_router_limits_degraded", "1 while the Redis that shares tenants' limits "
                                "cannot be reached and this router applies them alone.",
                                value=1 if snap.limits_degraded else 0)
        parse = GaugeMetricFamily("llmgw_router_body_parses", "Big request bodies in the parse worker process "
                                  "(parsing) and waiting for it (waiting).", labels=("state",))
        parse.add_metric(("parsing",), snap.parsing)
        parse.add_metric(("waiting",), snap.parse_waiting)
        yield parse
        # What the router's memory holds of bodies, against RouterConfig.buffered_limit: near the
        # limit, new uploads are 503s; still above zero with nothing in flight, a leak.
        yield GaugeMetricFamily("llmgw_router_request_body_bytes", "Bytes of request bodies held by requests in "
                                "flight (new ones are refused past the router's buffered limit).", value=snap.buffered)
        yield CounterMetricFamily("llmgw_router_body_parses_off_loop", "Request bodies parsed in the worker process "
                                  "(too big to parse on the event loop) since start.", value=snap.parsed_off_loop)


class _UsageCollector(Collector):
    """Usage per tenant, API key and model: customers' names, served behind the admin token only."""

    def __init__(self, read: Callable[[], GaugeSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        tokens = CounterMetricFamily("llmgw_router_usage_tokens", "Tokens per tenant (empty: the key is in none), "
                                     "API key (empty: no keys configured), model served and kind (prompt, "
                                     "completion), as the engines reported them.",
                                     labels=("tenant", "key", "model", "kind"))
        requests = CounterMetricFamily("llmgw_router_usage_requests", "Answers per tenant, API key and model served, "
                                       "by how their tokens were counted (reported by the engine, or from the stream).",
                                       labels=("tenant", "key", "model", "counted"))
        refused = CounterMetricFamily("llmgw_router_usage_refused", "Requests the tenant's limits refused (rate, "
                                      "requests in flight, budget), per tenant, API key and model asked (empty: "
                                      "refused before the body was read).", labels=("tenant", "key", "model"))
        for (tenant, key, model), u in sorted(snap.usage.items()):
            tokens.add_metric((tenant, key, model, "prompt"), u.prompt_tokens)
            tokens.add_metric((tenant, key, model, "completion"), u.completion_tokens)
            requests.add_metric((tenant, key, model, "engine"), u.requests - u.counted_from_stream)
            requests.add_metric((tenant, key, model, "stream"), u.counted_from_stream)
            if u.refused:
                refused.add_metric((tenant, key, model), u.refused)
        yield tokens
        yield requests
        yield refused


_PROMPT_CACHE_COUNTERS = (
    ("llmgw_router_prefix_blocks", "blocks",
     "Models routed by prefix: blocks of the prompts routed (64 characters each by default)."),
    ("llmgw_router_prefix_matched_blocks", "matched",
     "Models routed by prefix: blocks the router's index expected the chosen replica to hold "
     "(estimated hit ratio = matched / blocks)."),
    ("llmgw_router_engine_prompt_tokens", "prompt_tokens",
     "Prompt tokens engines reported processing (llama.cpp per answer, vLLM from its prefix-cache counters)."),
    ("llmgw_router_engine_cached_prompt_tokens", "cached_tokens",
     "Of those, the tokens engines reported reusing from their prompt cache (engine hit ratio = cached / prompt)."),
)
