"""The desired state in force: one catalog, swapped atomically, subscribers told in order.

The router subscribes first so that a model that left the catalog stops receiving
traffic before the reconciler, told second, stops its replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.catalog import Catalog
from llmgw.health import Tracker

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

    def __init__(self, catalog: Catalog | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self._catalog = catalog
        self._clock = clock
        # Each catalog put in force is one turn: failed when it did not reach every subscriber.
        self.health = Tracker("catalog-delivery")
        self._subs: list[_Sub] = []
        self._lock = threading.Lock()
        # Why the last catalog did not reach every subscriber (None: it did): said in status.
        self.problem: str | None = None
        self._failed_order = 0

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

        A subscriber that raises is logged with its traceback and counted, and the others of its
        order are still told; those of a later order are not: the order is the guarantee (seen: a
        router that failed to take a catalog, and the reconciler told anyway, stopped replicas the
        router still sent to). The next catalog is told to all again. ``problem`` says what failed.
        """
        with self._lock:
            self._catalog = catalog
            subs = list(self._subs)
        failed: list[str] = []
        for sub in subs:
            if failed and sub.order > self._failed_order:
                break
            try:
                sub.fn(catalog)
            except Exception as exc:  # noqa: BLE001 - isolate subscribers; logged with traceback, counted, said
                log.exception("desired-state subscriber %r failed", sub.fn)
                if not failed:
                    self._failed_order = sub.order
                failed.append(f"{getattr(sub.fn, '__qualname__', sub.fn)}: {type(exc).__name__}: {exc}")
        self.problem = None if not failed else (
            f"the applied catalog did not reach every part: {'; '.join(failed)[:500]}"
            + ("; later parts (the reconciler) were not told, and keep the catalog before" if
               any(s.order > self._failed_order for s in subs) else ""))
        if self.problem is None:
            self.health.ok(self._clock())
        else:
            self.health.failed(self._clock(), self.problem)
