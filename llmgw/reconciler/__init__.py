"""The reconciler: makes the fleet match the desired state, tick by tick (DESIGN §5).

    decide, Decisions             the pure decision of one tick (what `llmgw diff` also runs)
    Replica, ReplicaState         the replica records
    Reconciler, ReconcilerConfig  the loop that applies decisions through the dispatcher
"""

from llmgw.lazy import lazy_exports

# Resolved on first use: the pure decision (and the prune guard and plan built on it) must not
# load the reconciler's I/O (aiohttp, the dispatcher, the store) just by being imported.
_EXPORTS = {
    "Decisions": "llmgw.reconciler.decide", "decide": "llmgw.reconciler.decide",
    "Replica": "llmgw.reconciler.replica", "ReplicaState": "llmgw.reconciler.replica",
    "Reconciler": "llmgw.reconciler.reconciler", "ReconcilerConfig": "llmgw.reconciler.config",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
