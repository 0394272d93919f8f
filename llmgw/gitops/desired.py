"""The desired state in force: one catalog, swapped atomically, subscribers told in order.

The router subscribes first so that a model that left the catalog stops receiving
traffic before the reconciler, told second, stops its replicas.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.catalog import Catalog

log = logging.getLogger(__name__)

Subscriber = Callable[[Catalog], None]

ROUTER = 0
RECONCILER = 10


@dataclass(frozen=True)
class _Sub:
    order: int
    seq: int
    fn: Subscriber


class DesiredState:
    """Holds the applied catalog; readers get a consistent snapshot without locking."""

    def __init__(self, catalog: Catalog | None = None) -> None:
        self._catalog = catalog
        self._subs: list[_Sub] = []
        self._lock = threading.Lock()

    @property
    def catalog(self) -> Catalog | None:
        return self._catalog

    def subscribe(self, fn: Subscriber, *, order: int = RECONCILER) -> None:
        """Call ``fn`` on every change, lower ``order`` first; at once if a catalog is in force."""
        with self._lock:
            self._subs.append(_Sub(order, len(self._subs), fn))
            self._subs.sort(key=lambda s: (s.order, s.seq))
            current = self._catalog
        if current is not None:
            fn(current)

    def set(self, catalog: Catalog) -> None:
        """Put ``catalog`` in force and tell every subscriber, in order.

        A subscriber that raises is logged with its traceback and the others are still
        told: one broken view must not leave the rest on the old desired state.
        """
        with self._lock:
            self._catalog = catalog
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.fn(catalog)
            except Exception:  # noqa: BLE001 - isolate subscribers; logged with traceback
                log.exception("desired-state subscriber %r failed", sub.fn)
