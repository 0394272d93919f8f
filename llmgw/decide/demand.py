"""What the routers say of a model's load, as far as its engines bear it out (issue 41).

A router's report is its own word: a router host taken over could report demand no client made
(seen: one forged report took a model from 1 to 3 replicas). Scaling up for load acts only on
load the model's engines confirm: each engine counts every client's requests, running and
waiting, and the controller's own router reads that count from every ready replica. Pure: the
readings are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw.contract import Demand
from llmgw.decide.replica import Replica, ReplicaState


@dataclass(frozen=True)
class Believed:
    """The demand to act on, and per model what the routers said beyond it (not acted on)."""

    demand: dict[str, Demand]
    unconfirmed: dict[str, int]


def believed_demand(said: Mapping[str, Demand], engine_queue: Mapping[str, tuple[int, int]] | None,
                    replicas: Iterable[Replica]) -> Believed:
    """In flight at most what the model's ready engines count running and waiting; a ready replica
    not read (not yet, or its engine did not answer in time) counts none: every engine llmgw starts
    serves the count. ``engine_queue`` None (a usage source that reads no engine): the routers'
    word stands, as before. An empty reading is not that: every read of every engine failing at
    once (a loaded machine, all timed out) once let a forged report scale a model up. Requests
    held for want of a replica are believed as said: with none ready there is no engine to ask,
    and they take a model at zero to one replica, never more."""
    ready: dict[str, list[str]] = {}
    for r in replicas:
        if r.state == ReplicaState.READY and not r.canary:
            ready.setdefault(r.model, []).append(r.id)
    out: dict[str, Demand] = {}
    unconfirmed: dict[str, int] = {}
    for model, d in said.items():
        ids = ready.get(model, [])
        if ids and engine_queue is not None:
            counted = sum(sum(engine_queue.get(rid, (0, 0))) for rid in ids)
            if d.inflight > counted:
                unconfirmed[model] = d.inflight - counted
                d = Demand(held=d.held, inflight=counted)
        out[model] = d
    return Believed(out, unconfirmed)
