"""Fleet metrics for Prometheus, read from the controller's state at scrape time.

A custom collector rather than gauges updated by the loops: a scrape then always sees
one consistent moment, and nothing on the reconcile path pays for metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from llmgw.decide import holding
from llmgw.decide.rollout import Phase
from llmgw.health import UNHEALTHY_AFTER, Health
from llmgw.inventory import NodeState
from llmgw.placement.capacity import free_capacity

if TYPE_CHECKING:
    from llmgw.control.ops import FleetOps


class FleetCollector(Collector):
    def __init__(self, ops: FleetOps) -> None:
        self.c = ops

    def collect(self) -> Iterator:
        c = self.c
        now = time.time()
        inv = c.inventory()
        nodes = GaugeMetricFamily("llmgw_nodes", "Nodes by state", labels=["state"])
        counts = {s.value: 0 for s in NodeState}
        for n in inv.nodes.values():
            counts[n.state.value] += 1
        for state, count in counts.items():
            nodes.add_metric([state], count)
        yield nodes

        # Counted as placement counts (holding): engines no replica claims take their GPUs too.
        capacity = free_capacity(inv, holding(inv, c.replicas()))
        total = GaugeMetricFamily("llmgw_gpus", "GPUs per node and class", labels=["node", "class"])
        free = GaugeMetricFamily("llmgw_gpus_free", "Healthy GPUs nothing uses (placement's count)",
                                 labels=["node", "class"])
        sick = GaugeMetricFamily("llmgw_gpus_unhealthy", "Unhealthy GPUs", labels=["node", "class"])
        for n in inv.nodes.values():
            if n.report is None:
                continue
            by_class: dict[str, list] = {}
            for g in n.report.gpus:
                by_class.setdefault(g.gpu_class, []).append(g)
            for cls, gs in by_class.items():
                total.add_metric([n.id, cls], len(gs))
                free.add_metric([n.id, cls], len([g for g in gs if g.index in capacity[n.id].free]))
                sick.add_metric([n.id, cls], len([g for g in gs if not g.healthy]))
        yield total
        yield free
        yield sick

        unconfirmed = GaugeMetricFamily(
            "llmgw_controller_demand_unconfirmed", "In-flight requests routers reported for a model beyond what its "
            "engines count (not scaled for: a router's report is its own word)", labels=["model"])
        for model, extra in sorted(c.unconfirmed_demand().items()):
            unconfirmed.add_metric([model], extra)
        yield unconfirmed

        reps = GaugeMetricFamily("llmgw_replicas", "Replicas by model and state", labels=["model", "state"])
        counts2: dict[tuple[str, str], int] = {}
        for r in c.replicas():
            counts2[(r.model, r.state.value)] = counts2.get((r.model, r.state.value), 0) + 1
        for (model, state), count in sorted(counts2.items()):
            reps.add_metric([model, state], count)
        yield reps

        idle = GaugeMetricFamily("llmgw_replica_idle_seconds", "Seconds since the router last used a replica",
                                 labels=["replica", "model"])
        last = c.last_used()
        for r in c.replicas():
            if r.id in last:
                idle.add_metric([r.id, r.model], now - last[r.id])
        yield idle

        sync = c.sync_status
        info = InfoMetricFamily("llmgw_catalog", "Catalog revisions: applied and last rejected")
        info.add_metric([], {"applied": sync.applied_sha or "", "rejected": sync.rejected.sha if sync.rejected else "",
                             "state": sync.state.value})
        yield info
        if sync.rejected is not None:
            rt = GaugeMetricFamily("llmgw_catalog_rejected_timestamp_seconds", "When the last rejected commit was seen")
            rt.add_metric([], sync.rejected.time)
            yield rt

        yield from _rollout_metrics(c.rollouts())


def _rollout_metrics(rollouts: list[dict]) -> Iterator[GaugeMetricFamily]:
    """Each model's last rollout: its phase (1 for the current one, 0 for the others, so an alert
    can say ``== 1``), the canary's share of traffic, and whether it was rolled back (the model
    then runs its last good version while git asks for another: worth a page, not a log line)."""
    phase = GaugeMetricFamily("llmgw_rollout_phase", "Phase of each model's last rollout (1 = current)",
                              labels=["model", "phase"])
    percent = GaugeMetricFamily("llmgw_rollout_canary_percent", "Percent of a model's traffic on its canary",
                                labels=["model"])
    rolled = GaugeMetricFamily("llmgw_rollout_rolled_back",
                               "1 while a model's last rollout is rolled back (it keeps its last good version)",
                               labels=["model"])
    total = GaugeMetricFamily("llmgw_rollouts_rolled_back", "Models whose last rollout was rolled back")
    for r in rollouts:
        for p in Phase:
            phase.add_metric([r["model"], p.value], 1 if r["phase"] == p.value else 0)
        percent.add_metric([r["model"]], r["percent"])
        rolled.add_metric([r["model"]], 1 if r["phase"] == Phase.ROLLED_BACK.value else 0)
    total.add_metric([], sum(1 for r in rollouts if r["phase"] == Phase.ROLLED_BACK.value))
    yield phase
    yield percent
    yield rolled
    yield total


class HealthCollector(Collector):
    """/metrics: each loop's failures (llmgw.health), read at scrape time like the fleet's figures."""

    def __init__(self, health: Callable[[], Health]) -> None:
        self._health = health

    def collect(self) -> Iterator:
        h = self._health()
        failures = CounterMetricFamily("llmgw_controller_loop_failures", "Turns of a controller loop that failed, "
                                       "since start", labels=["loop"])
        row = GaugeMetricFamily("llmgw_controller_loop_consecutive_failures",
                                "Turns of a controller loop that failed in a row (0: the last one succeeded)",
                                labels=["loop"])
        last_ok = GaugeMetricFamily("llmgw_controller_loop_last_success_timestamp_seconds",
                                    "When a controller loop last completed a turn", labels=["loop"])
        for loop in h.loops:
            failures.add_metric([loop.name], loop.failures)
            row.add_metric([loop.name], loop.consecutive_failures)
            if loop.last_ok is not None:
                last_ok.add_metric([loop.name], loop.last_ok)
        yield failures
        yield row
        yield last_ok
        yield GaugeMetricFamily("llmgw_controller_healthy", "1 while no critical controller loop has failed "
                                f"{UNHEALTHY_AFTER} turns in a row (what /healthz answers 503 to), else 0",
                                value=1.0 if h.fit else 0.0)
