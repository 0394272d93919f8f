"""The reconciler: makes the fleet match the desired state, tick by tick (DESIGN §5).

    Reconciler, ReconcilerConfig  the loop that applies decisions through the dispatcher
    LiveInventory                 the agents' latest reports, polled each tick

The decision itself and the replica records are pure, in `llmgw.decide`.
"""

from llmgw.lazy import lazy_exports

# Resolved on first use: the config (read by `llmgw controller --config`) must not load the
# reconciler's I/O (aiohttp, the dispatcher, the store) just by being imported.
_EXPORTS = {
    "Reconciler": "llmgw.reconciler.reconciler", "ReconcilerConfig": "llmgw.reconciler.config",
    "LiveInventory": "llmgw.reconciler.live",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
