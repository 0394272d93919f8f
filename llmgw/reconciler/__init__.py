"""The reconciler: makes the fleet match the desired state, tick by tick (DESIGN §5)."""

from llmgw.reconciler.decide import Decisions, Demand, decide
from llmgw.reconciler.reconciler import EndpointSink, Reconciler, ReconcilerConfig, UsageSource
from llmgw.reconciler.replica import Endpoint, Replica, ReplicaState

__all__ = [
    "Decisions", "Demand", "Endpoint", "EndpointSink", "Reconciler", "ReconcilerConfig", "Replica",
    "ReplicaState", "UsageSource", "decide",
]
