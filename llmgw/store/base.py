"""What both stores share: the follower's records as JSON rows, the usage ledger's query, the
lease's arguments, and the error a failed call raises.

The SQL differs between the two (placeholders, clocks, sums), the rows do not: one codec here
means a record round-trips the same way whichever database holds it.
"""

from __future__ import annotations

import json
import math
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from llmgw.contract import USAGE_COUNTS
from llmgw.errors import StoreError
from llmgw.store.protocol import USAGE_GROUPS
from llmgw.store.records import Applied, PendingPrune, Rejection, Rewrite, SyncKind

# Minutes older than this are summed into hours (a year of minutes per key and model is a lot
# of rows for a dashboard that shows hours).
USAGE_MINUTES_KEPT = 7 * 86400
LEASE_NAME = "controller"  # the one lease row: which controller leads
# A controller not seen (checked in) for this long is forgotten: a standby shut down for good.
FORGET_AFTER = 3600.0
BIGINT_MAX = 2 ** 63 - 1


class DatabaseError(StoreError, sqlite3.Error):
    """What a store raises when its database fails a call: a :class:`StoreError`, chained to the
    driver's error. Also a ``sqlite3.Error`` for the callers written when SQLite was the only
    store (llmgw.control.usage and .feed catch that to keep a usage batch for the next try);
    once they catch StoreError, that second base can go."""


class JsonRecords(ABC):
    """The follower's records, each a JSON row of the ``sync`` table, over a store's two
    primitives :meth:`_sync` and :meth:`_set_sync`."""

    @abstractmethod
    def _sync(self, kind: SyncKind) -> Any:
        """The record of ``kind`` (decoded JSON), or None."""

    @abstractmethod
    def _set_sync(self, kind: SyncKind, record: Any) -> None:
        """Store ``record`` (JSON-able) as ``kind``, or forget it when None."""

    def applied(self) -> Applied | None:
        raw = self._sync(SyncKind.APPLIED)
        return Applied(raw["sha"], float(raw["time"]), raw.get("source")) if raw else None

    def set_applied(self, applied: Applied) -> None:
        self._set_sync(SyncKind.APPLIED, {"sha": applied.sha, "time": applied.time, "source": applied.source})

    def pending(self) -> PendingPrune | None:
        raw = self._sync(SyncKind.PENDING)
        return PendingPrune.from_json(raw) if raw else None

    def set_pending(self, pending: PendingPrune | None) -> None:
        self._set_sync(SyncKind.PENDING, pending.to_json() if pending else None)

    def rejected(self) -> Rejection | None:
        raw = self._sync(SyncKind.REJECTED)
        return Rejection.from_json(raw) if raw else None

    def set_rejected(self, rejection: Rejection | None) -> None:
        self._set_sync(SyncKind.REJECTED, rejection.to_json() if rejection else None)

    def judged(self) -> str | None:
        """The head last judged, so a bad commit is judged (and reported) once."""
        raw = self._sync(SyncKind.JUDGED)
        return str(raw) if raw else None

    def set_judged(self, sha: str | None) -> None:
        self._set_sync(SyncKind.JUDGED, sha)

    def rewrite(self) -> Rewrite | None:
        raw = self._sync(SyncKind.REWRITE)
        return Rewrite.from_json(raw) if raw else None

    def set_rewrite(self, rewrite: Rewrite | None) -> None:
        self._set_sync(SyncKind.REWRITE, rewrite.to_json() if rewrite else None)

    def weight_digests(self) -> dict[str, str]:
        raw = self._sync(SyncKind.WEIGHTS)
        return {str(k): v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}

    def set_weight_digests(self, digests: Mapping[str, str]) -> None:
        self._set_sync(SyncKind.WEIGHTS, dict(digests))

    def usage_gate_state(self) -> Any:
        return self._sync(SyncKind.USAGE_GATE)

    def set_usage_gate_state(self, state: Any) -> None:
        self._set_sync(SyncKind.USAGE_GATE, state)


def decode_rollouts(rows: list[tuple[str, str]], log: Any) -> dict[str, dict[str, Any]]:
    """The rollout rows as records. One torn or hand-edited row must not stop the controller: that
    model is taken as serving what the catalog says, as on a first start."""
    out = {}
    for model, raw in rows:
        try:
            out[model] = json.loads(raw)
        except ValueError:
            log.warning("rollout record of %s is not JSON; ignored", model)
    return out


def usage_query(by: tuple[str, ...], step: int, where: dict[str, str] | None, *, sums: str,
                mark: str) -> tuple[str, list[str]]:
    """The ledger's query (its SQL and the names of its columns but the last, a row count) for
    :meth:`Store.usage`; ``sums`` the dialect's saturating sum of each count, ``mark`` its
    placeholder. Only names from USAGE_GROUPS and a whole number reach the SQL text; the
    bounds and ``where``'s values are bound, in that order."""
    if not set(by) <= set(USAGE_GROUPS) or not set(where or {}) <= set(USAGE_GROUPS):
        raise ValueError(f"usage is grouped and filtered by {', '.join(USAGE_GROUPS)} only")
    groups = ([f"(minute / {int(step)}) * {int(step)}"] if step > 0 else []) + list(by)
    filters = "".join(f" AND {c} = {mark}" for c in (where or {}))
    sql = (f"SELECT {', '.join(groups + [sums])}, COUNT(*) FROM usage WHERE minute >= {mark} AND minute < {mark}"
           f"{filters}" + (f" GROUP BY {', '.join(groups)} ORDER BY {', '.join(groups)}" if groups else ""))
    return sql, (["time"] if step > 0 else []) + list(by) + list(USAGE_COUNTS)


def check_ttl(ttl: float) -> float:
    """A lease's duration: positive and finite (ValueError otherwise): a lease of .inf would never
    lapse, and one of 0 or less is lapsed before anyone could use it."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"a lease lasts a positive, finite number of seconds, not {ttl!r}")
    return float(ttl)
